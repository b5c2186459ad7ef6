"""Checks for lab 02: broadcast and reduce built from point-to-point messages.

Each check runs the student's function on the first P ranks for every P up to the
world's size, with every root and several inputs (dtypes, shapes, an empty array,
views that are not contiguous), through a CountingComm. It compares the results
with the reference in `ddlab.collectives`, makes sure `x` is untouched, and counts
the messages: a linear version sends P-1, all through the root; a binomial tree
sends P-1 in ceil(log2 P) rounds with no rank handling more than ceil(log2 P).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .. import collectives as reference
from ..runtime.counting import Traffic, rounds
from ._core import CheckFailed, array_problem, each_size, fail_together, passed, run_counted
from ._draw import Draw, grading_draw, named

Collective = Callable[..., Any]


@dataclass(frozen=True)
class Case:
    """One input: every rank passes an array of this dtype and shape, values set by its rank."""

    dtype: str
    shape: tuple[int, ...]
    layout: str = "contiguous"  # or "strided" (every other element), "transposed" (Fortran order)
    seed: int | None = None  # the grader's: values drawn instead of counted

    def make(self, rank: int) -> np.ndarray:
        """This rank's x: small whole numbers (exact sums in any dtype), different on every rank."""
        size = math.prod(self.shape)
        counted = (
            np.arange(size) % 7 if self.seed is None else np.random.default_rng([self.seed, rank]).integers(0, 7, size)
        )
        values = counted + 1 + 10 * rank
        if self.layout == "strided":
            return np.repeat(values, 2).astype(self.dtype)[::2].reshape(self.shape)
        if self.layout == "transposed":
            return values.astype(self.dtype).reshape(self.shape[::-1]).T
        return values.astype(self.dtype).reshape(self.shape)

    def __str__(self) -> str:
        layout = {
            "contiguous": "",
            "strided": ", a strided view (every other element of a longer array)",
            "transposed": ", a transposed view (Fortran order)",
        }[self.layout]
        article = "an" if self.dtype[0] in "aeiou" else "a"
        drawn = "" if self.seed is None else f" (values from seed {self.seed})"
        return f"{article} {self.dtype} array of shape {self.shape}{layout}{drawn}"


CASES = (
    Case("float64", (8,)),
    Case("int32", (0,)),
    Case("float32", (3, 5)),
    Case("int64", (1,)),
    Case("float64", (6,), "strided"),
    Case("int64", (4, 3), "transposed"),
)
#: The dtypes the grader draws from: any the contract allows whose sums of the values stay exact.
DRAWN_DTYPES = ("float64", "float32", "int64", "int32", "int16", "uint8")


def drawn_cases(draw: Draw) -> tuple[Case, ...]:
    """As many cases as CASES, with the same layouts, of drawn dtypes, shapes (1 to 3 dimensions of 0 to 9) and values."""
    found = []
    for index, case in enumerate(CASES):
        dims = draw.integer(2 if case.layout == "transposed" else 1, 3, "ndim", index)
        shape = tuple(draw.integer(0 if index == 1 else 1, 9, "dim", index, d) for d in range(dims))
        dtype = draw.choose(DRAWN_DTYPES, 1, "dtype", index)[0]
        found.append(Case(dtype, shape, case.layout, draw.data_seed("values", index)))
    return tuple(found)


_LAYOUT_HINT = (
    "This x is not C-contiguous. MPI sends the bytes as they lie in memory, so send a "
    "C-contiguous copy (np.ascontiguousarray(x), or np.array(x, order='C')) and receive into "
    "np.empty(x.shape, x.dtype), which is C-contiguous too (np.empty_like(x) keeps x's order)."
)

_RESULT_HINT = {
    "bcast": (
        "Every rank must return a new array equal to the root's x (root={root}); "
        "the other ranks' x only give the shape and dtype."
    ),
    "reduce": (
        "The root (rank {root}) must return a new array holding the elementwise sum of "
        "every rank's x; every other rank returns None."
    ),
}

_NAMES = {"bcast": "broadcast", "reduce": "reduce"}

_PATTERN_HINT = {
    ("bcast", "linear"): "In a linear broadcast the root sends x once to each other rank (not to "
    "itself, not twice) and each other rank receives once, from the root.",
    ("reduce", "linear"): "In a linear reduce each rank other than the root sends its x once, to "
    "the root, which receives and adds them; no other messages.",
    ("bcast", "tree"): "Compare with the lab's picture: every round, each rank that has the data sends "
    "it to one rank that has not, so the holders double; each rank receives once, "
    "before it sends. Another root: number the ranks from the root. If these are "
    "the tree's messages, look at their order: a rank sends first to the child with "
    "the most sending left to do.",
    ("reduce", "tree"): "Compare with the lab's picture: the broadcast's messages reversed, round by round; "
    "each rank other than the root sends once, after adding what its children sent. "
    "If these are the tree's messages, look at their order: a rank receives from its "
    "children round by round, lowest round first.",
}


def _messages(n: int) -> str:
    return f"{n} message{'' if n == 1 else 's'}"


def _expected_rounds(size: int) -> int:
    return math.ceil(math.log2(size)) if size > 1 else 0


def _describe_messages(traffic: list[Traffic]) -> str:
    """'0->1, 0->2, ...': every message, grouped by sender in the order it sent them."""
    arrows = [f"{t.rank}->{e.peer}" for t in traffic for e in t.sends]
    shown = ", ".join(arrows[:16]) + (f", ... ({len(arrows)} in all)" if len(arrows) > 16 else "")
    return f"messages sent (rank->rank): {shown or 'none'}"


def _result_problem(kind: str, got: Any, want: np.ndarray | None, x: np.ndarray) -> str | None:
    """What is wrong with this rank's result, or None."""
    if want is None:
        if got is not None:
            return f"returned a {type(got).__name__}, expected None (only the root gets the sum)"
        return None
    if got is None:
        return "returned None, expected the " + ("root's array" if kind == "bcast" else "sum (this rank is the root)")
    problem = array_problem(got, want, "the result")
    if problem is None and np.shares_memory(got, x):
        problem = (
            "returned x itself or a view of it: return a new array (e.g. a copy), so that "
            "changing the result cannot change the caller's x"
        )
    return problem


def _pattern_problems(kind: str, algorithm: str, traffic: list[Traffic], root: int) -> list[str]:
    """How the messages differ from a linear or binomial-tree pattern (the same on every rank)."""
    size = len(traffic)
    messages = sorted((t.rank, e.peer) for t in traffic for e in t.sends)
    if algorithm == "linear":
        others = [r for r in range(size) if r != root]
        want = sorted((root, r) for r in others) if kind == "bcast" else sorted((r, root) for r in others)
        if messages == want:
            return []
        direction = "from the root to each other rank" if kind == "bcast" else "from each other rank to the root"
        return [f"{_messages(len(messages))} sent, expected P-1 = {size - 1}, one {direction} (root = rank {root})"]
    problems, most = [], _expected_rounds(size)
    if len(messages) != size - 1:
        problems.append(
            f"{_messages(len(messages))} sent, expected P-1 = {size - 1}: in a tree each rank "
            "other than the root " + ("receives the data once" if kind == "bcast" else "sends its partial sum once")
        )
    taken = rounds(traffic, one_receive_at_a_time=True)
    if taken != most:
        problems.append(
            f"took {taken} rounds (the longest chain of messages, each waiting for the one "
            f"before; a rank sends and receives one message at a time), a binomial tree "
            f"takes ceil(log2 P) = {most}"
        )
    verbs, attribute = (
        (("sent", "sends"), "messages_sent") if kind == "bcast" else (("received", "receives"), "messages_received")
    )
    for t in traffic:
        if getattr(t, attribute) > most:
            problems.append(
                f"rank {t.rank} {verbs[0]} {_messages(getattr(t, attribute))}; in a binomial tree "
                f"no rank {verbs[1]} more than ceil(log2 P) = {most}"
            )
    return problems


def _check_case(sub: MPI.Comm, fn: Collective, name: str, root: int, case: Case, timeout: float) -> None:
    """Run fn once on sub with this root and input; raise the same CheckFailed on every rank if wrong."""
    kind, algorithm = name.split("_")
    size = sub.Get_size()
    x = case.make(sub.Get_rank())
    before = x.copy()
    want = getattr(reference, name)(sub, x, root)
    call = f"{name}(comm, x, root={root}) on {size} rank{'s' if size > 1 else ''}, x {case}"
    try:
        got, traffic = run_counted(sub, fn, (x, root), call, timeout)
    except CheckFailed as err:
        raise CheckFailed(f"{err}\n{_LAYOUT_HINT}" if case.layout != "contiguous" else str(err)) from None
    hint = _RESULT_HINT[kind].format(root=f"{root} here" + (": use the `root` argument, not rank 0" if root else ""))
    if case.layout != "contiguous":
        hint += "\n" + _LAYOUT_HINT
    fail_together(sub, _result_problem(kind, got, want, x), f"{call}: wrong result", hint)
    changed = array_problem(x, before, "x after the call")
    fail_together(
        sub,
        changed and f"changed its input: {changed}",
        f"{call}: x was modified",
        "Leave x as it is: receive (and add) into a new array, e.g. np.empty(x.shape, x.dtype) or x.copy().",
    )
    problems = _pattern_problems(kind, algorithm, traffic, root)
    if problems:
        raise CheckFailed(
            f"{call}: the results are right but the messages are not those of a "
            f"{'linear' if algorithm == 'linear' else 'binomial-tree'} {_NAMES[kind]}:\n"
            + "\n".join(f"  {p}" for p in problems)
            + f"\n  {_describe_messages(traffic)}\n{_PATTERN_HINT[kind, algorithm]}"
        )


def _check(fn: Collective, name: str, promise: str, timeout: float) -> None:
    """Check fn on every rank count, root and case; every world rank raises or passes together.

    Under the grader's draw (ddlab.checks._draw): drawn ranks, and drawn dtypes, shapes and values."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, name)
    cases = CASES if draw is None else drawn_cases(draw)

    def every_root_and_case(sub: MPI.Comm) -> None:
        for root in range(sub.Get_size()):
            for case in cases:
                _check_case(sub, fn, name, root, case, timeout)

    each_size(world, every_root_and_case, name, draw=draw)
    passed(
        world, f"{name}: {promise} (1 to {world.Get_size()} ranks, every root, {len(cases)} dtypes/shapes){named(draw)}"
    )


def check_bcast_linear(fn: Collective, timeout: float = 20.0) -> None:
    """fn(comm, x, root) must give every rank a copy of the root's x, with P-1 messages from the root."""
    _check(fn, "bcast_linear", "every rank gets the root's x, P-1 messages from the root", timeout)


def check_bcast_tree(fn: Collective, timeout: float = 20.0) -> None:
    """fn(comm, x, root) must give every rank the root's x, in ceil(log2 P) rounds of a binomial tree."""
    _check(fn, "bcast_tree", "every rank gets the root's x, P-1 messages in ceil(log2 P) rounds", timeout)


def check_reduce_linear(fn: Collective, timeout: float = 20.0) -> None:
    """fn(comm, x, root) must give the root the sum (None elsewhere), with P-1 messages into the root."""
    _check(fn, "reduce_linear", "the root gets the sum, the others None, P-1 messages into the root", timeout)


def check_reduce_tree(fn: Collective, timeout: float = 20.0) -> None:
    """fn(comm, x, root) must give the root the sum (None elsewhere), in ceil(log2 P) rounds of a tree."""
    _check(fn, "reduce_tree", "the root gets the sum, the others None, P-1 messages in ceil(log2 P) rounds", timeout)
