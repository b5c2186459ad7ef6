"""The oracle's terms for what an implementation adds (lab 08's overhead and own exchange curves), by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from ddlab.allreduce.cost import Link, collective_seconds
from ddlab.oracle import Curves, Platform, describe, filter_parallel, spatial
from ddlab.oracle.implementation import LocalComm, LocalHalo
from ddlab.oracle.strategies import channel_exchanges, halo_layers, halo_rows_padded, pipeline, sync_share
from torch import nn

NET = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
INFO = describe(NET, (2, 8, 8))
W = INFO.parameter_bytes


def platform(overheads: dict[str, float], curves: dict[str, float]) -> Platform:
    """Two ranks; each named exchange measured at a constant time over sizes 1 B .. 1 MB."""
    table = Curves()
    for op, seconds in curves.items():
        table.add(op, 2, [1, 1e6], [seconds, seconds])
    return Platform(
        "test",
        devices_per_node=2,
        flops=1e9,
        memory=2**30,
        intra=Link(1e-5, 1e-9),
        inter=Link(1e-5, 1e-9),
        curves=table,
        overheads=overheads,
    )


def test_spatial_overhead_and_halo_curve_by_hand():
    # two 3x3 convolutions exchange halos twice a step, the first (on the data) once; 4 samples on 2 slabs
    assert len(halo_layers(INFO, 2)) == 2
    pred = spatial(INFO, 4, 2, platform({"halo": 1e-3}, {"halo": 2e-3}))
    assert pred.overhead == pytest.approx(3 * 4 * 1e-3)
    assert pred.communication == pytest.approx(3 * 2e-3 + collective_seconds("allreduce", 2, W, Link(1e-5, 1e-9)))
    assert pred.time == pytest.approx(pred.compute + pred.communication + pred.overhead)
    bare = spatial(INFO, 4, 2, platform({}, {}))
    assert bare.overhead == 0 and bare.communication != pred.communication  # no curve: p2p + sync


def test_filter_overhead_and_curves_by_hand():
    assert channel_exchanges(INFO, 2) == 3 and channel_exchanges(INFO, 1) == 0
    pred = filter_parallel(INFO, 4, 2, platform({"filter": 1e-3}, {"filter allgather": 3e-3, "filter allreduce": 5e-3}))
    assert pred.overhead == pytest.approx(3 * 4 * 1e-3)
    assert pred.communication == pytest.approx(2 * 3e-3 + 1 * 5e-3)  # no allreduce of the data's gradient


def test_spatial_conv2d_keeps_thin_halo_strips():
    assert halo_rows_padded(1, 2) == 2 and halo_rows_padded(1, 1) == 2 and halo_rows_padded(2, 2) == 6


def test_profiled_seconds_scale_together():
    timed = INFO.scaled(0.0)
    assert timed.step_seconds(3) == 0
    layers = tuple(replace(layer, seconds_forward=1.0, seconds_backward=2.0) for layer in INFO.layers)
    info = replace(INFO, layers=layers, update_seconds=0.5)
    assert info.step_seconds(2) == pytest.approx(2 * 3 * 3.0 + 0.5)
    assert info.scaled(2).step_seconds(2) == pytest.approx(2 * info.step_seconds(2))


def test_stand_ins_move_no_data_but_keep_shapes():
    comm = LocalComm(1, 3)
    counts = np.empty(3, dtype=np.int64)
    comm.Allgather(np.array([5], dtype=np.int64), counts)
    assert list(counts) == [5, 5, 5]
    whole = np.full(6, 7.0)
    comm.Allgatherv(np.array([1.0, 2.0]), [whole, [2, 2, 2]])
    assert list(whole) == [0, 0, 1, 2, 0, 0]
    x = torch.ones(2, 3, 4, 5, requires_grad=True)
    above, below = LocalHalo.apply(x, comm, 1)
    assert above.shape == (2, 3, 1, 5) and not above.any()
    (above.sum() + 2 * below.sum()).backward()
    assert x.grad.shape == x.shape and x.grad.sum() == pytest.approx(3 * 2 * 3 * 5)


def test_a_pipeline_pays_sync_only_as_its_ranks_crowd_the_cores():
    crowded = Platform(
        "test",
        devices_per_node=4,
        flops=1e9,
        memory=2**30,
        intra=Link(1e-5, 1e-9),
        inter=Link(1e-5, 1e-9),
        contention=(1.0, 2.0, 3.0, 4.0),
        sync=1e-3,
    )
    assert sync_share(1, crowded) == 0 and sync_share(4, crowded) == 1
    assert sync_share(2.5, crowded) == pytest.approx(0.5)
    free = Platform("test", 4, 1e9, 2**30, Link(1e-5, 1e-9), Link(1e-5, 1e-9), contention=(1.0,) * 4, sync=1e-3)
    assert sync_share(1, free) == 1
    # M = 1: one stage computes at a time, so its messages are priced without sync
    assert (
        pipeline(INFO, 2, 3, 1, crowded).communication
        == pipeline(INFO, 2, 3, 1, replace(crowded, sync=0)).communication
    )
