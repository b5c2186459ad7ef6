"""Pipelined UNet stages: the same gradients as one process for every schedule, and what a step measures.

Every rank runs the same tests and asserts on values gathered from all ranks. Timing
numbers are never asserted; memory numbers (bytes of saved tensors) are exact.
"""

from __future__ import annotations

import pytest
import torch
from ddlab.data.images import make_segmentation
from ddlab.data_parallel import close_gloo
from ddlab.model_parallel import Stage, gradient_error, naive_split, reference_gradients
from ddlab.models.unet import UNet
from ddlab.pipeline import (
    TorchPipeline,
    calibrate,
    gpipe,
    measure_pipeline,
    measured_stage_times,
    one_f_one_b,
    pipedream_partition,
    pipeline_step,
)
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
K = WORLD.Get_size()


def _model(dtype: torch.dtype = torch.float64, width: int = 4, depth: int = 3) -> UNet:
    torch.manual_seed(0)
    return UNet(width=width, depth=depth).to(dtype)


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_pipelined_gradients_equal_one_process(schedule, m, recompute):
    model = _model()
    images, masks = make_segmentation(4, 16, seed=2, dtype=torch.float64)
    bounds = naive_split(len(model.layers), K) if m != 2 else list(range(K)) + [len(model.layers)]
    stage = Stage(model, bounds, WORLD, (3, 16, 16), recompute=recompute)
    loss = pipeline_step(stage, schedule, images, masks, m)
    errors = WORLD.allgather(gradient_error(stage, reference_gradients(model, images, masks)))
    losses = WORLD.allgather(loss)
    stage.mailbox.free()
    assert max(errors) < 1e-12, f"gradient error per rank: {errors}"
    want = torch.nn.functional.cross_entropy(model(images), masks).item()
    assert losses[-1] == pytest.approx(want, rel=1e-12)


def test_a_schedule_that_skips_a_backward_is_refused_on_every_rank():
    model = _model()
    images, masks = make_segmentation(2, 16, seed=2, dtype=torch.float64)
    stage = Stage(model, naive_split(len(model.layers), K), WORLD, (3, 16, 16))

    def forgets_last_backward(k, m, s):
        return gpipe(k, m, s)[:-1]

    with pytest.raises(ValueError, match="never ran the backward of micro-batches \\[1\\]"):
        pipeline_step(stage, forgets_last_backward, images, masks, 2)
    stage.mailbox.recover()
    stage.mailbox.free()


def test_measured_step_has_timelines_and_1f1b_keeps_fewer_activations():
    model = _model(torch.float32)
    images, masks = make_segmentation(2 * K, 32, seed=1)
    bounds = naive_split(len(model.layers), K)
    runs = {
        s.__name__: measure_pipeline(WORLD, model, bounds, s, 2 * K, images, masks, repeats=1)
        for s in (gpipe, one_f_one_b)
    }
    same = WORLD.allgather([(r.peak_activations, r.m) for r in runs.values()])
    assert all(s == same[0] for s in same), "every rank must get the same measurement"
    for run in runs.values():
        assert len(run.busy) == len(run.wall) == len(run.stage_times) == K
        kinds = {span.name.split()[0] for spans in run.busy for span in spans}
        assert {"forward", "backward"} <= kinds and 0 <= run.bubble < 1
    g, f = runs["gpipe"].peak_activations, runs["one_f_one_b"].peak_activations
    # stage s holds all 2K micro-batches under GPipe, at most K-s under 1F1B
    for s in range(K):
        assert f[s] <= g[s] * (K - s) / (2 * K) * 1.1 + 1, (s, f, g)


def test_calibrated_partition_is_a_valid_split():
    model = _model(torch.float32, width=2, depth=2)
    one_image, one_mask = make_segmentation(1, 16, seed=3)
    times = measured_stage_times(WORLD, model, one_image, one_mask, repeats=1)
    n = len(model.layers)
    bounds = pipedream_partition(n, K, times.per_direction)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == K + 1
    images, masks = make_segmentation(2 * K, 16, seed=4)
    result = calibrate(WORLD, model, images, masks, times, m=2 * K, rounds=1, repeats=1)
    assert result.best == bounds and len(result.rounds) == 1
    assert WORLD.allgather(result.best) == [bounds] * K


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_torch_pipelining_gives_the_same_gradients(schedule):
    model = _model()
    images, masks = make_segmentation(K, 16, seed=2, dtype=torch.float64)
    bounds = naive_split(len(model.layers), K)
    pipe = TorchPipeline(WORLD, model, bounds, K, schedule)
    pipe.step(images, masks)
    errors = WORLD.allgather(pipe.gradient_error(reference_gradients(model, images, masks), bounds))
    close_gloo()
    assert max(errors) < 1e-12, errors


def test_interleaved_run_records_its_ops_on_a_clock():
    """run_interleaved with a Timeline: the same losses as without, a forward and a backward span of every
    (chunk, micro-batch) on both clocks, and the wait of the last rank's first forward idle on the busy clock."""
    from ddlab.model_parallel import Timeline, utilisation
    from ddlab.pipeline import interleaved_1f1b, micro_batch_loss, run_interleaved
    from ddlab.runtime.trace import gather_spans

    rank, v, m = WORLD.Get_rank(), 2, K
    torch.manual_seed(0)
    chunks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).double() for _ in range(v)]
    inputs = [torch.randn(3, 8, dtype=torch.float64) for _ in range(m)]
    ops = interleaved_1f1b(K, m, rank, v)
    plain = run_interleaved(WORLD, chunks, ops, inputs, inputs, micro_batch_loss)
    clock = Timeline(rank)
    timed = run_interleaved(WORLD, chunks, ops, inputs, inputs, micro_batch_loss, clock=clock)
    assert timed == plain
    busy, wall = gather_spans(clock.busy, WORLD), gather_spans(clock.wall, WORLD)
    for spans in (busy, wall):
        for per_rank in spans:
            for name in ("forward", "backward"):
                assert {s.number for s in per_rank if s.name == name} == set(range(m)), (name, per_rank)
        assert 0 <= utilisation(spans)["bubble"] < 1
    if K > 1:
        first = next(i for i, s in enumerate(busy[-1]) if s.name == "forward")
        assert any(s.name == "idle" for s in busy[-1][first:]), busy[-1]
