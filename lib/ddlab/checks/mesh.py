"""Checks for lab 16: the mesh's coordinates and sub-communicators (exercise 16.1).

The student's `split_mesh(comm, sizes)` runs on the first P ranks for P = 1 .. world size,
on every layout of P ranks over the four dimensions, through a counting communicator that
offers Split, Dup, Create_cart and a grid's Sub, each entered by every rank under the
check's deadline (a rank that never calls it fails the check instead of hanging it).
"""

from __future__ import annotations

from typing import Any, cast

from mpi4py import MPI

from ..mesh.layout import DIMS, SplitMesh, coordinates, layouts
from ..runtime.counting import CountingComm, MismatchedCollective, underlying
from ._core import each_size, fail_together, passed, run_counted

TIMEOUT = 10.0
#: The communicator constructors the check's communicator offers; the ranks must call the same one.
CALLS = ("Split", "Dup", "Create_cart", "Sub")


class _MeshComm(CountingComm):
    """The check's communicator: the counting one, with Create_cart and a grid's Sub besides Split and Dup."""

    def _same_call(self, name: str) -> None:
        codes = self.agree(CALLS.index(name), f"{name} to be called on every rank")
        if len(set(codes)) > 1:
            calls = ", ".join(f"rank {rank} {CALLS[code]}" for rank, code in enumerate(codes))
            raise MismatchedCollective(
                f"the ranks called different collectives at the same point ({calls}): every "
                "rank must make the same collective calls, in the same order"
            )

    def Create_cart(self, dims: Any, periods: Any = None, reorder: bool = False) -> Any:
        self._same_call("Create_cart")
        return _MeshComm(cast(MPI.Intracomm, self.comm).Create_cart(dims, periods, reorder), self.timeout, parent=self)

    def Sub(self, remain_dims: Any) -> Any:
        self._same_call("Sub")
        return _MeshComm(cast(MPI.Cartcomm, self.comm).Sub(remain_dims), self.timeout, parent=self)


def _run(sub: MPI.Comm, fn: SplitMesh, cases: list[dict[str, int]], timeout: float) -> list[tuple[Any, str | None]]:
    """fn(comm, sizes) on sub's ranks for each sizes in turn: (its result, None), or (None, the ValueError's text)."""

    def call(counting: CountingComm) -> list[tuple[Any, str | None]]:
        comm = cast(MPI.Comm, _MeshComm(counting.comm, timeout, parent=counting))  # what the student's code calls
        out: list[tuple[Any, str | None]] = []
        for sizes in cases:
            try:
                out.append((fn(comm, dict(sizes)), None))
            except ValueError as err:
                out.append((None, str(err)))
        return out

    results, _ = run_counted(sub, call, (), f"split_mesh on {sub.Get_size()} ranks", timeout=timeout)
    return results


def _communicators(result: Any) -> list[MPI.Comm]:
    """The real communicators among what fn returned (to free them)."""
    comms = result[1] if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict) else {}
    found: list[MPI.Comm] = []
    for value in comms.values():
        raw = underlying(value) if isinstance(value, (CountingComm, MPI.Comm)) else None
        if isinstance(raw, MPI.Comm) and raw != MPI.COMM_NULL and all(raw is not f for f in found):
            found.append(raw)
    return found


def _shape_problem(result: Any, sizes: dict[str, int], rank: int) -> str | None:
    if not (isinstance(result, tuple) and len(result) == 2):
        return f"should return (coords, comms), got {type(result).__name__}"
    coords, comms = result
    if not isinstance(coords, dict) or set(coords) != set(DIMS):
        return f"coords should be a dict with the keys {DIMS}, got {coords!r}"
    if not isinstance(comms, dict) or set(comms) != set(DIMS):
        return f"comms should be a dict with the keys {DIMS}, got {comms!r}"
    want = coordinates(rank, sizes)
    if {name: coords[name] for name in DIMS} != want or not all(type(v) is int for v in coords.values()):
        return (
            f"coords are {coords}, expected {want} (ints; ranks numbered row-major over {DIMS}, "
            "tensor fastest, pipeline slowest)"
        )
    for name in DIMS:
        raw = underlying(comms[name]) if isinstance(comms[name], (CountingComm, MPI.Comm)) else None
        if not isinstance(raw, MPI.Intracomm) or raw == MPI.COMM_NULL:
            return f"comms[{name!r}] should be a communicator, got {type(comms[name]).__name__}"
    return None


def _group_problem(sub: MPI.Comm, comms: dict[str, Any], sizes: dict[str, int], coords: dict[str, int]) -> str | None:
    """The first thing wrong with this rank's groups; every group is gathered (all its members call it)."""
    rank, problems = sub.Get_rank(), []
    everyone = [coordinates(r, sizes) for r in range(sub.Get_size())]
    for name in DIMS:
        raw = underlying(comms[name])
        members = raw.allgather(rank)
        want = [r for r, c in enumerate(everyone) if all(c[o] == coords[o] for o in DIMS if o != name)]
        if members != want:
            problems.append(
                f"comms[{name!r}] holds ranks {members} in that order, expected {want}: the ranks that "
                f"differ from this one only in the {name} coordinate, ranked by it"
            )
        elif raw == sub:
            problems.append(f"comms[{name!r}] is the communicator passed in: return a new one (the caller frees it)")
    return problems[0] if problems else None


def _layout_problem(sub: MPI.Comm, sizes: dict[str, int], result: Any, refused: str | None) -> None:
    shown = " x ".join(f"{sizes[name]} {name}" for name in DIMS)
    problem = f"raised ValueError on valid sizes {shown}: {refused}" if refused is not None else None
    problem = problem or _shape_problem(result, sizes, sub.Get_rank())
    fail_together(sub, problem, f"split_mesh is wrong for {shown}")
    problem = _group_problem(sub, result[1], sizes, result[0])
    fail_together(sub, problem, f"split_mesh's communicators are wrong for {shown}")


def check_split_mesh(fn: SplitMesh, timeout: float = TIMEOUT) -> None:
    """fn(comm, sizes) -> (coords, comms), as ddlab.mesh.split_mesh (exercise 16.1's signature).

    timeout: seconds a rank waits for the others at each collective call before the check fails."""
    world = MPI.COMM_WORLD

    def body(sub: MPI.Comm) -> str | None:
        size = sub.Get_size()
        valid = layouts(size, DIMS)
        wrong = {**dict.fromkeys(DIMS, 1), "data": size + 1}
        results = _run(sub, fn, [*valid, wrong], timeout)
        try:
            for sizes, (result, refused) in zip(valid, results):
                _layout_problem(sub, sizes, result, refused)
        finally:
            for result, _ in results:
                for raw in _communicators(result):
                    if raw != sub:
                        raw.Free()
        if results[-1][1] is None:
            return (
                f"accepted sizes {wrong} whose product {size + 1} is not the {size} ranks: raise ValueError saying so"
            )
        return None

    each_size(world, body, "split_mesh is wrong")
    passed(
        world,
        "split_mesh: every layout's coordinates and its four sub-communicators are right, and sizes "
        "that do not multiply to the ranks are refused",
    )
