"""The lab's GPT trained under each precision recipe, on one process, for the loss curves side by side (lab 18).

Recipes (each AdamW on float32 master weights; what differs is what the forward and backward compute in):

- "float32": everything in float32 (the baseline).
- "bfloat16": a bfloat16 copy of the masters computes forward and backward; the gradients go back
  to float32 for the step.
- "float16": the same in float16 with dynamic loss scaling (`loss_scale_step`); skipped steps counted.
- "float16 unscaled": float16 without loss scaling: small gradients flush to zero.
- "float8 tensor", "float8 delayed", "float8 block": float32 compute whose linear layers see their
  inputs and weights cast to E4M3 and back (emulated float8: cast with scale, cast back, multiply in
  float32), with one scale per tensor, one from a delayed amax history, or per tile and block (DeepSeek-V3's
  1 x 128 tiles and 128 x 128 blocks, shrunk to the small model's width: `tile` and `block`). The backward
  passes gradients straight through the casts (the straight-through estimator); the tied output layer
  and the embeddings stay in float32.

`train_recipe` is `recipe_models` (the float32 masters, and the module that computes: the masters themselves for
float32 and float8, a 16-bit copy for bfloat16 and float16) and `recipe_step` per step; `footprint.measured_bytes`
runs the same two under the memory ledger.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from mpi4py import MPI
from torch import nn
from torch.nn.utils import parametrize

from ..models.gpt import GPT, BatchAt
from ..runtime.memory import Ledger
from .float8 import AmaxHistory, dequantize, quantize_float8
from .scaling import LossScale, loss_scale_step

RECIPES = (
    "float32",
    "bfloat16",
    "float16",
    "float16 unscaled",
    "float8 tensor",
    "float8 delayed",
    "float8 block",
)


class _Float8Cast(nn.Module):
    """x -> x cast to E4M3 and back with its scales; the gradient passes straight through."""

    def __init__(self, scaling: str, block: tuple[int, int]):
        super().__init__()
        self.scaling, self.block = scaling, block
        self.history: AmaxHistory | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        block = (flat.shape[0], flat.shape[1]) if self.scaling in ("tensor", "delayed") else self.block
        amax = None
        if self.scaling == "delayed":
            if self.history is None:  # one amax per tensor, the history started at the first shape seen
                self.history = AmaxHistory((flat.shape[0], flat.shape[1]), length=16)
            amax = self.history.amax(flat.detach())
            self.history.record(flat.detach())
        q, scale = quantize_float8(flat.detach(), torch.float8_e4m3fn, block, amax)
        cast = dequantize(q, scale, block).view_as(x)
        return x + (cast - x).detach()


def _emulate_float8(model: nn.Module, scaling: str, tile: tuple[int, int], block: tuple[int, int]) -> None:
    """Every nn.Linear of model casts its input (per `tile`) and weight (per `block`) to float8 and back."""
    for linear in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        parametrize.register_parametrization(linear, "weight", _Float8Cast(scaling, block))
        caster = _Float8Cast(scaling, tile)
        linear.register_forward_pre_hook(lambda module, args, cast=caster: (cast(args[0]), *args[1:]))


def recipe_models(
    recipe: str, model: GPT, tile: tuple[int, int] = (1, 16), block: tuple[int, int] = (16, 16)
) -> tuple[nn.Module, nn.Module]:
    """(worker, master) of `recipe` for a copy of the float32 `model`: the master holds the float32 weights the
    optimizer steps; the worker computes forward and backward. For "float32" and the float8 recipes they are one
    module (the float8 casts are made from the float32 weights on the fly); for bfloat16 and float16 the worker
    is a copy in that type, which every step refreshes from the masters."""
    if recipe not in RECIPES:
        raise ValueError(f"no recipe {recipe!r}: use one of {RECIPES}")
    master = copy.deepcopy(model).float()
    if recipe.startswith("float8"):
        _emulate_float8(master, recipe.split()[1], tile, block)
    compute = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float16 unscaled": torch.float16}.get(recipe)
    return (master, master) if compute is None else (copy.deepcopy(master).to(compute), master)


def recipe_step(
    recipe: str,
    worker: nn.Module,
    master: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: LossScale,
    x: torch.Tensor,
    y: torch.Tensor,
    ledger: Ledger | None = None,
) -> tuple[float, LossScale, bool]:
    """One step of `recipe` (see `recipe_models`): (the loss, the loss scale's new state, whether it stepped).

    With a `ledger`, what the worker's forward saves for backward is charged to its activations."""
    if worker is not master:
        with torch.no_grad():
            for w, m in zip(worker.parameters(), master.parameters()):
                w.copy_(m)
    worker.zero_grad(set_to_none=True)
    with ledger.activations() if ledger is not None else contextlib.nullcontext():
        _, loss = worker(x, y)
    assert loss is not None
    (loss * state.scale).backward()
    if worker is not master:
        grads = [w.grad if w.grad is not None else torch.zeros_like(w) for w in worker.parameters()]
        if recipe == "float16":
            unscaled, state = loss_scale_step(MPI.COMM_SELF, grads, state)
            if unscaled is None:
                return float(loss.detach().float()), state, False
        else:
            unscaled = [g.float() for g in grads]
        for m, g in zip(master.parameters(), unscaled):
            m.grad = g
    optimizer.step()
    if worker is not master:
        optimizer.zero_grad(set_to_none=True)  # the float32 copies of the gradients live for the step only
    return float(loss.detach().float()), state, True


def train_recipe(
    recipe: str,
    model: GPT,
    batch_at: BatchAt,
    steps: int,
    lr: float = 1e-2,
    tile: tuple[int, int] = (1, 16),
    block: tuple[int, int] = (16, 16),
    initial_scale: float = 2.0**16,
) -> dict[str, Any]:
    """Train a copy of the float32 `model` under `recipe`; {"losses": [...], "skipped": steps skipped}."""
    worker, master = recipe_models(recipe, model, tile, block)
    optimizer = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    state = LossScale(scale=initial_scale if recipe == "float16" else 1.0, interval=20)
    losses, skipped = [], 0
    for step in range(steps):
        loss, state, stepped = recipe_step(recipe, worker, master, optimizer, state, *batch_at(step))
        losses.append(loss)
        skipped += not stepped
    return {"losses": losses, "skipped": skipped, "final_scale": state.scale}
