"""Bytes per parameter and per activation of each of lab 18's recipes: counted by the ledger, predicted by the oracle.

`measured_bytes` runs steps of a recipe as `train_recipe` does (`recipe_models`, `recipe_step`; float16's loss
scale starting lower, so that its steps are taken and Adam's state exists) with a
`ddlab.runtime.memory.Ledger` watching the module that computes, and returns per parameter the bytes of

- weights: the copy the layers compute with (the worker's parameters);
- gradients: the worker's gradients, as backward leaves them;
- masters: float32 weights kept apart from those (bfloat16 and float16 only; 0 where the weights are the masters);
- states: AdamW's state (two float32 moments per parameter, and a step count per tensor);

and the bytes autograd saves for backward: per token of one block (`block`, the mean over the blocks, each
measured around its own forward), the same per activation element of a block as Korthikanti et al. count
them (`per element`: `block` over the elements `layer_activations` counts at one byte each), and for the
whole forward of the batch (`activations`).

`predicted_bytes` gives the same from the transformer oracle (`ddlab.oracle.transformer`) for the same GPT and
recipe, the recipe given as a `Precision` (`PRECISIONS`): per parameter its weights, gradients and optimizer
bytes (Adam's two float32 moments, 8 bytes, are the states; the rest of the optimizer's bytes the masters:
Rajbhandari et al., "ZeRO", SC 2020, section 3.1, K = 12 = 4 + 4 + 4), per token and block Korthikanti et al.'s
terms (`layer_activations`, MLSys 2023, section 4, no dropout here), and for the whole forward `rank_memory`'s
activations (the blocks' and the loss's copies of the logits).

What the two leave apart, and why (`tests/test_precision.py` holds each to it):
- every block also saves its two LayerNorms' mean and reciprocal deviation, in the compute type (4 elements per
  token: 16 bytes in float32, 8 in bfloat16 or float16), which Korthikanti et al. do not count;
- the float8 recipes are emulated: each linear layer saves the float32 cast of its input (4 bytes an element,
  as the oracle's float32 activations predict) and also the float32 cast of its weight (4 bytes per weight of
  every linear layer, a copy the oracle does not know of);
- the whole forward also keeps the token ids and targets (int64), the final LayerNorm's input and output and
  statistics; the bfloat16 and float16 GPTs keep their loss's softmax in 16 bits, where the oracle counts the
  loss's peak, a float32 copy of the logits beside the 16-bit ones (`oracle.transformer.LOSSES`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.gpt import GPT, Block, GPTConfig
from ..oracle.transformer import GPT as OracleGPT
from ..oracle.transformer import Layout, Precision, layer_activations, rank_memory
from ..runtime.memory import Ledger, tensor_bytes
from .recipes import RECIPES, recipe_models, recipe_step
from .scaling import LossScale

#: Each recipe as the oracle takes it: what the lab's run of it keeps (float8 emulated: float32 weights cast
#: on the fly, float32 activations, the linear layers at float8's rate).
PRECISIONS = {
    "float32": Precision(4, 4, 8, 4, 4, 4, "fp32"),
    "bfloat16": Precision(2, 2, 12, 2, 2, 2, "bf16"),
    "float16": Precision(2, 2, 12, 2, 2, 2, "bf16"),
    "float16 unscaled": Precision(2, 2, 12, 2, 2, 2, "bf16"),
    "float8 tensor": Precision(4, 4, 8, 4, 4, 4, "fp8"),
    "float8 delayed": Precision(4, 4, 8, 4, 4, 4, "fp8"),
    "float8 block": Precision(4, 4, 8, 4, 4, 4, "fp8"),
}
#: Adam's two float32 moments per parameter, in every recipe.
ADAM_STATE = 8.0
PARTS = ("weights", "gradients", "masters", "states")


def oracle_gpt(config: GPTConfig) -> OracleGPT:
    """The oracle's GPT of the lab's `GPTConfig` (its dropout, biases and tied output layer too)."""
    return OracleGPT(
        layers=config.n_layer,
        hidden=config.n_embd,
        heads=config.n_head,
        seq=config.block_size,
        vocab=config.vocab_size,
        tied=config.tied,
        bias=config.bias,
        dropout=config.dropout > 0,
    )


def block_elements(config: GPTConfig, batch: int) -> float:
    """The activation elements one block keeps for backward, as Korthikanti et al. count them (1 byte each)."""
    gpt = oracle_gpt(config)
    return layer_activations(gpt, gpt.seq, batch, 1, False, 1, "none", False, "local")


def predicted_bytes(recipe: str | Precision, config: GPTConfig, batch: int) -> dict[str, float]:
    """The oracle's bytes for a batch of `batch` sequences of config.block_size tokens on one process (see the
    module's docstring): per parameter "weights", "gradients", "masters", "states"; "block" per token, "per element";
    "activations"."""
    prec = recipe if isinstance(recipe, Precision) else PRECISIONS[recipe]
    gpt = oracle_gpt(config)
    layout = Layout(batch=batch, micro_batch=batch, precision=prec)
    block = layer_activations(gpt, gpt.seq, batch, 1, False, prec.activations, "none", False, "local")
    return {
        "weights": prec.weights,
        "gradients": prec.gradients,
        "masters": prec.optimizer - ADAM_STATE,
        "states": ADAM_STATE,
        "block": block / (gpt.seq * batch),
        "per element": prec.activations,
        "activations": rank_memory(gpt, layout)["activations"],
    }


def measured_bytes(
    recipe: str,
    model: GPT,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int = 2,
    initial_scale: float = 2.0**10,
    tile: tuple[int, int] = (1, 16),
    block: tuple[int, int] = (16, 16),
) -> dict[str, float]:
    """The ledger's bytes of `steps` steps of `recipe` on the batch (x, y), as `predicted_bytes` gives them."""
    if recipe not in RECIPES:
        raise ValueError(f"no recipe {recipe!r}: use one of {RECIPES}")
    worker, master = recipe_models(recipe, model, tile, block)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3, weight_decay=0.0)
    ledger = Ledger()
    ledger.watch(worker, optimizer)
    blocks = [b for b in worker.modules() if isinstance(b, Block)]
    saved: list[int] = []
    before: dict[int, int] = {}

    def enter(module: nn.Module, _: object) -> None:
        before[id(module)] = ledger.used["activations"]

    def leave(module: nn.Module, _: object, __: object) -> None:
        saved.append(ledger.used["activations"] - before[id(module)])

    hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    state = LossScale(scale=initial_scale if recipe == "float16" else 1.0, interval=20)
    taken = 0
    for _ in range(steps):
        _, state, stepped = recipe_step(recipe, worker, master, optimizer, state, x, y, ledger)
        taken += stepped
    for hook in hooks:
        hook.remove()
    ledger.close()
    if not taken:
        raise ValueError(f"every one of the {steps} steps overflowed at scale {initial_scale:g}: use a smaller one")
    n = sum(p.numel() for p in worker.parameters())
    masters = 0 if master is worker else sum(tensor_bytes(p) for p in master.parameters())
    return {
        "weights": ledger.used["parameters"] / n,
        "gradients": ledger.peak["gradients"] / n,
        "masters": masters / n,
        "states": tensor_bytes(list(optimizer.state.values())) / n,
        "block": sum(saved) / len(saved) / x.numel(),
        "per element": sum(saved) / len(saved) / block_elements(model.config, len(x)),
        "activations": float(ledger.peak["activations"]),
    }
