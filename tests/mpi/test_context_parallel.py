"""Ring attention equals one process's causal attention, forward and backward (float64, 1e-10).

Every rank runs the same tests on sub-communicators of the first P ranks for P = 1 .. world
size, with the zig-zag and the contiguous layouts, at lengths that 2P divides and that it does
not (padding), causal and (at lengths every 2P divides) not, on (n, d) and (batch, heads, n, d) arrays; values are gathered and compared on
every rank, so a failure fails every rank. Also: the messages each rank sends, the autograd
function on lab 14's GPT shapes, and a ring whose neighbour never sends stalling within its deadline.
The solution notebook's ring backward (exercise 15.3) and Ulysses (15.5) are run here too, against
autograd and one process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ddlab.checks._core import each_size
from ddlab.context_parallel import (
    all_positions,
    put_rows,
    reference_attention,
    ring_attention,
    ring_attention_backward,
    ring_attention_torch,
    take_rows,
    ulysses_attention,
)
from ddlab.context_parallel.ring import TAG_KV, Ring
from ddlab.models.gpt import GPTConfig, causal_attention, make_gpt
from ddlab.runtime.comm import first_ranks
from ddlab.runtime.counting import CountingComm, gather_traffic
from ddlab.runtime.waiting import Stalled
from ddlab.tools.solutions import run_cells
from mpi4py import MPI

CASES = [((11, 4), True), ((2, 3, 16, 4), True), ((13, 4), False), ((2, 16, 2), False)]
#: Without the causal mask every query sees every key, padding too: lengths 2P divides for every P up to 4.
NOT_CAUSAL = [((24, 4), True), ((2, 3, 24, 2), False)]


def _inputs(shape: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(list(shape))
    return [rng.standard_normal(shape) for _ in range(4)]  # q, k, v, grad_out


def _torch_reference(q, k, v, grad_out, causal=True):
    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    length = q.shape[-2]
    scores = qt @ kt.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if causal:
        scores = scores + torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    out = torch.softmax(scores, dim=-1) @ vt
    out.backward(torch.tensor(grad_out))
    return out.detach().numpy(), [t.grad.numpy() for t in (qt, kt, vt)]


@pytest.mark.parametrize("shape,zigzag,causal", [(*c, True) for c in CASES] + [(*c, False) for c in NOT_CAUSAL])
def test_forward_and_backward_equal_one_process(comm, shape, zigzag, causal):
    q, k, v, grad_out = _inputs(shape)
    want_out, want_grads = _torch_reference(q, k, v, grad_out, causal)
    _, want_lse = reference_attention(q, k, v, causal=causal)
    length = shape[-2]

    def body(sub):
        rank, size = sub.Get_rank(), sub.Get_size()
        positions = all_positions(length, size, zigzag)
        mine = [take_rows(a, positions[rank]) for a in (q, k, v, grad_out)]
        out, lse = ring_attention(sub, *mine[:3], positions, causal=causal)
        grads = ring_attention_backward(sub, *mine[:3], out, lse, mine[3], positions, causal)
        full = [put_rows(sub.allgather(a), positions, length) for a in (out, *grads)]
        lse_full = put_rows([p[..., None] for p in sub.allgather(lse)], positions, length)[..., 0]
        for name, got, want in zip(("output", "dq", "dk", "dv"), full, [want_out, *want_grads]):
            if not np.allclose(got, want, rtol=0, atol=1e-10):
                return f"{name} differs from one process's by {np.abs(got - want).max():.2e}"
        if not np.allclose(lse_full, want_lse, rtol=0, atol=1e-10):
            return "the log-sum-exp differs from one process's"
        return None

    each_size(comm, body, f"ring attention of shape {shape}, {'zig-zag' if zigzag else 'contiguous'}, causal {causal}")


def test_messages_per_rank(comm):
    """Forward: P-1 key/value blocks to the next rank; backward: P-1 blocks and P of their gradients."""
    q, k, v, grad_out = _inputs((2, 12, 3))

    def body(sub):
        rank, size = sub.Get_rank(), sub.Get_size()
        positions = all_positions(12, size)
        mine = [take_rows(a, positions[rank]) for a in (q, k, v, grad_out)]
        block = 2 * mine[1].nbytes
        counting = CountingComm(sub)
        out, lse = ring_attention(counting, *mine[:3], positions)
        forward = gather_traffic(counting)[rank]
        counting.free()
        counting = CountingComm(sub)
        ring_attention_backward(counting, *mine[:3], out, lse, mine[3], positions)
        backward = gather_traffic(counting)[rank]
        counting.free()
        got = (forward.messages_sent, forward.bytes_sent, backward.messages_sent, backward.bytes_sent)
        want = (size - 1, (size - 1) * block, 2 * size - 1 if size > 1 else 0, (2 * size - 1) * block * (size > 1))
        peers = {e.peer for e in forward.sends + backward.sends}
        if got != want:
            return f"(messages, bytes) forward and backward {got}, expected {want}"
        if size > 1 and peers != {(rank + 1) % size}:
            return f"sent to ranks {sorted(peers)}, not only to the next one"
        return None

    each_size(comm, body, "ring attention's messages")


def test_autograd_function_on_gpt_shapes(comm):
    """Lab 14's GPT attention: q, k, v of one block, heads split out, equal to its causal_attention."""
    config = GPTConfig(block_size=20, n_layer=1, n_head=4, n_embd=16)
    model = make_gpt(config, seed=3, dtype=torch.float64)
    x = torch.randn(2, 18, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    q, k, v = model.blocks[0].attn.qkv(x).detach().split(16, dim=2)

    def heads(t):
        return t.view(2, 18, 4, 4).transpose(1, 2).contiguous()

    want = causal_attention(q, k, v, 4, 0.0, None, 0)
    leaves = [heads(t).requires_grad_() for t in (q, k, v)]
    want_heads = causal_attention(*(t.transpose(1, 2).reshape(2, 18, 16) for t in leaves), 4, 0.0, None, 0)
    want_heads.square().sum().backward()
    want_grads = [t.grad.numpy() for t in leaves]

    def body(sub):
        rank, size = sub.Get_rank(), sub.Get_size()
        positions = all_positions(18, size)
        mine = [torch.from_numpy(take_rows(heads(t).numpy(), positions[rank])).requires_grad_() for t in (q, k, v)]
        out = ring_attention_torch(sub, *mine, positions)
        grad = 2 * out.detach()  # d(sum out^2)/d out, on this rank's rows; the padding rows' outputs are dropped
        grad[..., positions[rank] >= 18, :] = 0
        out.backward(grad)
        full = put_rows(sub.allgather(out.detach().numpy()), positions, 18).transpose(0, 2, 1, 3).reshape(2, 18, 16)
        if not np.allclose(full, want.numpy(), rtol=0, atol=1e-10):
            return "the output differs from GPT's causal_attention"
        for name, t, w in zip("qkv", mine, want_grads):
            got = put_rows(sub.allgather(t.grad.numpy()), positions, 18)
            if not np.allclose(got, w, rtol=0, atol=1e-10):
                return f"d{name} differs from autograd's through GPT's causal_attention"
        return None

    each_size(comm, body, "ring attention on GPT shapes")


def test_a_silent_neighbour_stalls_within_the_deadline(comm):
    """Rank 0 waits for a block rank P-1 never sends: Stalled after the deadline, not a hang."""
    sub = first_ranks(comm, 2) if comm.Get_size() >= 2 else None
    if sub is not None:
        ring = Ring(sub, timeout=1.0)
        if sub.Get_rank() == 0:
            incoming = np.empty(3)
            request = sub.Irecv(incoming, ring.previous, TAG_KV)
            with pytest.raises(Stalled):
                ring.wait([request], "a block that never comes")
            request.Cancel()
            request.Wait()
        ring.free()  # takes in rank 0's failure notice: none may be left for later tests' communicators
        sub.Free()


def test_bad_positions_say_what_to_pass(comm):
    q = np.zeros((4, 2))
    with pytest.raises(ValueError, match="every rank's positions"):
        ring_attention(comm, q, q, q, np.arange(4))


def _solution(function: str):
    """The solution notebook's answer `function` (lab 15), as the student writes it: its exercise cell run here."""
    namespace = {"np": np, "MPI": MPI, "reference_attention": reference_attention}
    return run_cells(SOLUTIONS, lambda text: f"def {function}(" in text and "### BEGIN SOLUTION" in text, namespace)[
        function
    ]


SOLUTIONS = Path(__file__).parents[2] / "solutions" / "15_long_sequences_and_experts.ipynb"


@pytest.mark.parametrize("answer", ["library", "my_ring_backward"])
@pytest.mark.parametrize("shape,zigzag,causal", [(*c, True) for c in CASES] + [(*c, False) for c in NOT_CAUSAL])
def test_the_students_backward_equals_autograd_on_one_process(comm, shape, zigzag, causal, answer):
    """Exercise 15.3's answer (and the library's) from the forward's own out and lse: dq, dk, dv within 1e-10,
    causal and not, on 1 .. P ranks."""
    backward = ring_attention_backward if answer == "library" else _solution(answer)
    q, k, v, grad_out = _inputs(shape)
    _, want_grads = _torch_reference(q, k, v, grad_out, causal)
    length = shape[-2]

    def body(sub):
        rank, size = sub.Get_rank(), sub.Get_size()
        positions = all_positions(length, size, zigzag)
        mine = [take_rows(a, positions[rank]) for a in (q, k, v, grad_out)]
        out, lse = ring_attention(sub, *mine[:3], positions, causal=causal)
        grads = backward(sub, *mine[:3], out, lse, mine[3], positions, causal)
        for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
            whole = put_rows(sub.allgather(got), positions, length)
            if not np.allclose(whole, want, rtol=0, atol=1e-10):
                return f"{name} differs from autograd's by {np.abs(whole - want).max():.2e}"
        return None

    layout = "zig-zag" if zigzag else "contiguous"
    each_size(comm, body, f"{answer}'s backward, shape {shape}, {layout}, {'causal' if causal else 'not causal'}")


@pytest.mark.parametrize("answer", ["library", "my_ulysses"])
@pytest.mark.parametrize("zigzag", [True, False])
def test_ulysses_equals_one_process(comm, answer, zigzag):
    """Ulysses (the library's and exercise 15.5's) on every P dividing the heads: each rank's rows within 1e-10."""
    attend = ulysses_attention if answer == "library" else _solution(answer)
    heads, length = 12, 23
    q, k, v = (np.random.default_rng(i).standard_normal((heads, length, 4)) for i in range(3))
    want, _ = reference_attention(q, k, v)

    def body(sub):
        rank, size = sub.Get_rank(), sub.Get_size()
        positions = all_positions(length, size, zigzag)
        out = attend(sub, *(take_rows(a, positions[rank]) for a in (q, k, v)), positions)
        got = put_rows(sub.allgather(out), positions, length)
        if not np.allclose(got, want, rtol=0, atol=1e-10):
            return f"differs from one process's by {np.abs(got - want).max():.2e}"
        return None

    each_size(
        comm,
        body,
        f"{answer} ({'zig-zag' if zigzag else 'contiguous'})",
        [p for p in range(1, 5) if p <= comm.Get_size() and heads % p == 0],
    )
