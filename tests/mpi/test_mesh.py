"""The mesh's sub-communicators and coordinates on every layout, and lab 14's GPT trained on every
layout of the world's ranks (data x tensor x pipeline, and ZeRO on the data dimension) taking the
steps of one process: float64 losses to 1e-8 over 10 steps.

On 4 ranks the layouts are 4x1x1, 2x2x1, 2x1x2, 1x4x1, 1x2x2, 1x1x4; on 3 ranks 3x1x1, 1x3x1, 1x1x3.
With context parallelism (ring attention, lab 15), on 4 ranks 1x1x1x4, 2x1x1x2 (and with ZeRO-2),
1x2x1x2, 1x1x2x2; on 3 ranks 1x1x1x3.
"""

from __future__ import annotations

import math

import pytest
import torch
from ddlab.data.text import BatchSampler, make_corpus
from ddlab.mesh import DIMS, GPTStage, Mesh, MeshTrainer, coordinates, layouts, train_on_mesh
from ddlab.models.gpt import GPTConfig, make_gpt, train_gpt
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
STEPS = 10
CONFIG = GPTConfig(vocab_size=256, block_size=8, n_layer=4, n_head=4, n_embd=16, tied=False)
BATCH = 12  # splits over 1..4 data ranks x 1..2 micro-batches (4 x 2 = 8 does not divide 12: ZeRO runs use 1)


@pytest.fixture(scope="module")
def sampler() -> BatchSampler:
    return BatchSampler(make_corpus().train, batch=BATCH, block=CONFIG.block_size)


@pytest.fixture(scope="module")
def one_process(sampler: BatchSampler) -> list[float]:
    return train_gpt(make_gpt(CONFIG, dtype=torch.float64), sampler.batch_at, STEPS)


def every_mesh(world: int) -> list[dict[str, int]]:
    return layouts(world, DIMS)


def test_layouts_multiply_to_the_world() -> None:
    four = layouts(4)
    assert [f"{s['data']}x{s['tensor']}x{s['pipeline']}" for s in four] == [
        "4x1x1",
        "2x2x1",
        "2x1x2",
        "1x4x1",
        "1x2x2",
        "1x1x4",
    ]
    assert all(s["context"] == 1 for s in four)
    assert len(layouts(12, DIMS)) == 10 * 4  # the two 2s over 4 dimensions (10 ways) times the 3 (4 ways)
    assert all(math.prod(s.values()) == 12 for s in layouts(12, DIMS))


def test_every_rank_has_its_coordinates_and_its_groups(comm: MPI.Comm) -> None:
    size = comm.Get_size()
    for sizes in every_mesh(size):
        mesh = Mesh.build(comm, **sizes)
        assert mesh.coords == coordinates(comm.Get_rank(), sizes)
        everyone = comm.allgather(mesh.coords)
        for name in DIMS:
            sub = mesh.comms[name]
            assert sub.Get_size() == sizes[name] and sub.Get_rank() == mesh.coords[name]
            members = sub.allgather(comm.Get_rank())
            same = [r for r, c in enumerate(everyone) if all(c[o] == mesh.coords[o] for o in DIMS if o != name)]
            assert members == same, (name, sizes)
        # the rank order: tensor fastest, pipeline slowest
        strides = {"tensor": 1}
        strides["context"] = sizes["tensor"]
        strides["data"] = strides["context"] * sizes["context"]
        strides["pipeline"] = strides["data"] * sizes["data"]
        assert comm.Get_rank() == sum(mesh.coords[n] * strides[n] for n in DIMS)
        mesh.free()


def test_sizes_that_do_not_multiply_to_the_world_are_refused(comm: MPI.Comm) -> None:
    with pytest.raises(ValueError, match="multiply to .* but the communicator has"):
        Mesh.build(comm, data=comm.Get_size() + 1)
    with pytest.raises(ValueError, match="positive int"):
        Mesh.build(comm, data=comm.Get_size(), tensor=0)


def test_the_replicas_are_the_data_x_context_plane(comm: MPI.Comm) -> None:
    size = comm.Get_size()
    for sizes in every_mesh(size):
        mesh = Mesh.build(comm, **sizes)
        everyone = comm.allgather(mesh.coords)
        same = [r for r, c in enumerate(everyone) if all(c[o] == mesh.coords[o] for o in ("pipeline", "tensor"))]
        assert sorted(mesh.replicas.allgather(comm.Get_rank())) == same, sizes
        assert mesh.replicas.Get_rank() == mesh.coords["data"] * sizes["context"] + mesh.coords["context"]
        assert (mesh.replicas is mesh.data) == (sizes["context"] == 1)
        mesh.free()


def test_a_sequence_that_does_not_split_into_2c_chunks_is_refused(comm: MPI.Comm) -> None:
    mesh = Mesh.build(comm, context=comm.Get_size())
    assert mesh.label.endswith(f"x{comm.Get_size()}")
    trainer = MeshTrainer(make_gpt(CONFIG, dtype=torch.float64), mesh)
    idx = targets = torch.zeros((4, 7), dtype=torch.int64)  # a sequence of 7
    with pytest.raises(ValueError, match=f"multiple of {2 * comm.Get_size()}"):
        trainer.step(idx, targets)
    mesh.free()


def test_a_tied_gpt_and_a_batch_that_does_not_split_are_refused_with_what_to_do(comm: MPI.Comm) -> None:
    mesh = Mesh.build(comm, pipeline=comm.Get_size())
    tied = make_gpt(GPTConfig(vocab_size=256, block_size=8, n_layer=4, n_head=4, n_embd=16), dtype=torch.float64)
    if mesh.coords["pipeline"] == comm.Get_size() - 1:  # the last stage holds the output layer
        with pytest.raises(ValueError, match="tied=False"):
            GPTStage(tied, mesh)
    trainer = MeshTrainer(make_gpt(CONFIG, dtype=torch.float64), mesh)
    idx, targets = BatchSampler(make_corpus().train, batch=5, block=8).batch_at(0)
    with pytest.raises(ValueError, match="multiple of 2"):
        trainer.step(idx, targets, micro_batches=2)
    mesh.free()


@pytest.mark.parametrize("index", range(6))
def test_every_layout_takes_the_steps_of_one_process(
    comm: MPI.Comm, sampler: BatchSampler, one_process: list[float], index: int
) -> None:
    found = layouts(comm.Get_size())
    if index >= len(found):
        pytest.skip(f"{comm.Get_size()} ranks have {len(found)} layouts of data x tensor x pipeline")
    sizes = found[index]
    micro = 2 if sizes["pipeline"] > 1 else 1
    run = train_on_mesh(
        comm,
        make_gpt(CONFIG, dtype=torch.float64),
        sampler.batch_at,
        STEPS,
        sizes["data"],
        sizes["tensor"],
        sizes["pipeline"],
        micro_batches=micro,
    )
    error = max(abs(a - b) for a, b in zip(run.losses, one_process))
    assert len(run.losses) == STEPS and one_process[-1] < one_process[0] - 0.1  # it learns
    assert error < 1e-8, f"{run.label}: losses differ from one process's by {error:.3g}"
    assert len(run.peak_bytes) == comm.Get_size() and min(run.peak_bytes) > 0


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_on_the_data_dimension_takes_the_steps_of_one_process(
    comm: MPI.Comm, sampler: BatchSampler, one_process: list[float], zero: int
) -> None:
    size = comm.Get_size()
    # 4 ranks: ZeRO-1 beside a pipeline (2x1x2), ZeRO-2 beside tensor parallelism (2x2x1), ZeRO-3 over all (4x1x1)
    data, tensor, pipeline = {1: (2, 1, 2), 2: (2, 2, 1), 3: (4, 1, 1)}[zero] if size == 4 else (size, 1, 1)
    run = train_on_mesh(
        comm,
        make_gpt(CONFIG, dtype=torch.float64),
        sampler.batch_at,
        STEPS,
        data,
        tensor,
        pipeline,
        micro_batches=2 if pipeline > 1 else 1,
        zero=zero,
    )
    error = max(abs(a - b) for a, b in zip(run.losses, one_process))
    assert error < 1e-8, f"{run.label}: losses differ from one process's by {error:.3g}"


# data x tensor x pipeline x context, micro-batches, ZeRO, steps: every composition with context on 4 ranks (c = 4,
# 2 data x 2 context, 2 tensor x 2 context, 2 pipeline x 2 context, and ZeRO-2 over 2 data x 2 context for 3
# steps); on 3 ranks c = 3, whose 6 zig-zag chunks need a sequence of 6 (lab 16's of 8 would be refused). A GPT
# of 2 blocks: each block's ring attention is a Dup, an allgather and 2c - 1 waits per micro-batch and step.
CONTEXT_LAYOUTS = {
    4: [(1, 1, 1, 4, 1, 0, STEPS), (2, 1, 1, 2, 1, 0, STEPS), (1, 2, 1, 2, 1, 0, STEPS), (1, 1, 2, 2, 2, 0, STEPS)]
    + [(2, 1, 1, 2, 1, 2, 3)],
    3: [(1, 1, 1, 3, 1, 0, STEPS)],
}


@pytest.fixture(scope="module")
def context_gpts() -> dict[int, tuple[GPTConfig, BatchSampler, list[float]]]:
    """Per block size (8, and 6 for 3 context ranks): the 2-block GPT, its batches and one process's losses."""
    found = {}
    for block in {8, 6} if WORLD.Get_size() == 3 else {8}:
        config = GPTConfig(vocab_size=256, block_size=block, n_layer=2, n_head=4, n_embd=16, tied=False)
        sampler = BatchSampler(make_corpus().train, batch=BATCH, block=block)
        found[block] = config, sampler, train_gpt(make_gpt(config, dtype=torch.float64), sampler.batch_at, STEPS)
    return found


@pytest.mark.parametrize("index", range(5))
def test_context_layouts_take_the_steps_of_one_process(
    comm: MPI.Comm, context_gpts: dict[int, tuple[GPTConfig, BatchSampler, list[float]]], index: int
) -> None:
    found = CONTEXT_LAYOUTS.get(comm.Get_size(), [])
    if index >= len(found):
        pytest.skip(f"{comm.Get_size()} ranks: {len(found)} context layouts tested")
    data, tensor, pipeline, context, micro, zero, steps = found[index]
    config, sampler, want = context_gpts[8 if 8 % (2 * context) == 0 else 6]
    run = train_on_mesh(
        comm,
        make_gpt(config, dtype=torch.float64),
        sampler.batch_at,
        steps,
        data,
        tensor,
        pipeline,
        micro_batches=micro,
        zero=zero,
        context=context,
    )
    error = max(abs(a - b) for a, b in zip(run.losses, want))
    assert len(run.losses) == steps and want[-1] < want[0] - 0.1  # it learns
    assert error < 1e-8, f"{run.label}: losses differ from one process's by {error:.3g}"
    assert run.label.startswith(f"{data}x{tensor}x{pipeline}x{context}") and min(run.peak_bytes) > 0


def test_sequence_parallel_rows_that_do_not_split_evenly_are_refused(comm: MPI.Comm) -> None:
    mesh = Mesh.build(comm, tensor=comm.Get_size())
    trainer = MeshTrainer(make_gpt(CONFIG, dtype=torch.float64), mesh, sequence_parallel=True)
    idx = targets = torch.zeros((4, 2 * comm.Get_size() + 1), dtype=torch.int64)
    with pytest.raises(ValueError, match=f"multiple of {comm.Get_size()}"):
        trainer.step(idx, targets)
    mesh.free()
