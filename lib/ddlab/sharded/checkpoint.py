"""Sharded checkpoints: every rank writes its own shards; any number of ranks reads them back.

A checkpoint is a directory:
- `shard-<q>.pt`, one per rank q that wrote it: for each unit, rank q's master shard and
  its optimizer state (each tensor the shard's shape: Adam's two moments, SGD's
  momentum; scalars such as Adam's step count alike on every rank);
- `index.json`, written by rank 0: the rank count, for each unit its parameters (name,
  offset in the flat buffer, shape), length N, shard length and dtype, the optimizer's
  hyperparameters and the caller's `state` (epoch, step...);
- `COMMITTED`, written last, by rank 0, only after every rank has reported its file
  written, flushed to disk and renamed into place.

Loading on P' ranks recuts each unit: new rank r needs items [r s', (r+1) s') of the
flat buffer (s' = ceil(N / P')), so it reads only the old shards that overlap them and
copies the pieces; the new padding is zeros. No arithmetic touches the values, so the
parameters and optimizer state come back bit for bit. A directory without COMMITTED
(a run killed while writing, or one still writing) is refused, never read in part;
writing starts by removing COMMITTED, so a rewrite interrupted halfway is refused too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..runtime.counting import underlying
from .hybrid import HybridSharded
from .zero import Sharded

INDEX, COMMITTED = "index.json", "COMMITTED"


class CheckpointError(RuntimeError):
    """A sharded checkpoint that cannot be loaded (not committed, or made for another model)."""


def _file(path: Path, rank: int) -> Path:
    return path / f"shard-{rank:05d}.pt"


def _write(target: Path, payload: Any) -> None:
    """torch.save to a temporary name, flushed to disk, then renamed: a file is whole or absent."""
    partial = target.with_name(target.name + ".partial")
    with open(partial, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, target)


def _agree(model: Sharded, problem: str | None, doing: str) -> None:
    """Raise the same error on every rank if any rank had a problem."""
    problems = [p for p in underlying(model.comm).allgather(problem) if p]
    if problems:
        raise OSError(f"{doing} failed: " + "; ".join(problems))


def save_sharded(path: str | Path, model: Sharded, optimizer: torch.optim.Optimizer, **state: Any) -> None:
    """Every rank writes its shards and their optimizer state; rank 0 the index, then COMMITTED (collective).

    A `HybridSharded` model's groups hold the same shards: the first group writes, every other
    rank returns once it has committed."""
    path, rank, comm = Path(path), model.rank, underlying(model.comm)
    replicas = underlying(model.replicate_comm) if isinstance(model, HybridSharded) else None
    if replicas is not None and replicas.Get_rank() != 0:
        model.synchronize()
        replicas.Barrier()  # returns once the first group's rank of this shard is past its commit
        return
    model.synchronize()
    problem = None
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / COMMITTED).unlink(missing_ok=True)
            for old in path.glob("shard-*.pt"):
                old.unlink()
        except OSError as err:
            problem = f"rank 0 could not prepare {path}: {err}"
    _agree(model, problem, "saving the checkpoint")
    problem = None
    try:
        units = [
            {
                "master": unit.master.detach().clone(),
                "state": {
                    k: v.clone() if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state.get(unit.master, {}).items()
                },
            }
            for unit in model.units
        ]
        _write(_file(path, rank), units)
    except (OSError, RuntimeError) as err:
        problem = f"rank {rank} could not write its shard: {err}"
    _agree(model, problem, "saving the checkpoint")
    if rank == 0:
        index = {
            "ranks": model.size,
            "units": [
                {
                    "names": unit.names,
                    "offsets": list(unit.space.offsets),
                    "shapes": [list(s) for s in unit.space.shapes],
                    "numel": unit.space.numel,
                    "shard_numel": unit.space.shard_numel,
                    "dtype": str(unit.master.dtype),
                }
                for unit in model.units
            ],
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
            "state": state,
        }
        (path / INDEX).write_text(json.dumps(index, indent=1))
        (path / COMMITTED).write_text(f"{model.size} shards\n")  # last: the checkpoint is whole from here on
    comm.Barrier()
    if replicas is not None:
        replicas.Barrier()


def _unit_layout(model: Sharded) -> list[dict[str, Any]]:
    return [
        {"names": u.names, "shapes": [list(s) for s in u.space.shapes], "dtype": str(u.master.dtype)}
        for u in model.units
    ]


def load_sharded(path: str | Path, model: Sharded, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a committed checkpoint written on any rank count into this model's shards and optimizer; returns `state`."""
    path = Path(path)
    if not (path / COMMITTED).exists():
        raise CheckpointError(
            f"{path} has no {COMMITTED} marker: the run that wrote it stopped before every rank "
            "had finished (or is still writing), so its shards may be missing or stale. Load an "
            "earlier checkpoint."
        )
    index = json.loads((path / INDEX).read_text())
    saved = [{"names": u["names"], "shapes": u["shapes"], "dtype": u["dtype"]} for u in index["units"]]
    if saved != _unit_layout(model):
        raise CheckpointError(
            f"{path} was written for other units or parameters than this model's: build the "
            "model with the same units (names, shapes and dtype) as the one that saved it"
        )
    files: dict[int, list[dict[str, Any]]] = {}

    def shard_of(q: int) -> list[dict[str, Any]]:  # read each old rank's file once, and only if needed
        if q not in files:
            files[q] = torch.load(_file(path, q), weights_only=True)
        return files[q]

    for i, (unit, layout) in enumerate(zip(model.units, index["units"])):
        old, new = layout["shard_numel"], unit.space.shard_numel
        start, stop = model.rank * new, min((model.rank + 1) * new, unit.space.numel)
        master = torch.zeros_like(unit.master)
        moments: dict[str, Any] = {}
        for q in range(start // old, -(-stop // old)) if stop > start else ():
            piece = shard_of(q)[i]
            lo, hi = max(start, q * old), min(stop, (q + 1) * old)
            master[lo - start : hi - start] = piece["master"][lo - q * old : hi - q * old]
            for key, value in piece["state"].items():
                if isinstance(value, torch.Tensor) and value.shape == piece["master"].shape:
                    moments.setdefault(key, torch.zeros_like(master, dtype=value.dtype))
                    moments[key][lo - start : hi - start] = value[lo - q * old : hi - q * old]
                else:
                    moments.setdefault(key, value)
        if not moments:  # a rank whose shard is all padding: the scalars are alike everywhere, take rank 0's
            moments = {
                k: v for k, v in shard_of(0)[i]["state"].items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)
            }
            moments.update(
                {
                    k: torch.zeros_like(master, dtype=v.dtype)
                    for k, v in shard_of(0)[i]["state"].items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                }
            )
        with torch.no_grad():
            unit.master.copy_(master)
        if moments:
            optimizer.state[unit.master] = moments
    for group, saved_group in zip(optimizer.param_groups, index["param_groups"]):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved_group.items()})
    model.refresh()
    return index["state"]
