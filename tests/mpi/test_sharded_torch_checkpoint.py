"""ddlab's sharded checkpoints and torch's: saved by ddlab on every rank, loaded by FSDP2 on 2 (gloo);
saved by FSDP2 on 2, loaded by ddlab on 3 (or every rank); parameters and Adam's moments bit for bit.

Every rank runs every test; subsets of ranks compute, and every rank asserts on values agreed
with collectives, so a failure never leaves a rank waiting.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from ddlab import sharded
from ddlab.data import StressStrainCurves
from ddlab.data_parallel import close_gloo, init_gloo, squared_error
from ddlab.models import make_mlp
from ddlab.runtime.comm import first_ranks
from mpi4py import MPI
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

PER_RANK, STEPS = 6, 3
HIDDEN = (48, 32, 17)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, comm: MPI.Comm) -> None:
    data = StressStrainCurves(n=comm.Get_size() * PER_RANK * STEPS, seed=3, dtype=torch.float64)
    for step in range(STEPS):
        first = (step * comm.Get_size() + comm.Get_rank()) * PER_RANK
        x, y = data[np.arange(first, first + PER_RANK)]
        optimizer.zero_grad()
        squared_error(model(x), y).mean().backward()
        optimizer.step()


def ddlab_state(model: sharded.Sharded, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its Adam state by name, gathered from the shards (collective)."""
    model.synchronize()
    out = {}
    for unit in model.units:
        pieces = {"param": unit.master.detach()} | dict(optimizer.state[unit.master])
        for key, value in pieces.items():
            if value.dim() == 0:
                out.update({f"{name}.{key}": value.clone() for name in unit.names})
                continue
            flat = torch.from_numpy(np.concatenate(model.comm.allgather(value.numpy().copy())))
            out.update({f"{n}.{key}": v.clone() for n, v in zip(unit.names, unit.space.views(flat))})
    return out


def fsdp2(comm: MPI.Comm, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    init_gloo(comm)
    model = sharded.torch_fsdp(make_mlp(seed=seed, dtype=torch.float64, hidden=HIDDEN))
    return model, adam(model.parameters())


def fsdp2_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its Adam state by name, whole (a collective on gloo)."""
    params, optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out = {f"{name}.param": p.clone() for name, p in params.items()}
    for name, state in optim["state"].items():
        out.update({f"{name}.{key}": v.clone() for key, v in state.items()})
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return (
        bool(want)
        and got.keys() == want.keys()
        and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    )


def test_saved_by_ddlab_on_every_rank_loaded_by_fsdp2_on_two(comm, tmp_path_factory):
    root = comm.bcast(str(tmp_path_factory.mktemp("to_torch")) if comm.Get_rank() == 0 else None)
    model = sharded.Sharded(make_mlp(seed=1, dtype=torch.float64, hidden=HIDDEN), comm, stage=3)
    optimizer = model.attach(adam(model.shards()))
    train(model, optimizer, comm)
    expected = ddlab_state(model, optimizer)
    sharded.save_sharded(f"{root}/ddlab", model, optimizer, step=STEPS)
    model.close()
    if comm.Get_rank() == 0:
        sharded.to_dcp(f"{root}/ddlab", f"{root}/dcp")
    comm.Barrier()
    ok = True
    sub = first_ranks(comm, 2)
    if sub is not None:
        fsdp, adam_ = fsdp2(sub, seed=5)  # other initial values: everything must come from the checkpoint
        params, optim = get_state_dict(fsdp, adam_)
        dcp.load({"model": params, "optim": optim}, checkpoint_id=f"{root}/dcp")
        set_state_dict(fsdp, adam_, model_state_dict=params, optim_state_dict=optim)
        ok = same(fsdp2_state(fsdp, adam_), expected) and adam_.param_groups[0]["weight_decay"] == 1e-3
        train(fsdp, adam_, sub)  # and it trains on from there
        close_gloo()
        sub.Free()
    assert comm.allreduce(int(ok), op=MPI.MIN) == 1


def test_saved_by_fsdp2_on_two_ranks_loaded_by_ddlab_on_three(comm, tmp_path_factory):
    root = comm.bcast(str(tmp_path_factory.mktemp("from_torch")) if comm.Get_rank() == 0 else None)
    expected = None
    sub = first_ranks(comm, 2)
    if sub is not None:
        fsdp, adam_ = fsdp2(sub, seed=1)
        train(fsdp, adam_, sub)
        params, optim = get_state_dict(fsdp, adam_)
        dcp.save({"model": params, "optim": optim}, checkpoint_id=f"{root}/dcp")
        expected = fsdp2_state(fsdp, adam_)
        close_gloo()
        sub.Free()
    expected = comm.bcast(expected)
    ok = True
    sub = first_ranks(comm, min(3, comm.Get_size()))
    if sub is not None:
        model = sharded.Sharded(make_mlp(seed=5, dtype=torch.float64, hidden=HIDDEN), sub, stage=2)
        optimizer = model.attach(adam(model.shards()))
        if sub.Get_rank() == 0:
            sharded.from_dcp(f"{root}/dcp", f"{root}/ddlab", [u.names for u in model.units], step=STEPS)
        sub.Barrier()
        state = sharded.load_sharded(f"{root}/ddlab", model, optimizer)
        ok = same(ddlab_state(model, optimizer), expected) and state == {"step": STEPS}
        ok &= optimizer.param_groups[0]["betas"] == (0.9, 0.999) and optimizer.param_groups[0]["weight_decay"] == 1e-3
        model.close()
        sub.Free()
    assert comm.allreduce(int(ok), op=MPI.MIN) == 1
