"""A CountingComm split from another agrees on its own ranks: Alltoall and Alltoallv on one group, while the
other group calls nothing, complete and are counted (they agreed on the parent's notice communicator, which
spans every rank, before: a group alone waited there for ranks that never came)."""

import numpy as np
from ddlab.checks._core import run_counted
from ddlab.runtime.counting import COLLECTIVE_TAG


def test_alltoalls_on_one_group_of_a_split_counting_comm(comm):
    def fn(counting):
        rank = counting.Get_rank()
        group = counting.Split(rank % 2, rank)
        if rank % 2:  # the odd ranks' group calls nothing
            return None
        size, mine = group.Get_size(), group.Get_rank()
        counts = np.arange(size, dtype=np.int64) + 10 * mine
        received = np.empty(size, dtype=np.int64)
        group.Alltoall(counts, received)
        rows = np.full(size * (mine + 1), mine, dtype=np.int64)  # mine + 1 items to every rank
        incoming = np.empty(sum(r + 1 for r in range(size)), dtype=np.int64)
        into = [r + 1 for r in range(size)]
        group.Alltoallv([rows, ([mine + 1] * size, None)], [incoming, (into, None)])
        return received.tolist(), incoming.tolist()

    result, traffic = run_counted(comm, fn, (), "alltoalls on a split", timeout=10.0, allow=("Alltoall", "Alltoallv"))
    rank = comm.Get_rank()
    if rank % 2:
        assert result is None and traffic[rank].events == []
        return
    evens = list(range(0, comm.Get_size(), 2))
    size, mine = len(evens), evens.index(rank)
    assert result == ([mine + 10 * r for r in range(size)], [r for r in range(size) for _ in range(r + 1)])
    sends = [(e.peer, e.nbytes) for e in traffic[rank].sends if e.tag == COLLECTIVE_TAG]
    assert sends == [(peer, 8) for peer in evens] + [(peer, 8 * (mine + 1)) for peer in evens]
    assert traffic[rank].calls == ["Alltoall", "Alltoallv"]
