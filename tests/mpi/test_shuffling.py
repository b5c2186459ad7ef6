"""Lab 12's shuffling strategies on real ranks: every sample once per epoch, Q = 0 is local, Q = 1 is global."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab.data import StressStrainCurves
from ddlab.data.sharding import epoch_permutation
from ddlab.runtime.blocks import block_range
from ddlab.shuffling import (
    Shuffler,
    SyncedBatchNorm1d,
    exchange_plan,
    exchange_samples,
    remove_store,
    stage,
    train_shuffled,
    write_shared,
)
from mpi4py import MPI

N = 103  # not a multiple of 3 or 4: partitions of different sizes
EPOCHS = 3


@pytest.fixture(scope="module")
def root():
    comm = MPI.COMM_WORLD
    path = write_shared(comm, StressStrainCurves(N, seed=3))
    yield path
    remove_store(comm, path)


def orders(comm: MPI.Comm, root, strategy: str, q: float = 0.0, seed: int = 0) -> tuple[list[np.ndarray], Shuffler]:
    """Each epoch's ids on this rank; every epoch's samples are read, and must be the shared copy's rows."""
    shared, local = stage(comm, root)
    shuffler = Shuffler(comm, shared, local, strategy, q, seed)
    epochs = []
    for epoch in range(EPOCHS):
        epochs.append(shuffler.start_epoch(epoch))
        x, y = shuffler.read(epochs[-1])
        assert np.array_equal(x, shared.x[epochs[-1]]) and np.array_equal(y, shared.y[epochs[-1]])
    return epochs, shuffler


@pytest.mark.parametrize(
    "strategy, q", [("global", 0.0), ("local", 0.0), ("partial", 0.1), ("partial", 0.3), ("partial", 1.0)]
)
def test_every_sample_once_per_epoch(comm, root, strategy, q):
    epochs, shuffler = orders(comm, root, strategy, q)
    for epoch, mine in enumerate(epochs):
        everyone = np.concatenate(comm.allgather(mine))
        assert np.array_equal(np.sort(everyone), np.arange(N)), f"{strategy} q={q} epoch {epoch}"
        assert len(mine) == len(block_range(N, comm.rank, comm.size))


def test_partitions_are_not_iid(comm, root):
    shared, local = stage(comm, root)
    first_target = comm.allgather((float(local.y[:, 0].min()), float(local.y[:, 0].max())))
    for (_, high), (low, _) in zip(first_target[:-1], first_target[1:]):
        assert high <= low  # rank r's yield strengths all lie below rank r+1's


def test_q0_equals_local(comm, root):
    local, _ = orders(comm, root, "local")
    partial, shuffler = orders(comm, root, "partial", 0.0)
    assert all(np.array_equal(a, b) for a, b in zip(local, partial))
    assert all(c.exchanged == 0 for c in shuffler.counters)


def test_q1_is_a_permutation_of_global(comm, root):
    glob, _ = orders(comm, root, "global")
    partial, shuffler = orders(comm, root, "partial", 1.0)
    # Epoch 0: the same samples per rank as global (the pool is every id in order); after that
    # the same permutation dealt over the pool as it then lies (a relabelling of global).
    assert np.array_equal(np.sort(partial[0]), np.sort(glob[0]))
    for epoch in range(1, EPOCHS):
        pool = np.concatenate(comm.allgather(np.sort(partial[epoch - 1])))
        dealt = pool[epoch_permutation(N, epoch, 0)]
        block = block_range(N, comm.rank, comm.size)
        assert np.array_equal(np.sort(partial[epoch]), np.sort(dealt[block.start : block.stop]))
    assert all(c.shared == 0 for c in shuffler.counters[1:])


def test_global_reads_shared_local_reads_local(comm, root):
    _, glob = orders(comm, root, "global")
    _, part = orders(comm, root, "partial", 0.3)
    row = glob.shared.row_bytes
    m = len(block_range(N, comm.rank, comm.size))
    assert [(c.shared, c.local) for c in glob.counters] == [(m * row, 0)] * EPOCHS
    assert part.counters[0].shared == m * row and all(c.shared == 0 for c in part.counters[1:])
    assert all(c.local == m * row for c in part.counters)
    sent = sum(comm.allgather(sum(c.exchanged for c in part.counters)))
    assert 0 < sent <= EPOCHS * round(0.3 * N + comm.size) * row


def test_exchange_samples_carries_the_planned_rows(comm):
    counts = [len(block_range(50, r, comm.size)) for r in range(comm.size)]
    offset = sum(counts[: comm.rank])
    x = np.arange(offset, offset + counts[comm.rank], dtype=np.float64)[:, None] * np.array([1.0, -1.0, 0.5])
    send, recv_counts = exchange_plan(counts, comm.rank, 0.5, epoch=2, seed=7)
    got = exchange_samples(comm, x, send, recv_counts)
    everyone = comm.allgather((offset, send))
    want = np.concatenate([x[:0]] + [(o + s[comm.rank])[:, None] * np.array([1.0, -1.0, 0.5]) for o, s in everyone])
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bad", [dict(q=1.5), dict(strategy="random")])
def test_bad_arguments_say_what_to_do(comm, root, bad):
    shared, local = stage(comm, root)
    with pytest.raises(ValueError, match="q must lie|strategy must be"):
        Shuffler(comm, shared, local, bad.get("strategy", "partial"), bad.get("q", 0.1))


def test_synced_batch_norm_is_batch_norm_of_all_ranks_batches(comm):
    """Each rank normalises its block of one batch (blocks of unequal size): outputs, input gradients,
    summed weight gradients and running statistics are those of one BatchNorm1d on the whole batch."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(11, 3, generator=generator, dtype=torch.float64) * 3 + 1
    target = torch.randn(11, 3, generator=generator, dtype=torch.float64)
    block = block_range(len(x), comm.rank, comm.size)
    whole, synced = torch.nn.BatchNorm1d(3).double(), SyncedBatchNorm1d(3, comm).double()
    for layer in (whole, synced):
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    mine = x[block.start : block.stop].clone().requires_grad_()
    out = synced(mine)
    (out * target[block.start : block.stop]).sum().backward()
    everything = x.clone().requires_grad_()
    want = whole(everything)
    (want * target).sum().backward()
    assert torch.allclose(out, want[block.start : block.stop], atol=1e-12)
    assert torch.allclose(mine.grad, everything.grad[block.start : block.stop], atol=1e-12)
    weight_grad = np.array(comm.allreduce(synced.weight.grad.numpy()))
    assert np.allclose(weight_grad, whole.weight.grad.numpy(), atol=1e-12)
    assert torch.allclose(synced.running_var, whole.running_var) and torch.allclose(
        synced.running_mean, whole.running_mean
    )
    synced.eval(), whole.eval()
    assert torch.allclose(synced(x), whole(x))


def test_train_shuffled_rejects_an_unknown_batch_norm(comm, root):
    with pytest.raises(ValueError, match="batch_norm must be one of"):
        train_shuffled(comm, root, "global", batch_norm="sync")
