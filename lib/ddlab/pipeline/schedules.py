"""Pipeline schedules: the order in which one stage runs the forwards and backwards of M micro-batches.

An op is ("F", i) or ("B", i), micro-batch i = 0 .. M-1.

- GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism", 2019): all M forwards, then all M backwards. Every stage keeps
  the activations of all M micro-batches until its backwards start.
- 1F1B (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
  Training", 2019; with a flush at the end of each step, as in Narayanan et al.,
  "Memory-Efficient Pipeline-Parallel DNN Training", 2021): stage s first runs
  K-s-1 forwards (the warm-up), then alternates one forward and one backward, then
  runs the remaining backwards. Stage s never holds more than K-s micro-batches.

Both take the same time: (M+K-1) forward-and-backward slots, of which each stage is
idle for K-1, a bubble of (K-1)/(M+K-1). They differ in memory.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..runtime.trace import Span

Op = tuple[str, int]
Schedule = Callable[[int, int, int], list[Op]]


def gpipe(k: int, m: int, stage: int) -> list[Op]:
    """All forwards, then all backwards (in micro-batch order)."""
    _check(k, m, stage)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(k: int, m: int, stage: int) -> list[Op]:
    """Warm-up forwards, then one forward one backward, then the remaining backwards."""
    _check(k, m, stage)
    warmup = min(k - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


def _check(k: int, m: int, stage: int) -> None:
    if k < 1 or m < 1 or not 0 <= stage < k:
        raise ValueError(
            f"need k >= 1 stages, m >= 1 micro-batches and 0 <= stage < k, got k={k}, m={m}, stage={stage}"
        )


def in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose forward is done and backward is not, at any point of ops."""
    live = most = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def simulate(
    schedules: list[list[Op]], forward: float | list[float] = 1.0, backward: float | list[float] = 2.0
) -> list[list[tuple[Op, float, float]]]:
    """Run per-stage op lists on a linear chain of stages; messages take no time.

    forward, backward: the time of one micro-batch's op, the same on every stage or
    one per stage. F(i) on stage s needs F(i) on s-1; B(i) needs F(i) on s and B(i)
    on s+1. Returns, per stage, (op, start, end). Raises ValueError on a deadlock.
    """
    k = len(schedules)
    forward = forward if isinstance(forward, list) else [forward] * k
    backward = backward if isinstance(backward, list) else [backward] * k
    done: dict[tuple[int, Op], float] = {}
    cursor, clock = [0] * k, [0.0] * k
    out: list[list[tuple[Op, float, float]]] = [[] for _ in range(k)]
    progress = True
    while progress:
        progress = False
        for s in range(k):
            while cursor[s] < len(schedules[s]):
                op = schedules[s][cursor[s]]
                kind, i = op
                needs = [(s - 1, ("F", i))] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [(s, ("F", i))] + ([(s + 1, ("B", i))] if s < k - 1 else [])
                if any(need not in done for need in needs):
                    break
                start = max([clock[s]] + [done[need] for need in needs if need[0] != s])
                end = start + (forward[s] if kind == "F" else backward[s])
                done[(s, op)], clock[s] = end, end
                out[s].append((op, start, end))
                cursor[s] += 1
                progress = True
    stuck = [s for s in range(k) if cursor[s] < len(schedules[s])]
    if stuck:
        waiting = ", ".join(f"stage {s} at {schedules[s][cursor[s]]}" for s in stuck)
        raise ValueError(f"the schedules deadlock: {waiting} wait for ops that never run")
    return out


def as_spans(timeline: list[list[tuple[Op, float, float]]]) -> list[list[Span]]:
    """A simulated timeline as spans like measured ones (kind and micro-batch), for the same Gantt charts."""
    names = {"F": "forward", "B": "backward"}
    return [
        [Span(names[kind], start, end, rank=s, number=i) for (kind, i), start, end in ops]
        for s, ops in enumerate(timeline)
    ]


def bubble(timeline: Sequence[Sequence[tuple[Any, float, float]]]) -> float:
    """Idle share of stages x makespan in a simulated timeline (of lab 07's ops or the interleaved chunk ops)."""
    makespan = max(end for ops in timeline for _, _, end in ops)
    busy = sum(end - start for ops in timeline for _, start, end in ops)
    return 1 - busy / (len(timeline) * makespan)


def theory_bubble(k: int, m: int, hidden: float = 0.0) -> float:
    """(K-1)/(M+K-1): the bubble of GPipe and 1F1B with equal stages whose ops are indivisible.

    hidden: the share of a lone micro-batch's work (M = 1) that overlapped other
    stages' work (see `hidden_share`). Then each of the K-1 slots of filling and
    draining shrinks by hidden x K/(K-1), and the bubble with it.
    """
    if k == 1:
        return 0.0
    fill = (k - 1) * (1 - hidden * k / (k - 1))
    return fill / (m + fill)
