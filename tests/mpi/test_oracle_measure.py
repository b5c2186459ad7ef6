"""`measure_links`, the part of `measure_platform` that times the links: every rank gets the
same curves (each collective on 2 .. P ranks, the ping-pong) and the same link fitted to the ping-pong."""

from __future__ import annotations

from ddlab.oracle.measure import measure_links
from mpi4py import MPI

SIZES = (8, 4096, 65536)


def test_every_rank_gets_the_same_curves_and_link(comm: MPI.Comm) -> None:
    curves, link = measure_links(comm, SIZES, repeats=2)
    size = comm.Get_size()
    want = {(op, n) for op in ("allreduce", "allgather", "reduce_scatter") for n in range(2, size + 1)} | {("p2p", 2)}
    assert set(curves.table) == want
    assert all(sizes == [float(s) for s in SIZES] and min(seconds) > 0 for sizes, seconds in curves.table.values())
    everyone = comm.allgather((sorted(curves.table.items()), link))
    assert all(mine == everyone[0] for mine in everyone)
    assert link.alpha >= 0 and link.beta > 0
