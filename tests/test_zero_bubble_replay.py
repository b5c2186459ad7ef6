"""Lab 17's replay is lab 07's: `replay_split` runs `schedules.replay`, which lab 07's `simulate` and lab 16's
`simulate_interleaved` run too; op lists without W ops replay alike through either."""

from __future__ import annotations

import pytest
from ddlab.pipeline import interleaved_1f1b, one_f_one_b, simulate, simulate_interleaved
from ddlab.pipeline.zero_bubble import one_f_one_b_whole, replay_split, split_peak_bytes, zb_h1


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (3, 7), (4, 8)])
def test_lab_07_and_16_op_lists_replay_alike_through_lab_17_s_replay(p, m):
    chain = [one_f_one_b(p, m, s) for s in range(p)]
    assert replay_split(chain, 1.0, 2.0, 0.0) == simulate(chain, 1.0, 2.0)
    assert replay_split([one_f_one_b_whole(p, m, s) for s in range(p)], 1.0, 1.5, 0.5) == [
        [(("BW", i) if kind == "B" else (kind, i), start, end) for (kind, i), start, end in ops]
        for ops in simulate(chain, 1.0, 2.0)
    ]
    if m % p == 0:
        chunks = [interleaved_1f1b(p, m, r, 2) for r in range(p)]
        assert replay_split(chunks, 0.5, 1.0, 0.0, "interleaved") == simulate_interleaved(chunks, 2, 1.0, 2.0)


def test_a_deadlock_names_each_stuck_rank_and_its_op():
    with pytest.raises(ValueError, match=r"the op lists deadlock: rank 0 at \('B', 0\), rank 1 at \('F', 0\)"):
        replay_split([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], 1.0, 1.0, 1.0)


def test_an_op_list_s_peak_bytes():
    p, m = 4, 8
    assert [split_peak_bytes(zb_h1(p, m, s), 3.0, 6.0) for s in range(p)] == [15.0, 18.0, 21.0, 24.0]
    assert [split_peak_bytes(one_f_one_b_whole(p, m, s), 3.0, 6.0) for s in range(p)] == [12.0, 9.0, 6.0, 3.0]
