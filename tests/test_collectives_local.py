"""Lab 02 pieces that need no MPI job: round counting with wildcards, the checks' inputs and
message-pattern verdicts on hand-made traffic, and the data-movement figure."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest
from ddlab.checks.collectives import CASES, _pattern_problems
from ddlab.runtime.counting import Event, Traffic, rounds
from mpi4py import MPI

matplotlib.use("Agg")


def traffic(size: int, messages: list[tuple[int, int]], recv_tag: int = 0) -> list[Traffic]:
    """Traffic of messages (src, dst) in this order; receivers log `recv_tag` as asked for."""
    out = [Traffic(rank) for rank in range(size)]
    for src, dst in messages:
        out[src].events.append(Event("send", dst, 0, 8))
        out[dst].events.append(Event("recv", src, recv_tag, 8))
    return out


def binomial_bcast(size: int, root: int = 0) -> list[tuple[int, int]]:
    """MPICH's binomial broadcast, message by message in round order."""
    messages, have = [], 1
    while have < size:
        messages += [((me + root) % size, (me + have + root) % size) for me in range(have) if me + have < size]
        have *= 2
    return messages


def test_receives_posted_with_any_tag_still_count():
    assert rounds(traffic(4, [(0, 1), (1, 2), (2, 3)], recv_tag=MPI.ANY_TAG)) == 3
    assert rounds(traffic(8, binomial_bcast(8), recv_tag=MPI.ANY_TAG)) == 3


def test_receives_posted_with_any_source_still_count():
    t = traffic(4, [(0, 1), (1, 2), (2, 3)])
    for rank_traffic in t:
        for event in rank_traffic.recvs:
            event.peer = MPI.ANY_SOURCE
    assert rounds(t) == 3


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_linear_reduce_takes_p_minus_1_rounds_one_receive_at_a_time(size):
    into_root = traffic(size, [(r, 0) for r in range(1, size)])
    assert rounds(into_root) == 1
    assert rounds(into_root, one_receive_at_a_time=True) == size - 1


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_tree_reduce_takes_log2_p_rounds_one_receive_at_a_time(size):
    up_the_tree = [(dst, src) for src, dst in reversed(binomial_bcast(size))]
    t = traffic(size, [])
    for src, dst in up_the_tree:  # each rank receives from its children, then sends to its parent
        t[dst].events.append(Event("recv", src, 0, 8))
    for rank in range(size):
        parents = [dst for src, dst in up_the_tree if src == rank]
        t[rank].events += [Event("send", dst, 0, 8) for dst in parents]
    assert rounds(t, one_receive_at_a_time=True) == math.ceil(math.log2(size))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("root", [0, 1])
def test_patterns_of_the_right_algorithms_pass(size, root):
    root %= size
    tree = traffic(size, binomial_bcast(size, root))
    linear = traffic(size, [(root, r) for r in range(size) if r != root])
    assert _pattern_problems("bcast", "tree", tree, root) == []
    assert _pattern_problems("bcast", "linear", linear, root) == []


def test_pattern_verdicts_name_counts_and_ranks():
    linear = traffic(8, [(0, r) for r in range(1, 8)])
    problems = _pattern_problems("bcast", "tree", linear, 0)
    assert any("took 7 rounds" in p and "ceil(log2 P) = 3" in p for p in problems)
    assert any("rank 0 sent 7 messages" in p for p in problems)
    wrong_root = _pattern_problems("bcast", "linear", traffic(3, [(0, 1), (0, 2)]), 1)
    assert wrong_root == ["2 messages sent, expected P-1 = 2, one from the root to each other rank (root = rank 1)"]


def test_inputs_differ_by_rank_and_cover_layouts():
    for case in CASES:
        x0, x1 = case.make(0), case.make(1)
        assert x0.shape == case.shape and x0.dtype == np.dtype(case.dtype)
        assert x0.size == 0 or not np.array_equal(x0, x1)
    layouts = {case.layout: case.make(0) for case in CASES}
    assert not layouts["strided"].flags.c_contiguous and not layouts["strided"].flags.f_contiguous
    assert layouts["transposed"].flags.f_contiguous and not layouts["transposed"].flags.c_contiguous
    assert any(case.shape == (0,) for case in CASES)


def test_data_movement_figure():
    from ddlab.plots import data_movement

    before = [np.arange(4) + 10 * r for r in range(3)]
    fig = data_movement(before, [sum(before), None, None], "Reduce", combined=True, alt="3 ranks reduce to rank 0")
    assert [ax.get_title() for ax in fig.axes] == ["before", "after"]
    empty = data_movement([np.arange(2), np.full(2, -1)], [np.arange(2)] * 2, "Bcast", alt="rank 0 broadcasts 2 values")
    assert len(empty.axes) == 2
