"""The counting communicator without an MPI run: round counts on hand-made traffic, and which calls are collectives."""

from __future__ import annotations

import math

import pytest
from ddlab.runtime.counting import ALLOWABLE, UNCOUNTED, CountingComm, Event, Traffic, is_collective, rounds
from mpi4py import MPI


def traffic(size: int, messages: list[tuple[int, int]]) -> list[Traffic]:
    """Traffic for messages (src, dst) issued in this order, each rank logging its own side."""
    out = [Traffic(rank) for rank in range(size)]
    for src, dst in messages:
        out[src].events.append(Event("send", dst, 0, 8))
        out[dst].events.append(Event("recv", src, 0, 8))
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_linear_broadcast_takes_p_minus_1_rounds(size):
    assert rounds(traffic(size, [(0, r) for r in range(1, size)])) == size - 1


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_binomial_tree_takes_log2_p_rounds(size):
    messages, have = [], 1
    while have < size:  # every rank that has the data sends to rank + have
        messages += [(r, r + have) for r in range(have) if r + have < size]
        have *= 2
    assert rounds(traffic(size, messages)) == math.ceil(math.log2(size))


def test_a_chain_counts_every_hop():
    assert rounds(traffic(4, [(0, 1), (1, 2), (2, 3)])) == 3


def test_traffic_totals():
    t = traffic(3, [(0, 1), (0, 2)])
    assert (t[0].messages_sent, t[0].bytes_sent, t[1].messages_received, t[2].bytes_received) == (2, 16, 1, 8)


def test_every_collective_is_known_in_every_form():
    """Every collective mpi4py offers (blocking, I..., ..._init, object API) is refused, nothing else."""
    names = [name for name in dir(MPI.Intracomm) if not name.startswith("_")]
    collectives = {name for name in names if is_collective(name)}
    assert {
        "Bcast",
        "Ibcast",
        "Bcast_init",
        "bcast",
        "Iallgatherv",
        "Alltoallw_init",
        "Reduce_scatter_block_init",
        "Ibarrier",
        "exscan",
    } <= collectives
    assert not collectives & {"Send", "Isend", "Iprobe", "iprobe", "Irecv", "Sendrecv", "Split", "Idup", "Iagree"}
    counted = {name for name in names if name in vars(CountingComm)}
    # counted only when a check allows them (an allowed Bcast allows the object form bcast too)
    assert not collectives & {name for name in counted if name not in ALLOWABLE and name.capitalize() not in ALLOWABLE}
    assert not set(UNCOUNTED) & counted and set(UNCOUNTED) <= set(names)
