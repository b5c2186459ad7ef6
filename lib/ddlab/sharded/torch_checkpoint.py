"""Checkpoints torch reads: a ddlab sharded checkpoint to and from `torch.distributed.checkpoint` (DCP).

DCP is the format PyTorch's FSDP2 (`fully_shard`) saves and loads: a directory of shard
files and a `.metadata` index, keyed by each tensor's fully qualified name, which any number of
ranks can load (each reads the pieces its own shards need). The state dict FSDP2 writes is

    {"model": {name: parameter},
     "optim": {"state": {name: {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}},
               "param_groups": [{hyperparameters..., "params": [names]}]}}

(`torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`), with each tensor
shaped like its parameter. A ddlab checkpoint keeps instead, per unit, flat shards of the
unit's flat buffer (`checkpoint.py`). The two converters below go from one to the other by
cutting and joining flat buffers at the parameters' offsets: copies only, so every parameter
and every moment is kept bit for bit. Each runs in one process and holds the whole model once
(a course-sized model); the sharded ends stay sharded: ddlab writes and reads its shards on any
rank count (`save_sharded`, `load_sharded`), torch reads and writes DCP on any rank count.

    to_dcp(ddlab_dir, dcp_dir)              # then FSDP2: dcp.load({"model": ..., "optim": ...}, checkpoint_id=dcp_dir)
    from_dcp(dcp_dir, ddlab_dir, [u.names for u in model.units])   # then load_sharded(ddlab_dir, model, optimizer)
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .checkpoint import COMMITTED, INDEX, CheckpointError, _file, _write
from .flat import FlatSpace


def _committed_index(path: Path) -> dict[str, Any]:
    if not (path / COMMITTED).exists():
        raise CheckpointError(
            f"{path} has no {COMMITTED} marker: it is not a whole ddlab checkpoint (a run stopped while "
            "writing, or another format). Convert a committed one."
        )
    return dict(json.loads((path / INDEX).read_text()))


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A saved param group's hyperparameters, lists turned back into the tuples torch uses (betas)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k != "params"}


def to_dcp(src: str | Path, dst: str | Path) -> None:
    """Write the committed ddlab checkpoint `src` (saved on any rank count) as a DCP checkpoint in `dst`."""
    import torch.distributed.checkpoint as dcp

    src = Path(src)
    index = _committed_index(src)
    files = [torch.load(_file(src, q), weights_only=True) for q in range(index["ranks"])]
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    names: list[str] = []
    for i, unit in enumerate(index["units"]):
        pieces = [f[i] for f in files]
        flat = torch.cat([p["master"] for p in pieces])[: unit["numel"]]
        space = FlatSpace(tuple(torch.Size(s) for s in unit["shapes"]), 1)
        flats = {
            key: torch.cat([p["state"][key] for p in pieces])[: unit["numel"]]
            for key, value in pieces[0]["state"].items()
            if isinstance(value, torch.Tensor) and value.shape == pieces[0]["master"].shape
        }
        scalars = {k: v for k, v in pieces[0]["state"].items() if k not in flats}
        for j, name in enumerate(unit["names"]):
            names.append(name)
            model[name] = space.views(flat)[j].clone()
            if pieces[0]["state"]:
                state[name] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}
                state[name].update({k: space.views(v)[j].clone() for k, v in flats.items()})
    groups = [{**_hyperparameters(g), "params": names} for g in index["param_groups"]]
    if len(groups) != 1:
        raise CheckpointError(f"{src} has {len(groups)} param groups: the converter handles one (all shards)")
    with warnings.catch_warnings():  # DCP warns that it writes from one process: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=dst, no_dist=True)


def from_dcp(src: str | Path, dst: str | Path, units: Sequence[Sequence[str]], **state: Any) -> None:
    """Write the DCP checkpoint `src` (FSDP2's {"model", "optim"} state dict) as a ddlab checkpoint in `dst`.

    `units`: each unit's parameter names, in the order of the model that will load it
    (`[unit.names for unit in model.units]`). The ddlab checkpoint is written as if by one
    rank; `load_sharded` recuts it for any rank count. `state`: the caller's (epoch, step...)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / COMMITTED).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=dst) as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(src, whole)
        saved = torch.load(whole, weights_only=False)
    params, optim = saved["model"], saved.get("optim", {"state": {}, "param_groups": [{}]})
    missing = [name for names in units for name in names if name not in params]
    if missing:
        raise CheckpointError(f"{src} has no parameters {missing}: was it saved from the same model?")
    pieces, layouts = [], []
    for names in units:
        tensors = [params[name] for name in names]
        space = FlatSpace.of(tensors, 1)
        moments = [optim["state"].get(name, {}) for name in names]
        keys = set(moments[0])
        if any(set(m) != keys for m in moments):
            raise CheckpointError(f"{src}: the parameters {list(names)} of one unit have different optimizer state")
        unit_state: dict[str, Any] = {}
        for key in sorted(keys):
            values = [m[key] for m in moments]
            if isinstance(values[0], torch.Tensor) and values[0].shape == tensors[0].shape:
                unit_state[key] = space.flatten(values, values[0].dtype)
            elif all(torch.equal(torch.as_tensor(v), torch.as_tensor(values[0])) for v in values):
                unit_state[key] = values[0]
            else:
                raise CheckpointError(f"{src}: {key!r} differs between the parameters {list(names)} of one unit")
        pieces.append({"master": space.flatten(tensors, tensors[0].dtype), "state": unit_state})
        layouts.append(
            {
                "names": list(names),
                "offsets": list(space.offsets),
                "shapes": [list(s) for s in space.shapes],
                "numel": space.numel,
                "shard_numel": space.shard_numel,
                "dtype": str(tensors[0].dtype),
            }
        )
    _write(_file(dst, 0), pieces)
    groups = [_hyperparameters(g) for g in optim["param_groups"]]
    index = {"ranks": 1, "units": layouts, "param_groups": groups, "state": state}
    (dst / INDEX).write_text(json.dumps(index, indent=1))
    (dst / COMMITTED).write_text("1 shards\n")
