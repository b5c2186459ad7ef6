"""Checks for lab 12 (shuffling): the partial exchange plan, the Alltoallv that carries it, and a redistribution.

`check_exchange_plan` runs the student's plan on every rank of sub-communicators of
every size, for several data set sizes, exchange fractions, epochs and seeds, gathers
the plans and replays the exchange: int64 positions as the lab asks, no sample lost or
duplicated, every rank keeps its count, round(Q m) samples leave each rank (floor or
ceil accepted), the plans agree pairwise, the same arguments give the same plan and
another epoch another one. The last case gives each rank 70,000 samples, so positions
computed in 16 bits on the way (past 32,767 or 65,535) wrap and fail.

`check_exchange_samples` hands the student's function a CountingComm that allows
exactly one collective, Alltoallv, with each send[d] listed out of position order, and
compares the rows received (in the order listed) with the reference
(`ddlab.shuffling.exchange_samples`), and the bytes sent to each rank with the rows planned.

`check_redistribute` gives the student's function diagrams (which ids each rank holds,
which it needs): unequal and empty holdings, ids not in order, a layout where nothing
leaves its rank, and 70,000 samples (positions past any 16-bit index); it compares the
rows with one process's answer, the bytes sent to each rank with the rows it needs from
this one (a local copy instead of a message to itself is fine), and the inputs after.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..data.sharding import epoch_permutation
from ..runtime.blocks import block_bounds
from ..runtime.counting import COLLECTIVE_TAG
from ..shuffling.shuffler import exchange_plan, exchanged_count
from ._core import array_problem, count, each_size, fail_together, passed, run_counted
from ._draw import Draw, grading_draw, named

PLAN_CASES = [(n, q, epoch, seed) for n in (1, 37, 200) for q in (0.0, 0.3, 1.0) for epoch, seed in ((0, 0), (3, 11))]
WIDE = 70_000  # samples a rank in the last plan case: positions past 16 bits (signed or not)
NARROW_HINT = f" (each rank holds {WIDE} samples: positions past 32,767 do not fit 16 bits; keep them int64 throughout)"


def _counts(n: int, size: int) -> list[int]:
    return np.diff(block_bounds(n, size)).tolist()


def _plan_cases(size: int, draw: Draw | None = None) -> list[tuple[list[int], float, int, int]]:
    """(counts, q, epoch, seed): data sets of 1, 37 and 200 samples, then WIDE samples on every rank.

    The grader's draw: 3 data set sizes up to 400, q of 0, 1 and one drawn, epochs and seeds; then a mixing case
    (`_mixes`) of 40 to 100 samples a rank and q from 0.3 to 0.9."""
    wide = [([WIDE] * size, 0.1, 1, 4)]
    if draw is None:
        return [(_counts(n, size), q, epoch, seed) for n, q, epoch, seed in PLAN_CASES] + wide
    cases = []
    for i, n in enumerate(draw.lengths(3, 1, 400, "n", size)):
        counts = _counts(n, size)
        for q in (0.0, draw.integer(1, 99, "q", size, i) / 100, 1.0):
            cases.append((counts, q, draw.integer(0, 99, "epoch", size, i), draw.integer(0, 10**6, "seed", size, i)))
    mixing = _counts(draw.integer(40 * size, 100 * size, "mixing n", size), size)
    q = draw.integer(30, 90, "mixing q", size) / 100
    return [
        *cases,
        (mixing, q, draw.integer(0, 99, "mixing epoch", size), draw.integer(0, 10**6, "mixing seed", size)),
    ] + wide


def _mixes(counts: list[int], q: float) -> bool:
    """Whether a case is one where a right plan moves samples off every rank and changes from epoch to epoch:
    12 or more exchanged on every rank of two or more (the notebook's 200 samples at q = 0.3, the drawn mixing
    case); with fewer, a right plan may by chance deal a rank's samples back to itself."""
    return len(counts) > 1 and 0 < q <= 1 and min(exchanged_count(m, q) for m in counts) >= 12


def _plan_shape_problem(plan: Any, size: int, m: int) -> str | None:
    """What is wrong with the form of one rank's plan, or None."""
    if not isinstance(plan, tuple) or len(plan) != 2:
        return f"should return a tuple (send, recv_counts), got {type(plan).__name__}"
    send, recv_counts = plan
    if not isinstance(send, list) or len(send) != size:
        return (
            f"send should be a list of {size} arrays (one per rank), got {type(send).__name__} of length "
            f"{len(send) if hasattr(send, '__len__') else '?'}"
        )
    for d, positions in enumerate(send):
        if not isinstance(positions, np.ndarray) or positions.ndim != 1:
            return f"send[{d}] should be a 1-D NumPy array of int64 positions"
        if positions.dtype != np.int64:
            return (
                f"send[{d}] holds {positions.dtype} positions: return int64 arrays, as the lab asks "
                f"(int16 cannot index past sample 32,767 of a rank)"
            )
        if positions.size and (positions.min() < 0 or positions.max() >= m):
            return f"send[{d}] holds positions outside 0..{m - 1} (this rank holds {m} samples)"
    if (
        not isinstance(recv_counts, (list, tuple, np.ndarray))
        or len(recv_counts) != size
        or any(int(c) != c or c < 0 for c in recv_counts)
    ):
        return f"recv_counts should be a list of {size} non-negative ints"
    return None


def _plan_problem(plans: list[Any], counts: list[int], rank: int, q: float) -> str | None:
    """Replay everyone's plan from this rank's point of view."""
    size, m = len(counts), counts[rank]
    send, recv_counts = plans[rank]
    leaving = np.concatenate(send)
    if len(np.unique(leaving)) != len(leaving):
        twice = leaving[np.flatnonzero(np.bincount(leaving) > 1)[0]] if leaving.size else None
        return f"position {twice} is sent more than once: that sample would be duplicated on its receivers"
    if abs(len(leaving) - q * m) >= 1:
        return f"sends {len(leaving)} of its {m} samples, expected round(Q m) = round({q} * {m}) (exchanged fraction Q)"
    for s in range(size):
        if int(recv_counts[s]) != len(plans[s][0][rank]):
            return (
                f"expects {int(recv_counts[s])} samples from rank {s}, but rank {s}'s plan sends it "
                f"{len(plans[s][0][rank])}: every rank must compute the same plan from (counts, q, epoch, seed)"
            )
    kept = m - len(leaving) + int(sum(recv_counts))
    if kept != m:
        return f"would hold {kept} samples after the exchange, expected its {m} (send as many as it receives)"
    return None


def _replay_problem(plans: list[Any], counts: list[int]) -> str | None:
    """Move sample ids as the plans say; every id must end up on exactly one rank."""
    bounds = block_bounds(sum(counts), len(counts))
    held = []
    for r, (send, _) in enumerate(plans):
        ids = np.arange(bounds[r], bounds[r + 1])
        held.append(np.delete(ids, np.concatenate(send)))
        held.extend(ids[positions] for d, positions in enumerate(send))
    everything = np.concatenate(held)
    if len(everything) != sum(counts) or np.any(np.bincount(everything, minlength=sum(counts)) != 1):
        return "replaying all plans loses or duplicates samples"
    return None


def check_exchange_plan(fn: Callable[..., tuple[list[np.ndarray], list[int]]]) -> None:
    """fn(counts, rank, q, epoch, seed) -> (send, recv_counts): a valid, agreed plan on every rank."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "exchange_plan")  # the grader's: ranks, counts, q, epochs and seeds

    def body(comm: MPI.Comm) -> str | None:
        rank, size = comm.Get_rank(), comm.Get_size()
        for counts, q, epoch, seed in _plan_cases(size, draw):
            wide = counts[0] == WIDE
            case = f"counts={counts}, q={q}, epoch={epoch}, seed={seed}{named(draw)}"
            plan = fn(list(counts), rank, q, epoch, seed)
            problem = _plan_shape_problem(plan, size, counts[rank])
            if problem is None:
                again = fn(list(counts), rank, q, epoch, seed)
                if _plan_shape_problem(again, size, counts[rank]) or any(
                    not np.array_equal(a, b) for a, b in zip(plan[0], again[0])
                ):
                    problem = "two calls with the same arguments gave different plans: seed the choice from them"
            everyone = comm.allgather((problem, plan if problem is None else None))
            if any(p for p, _ in everyone):
                return f"{case}: {problem}{NARROW_HINT if wide else ''}" if problem else None
            plans = [plan for _, plan in everyone]
            problem = _plan_problem(plans, counts, rank, q) or _replay_problem(plans, counts)
            if problem and wide:
                problem += NARROW_HINT
            # Each rank judges the plans from its own side: stop together, or the ranks that found
            # nothing would wait in the next case for the ones that stopped.
            fail_together(comm, problem and f"{case}: {problem}", f"exchange_plan on {count(size, 'rank')}")
            if _mixes(counts, q):
                moved = sum(len(positions) for d, positions in enumerate(plan[0]) if d != rank)
                later = fn(list(counts), rank, q, epoch + 1, seed)
                same = _plan_shape_problem(later, size, counts[rank]) is None and all(
                    np.array_equal(a, b) for a, b in zip(plan[0], later[0])
                )
                problem = (
                    f"{case}: sends all its {len(np.concatenate(plan[0]))} samples to itself: the exchange moves "
                    "nothing and mixes nothing; draw each sample's destination among all ranks"
                    if not moved
                    else None
                )
                if problem is None and same:
                    problem = f"{case}: the plan of epoch {epoch + 1} is the same as epoch {epoch}'s: draw it from the epoch too"
                fail_together(comm, problem, f"exchange_plan on {count(size, 'rank')}")
        return None

    each_size(world, body, "exchange_plan", draw=draw)
    passed(
        world,
        f"exchange_plan: every rank agrees, keeps its count, sends round(Q m); no sample lost or duplicated{named(draw)}",
    )


def _samples(rank: int, m: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Rank's holding: sample i of rank r reads 1000 r + i (+ a fraction per feature), so any mix-up shows."""
    base = (1000 * rank + np.arange(m)).reshape((m,) + (1,) * len(shape))
    features = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape) / 8 if shape else 0
    return (base + features).astype(dtype)


def _unsorted(plan: tuple[list[np.ndarray], list[int]], rank: int, seed: int = 7) -> tuple[list[np.ndarray], list[int]]:
    """The plan with each send[d] in a seeded random order: the rows must go in the order listed, not sorted."""
    send, recv_counts = plan
    rng = np.random.default_rng([seed, rank])
    return [rng.permutation(positions) for positions in send], recv_counts


EXCHANGE_CASES = ((37, 0.3, "float64", (3,)), (20, 1.0, "int64", ()), (41, 0.5, "float32", (2, 2)))
#: The dtypes the grader draws samples of.
DRAWN_DTYPES = ("float64", "float32", "int64", "int32")


def _drawn_samples(draw: Draw, what: str, count: int, most: int) -> list[tuple[int, str, tuple[int, ...]]]:
    """`count` (samples, 1 to `most`; dtype; shape of a sample, 0 to 2 dimensions up to 4) the grader draws."""
    return [
        (
            draw.integer(1, most, what, "n", i),
            draw.choose(DRAWN_DTYPES, 1, what, "dtype", i)[0],
            tuple(draw.integer(1, 4, what, "dim", i, d) for d in range(draw.integer(0, 2, what, "ndim", i))),
        )
        for i in range(count)
    ]


def check_exchange_samples(fn: Callable[..., np.ndarray]) -> None:
    """fn(comm, x, send, recv_counts) -> rows received by source, carried by one Alltoallv of exactly the planned rows."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "exchange_samples")  # the grader's: ranks, sizes, q, dtypes, shapes, plans' seeds
    cases: tuple[tuple[int, float, str, tuple[int, ...]], ...] = EXCHANGE_CASES
    if draw is not None:
        drawn = _drawn_samples(draw, "exchange", 3, 60)
        cases = tuple((n, draw.integer(0, 100, "q", i) / 100, d, s) for i, (n, d, s) in enumerate(drawn))
    seed = 2 if draw is None else draw.integer(0, 10**6, "plan")

    def body(comm: MPI.Comm) -> str | None:
        rank, size = comm.Get_rank(), comm.Get_size()
        for n, q, dtype, shape in cases:
            counts = _counts(n, size)
            plans = [_unsorted(exchange_plan(counts, r, q, epoch=1, seed=seed), r, seed + 5) for r in range(size)]
            holdings = [_samples(r, counts[r], dtype, shape) for r in range(size)]
            x = holdings[rank]
            original = x.copy()
            case = f"{np.dtype(dtype).name} samples of shape {shape}, counts={counts}, q={q}{named(draw)}"
            want = np.concatenate([holdings[s][plans[s][0][rank]] for s in range(size)])  # before fn can touch x
            got, traffic = run_counted(
                comm, fn, (x, *plans[rank]), f"exchange_samples with {case}", allow=("Alltoallv",)
            )
            problem = array_problem(got, want, "the rows received")
            if problem is not None:
                problem += _rows_for_elements(traffic[rank], [len(p) * x[0:1].nbytes for p in plans[rank][0]], x)
                sorted_rows = np.concatenate([holdings[s][np.sort(plans[s][0][rank])] for s in range(size)])
                if isinstance(got, np.ndarray) and got.shape == want.shape and np.array_equal(got, sorted_rows):
                    problem += (
                        " (each sender's rows came in position order: send them in the order send[d] lists them, "
                        "x[send[d]], not sorted)"
                    )
            if problem is None and np.shares_memory(got, x):
                problem = "returned x or a view of it: return a new array"
            if problem is None and not np.array_equal(x, original):
                problem = "changed x: leave the caller's samples as they are"
            if problem is None:
                problem = _traffic_problem(traffic[rank], [len(p) * x[0:1].nbytes for p in plans[rank][0]])
            fail_together(comm, problem and f"{case}: {problem}", f"exchange_samples on {count(size, 'rank')}")
        return None

    each_size(world, body, "exchange_samples", draw=draw)
    passed(
        world,
        f"exchange_samples: one Alltoallv carries exactly the planned rows, received grouped by source{named(draw)}",
    )


def _rows_for_elements(traffic: Any, want_bytes: list[int], x: np.ndarray) -> str:
    """A pointer when the Alltoallv sent every rank 1/f of its planned bytes (f elements per row), else ""."""
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    sent = [e.nbytes for e in traffic.sends]
    if row > 1 and any(want_bytes) and sent == [b // row for b in want_bytes]:
        return f" (the Alltoallv sent 1/{row} of the planned bytes: counts and displacements in elements, not rows?)"
    return ""


def _traffic_problem(traffic: Any, want_bytes: list[int], local_copy: int | None = None) -> str | None:
    """One Alltoallv, no point-to-point messages, and the planned bytes to every rank.

    local_copy: this rank, if it may copy its own rows instead of sending them to itself (0 bytes to it).
    """
    if traffic.calls != ["Alltoallv"]:
        return f"called comm.Alltoallv {len(traffic.calls)} times, expected exactly once (all samples in one call)"
    p2p = [e for e in traffic.events if e.tag != COLLECTIVE_TAG]
    if p2p:
        return f"sent or received {len(p2p)} point-to-point messages besides the Alltoallv: send everything in it"
    sent = [e.nbytes for e in traffic.sends]
    if local_copy is not None and len(sent) == len(want_bytes) and sent[local_copy] == 0:
        want_bytes = [0 if d == local_copy else b for d, b in enumerate(want_bytes)]
    if sent != want_bytes:
        wrong = next(d for d, (a, b) in enumerate(zip(sent, want_bytes)) if a != b)
        return (
            f"the Alltoallv sends rank {wrong} {sent[wrong]} bytes, expected {want_bytes[wrong]} "
            f"(the rows planned for it, and nothing else; counts and displacements are in elements)"
        )
    return None


def _diagram(n: int, size: int, kind: str, seed: int | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(holds, needs) of one case, the same on every rank.

    "blocks": staged blocks of ids in order, needing blocks of global shuffling's epoch-1 permutation;
    "uneven": random ids in random, unequal (some empty) holdings and needs;
    "stay": every rank needs what it holds, in reverse order (nothing needs to leave).
    """
    bounds = block_bounds(n, size)
    blocks = [np.arange(bounds[r], bounds[r + 1], dtype=np.int64) for r in range(size)]
    if kind == "blocks":
        permutation = epoch_permutation(n, 1, 0)
        return blocks, [permutation[bounds[r] : bounds[r + 1]] for r in range(size)]
    if kind == "stay":
        return blocks, [ids[::-1].copy() for ids in blocks]
    rng = np.random.default_rng([n, size] if seed is None else [n, size, seed])
    layouts = []
    for _ in range(2):
        cuts = np.sort(rng.integers(0, n + 1, size - 1))
        cuts[0 : min(1, size - 1)] = 0  # rank 0 holds (then needs) nothing
        layouts.append(np.split(rng.permutation(n).astype(np.int64), cuts))
    return layouts[0], layouts[1][::-1]


#: (samples, layout, dtype, shape of a sample): 70,000 rows on one rank index past int16 and uint16.
REDISTRIBUTE_CASES = (
    (12, "blocks", "float64", (3,)),
    (37, "uneven", "float32", (2, 2)),
    (20, "stay", "float64", ()),
    (70_000, "blocks", "int64", ()),
)


def _rows(ids: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Sample i's row reads i (+ a fraction per feature), so any mix-up shows."""
    base = ids.reshape((len(ids),) + (1,) * len(shape))
    features = np.arange(int(np.prod(shape, dtype=np.int64))).reshape(shape) / 8 if shape else 0
    return (base + features).astype(dtype)


def check_redistribute(fn: Callable[..., np.ndarray], timeout: float = 20.0) -> None:
    """fn(comm, x, holds, needs) -> the rows of needs[rank] in order, by one Alltoallv of the rows each rank needs.

    timeout: seconds the check waits for a rank stuck in a call the others never make.
    """
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "redistribute")  # the grader's: ranks, sizes, dtypes, shapes, the uneven layout
    cases: tuple[tuple[int, str, str, tuple[int, ...]], ...] = REDISTRIBUTE_CASES
    if draw is not None:
        drawn = _drawn_samples(draw, "redistribute", 3, 90)
        cases = (*((n, kind, d, s) for kind, (n, d, s) in zip(("blocks", "uneven", "stay"), drawn)), cases[-1])
    seed = None if draw is None else draw.data_seed("layout")

    def body(comm: MPI.Comm) -> str | None:
        rank, size = comm.Get_rank(), comm.Get_size()
        for n, kind, dtype, shape in cases:
            holds, needs = _diagram(n, size, kind, seed)
            x = _rows(holds[rank], dtype, shape)
            originals = (x.copy(), [h.copy() for h in holds], [w.copy() for w in needs])
            want = _rows(needs[rank], dtype, shape)
            owner = np.empty(n, dtype=np.int64)
            for r, ids in enumerate(holds):
                owner[ids] = r
            want_bytes = [int(np.count_nonzero(owner[needs[d]] == rank)) * x[0:1].nbytes for d in range(size)]
            lengths = [len(ids) for ids in holds]
            case = f"{n} {np.dtype(dtype).name} samples of shape {shape}, held {lengths if n < 100 else 'in blocks'}"
            case += named(draw)
            got, traffic = run_counted(
                comm, fn, (x, holds, needs), f"redistribute with {case}", timeout=timeout, allow=("Alltoallv",)
            )
            problem = array_problem(got, want, f"the returned array (the rows of needs[{rank}] in its order)")
            if problem is not None and n > np.iinfo(np.int16).max:
                problem += " (only with this many samples: do positions or ids pass through a narrow integer dtype?)"
            if problem is None and np.shares_memory(got, x):
                problem = "returned x or a view of it: return a new array"
            if problem is None and not np.array_equal(x, originals[0]):
                problem = "changed x: leave the caller's samples as they are"
            for name, before, after in (("holds", originals[1], holds), ("needs", originals[2], needs)):
                if problem is None and any(not np.array_equal(a, b) for a, b in zip(before, after)):
                    problem = f"changed {name}: the diagram is the caller's, read it without sorting or writing into it"
            if problem is None:
                problem = _traffic_problem(traffic[rank], want_bytes, local_copy=rank)
            fail_together(comm, problem and f"{case}: {problem}", f"redistribute on {count(size, 'rank')}")
        return None

    each_size(world, body, "redistribute", draw=draw)
    passed(world, f"redistribute: one Alltoallv brings every rank the samples it needs, in its order{named(draw)}")
