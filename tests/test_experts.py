"""Lab 15's mixture of experts in one process: the router, capacity, the balancing loss, the dense layer in a GPT."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab.experts import MoE, aux_loss, balancing_loss, capacity, combine, dispatch, route, use_experts
from ddlab.models.gpt import GPTConfig, make_gpt
from mpi4py import MPI


def test_capacity_is_the_ceiling_of_factor_times_k_tokens_over_experts():
    assert capacity(10, 4, 1, 1.0) == 3 and capacity(10, 4, 2, 1.25) == 7 and capacity(8, 4, 1, 2.0) == 4
    with pytest.raises(ValueError, match="positive"):
        capacity(10, 4, 1, 0.0)


def test_top1_weight_is_the_winners_probability_and_top2_weights_sum_to_one():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    probs = torch.softmax(logits, -1)
    one = route(logits, 1, 10.0)
    assert one.expert.tolist() == [0, 1] and torch.allclose(one.weight, probs.max(-1).values)
    two = route(logits, 2, 10.0)
    assert two.expert.tolist() == [0, 1, 1, 2] and two.token.tolist() == [0, 1, 0, 1]
    assert torch.allclose(two.weight[:2] + two.weight[2:], torch.ones(2))


def test_assignments_past_capacity_drop_second_choices_first():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 4)  # every token: expert 0 first, expert 1 second
    routing = route(logits, 2, 1.0)  # capacity ceil(1 * 2 * 4 / 4) = 2
    assert routing.capacity == 2 and routing.dropped == 4
    assert routing.expert.tolist() == [0, 0, 1, 1] and routing.token.tolist() == [0, 1, 0, 1]
    assert routing.load.tolist() == [4, 4, 0, 0]


def test_balancing_loss_is_one_when_uniform_and_grows_when_concentrated():
    uniform = torch.full((8, 4), 0.25)
    assert balancing_loss(uniform, torch.arange(8) % 4).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert balancing_loss(skewed, torch.zeros(8, dtype=torch.int64)).item() == pytest.approx(4 * 0.7)


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="k must be 1 or 2"):
        route(torch.zeros(3, 4), 3, 1.0)


def test_dispatch_and_combine_on_one_rank_sort_by_expert_and_undo_it():
    expert = np.array([2, 0, 1, 0, 2])
    x = np.arange(10.0).reshape(5, 2)
    rows, counts = dispatch(MPI.COMM_SELF, x, expert, 3)
    assert counts.tolist() == [[2, 1, 2]] and np.array_equal(rows, x[[1, 3, 2, 0, 4]])
    assert np.array_equal(combine(MPI.COMM_SELF, rows, counts, expert, 3), x)
    with pytest.raises(ValueError, match="expert ids"):
        dispatch(MPI.COMM_SELF, x, expert + 1, 3)


def test_moe_on_one_rank_equals_its_dense_fallback():
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    alone = MoE(8, 4, 2, 1.0, MPI.COMM_SELF, seed=5, dtype=torch.float64)
    dense = MoE(8, 4, 2, 1.0, None, seed=5, dtype=torch.float64)
    torch.testing.assert_close(alone(x), dense(x), rtol=0, atol=1e-10)
    assert alone.dropped == dense.dropped > 0


def test_a_token_routed_nowhere_gets_zero_and_the_others_their_experts_weighted_output():
    moe = MoE(4, 2, 1, 0.5, None, hidden=8, seed=1, dtype=torch.float64)  # capacity ceil(0.5 * 4 / 2) = 1 per expert
    x = torch.randn(4, 4, dtype=torch.float64)
    y = moe(x)
    routing = route(moe.gate(x), 1, 0.5)
    for token, expert, weight in zip(routing.token, routing.expert, routing.weight):
        torch.testing.assert_close(y[token], weight * moe.experts[int(expert)](x[token]))
    dropped = sorted(set(range(4)) - set(routing.token.tolist()))
    assert len(dropped) == moe.dropped and all(torch.all(y[t] == 0) for t in dropped)


def test_gpt_with_experts_trains_and_reports_its_balancing_loss():
    torch.manual_seed(0)
    model = make_gpt(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16))
    layers = use_experts(model, n_experts=4, k=2, capacity_factor=2.0, every=2)
    assert len(layers) == 1 and model.blocks[1].mlp is layers[0]
    idx = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        total = loss + 0.01 * aux_loss(layers)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    optimizer.zero_grad()
    model(idx[:, :-1], idx[:, 1:])
    aux_loss(layers).backward()  # the balancing loss alone reaches the gate, and only the gate
    assert layers[0].gate.weight.grad.abs().sum() > 0
    assert all(p.grad is None or not p.grad.any() for p in layers[0].experts.parameters())
