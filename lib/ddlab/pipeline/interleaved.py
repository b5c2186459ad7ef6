"""The interleaved 1F1B schedule: v model chunks per rank, a smaller bubble (lab 16, exercise 16.3).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021, section 2.2.2: instead of one contiguous run of layers, each of the p
ranks holds v *chunks*, and chunk j of rank r is virtual stage j p + r of the v p stages of the
model (with 8 layers, p = 2 and v = 2: rank 0 holds layers 1-2 and 5-6, rank 1 layers 3-4 and
7-8). A micro-batch goes round the ranks v times. Filling and draining the pipeline now takes
p - 1 *chunk* slots, 1/v of a stage's work each, so the bubble is (p - 1)/(v m) of the ideal
compute time t_ideal = m (t_f + t_b), against (p - 1)/m for plain 1F1B; as a share of the step
that is (p - 1)/(v m + p - 1). The price: v times as many messages between the ranks.

An op is ("F", j, i) or ("B", j, i): chunk j of this rank, micro-batch i. `interleaved_1f1b`
(exercise 16.3's reference) orders them as the paper's schedule does: micro-batches go in
groups of p (m must be a multiple of p); the k-th forward of a rank is chunk (k // p) mod v of
micro-batch (k // (p v)) p + k mod p, the k-th backward the same with the chunks in reverse
order (the last chunk's backward comes first). Rank r first runs 2 (p - r - 1) + (v - 1) p
forwards (the warm-up, at most v m), then alternates one forward and one backward, then runs
the backwards left. With v = 1 it is plain 1F1B (lab 07).

`simulate_interleaved` replays op lists with given op times (messages free), `run_interleaved`
runs them on real ranks, each chunk a torch module: a micro-batch's activation goes from
virtual stage q to q + 1, i.e. from rank r to rank r + 1, and from the last rank to rank 0's
next chunk.

Exercise 16.3 signature: `interleaved(p, m, rank, v) -> list of ("F" or "B", chunk, micro-batch)`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..model_parallel import Mailbox, Timeline
from ..runtime.comm import Comm
from ..runtime.reference import reference
from .schedules import replay, virtual_stage

ChunkOp = tuple[str, int, int]
Interleaved = Callable[[int, int, int, int], list[ChunkOp]]


def check_sizes(p: int, m: int, rank: int, v: int) -> None:
    """ValueError unless p >= 1 ranks, v >= 1 chunks, 0 <= rank < p, and m >= 1 a multiple of p (when v > 1)."""
    if p < 1 or v < 1 or m < 1 or not 0 <= rank < p:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1 and 0 <= rank < p, got p={p}, m={m}, v={v}, rank={rank}")
    if v > 1 and m % p:
        raise ValueError(
            f"the interleaved schedule takes micro-batches in groups of p = {p}: use m a multiple of {p}, got {m}"
        )


def warmup_forwards(p: int, m: int, rank: int, v: int) -> int:
    """How many forwards rank runs before its first backward: p - rank - 1 for v = 1 (lab 07's 1F1B),
    2 (p - rank - 1) + (v - 1) p with chunks, at most v m."""
    if v == 1:
        return min(p - rank - 1, m)
    return min(2 * (p - rank - 1) + (v - 1) * p, v * m)


@reference("interleaved")
def interleaved_1f1b(p: int, m: int, rank: int, v: int) -> list[ChunkOp]:
    """Exercise 16.3's reference: rank's ops under the interleaved 1F1B schedule (see the module's docstring)."""
    check_sizes(p, m, rank, v)
    total = v * m

    def op(kind: str, k: int) -> ChunkOp:
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p if v > 1 else k
        return (kind, chunk if kind == "F" else v - 1 - chunk, micro)

    warmup = warmup_forwards(p, m, rank, v)
    ops = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [op("F", warmup + k), op("B", k)]
    return ops + [op("B", k) for k in range(total - warmup, total)]


def simulate_interleaved(
    schedules: list[list[ChunkOp]], v: int, forward: float = 1.0, backward: float = 2.0
) -> list[list[tuple[ChunkOp, float, float]]]:
    """Replay per-rank op lists with equal chunks (forward / v and backward / v per chunk op); messages are free.

    F of virtual stage q needs F of q - 1; B of q needs F of q and B of q + 1. Returns, per rank,
    (op, start, end); raises ValueError on a deadlock (a rank waiting for an op that never runs).
    Lab 07's `simulate` is the same replay with v = 1."""
    p = len(schedules)
    return replay(schedules, [forward / v] * p, [backward / v] * p, v, unit="rank")


def chunk_in_flight(ops: list[ChunkOp]) -> int:
    """The most (chunk, micro-batch) activations a rank keeps at once: forwards done whose backward is not."""
    live = most = 0
    for kind, _, _ in ops:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def interleaved_bubble(p: int, m: int, v: int) -> float:
    """(p - 1)/(v m + p - 1): the idle share of the step, from a bubble of (p - 1)/(v m) of the ideal compute."""
    return (p - 1) / (v * m + p - 1)


def run_interleaved(
    comm: Comm,
    chunks: list[nn.Module],
    ops: list[ChunkOp],
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    clock: Timeline | None = None,
    activation: tuple[tuple[int, ...], torch.dtype] | None = None,
) -> list[float]:
    """Run rank r's ops with its v chunks (chunk j is virtual stage j p + r); gradients add up in .grad.

    Every activation has inputs[i]'s shape and dtype (or `activation`'s). inputs are used by rank 0's
    chunk 0, targets and `loss` by the last rank's last chunk, which returns the micro-batch losses in micro-batch order
    ([] elsewhere). Messages are posted without waiting and tagged by the receiver's chunk and
    micro-batch, and by direction (the last rank and rank 0 exchange both ways).

    With an enabled `clock` (lab 07's `Timeline`), each op is a forward or backward span of its micro-batch
    and each wait for a message is idle time, on the wall and the busy clock (messages carry the sender's
    busy time); the clock starts at 0 once every rank's mailbox is made (a collective).

    `activation` = (shape, dtype) of what the chunks send when it is not the inputs' (lab 16's GPT: token
    ids in, float activations between virtual stages), as `run_schedule`'s."""
    mailbox = Mailbox(comm, clock=clock)
    if clock is not None:
        clock.start()
    r, p, v, m = mailbox.rank, mailbox.size, len(chunks), len(inputs)
    nxt, prev = (r + 1) % p, (r - 1) % p

    def tag(chunk: int, i: int, backward: bool) -> int:
        return 2 * (chunk * m + i) + int(backward)

    kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    losses: dict[int, float] = {}
    for kind, j, i in ops:
        if kind not in ("F", "B"):
            raise ValueError(f"unknown op {(kind, j, i)!r}: ops are ('F', chunk, i) or ('B', chunk, i)")
        q = virtual_stage(p, r, j)
        with mailbox.clock.span("forward" if kind == "F" else "backward", i):
            if kind == "F":
                shape, dtype = activation or (tuple(inputs[i].shape), inputs[i].dtype)
                x = inputs[i] if q == 0 else mailbox.take(shape, dtype, prev, tag(j, i, False)).requires_grad_()
                y = chunks[j](x)
                if q == v * p - 1:
                    y = loss(y, targets[i])
                    losses[i] = y.item()
                else:
                    mailbox.post(y, nxt, tag(j + (r == p - 1), i, False))
                kept[(j, i)] = (x, y)
            else:
                x, y = kept.pop((j, i))
                last = q == v * p - 1
                y.backward(None if last else mailbox.take(tuple(y.shape), y.dtype, nxt, tag(j, i, True)))
                if q > 0:
                    assert x.grad is not None, "a received activation requires grad"
                    mailbox.post(x.grad, prev, tag(j - (r == 0), i, True))
    if kept:
        raise ValueError(f"rank {r}: the ops never ran the backward of (chunk, micro-batch) {sorted(kept)}")
    mailbox.free()
    return [losses[i] for i in sorted(losses)]
