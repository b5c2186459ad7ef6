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

`simulate` replays per-stage op lists with given op times; it is `replay`, which also
replays lab 16's interleaved schedule (v chunks per rank, `simulate_interleaved`), with v = 1, and
lab 17's op lists with W ops (`zero_bubble.replay_split`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..runtime.reference import reference
from ..runtime.trace import Span

Op = tuple[str, int]
Schedule = Callable[[int, int, int], list[Op]]


@reference("gpipe")
def gpipe(k: int, m: int, stage: int) -> list[Op]:
    """All forwards, then all backwards (in micro-batch order)."""
    _check(k, m, stage)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


@reference("one_f_one_b")
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
    return replay(schedules, forward, backward)


def virtual_stage(p: int, rank: int, chunk: int) -> int:
    """Chunk `chunk` of rank `rank` is virtual stage chunk x p + rank of the v p (lab 16's interleaving)."""
    return chunk * p + rank


def replay(
    schedules: Sequence[Sequence[Any]],
    forward: list[float],
    backward: list[float],
    v: int = 1,
    unit: str = "stage",
    weight: list[float] | None = None,
    place: Callable[[int, int, int], int] = virtual_stage,
    what: str = "schedules",
) -> list[list[tuple[Any, float, float]]]:
    """The one replay behind `simulate` (lab 07), `simulate_interleaved` (lab 16) and lab 17's `replay_split`.

    Messages are free. schedules[r] lists rank r's ops: ("F", i) and ("B", i), or with v chunks per rank
    ("F", j, i) and ("B", j, i), chunk j of rank r being virtual stage place(p, r, j) (by default
    j p + r; a plain op is chunk 0's). forward[r], backward[r]: the time of one op on rank r. F of
    virtual stage q needs F of q - 1; B of q needs F of q and B of q + 1. With `weight` (lab 17's split
    backward) ("W", ...) takes weight[r] and needs B of its stage, and ("BW", ...) is B and W in one op
    (backward[r] + weight[r]); without it every op but F is a B. Returns, per rank, (op, start, end);
    raises ValueError naming each stuck `unit` (stage or rank) on a deadlock, a rank waiting for an op
    that never runs.
    """
    p = len(schedules)
    last = v * p - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    cursor, clock = [0] * p, [0.0] * p
    out: list[list[tuple[Any, float, float]]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while cursor[r] < len(schedules[r]):
                op = schedules[r][cursor[r]]
                kind, chunk, i = (op[0], 0, op[1]) if len(op) == 2 else op
                q = place(p, r, chunk)
                if kind == "F":
                    needs, seconds = [("F", q - 1, i)] if q > 0 else [], forward[r]
                elif weight is not None and kind == "W":
                    needs, seconds = [("B", q, i)], weight[r]
                else:
                    kind, seconds = "B", backward[r] + (weight[r] if weight is not None and kind == "BW" else 0.0)
                    needs = [("F", q, i)] + ([("B", q + 1, i)] if q < last else [])
                if any(need not in done for need in needs):
                    break
                start = max([clock[r]] + [done[need] for need in needs])
                end = start + seconds
                done[(kind, q, i)], clock[r] = end, end
                out[r].append((op, start, end))
                cursor[r] += 1
                progress = True
    stuck = [r for r in range(p) if cursor[r] < len(schedules[r])]
    if stuck:
        waiting = ", ".join(f"{unit} {r} at {schedules[r][cursor[r]]}" for r in stuck)
        raise ValueError(f"the {what} deadlock: {waiting} wait for ops that never run")
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
