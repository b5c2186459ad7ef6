"""Checks for lab 09: the data-parallel, spatial and hybrid time and memory formulas.

The student's formula is compared with the reference (`ddlab.oracle.formulas`) on
generated cases: 1 to 9 ranks (one rank, two, odd and even counts), small and large
messages, fast and slow links, 1 to 4 convolutions, hybrids inside one node and across
nodes, and slab counts wider than a node, where 9.5 must raise ValueError. Some cases pass
float32 NumPy arrays or tuples of halo bytes where others pass lists: a formula must take
all three, and may return NumPy numbers (integers too); memory may be rounded to whole bytes.
The functions are pure: every rank runs all cases, `each_size` gathers one verdict. A formula
must leave its inputs unchanged and answer within `DEADLINE` seconds a case. A failure names
the first case that differs and, for 9.3 and 9.5, the kinds of case where the answer differs
and those where it agrees (not the formula). Under the grader's seed (`ddlab.checks._draw`) the
cases come from the same recipe on drawn values: P up to 1024, other byte counts, halos, nodes
and groups, so a formula fitted to the notebook's cases fails, naming the case and the seed.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..oracle import formulas
from ..runtime.reference import ReferenceCalled
from ._core import deadline, each_size, is_number, passed
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

DEADLINE = 10.0  # seconds for one case: these are closed forms, a loop that never ends fails

HINTS = {
    "data_parallel_time": "each rank computes its share of the batch; the ring moves 2(P-1)/P of the gradient "
    "bytes in and out of every rank, in 2(P-1) messages.",
    "data_parallel_memory": "which of the four parts does every replica hold whole, and which one shrinks with P?",
    "spatial_time": "per convolution one exchange forward (both neighbours at once), one backward except for the "
    "first convolution, whose input is the data; then the gradients' allreduce.",
    "spatial_memory": "a slab keeps halo rows only from the neighbours it has: edge slabs have one, inner slabs two.",
    "hybrid_time": "compare one group's step with your 9.3 on the group's share of the work, then the rings "
    "over the groups in the kinds of case named above.",
}

#: Other answers the lab's text allows: the reference with these keyword arguments.
ALTERNATIVES: dict[str, list[dict[str, Any]]] = {
    "spatial_time": [{"at_once": False}],
    "hybrid_time": [{"at_once": False}],
}

#: Kinds of case a failure is located by: (what holds when the test is true, when it is false, the test).
KINDS: dict[str, list[tuple[str, str, Callable[[tuple], bool]]]] = {
    "spatial_time": [
        ("P = 1", "P > 1", lambda c: c[3] == 1),
        ("P = 2 (every slab at an edge)", "P > 2 (inner slabs too)", lambda c: c[3] == 2),
    ],
    "hybrid_time": [
        ("s = 1 (no halos)", "s > 1 (halos)", lambda c: c[4] == 1),
        ("d = 1 (one group)", "d > 1", lambda c: c[3] == 1),
        ("d s > per_node (the groups' rings leave the node)", "d s <= per_node", lambda c: c[3] * c[4] > c[7]),
    ],
}


def _numpy_flavour(case: tuple, trial: int) -> tuple:
    """Every third case with a float32 NumPy array (or a tuple) where the others pass a list of bytes."""
    if trial % 3 != 1:
        return case
    return tuple(
        (np.asarray(value, dtype=np.float32) if trial % 2 else tuple(value)) if isinstance(value, list) else value
        for value in case
    )


def _ranks(draw: Draw | None) -> list[int]:
    """The rank counts P of the cases: the notebook's 1 to 9, or 1, 2 and five drawn from 3 to 1024."""
    return [1, 2, 3, 4, 5, 8, 9] if draw is None else [1, 2, *draw.lengths(5, 3, 1024, "p")]


def _cases(name: str, draw: Draw | None = None) -> list[tuple]:
    """The notebook's 40 cases (random.Random(9)), or the grader's 40 from the same recipe on drawn values:
    P as `_ranks`; byte counts 0 and four from 1 to 10^9; halos of three drawn sizes up to 1 MiB, 1 to 6
    convolutions; whole-batch activations of two drawn sizes up to 1 GiB; 0 to 4 optimizer copies; nodes of
    three drawn sizes from 2 to 16 devices; 1, 2 and three drawn data groups up to 256; slabs from 1 to a
    node, and in every 13th case more than a node holds (up to three nodes' worth), where 9.5 must raise;
    9.4 on every rank of P up to 9, else on the two edge ranks and three drawn inner ones."""
    rng = random.Random(9 if draw is None else draw.data_seed("cases"))
    ranks = _ranks(draw)
    byte_counts = [0, 4, 4096, 2**20, 10**8 + 4] if draw is None else [0, *draw.lengths(4, 1, 10**9, "bytes")]
    halo_sizes = [64, 4096, 2**16] if draw is None else draw.lengths(3, 1, 2**20, "halos")
    activations = [1000, 2**24] if draw is None else draw.lengths(2, 1, 2**30, "activations")
    nodes = [2, 4, 8] if draw is None else draw.lengths(3, 2, 16, "per_node")
    groups = [1, 2, 3, 4, 8] if draw is None else [1, 2, *draw.lengths(3, 3, 256, "d")]
    copies, convolutions = (3, 4) if draw is None else (5, 6)
    cases: list[tuple] = []
    for trial in range(40):
        p = ranks[trial % len(ranks)]
        alpha, beta = 10 ** rng.uniform(-6, -4), 10 ** rng.uniform(-11, -8)
        compute, nbytes = rng.uniform(1e-3, 1.0), rng.choice(byte_counts)
        halos = [float(rng.choice(halo_sizes)) for _ in range(1 + trial % convolutions)]
        if name == "data_parallel_time":
            case: tuple = (compute, nbytes, p, alpha, beta)
        elif name == "data_parallel_memory":
            case = (nbytes, rng.choice(activations), p, trial % copies)
        elif name == "spatial_time":
            case = (compute, halos, nbytes, p, alpha, beta)
        elif name == "hybrid_time":
            per_node = nodes[trial % len(nodes)]
            if draw is None:
                s = rng.choice([s for s in (1, 2, 3, 4) if s <= per_node]) if trial % 13 != 12 else 2 * per_node
            else:
                s = rng.randint(1, per_node) if trial % 13 != 12 else per_node + rng.randint(1, 2 * per_node)
            d = groups[trial % len(groups)]
            inter = (alpha * rng.uniform(1, 10), beta * rng.uniform(1, 10))
            case = (compute, halos, nbytes, d, s, (alpha, beta), inter, per_node)
        else:
            every = range(p) if p <= 9 else sorted({0, p - 1, *(rng.randrange(1, p - 1) for _ in range(3))})
            for rank in every:
                cases.append(_numpy_flavour((nbytes, 2**20, halos, p, rank, trial % copies), trial + rank))
            continue
        cases.append(_numpy_flavour(case, trial))
    return cases


def _copy(case: tuple) -> tuple:
    return tuple(value.copy() if isinstance(value, np.ndarray) else value for value in case)


def _same(a: tuple, b: tuple) -> bool:
    for x, y in zip(a, b):
        if isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _ratio(got: float, want: float) -> str:
    """'ratio 1.0007, +0.07%': enough digits that a ratio near 1 does not print as 1."""
    if not want:
        return "expected 0"
    ratio = got / want
    return f"ratio {ratio:.5g}, {100 * (ratio - 1):+.2g}%" if abs(ratio - 1) < 0.1 else f"ratio {ratio:.3g}"


def _mismatch(name: str, got: dict, want: dict, case: tuple) -> str | None:
    whole_bytes = 1.0 if name.endswith("_memory") else 1e-15  # memory may be rounded to whole bytes
    for key, value in want.items():
        number = got[key]
        if not is_number(number):
            return f"{name}{case}[{key!r}] is {number!r}, not a number"
        if not math.isclose(float(number), value, rel_tol=1e-6, abs_tol=whole_bytes):
            return f"{name}{case}[{key!r}] = {float(number):.6g}, expected {value:.6g} ({_ratio(float(number), value)})"
    return None


def _problem(name: str, fn: Callable, case: tuple) -> str | None:
    reference = getattr(formulas, name)
    try:
        want = reference(*case)
    except ValueError as err:  # a case the text tells the student to refuse
        want, refused = {}, str(err)
    else:
        refused = ""
    given = tuple(list(v) if isinstance(v, list) else v for v in _copy(case))  # the student's own copy
    try:
        with deadline(DEADLINE, f"{name}{case}"):
            got = fn(*given)
    except ValueError as err:
        if refused:
            return None
        return f"{name}{case} raised ValueError({err}), but the text asks for an answer to this case"
    except (NotImplementedError, CheckFailed, ReferenceCalled):  # the stub, the deadline, the refusal
        raise
    except Exception as err:  # noqa: BLE001 - the answer's error, told with the case that raised it
        return f"{name}{case} raised {type(err).__name__}: {err}"
    if refused:
        return f"{name}{case} returned {got!r}, but the text asks for a ValueError here: {refused}"
    if not _same(given, case):
        return f"{name}{case} changed its inputs (now {given}): leave them as they are, compute on copies"
    if not isinstance(got, dict):
        return f"{name}{case} returned {type(got).__name__}; return a dict with keys {sorted(want)}"
    if set(got) != set(want):
        return f"{name}{case} returned keys {sorted(got)}; expected {sorted(want)}"
    problem = _mismatch(name, got, want, case)
    for options in ALTERNATIVES.get(name, []) if problem else []:
        if _mismatch(name, got, reference(*case, **options), case) is None:
            return None
    return problem


def _refused(name: str, case: tuple) -> bool:
    """Whether the text tells the student to raise ValueError on this case."""
    try:
        getattr(formulas, name)(*case)
    except ValueError:
        return True
    return False


def _located(name: str, cases: list[tuple], wrong: list[bool]) -> str:
    """Which kinds of case the answer gets wrong and which it gets right, from every case's verdict."""
    where = []
    asks = [not _refused(name, case) for case in cases]  # the ValueError cases are a kind of their own
    cases, wrong = [c for c, a in zip(cases, asks) if a], [w for w, a in zip(wrong, asks) if a]
    for true, false, test in KINDS.get(name, []):
        kinds = [test(case) for case, bad in zip(cases, wrong) if bad]
        right = [test(case) for case, bad in zip(cases, wrong) if not bad]
        for value, label in ((True, true), (False, false)):
            if kinds and all(k == value for k in kinds) and any(r == value for r in right) is False:
                where.append(f"every case with {label} differs and no other does")
            elif kinds and all(k == value for k in kinds):
                where.append(f"only cases with {label} differ")
    if not any(wrong):
        return f"It agrees with the reference on the other {len(cases)} cases."
    counted = f"Of the {len(cases)} cases it should answer, {sum(wrong)} differ"
    return f"{counted}: {'; '.join(where)}." if where else f"{counted}."


def _check(name: str, fn: Callable, comm: MPI.Comm | None) -> None:
    comm = comm or MPI.COMM_WORLD
    draw = grading_draw(comm, name)
    cases = _cases(name, draw)

    def body(sub: MPI.Comm) -> None:
        first, wrong = None, []
        for case in cases:
            if first is None:
                try:
                    problem = _problem(name, fn, case)
                except CheckFailed as err:  # out of time: on which case, and whose draw
                    raise CheckFailed(f"{err}{named(draw)}") from None
                first = problem
            else:  # after the first difference, only to say where the others are
                try:
                    problem = _problem(name, fn, case)
                except CheckFailed:  # out of time: say no more than the cases seen so far
                    wrong.append(True)
                    break
                except Exception as err:  # noqa: BLE001 - any error counts as a difference here
                    problem = str(err) or type(err).__name__
            wrong.append(problem is not None)
        if first is not None:
            hint = f" Hint: {HINTS[name]}" if "expected" in first else ""
            raise CheckFailed(
                f"{name} differs from the reference{named(draw)}: {first}\n"
                f"{_located(name, cases[: len(wrong)], wrong)}{hint}"
            )

    each_size(comm, body, f"{name} differs from the reference{named(draw)}", sizes=[comm.Get_size()])
    passed(
        comm,
        f"{name} agrees with the reference on {len(cases)} generated cases "
        f"(P from 1 to {max(_ranks(draw))}){named(draw)}",
    )


def check_data_parallel_time(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(compute, gradient_bytes, p, alpha, beta) -> {"compute", "communication"} (Exercise 9.1).

    The grader's draw: the 40 cases on drawn values (P up to 1024, gradient bytes up to 10^9,
    the links; see `_cases`)."""
    _check("data_parallel_time", fn, comm)


def check_data_parallel_memory(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(parameter_bytes, activation_bytes, p, optimizer_copies) -> the four parts (Exercise 9.2).

    The grader's draw: the 40 cases on drawn values (P up to 1024, bytes up to 1 GiB,
    0 to 4 optimizer copies; see `_cases`)."""
    _check("data_parallel_memory", fn, comm)


def check_spatial_time(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(compute, halo_bytes, gradient_bytes, p, alpha, beta) -> {"compute", "communication"} (Exercise 9.3).

    The grader's draw: the 40 cases on drawn values (P up to 1024, 1 to 6 halos up to 1 MiB, gradient bytes,
    the links; see `_cases`)."""
    _check("spatial_time", fn, comm)


def check_spatial_memory(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(parameter_bytes, activation_bytes, halo_bytes, p, rank, optimizer_copies) -> five parts (Exercise 9.4).

    The grader's draw: the 40 cases on drawn values (P up to 1024 and its edge and inner ranks, 1 to 6 halos,
    0 to 4 optimizer copies; see `_cases`)."""
    _check("spatial_memory", fn, comm)


def check_hybrid_time(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(compute, halo_bytes, gradient_bytes, d, s, intra, inter, per_node) -> the two parts (Exercise 9.5).

    The grader's draw: the 40 cases on drawn values (nodes of 2 to 16 devices, up to 256 groups,
    slabs up to three nodes' worth, halos, links; see `_cases`)."""
    _check("hybrid_time", fn, comm)
