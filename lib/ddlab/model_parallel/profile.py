"""Measured cost of every layer of a UNet: bytes it keeps for backward, and CPU seconds it takes.

Each layer runs on its own, its input detached from the layer before, so its
forward and backward can be timed apart (`time.thread_time`, CPU seconds of this
rank only, whatever else the machine runs) and a `Ledger` can say which saved
tensors it added. These per-layer costs are what a model-aware split balances.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.unet import UNet, layer_names
from ..runtime.memory import Ledger, tensor_bytes


@dataclass
class LayerCost:
    """What one layer costs, for one batch of one image size."""

    name: str
    parameters: int  # bytes of its parameters
    activations: int  # bytes of the tensors autograd saves in its forward (each storage once)
    forward: float  # CPU seconds
    backward: float  # CPU seconds

    def memory(self, state_copies: int = 1) -> int:
        """Bytes it needs in training: parameters, gradients, `state_copies` optimizer copies, activations."""
        return self.parameters * (2 + state_copies) + self.activations

    @property
    def compute(self) -> float:
        return self.forward + self.backward


def profile_layers(model: UNet, images: torch.Tensor, masks: torch.Tensor, repeats: int = 2) -> list[LayerCost]:
    """Every layer's cost for this batch; times are the minimum over `repeats` runs (the first pays set-up costs).

    The last layer's backward includes the loss (forward and backward).
    """
    n = len(model.layers)
    forward, backward, saved = [float("inf")] * n, [float("inf")] * n, [0] * n
    for _ in range(repeats):
        ledger, inputs, outputs, x = Ledger(), [], [], images
        skips: dict[str, torch.Tensor] = {}
        ledger.ignore(model)
        with ledger.activations():
            for i, layer in enumerate(model.layers):
                x = x.detach().requires_grad_(i > 0)
                before, start = ledger.used["activations"], time.thread_time()
                y = layer(x, skips)
                forward[i] = min(forward[i], time.thread_time() - start)
                saved[i] = ledger.used["activations"] - before
                inputs.append(x)
                outputs.append(y)
                x = y
        logits = x.detach().requires_grad_()
        start = time.thread_time()
        torch.nn.functional.cross_entropy(logits, masks).backward()
        loss = time.thread_time() - start  # the last layer pays for the loss
        grad = logits.grad
        for i in reversed(range(n)):
            start = time.thread_time()
            torch.autograd.backward(outputs[i], grad)
            backward[i] = min(backward[i], time.thread_time() - start + (loss if i == n - 1 else 0.0))
            grad = inputs[i].grad
        model.zero_grad(set_to_none=True)
    names = layer_names(model)
    return [
        LayerCost(names[i], tensor_bytes(list(model.layers[i].parameters())), saved[i], forward[i], backward[i])
        for i in range(n)
    ]
