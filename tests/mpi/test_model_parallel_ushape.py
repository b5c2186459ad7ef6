"""The U-shaped split of a UNet: same gradients as one process, no skip connection crossing ranks.

Every rank runs the same tests and asserts on values gathered from all ranks.
"""

from __future__ import annotations

import pytest
import torch
from ddlab.data.images import make_segmentation
from ddlab.model_parallel import (
    PiecePlan,
    PieceStage,
    compare_layouts,
    gradient_error,
    layer_order_pieces,
    naive_split,
    reference_gradients,
    train_step,
    u_split,
)
from ddlab.models.unet import UNet
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
K = WORLD.Get_size()


def _model(depth: int = 3) -> UNet:
    torch.manual_seed(0)
    return UNet(width=4, depth=depth).double()


@pytest.mark.parametrize("layout", ["U-shaped", "layer order"])
def test_gradients_equal_one_process(layout):
    model = _model()
    pieces = u_split(model, K) if layout == "U-shaped" else layer_order_pieces(naive_split(len(model.layers), K))
    images, masks = make_segmentation(3, 16, seed=2, dtype=torch.float64)
    stage = PieceStage(model, pieces, WORLD, (3, 16, 16))
    loss = train_step(stage, images, masks)
    errors = WORLD.allgather(gradient_error(stage, reference_gradients(model, images, masks)))
    losses = WORLD.allgather(loss)
    last = pieces[-1].owner  # the rank that computes the loss: 0 in the U-shaped split
    stage.mailbox.free()
    assert max(errors) < 1e-12, f"gradient error per rank: {errors}"
    want = torch.nn.functional.cross_entropy(model(images), masks).item()
    assert losses[last] == pytest.approx(want, rel=1e-12)
    assert [loss for r, loss in enumerate(losses) if r != last] == [None] * (K - 1)


def test_u_split_keeps_every_skip_on_its_rank():
    model = _model()
    pieces = u_split(model, K)
    assert [p.owner for p in pieces] == [*range(K), *reversed(range(K - 1))]
    plan = PiecePlan(model, pieces, (3, 16, 16))
    assert [(e.name, e.src, e.dst) for e in plan.edges] == (
        [("x", r, r + 1) for r in range(K - 1)] + [("x", r + 1, r) for r in reversed(range(K - 1))]
    )
    with pytest.raises(ValueError, match="folds over"):
        u_split(_model(depth=1), 3)


def test_counted_traffic_no_skip_messages_in_the_u_split():
    model = _model()
    layouts = {"naive": layer_order_pieces(naive_split(len(model.layers), K)), "U": u_split(model, K)}
    results = compare_layouts(WORLD, model, layouts, 16, batch=2, steps=1)
    naive, u = results["naive"][1], results["U"][1]
    assert u.skip_messages == 0 and naive.skip_messages > 0
    assert u.messages == 2 * 2 * (K - 1)  # x down and back up, each with its gradient
    assert naive.messages == 2 * (K - 1) + naive.skip_messages
    assert all(len(fit.peak_per_rank) == K and fit.fits for fit, _ in results.values())
