"""ddlab.sharded in one process: the flat space's padding, shards and views; a unit's buffer and its parameters."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from ddlab import sharded
from ddlab.data import StressStrainCurves
from ddlab.data_parallel import squared_error
from ddlab.models import make_mlp
from mpi4py import MPI


def test_padding_makes_p_equal_contiguous_shards():
    space = sharded.FlatSpace((torch.Size([2, 3]), torch.Size([5])), size=4)
    assert (space.numel, space.shard_numel, space.padded) == (11, 3, 12)
    assert space.bounds == [0, 3, 6, 9, 12]
    assert space.offsets == (0, 6)
    flat = torch.arange(12.0)
    assert [space.shard(flat, r).tolist() for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_a_divisible_length_needs_no_padding_and_a_tiny_unit_still_gives_every_rank_a_shard():
    assert sharded.FlatSpace((torch.Size([12]),), size=4).padded == 12
    tiny = sharded.FlatSpace((torch.Size([2]),), size=4)
    assert (tiny.shard_numel, tiny.padded) == (1, 4)


def test_views_alias_the_buffer_and_flatten_pads_with_zeros():
    a, b = torch.randn(2, 3), torch.randn(5)
    space = sharded.FlatSpace.of([a, b], size=3)
    flat = space.flatten([a, None], torch.float64)
    assert flat.dtype == torch.float64 and flat.numel() == 12
    assert torch.equal(flat[:6].view(2, 3), a.double()) and not flat[6:].any()
    views = space.views(flat)
    views[1].fill_(7.0)
    assert flat[6:11].eq(7.0).all() and flat[11] == 0
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)


def test_a_flat_space_needs_a_rank():
    with pytest.raises(ValueError, match="at least one rank"):
        sharded.FlatSpace((torch.Size([3]),), size=0)


def test_parameters_become_views_of_their_unit_buffer_and_stage_3_frees_it():
    model = sharded.Sharded(make_mlp(seed=1), MPI.COMM_SELF, stage=3)
    unit = model.units[0]
    assert unit.full.untyped_storage().nbytes() == 0  # stage 3 holds only the shard until forward
    x, y = StressStrainCurves(n=4)[list(range(4))]
    seen = []
    hook = unit.module.register_forward_pre_hook(
        lambda m, a: seen.append(
            (
                m.weight.untyped_storage().data_ptr() == unit.full.untyped_storage().data_ptr(),
                unit.full.untyped_storage().nbytes(),
            )
        )
    )
    squared_error(model(x), y).mean().backward()
    hook.remove()
    assert seen == [(True, unit.full_bytes)]  # gathered for forward (this hook runs after the engine's)
    assert all(u.full.untyped_storage().nbytes() == 0 for u in model.units)
    assert all(u.master.grad is not None and u.master.grad.shape == u.master.shape for u in model.units)
    model.close()


def test_one_rank_trains_as_the_plain_model():
    plain, wrapped = make_mlp(seed=1, dtype=torch.float64), make_mlp(seed=1, dtype=torch.float64)
    model = sharded.Sharded(wrapped, MPI.COMM_SELF, stage=3, prefetch=1)
    optimizers = [
        torch.optim.Adam(plain.parameters(), lr=1e-2),
        model.attach(torch.optim.Adam(model.shards(), lr=1e-2)),
    ]
    data = StressStrainCurves(n=24, dtype=torch.float64)
    for step in range(3):
        x, y = data[list(range(8 * step, 8 * step + 8))]
        for net, optimizer in zip((plain, model), optimizers):
            optimizer.zero_grad()
            squared_error(net(x), y).mean().backward()
            optimizer.step()
    full = model.full_parameters()
    model.close()
    assert all(torch.allclose(full[name], p, rtol=1e-12, atol=0) for name, p in plain.named_parameters())


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="stage must be one of"):
        sharded.Sharded(make_mlp(), MPI.COMM_SELF, stage=4)
    with pytest.raises(ValueError, match="no collectives called 'rings'"):
        sharded.Sharded(make_mlp(), MPI.COMM_SELF, collectives="rings")
    with pytest.raises(ValueError, match="pass units= covering every parameter"):
        mlp = make_mlp()
        sharded.Sharded(mlp, MPI.COMM_SELF, units=[mlp[0]])
    model = sharded.Sharded(make_mlp(), MPI.COMM_SELF)
    with pytest.raises(ValueError, match="build the optimizer on model.shards"):
        model.attach(torch.optim.SGD(make_mlp().parameters(), lr=0.1))
    model.close()


KILLED_WRITER = """
import sys, time
import torch
from mpi4py import MPI
from ddlab import sharded
from ddlab.models import make_mlp

model = sharded.Sharded(make_mlp(seed=1), MPI.COMM_SELF, stage=2)
optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-3))
sharded.save_sharded(sys.argv[1], model, optimizer)  # a whole checkpoint first, then a rewrite that dies


def stuck(target, payload):
    target.with_name(target.name + ".partial").write_bytes(b"half a shard")
    print("writing", flush=True)
    time.sleep(120)


sharded.checkpoint._write = stuck
sharded.save_sharded(sys.argv[1], model, optimizer)
"""


def test_a_checkpoint_whose_writer_was_killed_mid_write_is_refused(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
    finally:
        writer.kill()  # SIGKILL while its shard is half written
        writer.wait()
    assert (tmp_path / "index.json").exists()  # the earlier checkpoint's index is still there...
    model = sharded.Sharded(make_mlp(seed=1), MPI.COMM_SELF, stage=2)
    optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-3))
    with pytest.raises(sharded.CheckpointError, match="no COMMITTED marker"):  # ...but it is not loaded
        sharded.load_sharded(tmp_path, model, optimizer)
    model.close()
