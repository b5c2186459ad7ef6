"""The UNet as a flat list of layers, the synthetic segmentation set, splits and per-layer profiles."""

from __future__ import annotations

import itertools

import pytest
import torch
from ddlab.data.images import CLASSES, make_segmentation
from ddlab.model_parallel import (
    Crossings,
    PiecePlan,
    StagePlan,
    balanced_split,
    check_bounds,
    layer_order_pieces,
    naive_split,
    profile_layers,
    stage_costs,
    trace_shapes,
    u_split,
)
from ddlab.models.unet import UNet, layer_names


def test_unet_layers_shapes_and_skips():
    model = UNet(width=4, depth=3)
    assert len(model.layers) == 6 * 3 + 3
    out = model(torch.zeros(2, 3, 32, 32))
    assert out.shape == (2, CLASSES, 32, 32)
    names = layer_names(model)
    assert names[:3] == ["Conv", "Conv", "Down0"] and names[-1] == "Head" and "Up0" in names
    outputs, skips = trace_shapes(model, (3, 32, 32))
    assert outputs[-1] == (CLASSES, 32, 32)
    assert skips == {"skip0": (4, 32, 32), "skip1": (8, 16, 16), "skip2": (16, 8, 8)}


def test_unet_rejects_sides_that_do_not_halve():
    with pytest.raises(ValueError, match="multiples of 2\\*\\*depth"):
        UNet(depth=3)(torch.zeros(1, 3, 20, 20))


def test_segmentation_set_is_seeded_and_labelled():
    images, masks = make_segmentation(3, 24, seed=5)
    again, _ = make_segmentation(3, 24, seed=5)
    assert images.shape == (3, 3, 24, 24) and masks.shape == (3, 24, 24) and masks.dtype == torch.long
    assert torch.equal(images, again)
    assert set(masks.unique().tolist()) <= set(range(CLASSES)) and masks.max() > 0
    assert make_segmentation(1, 16, dtype=torch.float64)[0].dtype == torch.float64


def _brute_force(costs, k):
    n = len(costs)
    return min(max(stage_costs(costs, [0, *cuts, n])) for cuts in itertools.combinations(range(1, n), k - 1))


@pytest.mark.parametrize("seed", range(20))
def test_balanced_split_is_optimal(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 10, (), generator=gen))
    k = int(torch.randint(1, n + 1, (), generator=gen))
    costs = (torch.rand(n, generator=gen) * 10).round(decimals=2).tolist()
    bounds = balanced_split(costs, k)
    check_bounds(bounds, n, k)
    assert max(stage_costs(costs, bounds)) == pytest.approx(_brute_force(costs, k))


def test_splits_refuse_impossible_requests():
    with pytest.raises(ValueError, match="non-empty"):
        naive_split(3, 4)
    with pytest.raises(ValueError, match="non-empty"):
        balanced_split([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="increase strictly"):
        check_bounds([0, 2, 2, 5], 5)
    assert naive_split(27, 4) == [0, 7, 14, 21, 27]


def test_plan_finds_the_skips_that_cross_stages():
    model = UNet(width=2, depth=2)  # 15 layers: Down0 is layer 2, Up0 layer 11; Down1 5, Up1 8
    plan = StagePlan(model, [0, 5, 10, 15], (3, 8, 8))
    edges = {(e.name, e.src, e.dst): e.shape for e in plan.edges}
    assert edges == {("x", 0, 1): (4, 4, 4), ("x", 1, 2): (4, 4, 4), ("skip0", 0, 2): (2, 8, 8)}
    assert [e.name for e in plan.inputs(2)] == ["x", "skip0"]
    tags = {plan.tag(e, mb) for e in plan.edges for mb in range(3)}
    assert len(tags) == 9, "every edge and micro-batch needs its own tag"


def test_crossings_list_what_a_stage_exchanges():
    model = UNet(width=2, depth=2)  # Down0 is layer 2 (skip 2x8x8), Up0 layer 11; Down1 5, Up1 8
    crossings = Crossings(model, (3, 8, 8), batch=1)
    assert crossings(0, len(model.layers)) == []
    assert crossings(0, 1) == [2 * 8 * 8 * 4]  # the first Conv's output, 2 channels of 8x8
    assert sorted(crossings(3, 5)) == [2 * 4 * 4 * 4, 4 * 4 * 4 * 4]  # in: pooled x; out: x
    assert sorted(crossings(0, 3)) == sorted([2 * 4 * 4 * 4, 2 * 8 * 8 * 4])  # out: x and skip0
    inside = crossings(2, 12)  # both ends of skip0 and skip1 inside: only the two activations
    assert len(inside) == 2


def test_profile_measures_every_layer():
    torch.manual_seed(0)
    model = UNet(width=4, depth=2)
    images, masks = make_segmentation(2, 16)
    costs = profile_layers(model, images, masks)
    assert [c.name for c in costs] == layer_names(model)
    assert all(c.forward >= 0 and c.backward >= 0 for c in costs)
    assert costs[0].parameters == (3 * 4 * 9 + 4) * 4
    assert costs[0].activations > 0 and costs[2].parameters == 0
    assert costs[-1].activations == 0, "the Head saves only its input, which the layer before already saved"
    assert all(p.grad is None for p in model.parameters()), "profiling must leave the model as it was"


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_u_split_folds_the_unet_and_keeps_skips_local(k):
    model = UNet(width=2, depth=4)
    pieces = u_split(model, k)
    assert [p.owner for p in pieces] == [*range(k), *reversed(range(k - 1))]
    assert [i for p in pieces for i in p.layers] == list(range(len(model.layers)))
    plan = PiecePlan(model, pieces, (3, 16, 16))
    assert all(e.name == "x" for e in plan.edges) and len(plan.edges) == 2 * (k - 1)
    assert set(plan.layers(0)) >= {0, len(model.layers) - 1}  # rank 0: the first layer and the head


def test_layer_order_pieces_send_the_skips_a_layer_order_split_sends():
    model = UNet(width=2, depth=3)
    bounds = naive_split(len(model.layers), 3)
    pieces = PiecePlan(model, layer_order_pieces(bounds), (3, 16, 16))
    stages = StagePlan(model, bounds, (3, 16, 16))
    assert [(e.name, e.src, e.dst, e.shape) for e in pieces.edges] == [
        (e.name, e.src, e.dst, e.shape) for e in stages.edges
    ]
