"""The memory ledger: what it counts, when it releases, and the out-of-memory error."""

from __future__ import annotations

import gc

import pytest
import torch
from ddlab.runtime.memory import Ledger, OutOfMemory, tensor_bytes


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))


def test_parameters_gradients_and_optimizer_state_are_charged():
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters())
    ledger = Ledger()
    ledger.watch(model, optimizer)
    params = tensor_bytes(list(model.parameters()))
    assert ledger.used["parameters"] == params
    model(torch.randn(4, 10)).sum().backward()
    assert ledger.used["gradients"] == params
    optimizer.step()
    assert ledger.used["optimizer"] == tensor_bytes(list(optimizer.state.values()))
    assert ledger.used["optimizer"] >= 2 * params  # Adam keeps two moments per parameter
    model(torch.randn(4, 10)).sum().backward()
    assert ledger.used["gradients"] == params, "gradients are charged once, not per step"
    ledger.close()


def test_saved_activations_are_counted_once_and_released_after_backward():
    model = _mlp()
    ledger = Ledger()
    ledger.watch(model)
    x = torch.randn(4, 10)
    with ledger.activations():
        loss = model(x).sum()
    # saved: the input (first Linear), the hidden pre-activation output saved by ReLU, which
    # the second Linear saves again (same storage: counted once); never the weights
    hidden = 4 * 20 * 4
    assert ledger.used["activations"] == x.numel() * 4 + hidden
    loss.backward()
    del loss
    gc.collect()
    assert ledger.used["activations"] == 0
    assert ledger.peak["activations"] == x.numel() * 4 + hidden


def test_held_tensors_are_charged_while_alive():
    ledger = Ledger()
    t = torch.zeros(100)
    ledger.hold(t)
    assert ledger.used["activations"] == 400
    del t
    gc.collect()
    assert ledger.used["activations"] == 0


def test_budget_raises_out_of_memory_naming_stage_and_bytes():
    model = _mlp()
    params = tensor_bytes(list(model.parameters()))
    ledger = Ledger(budget=params + 200, stage="stage 2")
    ledger.watch(model)
    with pytest.raises(OutOfMemory) as caught, ledger.activations():
        model(torch.randn(8, 10))
    err = caught.value
    assert err.stage == "stage 2" and err.asked == 8 * 10 * 4 and err.category == "activations"
    assert "stage 2: out of memory asking for 320 bytes" in str(err)
    assert isinstance(err, MemoryError)
    with pytest.raises(ValueError, match="positive"):
        Ledger(budget=0)


def test_a_deferred_charge_past_the_budget_is_kept_until_settle_then_charges_raise_again():
    ledger = Ledger(budget=100)
    ledger.defer()
    ledger.charge("activations", 80)
    ledger.charge("gradients", 50, "a gradient")  # past the budget: kept, charged, not raised
    ledger.charge("gradients", 60)
    assert ledger.total == 190
    first = ledger.settle()
    assert isinstance(first, OutOfMemory) and first.asked == 50 and "a gradient" in str(first)
    assert ledger.settle() is None
    with pytest.raises(OutOfMemory):
        ledger.charge("activations", 1)


def test_reset_peak_starts_from_current_use():
    ledger = Ledger()
    ledger.charge("activations", 100)
    ledger.release("activations", 60)
    ledger.reset_peak()
    assert ledger.peak_total == 40 and ledger.report()["peak"] == 40


def test_an_unignored_storage_is_counted_again():
    """ZeRO-3 frees a unit's storage; a tensor the allocator later puts at its address is an activation."""
    layer = torch.nn.Linear(4, 4)
    weight = layer.weight.detach()  # the parameter's storage, not a Parameter
    x = torch.randn(3, 4, requires_grad=True)
    ledger = Ledger()
    ledger.ignore(layer)
    with ledger.activations():
        ignored = (x * weight[0]).sum()  # saves the row of weight for x's gradient
    assert ledger.used["activations"] == 0
    ledger.unignore(layer)
    with ledger.activations():
        counted = (x * weight[0]).sum()
    assert ledger.used["activations"] == tensor_bytes(weight) > 0
    del ignored, counted
