"""ddlab.sharded on several ranks: ZeRO-1/2/3 reach one process's parameters; checkpoints reshard.

Every rank runs every test; subsets of ranks (first_ranks) compute, and every rank
asserts on values agreed with collectives, so a failure never leaves a rank waiting.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import sharded
from ddlab.data import StressStrainCurves
from ddlab.data_parallel import squared_error
from ddlab.models import make_mlp
from ddlab.runtime.comm import first_ranks
from ddlab.runtime.counting import CountingComm, gather_traffic
from mpi4py import MPI

TOLERANCE = 1e-10
PER_RANK = 6
STEPS = 4
HIDDEN = (48, 32, 17)  # 17: units whose length no rank count here divides


def worst_everywhere(comm: MPI.Comm, value: float) -> float:
    return comm.allreduce(value, op=MPI.MAX)


def batches(size: int, rank: int, dtype: torch.dtype = torch.float64):
    """This rank's block of each global batch of size * PER_RANK samples (rank=None: the whole batch)."""
    data = StressStrainCurves(n=size * PER_RANK * STEPS, seed=3, dtype=dtype)
    for step in range(STEPS):
        first = step * size * PER_RANK
        idx = (
            np.arange(first, first + size * PER_RANK)
            if rank is None
            else np.arange(first + rank * PER_RANK, first + (rank + 1) * PER_RANK)
        )
        yield data[idx]


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)


def sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def one_process(size: int, make_optimizer=adam) -> dict[str, torch.Tensor]:
    model = make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN)
    optimizer = make_optimizer(model.parameters())
    for x, y in batches(size, None):
        optimizer.zero_grad()
        squared_error(model(x), y).mean().backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def train_sharded(comm, make_optimizer=adam, **options):
    model = sharded.Sharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, **options)
    optimizer = model.attach(make_optimizer(model.shards()))
    for x, y in batches(comm.Get_size(), comm.Get_rank()):
        optimizer.zero_grad()
        squared_error(model(x), y).mean().backward()
        optimizer.step()
    return model, optimizer


def relative(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((params[k] - v).abs().max() / v.abs().max()) for k, v in reference.items())


VARIANTS = [
    {"stage": 1},
    {"stage": 2},
    {"stage": 3},
    {"stage": 3, "prefetch": 1},
    {"stage": 3, "prefetch": 2, "checkpoint": True},
    {"stage": 2, "checkpoint": True},
    {"stage": 1, "collectives": "ring"},
    {"stage": 3, "collectives": "ring", "prefetch": 1, "checkpoint": True},
]


@pytest.mark.parametrize("ranks", [2, 0], ids=["2 ranks", "all ranks"])
@pytest.mark.parametrize("options", VARIANTS, ids=str)
def test_zero_matches_one_process_with_the_global_batch(comm, ranks, options):
    sub = first_ranks(comm, ranks or comm.Get_size())
    error = 0.0
    if sub is not None:
        model, _ = train_sharded(sub, **options)
        error = relative(model.full_parameters(), one_process(sub.Get_size()))
        model.close()
        sub.Free()
    assert worst_everywhere(comm, error) < TOLERANCE


@pytest.mark.parametrize("stage", [1, 3])
def test_sgd_with_momentum_on_the_shards(comm, stage):
    model, _ = train_sharded(comm, sgd, stage=stage, prefetch=1)
    error = relative(model.full_parameters(), one_process(comm.Get_size(), sgd))
    model.close()
    assert worst_everywhere(comm, error) < TOLERANCE


def test_a_student_style_pair_of_collectives_is_called(comm):
    calls = []

    def reduce_scatter(c, x, bounds):
        calls.append("rs")
        return sharded.reduce_scatter_mpi(c, x, bounds)

    def allgather(c, mine, bounds):
        calls.append("ag")
        return sharded.allgather_mpi(c, mine, bounds)

    model, _ = train_sharded(comm, stage=3, collectives=(reduce_scatter, allgather))
    error = relative(model.full_parameters(), one_process(comm.Get_size()))
    units = len(model.units)
    model.close()
    assert worst_everywhere(comm, error) < TOLERANCE
    assert calls.count("rs") == STEPS * units and calls.count("ag") == STEPS * 2 * units + units


def test_stage_3_frees_every_unit_after_each_step_and_stage_2_keeps_no_full_gradient(comm):
    three, _ = train_sharded(comm, stage=3, prefetch=2)
    freed = all(u.full.untyped_storage().nbytes() == 0 for u in three.units)
    two, _ = train_sharded(comm, stage=2)
    no_grads = all(p.grad is None for u in two.units for p in u.params)
    one, _ = train_sharded(comm, stage=1)
    kept = all(p.grad is not None for u in one.units for p in u.params)
    for model in (three, two, one):
        model.close()
    assert comm.allreduce(int(freed and no_grads and kept), op=MPI.MIN) == 1


@pytest.mark.parametrize("collectives", ["ring", "mpi"])
def test_stage_3_sends_one_and_a_half_times_the_bytes_of_stage_2(comm, collectives):
    sent = {}
    for stage in (2, 3):
        counting = CountingComm(comm, timeout=60, allow=("Allgatherv", "Reduce_scatter"))
        model, _ = train_sharded(counting, stage=stage, collectives=collectives)
        model.synchronize()
        padded = sum(u.space.padded * 8 for u in model.units)
        model.close()
        sent[stage] = sum(t.bytes_sent for t in gather_traffic(counting))
        counting.free()
    size = comm.Get_size()
    # a ring half moves (P-1)/P of the padded buffer from every rank: P-1 chunks of padded/P
    assert sent[2] == STEPS * 2 * (size - 1) * padded
    assert sent[3] == STEPS * 3 * (size - 1) * padded  # two allgathers, one reduce-scatter per unit


def test_bfloat16_compute_with_float32_masters_and_reduction(comm):
    """SGD (Adam would turn the sign noise of tiny gradients into full steps): the update stays within a few percent."""
    reference = one_process(comm.Get_size(), sgd)
    start = {name: p.detach() for name, p in make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN).named_parameters()}
    model = sharded.Sharded(
        make_mlp(seed=1, dtype=torch.float32, hidden=HIDDEN),
        comm,
        stage=3,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        prefetch=1,
    )
    optimizer = model.attach(sgd(model.shards()))
    for x, y in batches(comm.Get_size(), comm.Get_rank(), torch.float32):
        optimizer.zero_grad()
        squared_error(model(x).float(), y).mean().backward()
        optimizer.step()
    params = model.full_parameters()
    dtypes = {u.master.dtype for u in model.units} | {u.full.dtype for u in model.units}
    model.close()
    got, want, was = (torch.cat([d[k].double().flatten() for k in reference]) for d in (params, reference, start))
    # bfloat16 keeps 8 bits of mantissa: measured 3% of the update on 2 ranks (float32 compute: 5e-6)
    assert worst_everywhere(comm, float((got - want).norm() / (want - was).norm())) < 0.1
    assert dtypes == {torch.float32, torch.bfloat16}


def test_float16_dynamic_loss_scaling_skips_overflowing_steps_on_every_rank(comm):
    model = sharded.Sharded(
        make_mlp(seed=1, dtype=torch.float32, hidden=HIDDEN), comm, stage=2, param_dtype=torch.float16
    )
    optimizer = model.attach(adam(model.shards()))
    scale = sharded.DynamicLossScale(model, initial=2.0**32, factor=2.0**10, interval=2)
    before = {k: v.clone() for k, v in model.full_parameters().items()}
    stepped = []
    for x, y in batches(comm.Get_size(), comm.Get_rank(), torch.float32):
        optimizer.zero_grad()
        scale.scale(squared_error(model(x).float(), y).mean()).backward()
        stepped.append(scale.step(optimizer))
    after = model.full_parameters()
    model.close()
    # 2^32 overflows float16 (max 65504): the first steps are skipped everywhere, then training moves
    assert comm.allgather(stepped) == [stepped] * comm.Get_size()
    assert stepped[0] is False and any(stepped) and scale.value < 2.0**32
    assert any(not torch.equal(before[k], after[k]) for k in before)


def flat_state(model, optimizer) -> dict[str, np.ndarray]:
    """Parameters and optimizer state of every unit, gathered and without padding (collective)."""
    out = {}
    model.synchronize()  # the allgathers a load started: the helper thread must be idle before we use its comm
    comm = model.comm
    for unit in model.units:
        n = unit.space.numel
        pieces = {"master": unit.master.detach()} | {k: v for k, v in optimizer.state[unit.master].items()}
        for key, value in sorted(pieces.items()):
            everyone = comm.allgather(value.numpy().copy())
            out[f"{unit.index}.{key}"] = np.concatenate(everyone)[:n] if value.dim() else np.unique(everyone)
    return out


def test_a_checkpoint_reshards_to_any_rank_count_bit_for_bit(comm, tmp_path_factory):
    root = comm.bcast(str(tmp_path_factory.mktemp("sharded")) if comm.Get_rank() == 0 else None)
    model, optimizer = train_sharded(comm, stage=3)
    expected = flat_state(model, optimizer)
    sharded.save_sharded(f"{root}/0", model, optimizer, step=STEPS)
    model.close()
    ok = True
    counts = [2, 3, 1] if comm.Get_size() >= 3 else [2, 1]
    for hop, (n, stage) in enumerate(zip(counts, [1, 2, 3])):
        sub = first_ranks(comm, n)
        if sub is not None:
            model = sharded.Sharded(make_mlp(seed=5, dtype=torch.float64, hidden=HIDDEN), sub, stage=stage)
            optimizer = model.attach(adam(model.shards()))
            state = sharded.load_sharded(f"{root}/{hop}", model, optimizer)
            got = flat_state(model, optimizer)
            ok &= (
                state == {"step": STEPS}
                and got.keys() == expected.keys()
                and all(np.array_equal(got[k], expected[k]) for k in expected)
            )
            ok &= optimizer.param_groups[0]["weight_decay"] == 1e-3
            sharded.save_sharded(f"{root}/{hop + 1}", model, optimizer, step=STEPS)
            model.close()
            sub.Free()
        comm.Barrier()
    assert comm.allreduce(int(ok), op=MPI.MIN) == 1


def test_a_checkpoint_whose_writing_a_rank_did_not_finish_is_refused(comm, tmp_path_factory, monkeypatch):
    path = comm.bcast(str(tmp_path_factory.mktemp("killed")) if comm.Get_rank() == 0 else None)
    model, optimizer = train_sharded(comm, stage=2)
    sharded.save_sharded(path, model, optimizer)  # a whole checkpoint first: the rewrite must not leave it loadable
    if comm.Get_rank() == comm.Get_size() - 1:

        def dies_mid_write(target, payload):
            target.with_name(target.name + ".partial").write_bytes(b"half a shard")
            raise OSError("killed")

        monkeypatch.setattr(sharded.checkpoint, "_write", dies_mid_write)
    with pytest.raises(OSError, match="could not write its shard"):
        sharded.save_sharded(path, model, optimizer)
    with pytest.raises(sharded.CheckpointError, match="COMMITTED marker.*stopped before every rank"):
        sharded.load_sharded(path, model, optimizer)
    model.close()
