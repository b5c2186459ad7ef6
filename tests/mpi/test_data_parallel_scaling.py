"""Lab 05 on several ranks: the bucketed-allreduce check, timings every rank agrees on."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ddlab import checks, scaling


def bucketed(comm, arrays, cap_bytes, allreduce):
    buckets, used = [], math.inf
    for i, array in enumerate(arrays):
        if buckets and used + array.nbytes <= cap_bytes:
            buckets[-1].append(i)
            used += array.nbytes
        else:
            buckets.append([i])
            used = array.nbytes
    out = [None] * len(arrays)
    for bucket in buckets:
        total = allreduce(comm, np.concatenate([arrays[i].ravel() for i in bucket]))
        offset = 0
        for i in bucket:
            out[i] = total[offset : offset + arrays[i].size].reshape(arrays[i].shape)
            offset += arrays[i].size
    return out


def one_per_array(comm, arrays, cap_bytes, allreduce):
    return [allreduce(comm, a.ravel()).reshape(a.shape) for a in arrays]


def all_fused(comm, arrays, cap_bytes, allreduce):
    return bucketed(comm, arrays, math.inf, allreduce)


def in_place(comm, arrays, cap_bytes, allreduce):
    out = bucketed(comm, arrays, cap_bytes, allreduce)
    for a, o in zip(arrays, out):
        a[...] = o
    return out


def cap_exceeded(comm, arrays, cap_bytes, allreduce):
    return bucketed(comm, arrays, cap_bytes * 2 + 1, allreduce)


def cap_exclusive(comm, arrays, cap_bytes, allreduce):
    """Starts a new bucket when the next array would reach the cap (< instead of <=): wrong when exactly full."""
    return bucketed(comm, arrays, cap_bytes - 1e-9, allreduce)


def as_float64(comm, arrays, cap_bytes, allreduce):
    return [o.astype(np.float64) for o in bucketed(comm, arrays, cap_bytes, allreduce)]


def direct_allreduce(comm, arrays, cap_bytes, allreduce):
    """Sums with comm.Allreduce itself instead of the allreduce it was given."""

    def own(c, x):
        out = np.empty_like(x)
        c.Allreduce(x, out)
        return out

    return bucketed(comm, arrays, cap_bytes, own)


def test_bucketed_check_passes_the_reference(comm):
    checks.check_allreduce_bucketed(bucketed)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (one_per_array, "allreduce calls"),
        (all_fused, "allreduce calls"),
        (in_place, "changed"),
        (cap_exceeded, "allreduce calls"),
        (cap_exclusive, "with cap 448 bytes"),
        (as_float64, "dtype float64"),
        (direct_allreduce, "never called the `allreduce` passed"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_bucketed_check_fails_on_wrong_packing(comm, wrong, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_allreduce_bucketed(wrong)


def last_bucket_on_rank_0_only(comm, arrays, cap_bytes, allreduce):
    """Rank 0 sends one bucket more than the others: they must not hang the check."""
    sums = bucketed(comm, arrays[:-1], cap_bytes, allreduce)
    return sums + (allreduce(comm, arrays[-1]) if comm.Get_rank() == 0 else [arrays[-1].copy()])


def test_bucketed_check_fails_when_ranks_disagree_and_does_not_hang(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank has no one to wait for")
    with pytest.raises(checks.CheckFailed, match="allreduce_bucketed"):
        checks.check_allreduce_bucketed(last_bucket_on_rank_0_only, timeout=3)


def test_bucketed_check_passes_a_stub_error_through(comm):
    def stub(comm, arrays, cap_bytes, allreduce):
        raise NotImplementedError("Exercise 5.2")

    with pytest.raises(NotImplementedError):
        checks.check_allreduce_bucketed(stub)


def test_timings_agree_on_every_rank(comm):
    times = scaling.time_pieces(comm, 10_000, [1, 8], repeats=3)
    alpha, beta = scaling.fit_allreduce(comm, sizes=[64, 4096, 2**18], repeats=3)
    assert comm.allgather((times, alpha, beta)) == [(times, alpha, beta)] * comm.Get_size()


def test_measure_training_returns_every_rank_its_phases(comm):
    result = scaling.measure_training(8, steps=3, warmup=1, n=512, bucket_cap_mb=0.1)
    gathered = comm.allgather((result["rank"], result["size"], sorted(result["phases"])))
    assert gathered == [
        (r, comm.Get_size(), sorted(["data", "forward", "backward", "allreduce", "optimizer"]))
        for r in range(comm.Get_size())
    ]
    assert any(s.track == "allreduce in flight" for s in result["spans"])


def test_train_for_time_stops_every_rank_together_and_counts_one_allreduce_per_batch(comm):
    from ddlab.scaling import syncs_per_epoch, train_for_time

    batch = 16 * comm.Get_size()
    run = train_for_time(comm, 0.5, batch, lr=0.01, n=512, test=128)
    summary = (run["times"], run["scores"], run["steps"], run["allreduces"])
    assert comm.allgather(summary) == [summary] * comm.Get_size()
    per_epoch = syncs_per_epoch(512, batch, comm.Get_size())
    # how many epochs 0.5 s holds depends on the machine's speed; what is counted does not
    assert run["allreduces_total"] == run["steps"] >= 1
    assert run["allreduces"] == [per_epoch] * (run["steps"] // per_epoch), "one allreduce per batch, epoch by epoch"


def test_allreduce_vs_gloo_agrees_on_every_rank(comm):
    from ddlab.data_parallel import close_gloo
    from ddlab.scaling import allreduce_vs_gloo

    try:
        times = allreduce_vs_gloo(comm, [64, 2**16], repeats=2)
    finally:
        close_gloo()
    assert comm.allgather(times) == [times] * comm.Get_size()
    assert all(len(v) == 2 and min(v) > 0 for v in times.values())
