"""A UNet split over the ranks: same gradients as one process, real out-of-memory, clean recovery.

Every rank runs the same tests and asserts on values gathered from all ranks, so a
failure on one rank fails the test on every rank instead of leaving others waiting.
"""

from __future__ import annotations

import pytest
import torch
from ddlab.data.images import make_segmentation
from ddlab.model_parallel import (
    Mailbox,
    Stage,
    attempt,
    balanced_split,
    fit_sweep,
    gradient_error,
    largest_sides,
    naive_split,
    reference_gradients,
    train_step,
    try_split,
)
from ddlab.models.unet import UNet
from ddlab.runtime.memory import Ledger
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
K = WORLD.Get_size()


def _model(width: int = 4, depth: int = 3, dtype: torch.dtype = torch.float64) -> UNet:
    torch.manual_seed(0)
    return UNet(width=width, depth=depth).to(dtype)


def _splits(n: int) -> dict[str, list[int]]:
    return {
        "naive": naive_split(n, K),
        "first layers alone": list(range(K)) + [n],
        "last layers alone": [0, *range(n - K + 1, n + 1)],
        "balanced": balanced_split([float(i % 5 + 1) for i in range(n)], K),
    }


@pytest.mark.parametrize("split", ["naive", "first layers alone", "last layers alone", "balanced"])
def test_gradients_equal_one_process(split):
    model = _model()
    images, masks = make_segmentation(3, 16, seed=2, dtype=torch.float64)
    stage = Stage(model, _splits(len(model.layers))[split], WORLD, (3, 16, 16))
    loss = train_step(stage, images, masks)
    errors = WORLD.allgather(gradient_error(stage, reference_gradients(model, images, masks)))
    losses = WORLD.allgather(loss)
    stage.mailbox.free()
    assert max(errors) < 1e-12, f"gradient error per rank: {errors}"
    want = torch.nn.functional.cross_entropy(model(images), masks).item()
    assert losses[-1] == pytest.approx(want, rel=1e-12) and losses[:-1] == [None] * (K - 1)


def test_skip_connections_cross_ranks_in_the_naive_split():
    model = _model()
    stage = Stage(model, naive_split(len(model.layers), K), WORLD, (3, 16, 16))
    skips = [e for e in stage.plan.edges if e.name.startswith("skip")]
    stage.mailbox.free()
    assert skips and all(e.dst > e.src for e in skips)
    assert any(e.dst - e.src > 1 for e in skips), "the outermost skip should jump over ranks"


def test_out_of_memory_on_one_stage_stops_every_rank_and_the_stage_recovers():
    model = _model(dtype=torch.float32)
    images, masks = make_segmentation(2, 32, seed=0)
    bounds = naive_split(len(model.layers), K)
    ledger = Ledger(budget=None, stage=f"stage {WORLD.Get_rank()}")
    stage = Stage(model, bounds, WORLD, (3, 32, 32), ledger=ledger, timeout=30)
    ledger.watch(stage.layers)
    # the last stage gets a budget just above its parameters: its first saved tensor overflows it
    ledger.budget = ledger.total + 1 if stage.last else None
    _, problems = attempt(stage, lambda: train_step(stage, images, masks))
    assert problems[:-1] == [None] * (K - 1)
    assert problems[-1].startswith(f"OutOfMemory: stage {K - 1}: out of memory asking for ")
    ledger.budget = None
    for param in stage.parameters():
        param.grad = None  # forget what the failed step accumulated
    _, problems = attempt(stage, lambda: train_step(stage, images, masks))
    errors = WORLD.allgather(gradient_error(stage, reference_gradients(model, images, masks)))
    stage.mailbox.free()
    assert not any(problems), problems
    assert max(errors) < 1e-6, f"gradient error per rank after recovering: {errors}"


def test_recover_clears_messages_left_in_flight():
    mailbox = Mailbox(WORLD, timeout=30)
    rank = WORLD.Get_rank()

    def step():
        if rank == 0:
            for peer in range(1, K):
                mailbox.post(torch.ones(1000), peer, tag=7)  # sent, never received
            raise RuntimeError("rank 0 gives up")
        mailbox.take((5,), torch.float32, 0, tag=99)  # waits for a message that never comes

    problem = None
    try:
        step()
    except Exception as err:
        problem = type(err).__name__
        if rank == 0:
            mailbox.fail(str(err))
    problems = WORLD.allgather(problem)
    mailbox.recover()
    # afterwards, messages with the old tag are gone: a fresh exchange gets fresh data
    if rank == 0:
        for peer in range(1, K):
            mailbox.post(torch.full((1000,), 2.0), peer, tag=7)
    got = mailbox.take((1000,), torch.float32, 0, tag=7) if rank else None
    mailbox.flush()
    values = WORLD.allgather(None if got is None else float(got.mean()))
    mailbox.free()
    assert problems == ["RuntimeError"] + ["PeerFailed"] * (K - 1)
    assert values == [None] + [2.0] * (K - 1)


def test_fit_sweep_reports_sizes_that_fit_and_oom():
    model = _model(width=4, depth=2, dtype=torch.float32)
    results = fit_sweep(WORLD, model, [16, 64], budget=2**20 // 2, steps=1)
    largest = largest_sides(results)
    summary = WORLD.allgather([(r.split, r.side, r.fits) for r in results])
    assert all(s == summary[0] for s in summary), "every rank must see the same results"
    assert [(r.split, r.side) for r in results] == [
        (s, side) for side in (16, 64) for s in ("one process", "naive", "balanced")
    ]
    oom = [r for r in results if not r.fits]
    assert oom and all("out of memory" in r.error for r in oom)
    assert largest["one process"] == 16 and all(len(r.peaks) == (1 if r.split == "one process" else K) for r in results)


def test_try_split_times_a_step_that_fits():
    model = _model(width=2, depth=2, dtype=torch.float32)
    fit = try_split(WORLD, model, naive_split(len(model.layers), K), 16, "naive", budget=None, steps=2)
    assert fit.fits and fit.seconds_per_sample > 0 and len(fit.peak_per_rank) == K
