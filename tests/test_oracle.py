"""The oracle in one process: traced FLOPs and bytes by hand, memory against the ledger, formulas, planner."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from ddlab.allreduce.cost import Link, collective_seconds
from ddlab.models import UNet, make_mlp
from ddlab.models.cnn import resnet50, vgg16
from ddlab.oracle import (
    Curves,
    LayerInfo,
    ModelInfo,
    Platform,
    channel_parallel,
    data,
    data_parallel_memory,
    data_parallel_time,
    describe,
    filter_parallel,
    gpu_cluster,
    hybrid_time,
    pipeline,
    plan,
    spatial,
    spatial_memory,
    spatial_time,
)
from ddlab.oracle.strategies import channel_exchanges, halo_exchanges
from ddlab.runtime.memory import Ledger
from torch import nn

FLAT = Platform("test", devices_per_node=4, flops=1e9, memory=2**30, intra=Link(1e-5, 1e-9), inter=Link(1e-4, 1e-8))


def test_linear_and_relu_by_hand():
    info = describe(nn.Sequential(nn.Linear(10, 5), nn.ReLU()), (10,))
    linear, relu = info.layers
    assert linear.flops_forward == 2 * 10 * 5 + 5 and linear.flops_backward == 2 * linear.flops_forward
    assert linear.parameter_bytes == (10 * 5 + 5) * 4
    assert linear.activation_bytes == 10 * 4  # its input, for the weights' gradient
    assert relu.activation_bytes == 5 * 4 and relu.flops_forward == 5 and relu.output_shape == (5,)


def test_convolutions_by_hand():
    info = describe(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ConvTranspose2d(8, 4, 2, stride=2)), (3, 16, 16))
    conv, up = info.layers
    assert conv.flops_forward == 8 * 16 * 16 * (2 * 3 * 9 + 1)
    assert conv.halo == 1 and conv.output_shape == (8, 16, 16) and conv.activation_bytes == 3 * 16 * 16 * 4
    assert up.flops_forward == 8 * 16 * 16 * 2 * 4 * 4 + 4 * 32 * 32
    assert up.output_shape == (4, 32, 32) and up.parameter_bytes == (8 * 4 * 4 + 4) * 4


def test_standard_networks():
    r = describe(resnet50(), (3, 224, 224))
    assert r.parameter_bytes == 25_557_032 * 4
    assert sum(layer.flops_forward for layer in r.layers) == pytest.approx(8.2e9, rel=0.01)  # 4.1 G multiply-adds
    v = describe(vgg16(), (3, 224, 224))
    assert v.parameter_bytes == 138_357_544 * 4
    assert sum(layer.flops_forward for layer in v.layers) == pytest.approx(31.0e9, rel=0.01)  # 15.5 G multiply-adds


@pytest.mark.parametrize("which", ["mlp", "unet"])
def test_data_parallel_memory_is_the_ledgers_count(which):
    torch.manual_seed(0)
    if which == "mlp":
        model, x, batch = make_mlp(), torch.randn(8, 600), 8
        loss = lambda out: out.square().sum()  # noqa: E731
    else:
        model, batch = UNet(width=4, depth=2), 2
        x = torch.randn(batch, 3, 32, 32)
        loss = lambda out: nn.functional.cross_entropy(out, torch.zeros(out.shape[0], 32, 32, dtype=torch.long))  # noqa: E731
    info = describe(model, tuple(x.shape[1:]), loss=loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ledger = Ledger()
    ledger.watch(model, optimizer)
    for _ in range(2):
        with ledger.activations():
            value = loss(model(x))
        value.backward()
        optimizer.step()
    predicted = data(info, batch, 1, FLAT, bucket_buffers=False).memory[0]
    for part in ("parameters", "gradients", "optimizer"):
        assert predicted[part] == ledger.peak[part], part
    # exact up to the loss's per-batch scalars (a mean's count), which the per-sample trace multiplies
    assert abs(predicted["activations"] - ledger.peak["activations"]) <= 8 * batch
    assert data(info, batch, 4, FLAT).memory[0]["activations"] == pytest.approx(ledger.peak["activations"] / 4, abs=8)


def _toy(n: int = 4, act: int = 100, params: int = 40) -> ModelInfo:
    layers = tuple(LayerInfo(f"l{i}", "Linear", 10.0, 20.0, params, act, (25,), (25,), 4) for i in range(n))
    return ModelInfo("toy", (25,), layers)


def test_pipeline_keeps_activations_per_micro_batch_in_flight():
    model = _toy()
    gpipe = pipeline(model, 8, 4, 4, FLAT, schedule="gpipe", bounds=[0, 1, 2, 3, 4])
    onefb = pipeline(model, 8, 4, 4, FLAT, schedule="1f1b", bounds=[0, 1, 2, 3, 4])
    # a micro-batch of 2 samples saves 200 bytes per stage; the received activation was saved before: +0 here
    assert [m["activations"] for m in gpipe.memory] == [4 * 200] * 4
    assert [m["activations"] for m in onefb.memory] == [k * 200 for k in (4, 3, 2, 1)]
    # equal stages: the slowest's M slots plus K - 1 more, the bubble (K-1)/(M+K-1) of the step
    free = Platform("free links", 4, 1e9, 2**30, Link(0.0, 0.0), Link(0.0, 0.0))
    even = pipeline(model, 8, 4, 4, free, schedule="gpipe", bounds=[0, 1, 2, 3, 4])
    assert even.bubble / even.time == pytest.approx(3 / 7)


def test_spatial_halos_and_edges():
    conv = LayerInfo("c", "Conv2d", 1e6, 2e6, 400, 4096, (4, 16, 16), (4, 16, 16), 4, halo=1)
    model = ModelInfo("two convs", (4, 16, 16), (conv, replace(conv, name="d")))
    pred = spatial(model, 2, 4, FLAT)
    row = 4 * 1 * 16 * 4 * 2  # channels x halo rows x width x itemsize x samples
    edge, inner = pred.memory
    assert edge["buffers"] == 2 * row and inner["buffers"] == 2 * 2 * row
    assert edge["activations"] == 2 * 4096 * 2 / 4
    # both neighbours at once (one message time); the first conv, on the data, sends no halo backward
    assert halo_exchanges(model, 4) == 1 + 2
    halos = (1 + 2) * (FLAT.intra.alpha + row * FLAT.intra.beta)
    assert pred.communication == pytest.approx(halos + collective_seconds("allreduce", 4, 800, FLAT.intra))


def test_first_layer_sends_nothing_backward():
    """Filter and channel parallelism: no collective for the data's gradient, forward only on the first layer."""
    model = _toy(2, act=100, params=400)
    for predict in (filter_parallel, channel_parallel):
        pred = predict(model, 4, 4, FLAT)
        fwd, bwd = ("allgather", "allreduce") if predict is filter_parallel else ("allreduce", "allgather")
        first, second = model.layers
        want = collective_seconds(fwd, 4, first.output_bytes * 4, FLAT.intra)
        want += collective_seconds(fwd, 4, second.output_bytes * 4, FLAT.intra)
        want += collective_seconds(bwd, 4, second.input_bytes * 4, FLAT.intra)
        assert pred.communication == pytest.approx(want)
        assert channel_exchanges(model, 4) == 3


def test_split_compute_off_prices_whole_layers():
    model = _toy(2, act=100, params=400)
    split, whole = filter_parallel(model, 4, 4, FLAT), filter_parallel(model, 4, 4, FLAT, split_compute=False)
    assert whole.compute == pytest.approx(4 * split.compute)
    assert whole.communication == split.communication


def test_filter_and_channel_split_weights():
    model = _toy(2, act=100, params=400)
    f, c = filter_parallel(model, 4, 4, FLAT), channel_parallel(model, 4, 4, FLAT)
    assert f.memory[0]["parameters"] == c.memory[0]["parameters"] == 2 * 100
    assert f.memory[0]["activations"] == 2 * 100 * 4  # filter: whole inputs on every rank
    assert c.memory[0]["activations"] == 2 * 100 * 4 / 4


def test_alpha_beta_and_curves():
    link = Link(2.0, 0.5)
    assert collective_seconds("allreduce", 4, 8, link) == 2 * (2 * 2.0 + 3 / 4 * 8 * 0.5)
    assert collective_seconds("allgather", 4, 8, link) == 2 * 2.0 + 3 / 4 * 8 * 0.5
    assert collective_seconds("p2p", 4, 8, link) == 2.0 + 4.0
    assert collective_seconds("allreduce", 1, 8, link) == 0.0
    curves = Curves()
    curves.add("allreduce", 4, [10, 1000], [1.0, 100.0])
    assert curves.seconds("allreduce", 100, 4) == pytest.approx(10.0)
    assert curves.seconds("allreduce", 2000, 4) == pytest.approx(200.0)
    assert curves.seconds("allreduce", 100, 8) is None


def test_exercise_formulas_by_hand():
    t = data_parallel_time(8.0, 100.0, 4, 1.0, 0.1)
    assert t == {"compute": 2.0, "communication": 6 * 1.0 + 1.5 * 100 * 0.1}
    assert data_parallel_memory(10, 40, 4, 2) == {"parameters": 10, "gradients": 10, "optimizer": 20, "activations": 10}
    s = spatial_time(8.0, [10.0, 20.0], 100.0, 4, 1.0, 0.1)
    # both neighbours at once; the first convolution (on the data) exchanges forward only
    assert s["communication"] == pytest.approx((1 + 1) + 2 * (1 + 2) + 6 + 15)
    serial = spatial_time(8.0, [10.0, 20.0], 100.0, 4, 1.0, 0.1, at_once=False)
    assert serial["communication"] == pytest.approx(2 * (1 + 1) + 2 * 2 * (1 + 2) + 6 + 15)
    h = hybrid_time(8.0, [10.0, 20.0], 100.0, 2, 4, (1.0, 0.1), (3.0, 0.2), 4)
    # halos on half the bytes; ring of 4 inside the node; ring of 2 across nodes, 4 rings sharing the link
    assert h == {"compute": 1.0, "communication": pytest.approx((1 + 0.5) + 2 * (1 + 1) + 6 + 15 + 2 * 3 + 100 * 0.8)}
    assert spatial_memory(10, 40, [3, 5], 4, 0, 1)["buffers"] == 8
    assert spatial_memory(10, 40, [3, 5], 4, 2, 1)["buffers"] == 16


def test_planner_never_offers_data_parallelism_to_a_model_too_big_for_one_device():
    big = _toy(4, act=10, params=2**28)  # 1 GiB of weights: with gradients and momentum, 3 GiB a replica
    cluster = gpu_cluster()
    result = plan(big, 64, 1, cluster, budget=2 * 2**30)
    assert result.ranked == [] and "data" in dict(result.infeasible)
    four = plan(big, 64, 4, cluster, budget=2 * 2**30)
    names = [p.strategy for p in four.ranked]
    assert "data" not in names and "pipeline" in names and "filter" in names
    assert "budget" in dict(four.infeasible)["data"]


def test_planner_prefers_data_parallelism_when_it_fits_and_computes_dominate():
    model = _toy(4, act=10, params=1000)
    result = plan(model, 64, 4, gpu_cluster())
    assert result.best.strategy == "data"
    assert all(p.time >= result.best.time for p in result.ranked)
    assert math.isclose(result.best.compute, 64 / 4 * 4 * 30 / gpu_cluster().flops)


def test_a_received_skip_waits_until_its_layer():
    model = _toy(4, act=100)

    def edges(a, b):  # a skip of 500 bytes per sample made by layer 0, concatenated by layer 3
        found = [("in", 100, a)] if a else []
        return found + ([("skip in", 500, 3)] if a <= 3 < b and a > 0 else [])

    pred = pipeline(model, 2, 2, 1, FLAT, bounds=[0, 2, 4], edges=edges)
    # stage 1 holds layers 2-3: before layer 3 it keeps layer 2's 100 bytes and the waiting skip
    assert pred.memory[1]["activations"] == 2 * (100 + 500)


def test_plan_maps_colour_a_strategy_the_same_in_every_map():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ddlab.oracle.figures import plot_plan_map

    def colour(best, key):
        fig = plot_plan_map(best, [4, 16], [224], "t", alt="the planner's fastest strategy per cell")
        image = fig.axes[0].images[0].get_array()
        labels = [t.get_text() for t in fig.axes[0].texts]
        plt.close(fig)
        return tuple(image[0][[4, 16].index(key[0])]), labels

    one, labels = colour({(4, 224): "data x pipeline", (16, 224): "data"}, (4, 224))
    two, _ = colour({(4, 224): "data", (16, 224): "data x pipeline"}, (16, 224))
    assert one == two and "data x\npipeline" in labels
    with pytest.raises(ValueError, match="no colour"):
        plot_plan_map({(4, 224): "data x tensor"}, [4], [224], "t", alt="a strategy without a colour")


def test_an_accuracy_below_zero_shows_as_zero_with_the_ratio():
    from ddlab.oracle.figures import _accuracy_label

    assert _accuracy_label(0.93, 1.07, 1.0) == "93%"
    assert _accuracy_label(-1.1, 2.1, 1.0) == "0%\n(pred 2.1x)"
