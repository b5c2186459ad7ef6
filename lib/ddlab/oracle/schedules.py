"""The pipeline schedules priced (lab 16): bubble from F, B and W times, memory from the op lists (lab 17's).

A stage's backward is two computations (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section
2): B, the gradient of the stage's input, which the previous stage waits for, and W, the gradients of its
weights, which nobody waits for. For a transformer layer the FLOPs split as (`split_flops`): F = the linear
layers' forward L plus the attention's scores and weighted values A; B = the input-gradient matmuls (L again)
plus the attention's backward (2A: it has no weights, so all of it is B); W = the weight-gradient matmuls (L).
Full recomputation reruns F before B (so it adds F to B), selective recomputation A. The output layer is L-like:
its forward, input gradient and weight gradient, one third each. F + B + W = 3 forward, as
`transformer.iteration_flops` counts.

Idle seconds per rank in a step of m micro-batches on p stages, f, b, w one micro-batch's op times on a stage
(`idle_per_rank`), and the closed forms it uses where they hold (each equal to the replay of the op list with
the same times, messages free: tests/test_oracle_transformer_schedules.py):

- "1f1b" (lab 07, the whole backward as one op): (p - 1)(f + b + w); with v chunks per rank (the interleaved
  schedule, Narayanan et al., SC 2021, section 2.2.2) (p - 1)(f + b + w)/v;
- "zb-h1" (Qi et al., ICLR 2024, section 2.1 as the ICLR version numbers it; `ddlab.pipeline.zb_h1`): (p - 1)(F + B - W) for m >= p, at
  least (p - 1) F (the last stage's first forward waits for p - 1 others when W > B);
- "zb-h2" (the same, section 2.2; `zb_h2`): (p - 1)(F + B - 2W), at least (p - 1) F (every rank's step ending
  together, as the optimizer step makes it; Qi et al.'s post-validation, section 4, lets the stages' steps
  overlap instead, which a synchronised step does not), for m >= 2p;
- "zb-v" (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024, section 3; `zb_v`): two chunks per
  rank in a V; no closed form: its op list is built greedily for equal F, B and W times (where the paper
  gives it a bubble near zero), so its idle time is that op list's replay at the given times, which grows
  with m when B and W differ. Priced up to `ZB_V_LIMIT` micro-batches times stages (the greedy
  builder takes seconds beyond).

Outside a closed form's range (m < p for ZB-H1, m < 2p for ZB-H2) the replay of the op list is the price.

Memory (`in_flight`): the most micro-batches a stage keeps alive at once (F done, its W not yet) in the op
list, on the first and the last stage: 1F1B min(p - s, m) on stage s; ZB-H1 min(p, m) on every stage (its W's
wait s B's on stage s); ZB-H2 2p on the first (2p - 1 warm-up forwards, then one more before its first B);
ZB-V 2p chunks of l/(2p) layers, 1F1B's p stages' worth. Between B
and W a micro-batch keeps only what W needs (each linear layer's input and output gradient, Qi et al.,
Table 1), counted here as its whole activations: an upper bound.
"""

from __future__ import annotations

from functools import lru_cache

from ..pipeline.zero_bubble import one_f_one_b_whole, replay_split, split_peak, zb_h1, zb_h2, zb_v

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-v")
#: ZB-V is priced for p m up to this (its op list, built by a greedy replay, takes about 0.1 s at p m = 256).
ZB_V_LIMIT = 256
_BUILDERS = {"1f1b": one_f_one_b_whole, "zb-h1": zb_h1, "zb-h2": zb_h2, "zb-v": zb_v}


def check_schedule(schedule: str, p: int, m: int) -> str | None:
    """Why `schedule` cannot be priced on p stages and m micro-batches (None if it can)."""
    if schedule not in SCHEDULES:
        return f"schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}"
    if schedule == "zb-v" and p * m > ZB_V_LIMIT:
        return (
            f"schedule zb-v is priced for p m <= {ZB_V_LIMIT} (its op list is built by a greedy replay): "
            f"p {p} x m {m} is {p * m}; choose zb-h1 or zb-h2"
        )
    return None


@lru_cache(maxsize=256)
def op_lists(schedule: str, p: int, m: int) -> tuple[tuple[tuple, ...], ...]:
    """Every rank's op list of `schedule` (lab 17's generators), cached."""
    reason = check_schedule(schedule, p, m)
    if reason:
        raise ValueError(reason)
    return tuple(tuple(_BUILDERS[schedule](p, m, rank)) for rank in range(p))


def replayed_idle(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    """Idle seconds of the busiest rank in the replay of the op lists (messages free); in a V each chunk takes
    half a stage's f, b and w. The replay scales with the times, so it runs once per ratio b/f, w/f."""
    scale = f or b or w
    return scale * _unit_idle(schedule, p, m, f / scale, b / scale, w / scale) if scale else 0.0


@lru_cache(maxsize=4096)
def _unit_idle(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    ops = op_lists(schedule, p, m)
    if schedule == "zb-v":
        timeline = replay_split(ops, f / 2, b / 2, w / 2, shape="V")
    else:
        timeline = replay_split(ops, f, b, w)
    makespan = max(end for rank in timeline for _, _, end in rank)
    return makespan - min(sum(end - start for _, start, end in rank) for rank in timeline)


def idle_per_rank(schedule: str, p: int, m: int, f: float, b: float, w: float, v: int = 1) -> float:
    """Seconds a rank idles in a step of m micro-batches through p stages (f, b, w: one micro-batch's forward,
    input-gradient and weight-gradient time on a stage); v chunks per rank for the interleaved 1F1B."""
    reason = check_schedule(schedule, p, m)
    if reason:
        raise ValueError(reason)
    if min(f, b, w) < 0 or p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1 and times >= 0, got p={p}, m={m}, v={v}, f={f}, b={b}, w={w}")
    if p == 1:
        return 0.0
    if schedule == "1f1b":
        return (p - 1) * (f + b + w) / v
    if v != 1:
        raise ValueError(f"{schedule} runs one chunk per rank (zb-v two, in a V): use v = 1, got {v}")
    if schedule == "zb-h1" and m >= p:
        return (p - 1) * max(f, f + b - w)
    if schedule == "zb-h2" and m >= 2 * p:
        return (p - 1) * max(f, f + b - 2 * w)
    return replayed_idle(schedule, p, m, f, b, w)


@lru_cache(maxsize=1024)
def in_flight(schedule: str, p: int, m: int, stage: int) -> int:
    """The most micro-batches (chunk activations for zb-v) stage `stage` keeps alive at once in the op list."""
    return split_peak(op_lists(schedule, p, m)[stage])


def split_flops(
    linear: float,
    attention: float,
    output: float,
    recompute: str,
    share: float = 1.0,
    attention_backward: float | None = None,
) -> tuple[float, float, float]:
    """(F, B, W) FLOPs from a forward's linear-layer FLOPs, attention FLOPs (scores and weighted values) and
    output-layer FLOPs: F = linear + attention + output; B = linear + 2 attention + output plus the rerun (full:
    the layers' F, of the `share` of the layers it reruns; selective: the attention's; op: the `share` of the linear
    layers' it reruns); W = linear + output. `attention_backward`, if given, stands for the 2 attention in B (a
    kernel whose backward runs at another pace than its forward)."""
    rerun = {"none": 0.0, "selective": attention, "full": share * (linear + attention), "op": share * linear}[recompute]
    backward = 2 * attention if attention_backward is None else attention_backward
    return linear + attention + output, linear + backward + output + rerun, linear + output
