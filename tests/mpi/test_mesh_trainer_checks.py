"""Lab 16's checks of the assembled mesh trainer (16.2) and the interleaved schedule (16.3): the solution's
code and valid alternatives pass, each wrong answer fails with its message, and the stubs raise
NotImplementedError; on every rank."""

from __future__ import annotations

import faulthandler
import functools
import time

import pytest
import torch
from ddlab.checks import CheckFailed, check_interleaved, check_mesh_trainer
from ddlab.context_parallel import ring_attention_heads
from ddlab.data.text import BatchSampler, make_corpus
from ddlab.data_parallel import average_gradients
from ddlab.mesh import (
    DIMS,
    Chain,
    Embeddings,
    Head,
    Mesh,
    MeshTrainer,
    context_rows,
    layouts,
    mesh_loss,
    sequence_rows,
    sum_sequence_parallel_grads,
)
from ddlab.models.gpt import GPTConfig, make_gpt, train_gpt
from ddlab.pipeline import interleaved_1f1b, one_f_one_b, run_schedule
from ddlab.runtime.blocks import block_range
from ddlab.runtime.reference import unguarded
from ddlab.sharded import Sharded
from ddlab.tensor_parallel import ParallelBlock
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
MeshTrainer = unguarded(MeshTrainer)
interleaved_1f1b = unguarded(interleaved_1f1b)

STEPS = 10


def assembled(
    plane="replicas",
    sum_sp=True,
    scale=True,
    schedule=one_f_one_b,
    last_broadcasts=True,
    zero_grad="before",
    loss_over="replicas",
):
    """Exercise 16.2's solution as the notebook writes it; the arguments make the wrong answers.

    plane: "replicas" (right), "data" (every rank averages over its data ranks only), or "mixed" (context rank 1
    averages, shards and sums the loss over mesh.data, the others over mesh.replicas: ranks of one plane
    meet different collectives). last_broadcasts=False: the last stage keeps its loss instead of joining the
    pipeline's broadcast of it, so the other stages wait for it. zero_grad: "before" each step's backward (right),
    "after" its optimizer step (right too), or "never" (the gradients add up from step to step). loss_over:
    "replicas" (right), "data, then context" (two allreduces, right too), or "world": the loss summed over
    MPI.COMM_WORLD on every rank (the last stages' losses, the others' 0) and divided by the world's ranks per
    stage, with no broadcast: one process's loss wherever the mesh spans the whole world."""

    def train(model, mesh, batch_at, steps, micro_batches=1, zero=0, sequence_parallel=False):
        p, s = mesh.sizes["pipeline"], mesh.coords["pipeline"]
        mixed = plane == "mixed" and mesh.coords["context"] == 1
        replicas = mesh.replicas if plane == "replicas" or (plane == "mixed" and not mixed) else mesh.data
        attend = functools.partial(ring_attention_heads, mesh.context) if mesh.sizes["context"] > 1 else None
        units = [Embeddings(model, mesh.tensor, mesh.context, sequence_parallel)] if s == 0 else []
        for i in block_range(model.config.n_layer, s, p):
            units.append(ParallelBlock(model.blocks[i], mesh.tensor, sequence_parallel, attend))
        if s == p - 1:
            units.append(Head(model, mesh.tensor, sequence_parallel))
        stage = Chain(units, mesh.tensor, sequence_parallel)
        if zero:
            module = Sharded(stage, replicas, stage=zero, units=stage.units())
            optimizer = module.attach(torch.optim.AdamW(module.shards(), lr=3e-3, weight_decay=0.0))
        else:
            module = stage
            optimizer = torch.optim.AdamW(stage.parameters(), lr=3e-3, weight_decay=0.0)
        loss = mesh_loss(units[-1], micro_batches if scale else 1) if s == p - 1 else None
        losses = []
        for step in range(steps):
            idx, targets = batch_at(step)
            mine = block_range(idx.shape[0], mesh.data.Get_rank(), mesh.data.Get_size())
            rows = context_rows(idx.shape[1], mesh.context)
            idx, targets = idx[mine.start : mine.stop, rows], targets[mine.start : mine.stop, rows]
            length = len(sequence_rows(idx.shape[1], mesh.tensor)) if sequence_parallel else idx.shape[1]
            shape = (idx.shape[0] // micro_batches, length, model.config.n_embd)
            dtype = next(model.parameters()).dtype
            ops = schedule(p, micro_batches, s)
            if zero_grad == "before":
                optimizer.zero_grad()
            done = run_schedule(
                mesh.pipeline,
                module,
                ops,
                list(idx.chunk(micro_batches)),
                list(targets.chunk(micro_batches)),
                loss,
                (shape, dtype),
            )
            if sequence_parallel and sum_sp:
                sum_sequence_parallel_grads(stage, mesh.tensor)
            if not zero:
                average_gradients(stage, replicas)
            optimizer.step()
            if zero_grad == "after":
                optimizer.zero_grad(set_to_none=False)
            if loss_over == "world":
                world = MPI.COMM_WORLD
                losses.append(world.allreduce(sum(done) if s == p - 1 else 0.0) / (world.Get_size() // p))
                continue
            if loss_over == "replicas":
                mean = replicas.allreduce(sum(done)) / replicas.Get_size() if s == p - 1 else 0.0
            else:
                total = mesh.context.allreduce(mesh.data.allreduce(sum(done))) if s == p - 1 else 0.0
                mean = total / (mesh.data.Get_size() * mesh.context.Get_size())
            if last_broadcasts or s < p - 1:
                losses.append(mesh.pipeline.bcast(mean, root=p - 1))
            else:
                losses.append(mean)
        if zero:
            module.close()
        return losses

    return train


# Exercise 16.2's solution with sequence parallelism on, every layout of the world's ranks over the four dimensions
# (10 on 4 ranks, 4 on 3), lab 16's 4-block GPT (a sequence of 8; 6 on 3 ranks), 10 steps: one process's losses.
@pytest.fixture(scope="module")
def deep_gpt():
    block = 8 if MPI.COMM_WORLD.Get_size() != 3 else 6
    config = GPTConfig(vocab_size=256, block_size=block, n_layer=4, n_head=4, n_embd=16, tied=False)
    sampler = BatchSampler(make_corpus().train, batch=12, block=block)
    return config, sampler, train_gpt(make_gpt(config, dtype=torch.float64), sampler.batch_at, STEPS)


@pytest.mark.parametrize("index", range(10))
def test_the_assembled_trainer_with_sequence_parallelism_takes_one_process_s_steps_on_every_layout(
    comm, deep_gpt, index
) -> None:
    found = layouts(comm.Get_size(), DIMS)
    if index >= len(found):
        pytest.skip(f"{comm.Get_size()} ranks have {len(found)} layouts over {DIMS}")
    sizes = found[index]
    config, sampler, want = deep_gpt
    mesh = Mesh.build(comm, **sizes)
    try:
        micro = 2 if sizes["pipeline"] > 1 else 1
        got = assembled()(make_gpt(config, dtype=torch.float64), mesh, sampler.batch_at, STEPS, micro, 0, True)
    finally:
        mesh.free()
    error = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == STEPS and want[-1] < want[0] - 0.1  # it learns
    assert error < 1e-8, f"{sizes}: losses differ from one process's by {error:.3g}"


def the_library_trainer(model, mesh, batch_at, steps, micro_batches=1, zero=0, sequence_parallel=False):
    """A valid alternative: the library's MeshTrainer, step by step."""
    trainer = MeshTrainer(model, mesh, zero=zero, sequence_parallel=sequence_parallel)
    try:
        return [trainer.step(*batch_at(step), micro_batches) for step in range(steps)]
    finally:
        trainer.close()


def expect_trainer_failure(fn, *words: str, timeout: float = 20.0) -> None:
    """check_mesh_trainer(fn) fails with every word in its message, the same message on every rank."""
    with pytest.raises(CheckFailed) as info:
        check_mesh_trainer(fn, timeout=timeout)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert len(set(MPI.COMM_WORLD.allgather(str(info.value)))) == 1, "the ranks disagree on the failure"


def test_valid_trainers_pass(comm) -> None:
    """The library's trainer, and the notebook's with the gradients zeroed after the step instead of before it and
    the loss averaged over the data ranks and then the context ranks instead of mesh.replicas at once: one process's
    steps, on the meshes of part of the world too. (The notebook's own answer passes at the end of
    test_trainers_whose_ranks_meet_different_collectives_fail_within_the_deadline.)"""
    check_mesh_trainer(assembled(zero_grad="after", loss_over="data, then context"))
    check_mesh_trainer(the_library_trainer)


def test_wrong_trainers_fail(comm) -> None:
    if comm.Get_size() == 4:  # the cases with context ranks (replicas = data x context) and a pipeline
        expect_trainer_failure(assembled(plane="data"), "differ from one process's", "context")
    expect_trainer_failure(assembled(sum_sp=False), "differ from one process's", "sequence parallel")
    expect_trainer_failure(assembled(scale=False), "differ from one process's", "micro-batches")


def test_a_trainer_whose_gradients_are_never_zeroed_fails(comm) -> None:
    """Its first two losses are one process's (step 2's update is the first the leftover gradients change)."""
    expect_trainer_failure(assembled(zero_grad="never"), "step 3's is not", "zero_grad")


def test_a_loss_averaged_over_the_world_fails_on_meshes_of_part_of_it(comm) -> None:
    """One process's loss on every layout that spans the whole world; on meshes of half of it, a mix of theirs."""
    if comm.Get_size() == 1:
        pytest.skip("one rank has no mesh of part of the world")
    expect_trainer_failure(
        assembled(loss_over="world"), "layouts before it spanned the whole world", "MPI.COMM_WORLD", "mesh.replicas"
    )


#: The check's deadline per wait in the tests of answers that used to hang it.
WAIT = 5.0


def test_trainers_whose_ranks_meet_different_collectives_fail_within_the_deadline(comm) -> None:
    """Both hung the check before it ran the trainer on counting communicators (the pipeline's stages left in
    the loss's broadcast; a plane's ranks in a broadcast or an allreduce the others never join)."""
    started = time.monotonic()
    expect_trainer_failure(
        assembled(last_broadcasts=False), "Stalled", "Bcast", "waited in vain", "the loss's broadcast", timeout=WAIT
    )
    if comm.Get_size() == 4:  # a ZeRO case with context ranks: replicas (data x context) differs from data
        expect_trainer_failure(assembled(plane="mixed"), "Stalled", "Dup", "mesh.replicas", timeout=WAIT)
    assert time.monotonic() - started < 180, "the failures took longer than the deadlines allow"
    check_mesh_trainer(assembled(), timeout=WAIT)  # and the next check on the same ranks runs clean


def test_a_trainer_stub_raises_not_implemented(comm) -> None:
    def stub(*args):
        raise NotImplementedError("exercise 16.2: the mesh trainer")

    with pytest.raises(NotImplementedError, match="16.2"):
        check_mesh_trainer(stub)


# The interleaved schedule -----------------------------------------------------------------------------------
def by_forward_count(p, m, rank, v):
    """A valid alternative: the same order, written as the forwards and backwards each a list, then merged."""
    if v > 1 and m % p:
        raise ValueError("m must be a multiple of p")
    forwards, backwards = [], []
    for group in range(0, m, p if v > 1 else m):
        width = p if v > 1 else m
        for chunk in range(v):
            forwards += [("F", chunk, group + k) for k in range(width)]
            backwards += [("B", v - 1 - chunk, group + k) for k in range(width)]
    warm = min(p - rank - 1, m) if v == 1 else min(2 * (p - rank - 1) + (v - 1) * p, v * m)
    ops = forwards[:warm]
    for f, b in zip(forwards[warm:], backwards):
        ops += [f, b]
    return ops + backwards[len(forwards) - warm :]


def all_forwards_first(p, m, rank, v):
    """GPipe with chunks: the bubble is the same, but every activation is kept until the backwards."""
    ops = interleaved_1f1b(p, m, rank, v)
    return [op for op in ops if op[0] == "F"] + [op for op in ops if op[0] == "B"]


def backwards_in_forward_chunk_order(p, m, rank, v):
    """The backward of chunk 0 before chunk 1's: it waits for a gradient that never comes."""
    return [(kind, j if kind == "F" else v - 1 - j, i) for kind, j, i in interleaved_1f1b(p, m, rank, v)]


def one_chunk_at_a_time(p, m, rank, v):
    """Chunk 0 for every micro-batch, then chunk 1 ...: plain 1F1B per chunk, the bubble v times."""
    if v > 1 and m % p:
        raise ValueError("m must be a multiple of p")
    ops = []
    for j in range(v):
        ops += [(kind, j, i) for kind, i in one_f_one_b(p, m, rank)]
    return ops


def never_refuses(p, m, rank, v):
    return interleaved_1f1b(p, m, rank, 1) if m % p else interleaved_1f1b(p, m, rank, v)


def half_warmup(p, m, rank, v):
    """The interleaved order with a warm-up of (p - r - 1) + (v - 1)p forwards, not the text's 2(p - r - 1) + (v - 1)p."""
    if v > 1 and m % p:
        raise ValueError("m must be a multiple of p")
    total = v * m

    def op(kind, k):
        chunk = (k // p) % v
        micro = (k // (p * v)) * p + k % p if v > 1 else k
        return (kind, chunk if kind == "F" else v - 1 - chunk, micro)

    warmup = min((p - rank - 1) + (v - 1) * p, total)
    ops = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [op("F", warmup + k), op("B", k)]
    return ops + [op("B", k) for k in range(total - warmup, total)]


def refuses_any_m_not_a_multiple(p, m, rank, v):
    """Raises for v = 1 too when p does not divide m, where the text asks for lab 07's 1F1B."""
    if m % p:
        raise ValueError("m must be a multiple of p")
    return interleaved_1f1b(p, m, rank, v)


def expect_schedule_failure(fn, *words: str) -> None:
    with pytest.raises(CheckFailed) as info:
        check_interleaved(fn, timeout=5.0)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_the_interleaved_reference_and_an_alternative_pass(comm) -> None:
    check_interleaved(interleaved_1f1b)
    check_interleaved(by_forward_count)


def test_wrong_interleaved_schedules_fail(comm) -> None:
    expect_schedule_failure(all_forwards_first, "keeps", "activations")
    expect_schedule_failure(backwards_in_forward_chunk_order, "deadlock")
    expect_schedule_failure(one_chunk_at_a_time, "deadlock")
    expect_schedule_failure(never_refuses, "raise ValueError")
    expect_schedule_failure(half_warmup, "forwards before its first backward", "2(p - r - 1) + (v - 1)p")
    expect_schedule_failure(refuses_any_m_not_a_multiple, "v = 1", "m must be a multiple")


def test_a_schedule_wrong_alike_on_every_rank_is_told_once(comm) -> None:
    """Every engine replays the same lists, so a wrong one is said once, not once per rank."""
    with pytest.raises(CheckFailed) as info:
        check_interleaved(refuses_any_m_not_a_multiple, timeout=5.0)
    message = str(info.value)
    assert message.count("m must be a multiple") == 1 and "rank 1:" not in message, message
    if comm.Get_size() > 1:
        assert "on every rank" in message, message


def wrong_on_the_last_rank_only(p, m, rank, v):
    """Wrong on the world's last rank only (it refuses v = 1 with p not dividing m): the ranks differ."""
    world = MPI.COMM_WORLD
    if world.Get_size() > 1 and world.Get_rank() == world.Get_size() - 1:
        return refuses_any_m_not_a_multiple(p, m, rank, v)
    return interleaved_1f1b(p, m, rank, v)


def test_a_schedule_wrong_on_some_ranks_names_them(comm) -> None:
    if comm.Get_size() == 1:
        pytest.skip("needs ranks that differ")
    last = comm.Get_size() - 1
    expect_schedule_failure(wrong_on_the_last_rank_only, f"rank {last}:", "m must be a multiple")


def forward_count_never_advances(p, m, rank, v):
    """A steady-state loop whose forward count never moves (only the backwards do): it never returns."""
    forwards, backwards = 0, 0
    while forwards < v * m:
        backwards = min(backwards + 1, v * m)
    return []


def test_a_schedule_that_never_returns_fails_at_the_deadline(comm, monkeypatch) -> None:
    from ddlab.checks import mesh

    monkeypatch.setattr(mesh, "SCHEDULE_DEADLINE", 1.0)
    faulthandler.dump_traceback_later(120, exit=True)  # a hang ends the process, with tracebacks
    try:
        expect_schedule_failure(forward_count_never_advances, "did not return within 1 s", "never advances")
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_an_interleaved_stub_raises_not_implemented(comm) -> None:
    def stub(p, m, rank, v):
        raise NotImplementedError("exercise 16.3: the interleaved schedule")

    with pytest.raises(NotImplementedError, match="16.3"):
        check_interleaved(stub)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("mesh_trainer", "ddlab.mesh.train_on_mesh", ()),
        ("interleaved", "ddlab.pipeline.interleaved_1f1b", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
