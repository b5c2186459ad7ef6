"""The same mesh in torch's vocabulary: `init_device_mesh` and DTensor placements beside ddlab's (lab 16).

torch.distributed's `DeviceMesh` numbers its ranks row-major over its named dimensions, as
`ddlab.mesh.Mesh` does over `DIMS`, so `init_device_mesh("cpu", sizes in DIMS order,
mesh_dim_names=DIMS)` puts every rank at the same coordinates, and its dimension groups hold
the same ranks as ddlab's sub-communicators. A DTensor says, per mesh dimension, how a tensor
lies on it: `Replicate()` (every rank the whole), `Shard(k)` (split along tensor dimension k),
`Partial()` (every rank a part of a sum not yet taken). One block of lab 14's GPT on the
(data, tensor) plane, in those words (`BLOCK_PLACEMENTS`):

- the input x: Shard(0) over data (each data rank its samples), Replicate over tensor;
- LayerNorms, the row-parallel layers' biases: Replicate over both;
- q, k, v weights (each (h, h)) and the MLP's first layer (weight and bias): Shard(0) over tensor,
  its output features (column-parallel: heads, hidden features);
- the attention's and the MLP's output projections: Shard(1) over tensor, their input features
  (row-parallel); their output before the sum is Partial over tensor, and the sum (ddlab's
  `Reduce`, an allreduce) makes it Replicate;
- with sequence parallelism the residual stream is Shard(1) over tensor (its sequence rows), and
  that sum is a reduce-scatter to Shard(1) instead.

`dtensor_block` computes a block's output from DTensors so placed (the attention of a rank's
heads on its local shards, as ddlab's `ParallelAttention` does), for comparison with
`ddlab.tensor_parallel.ParallelBlock` on ddlab's mesh. torch.distributed must run (gloo:
`ddlab.data_parallel.torch_ddp.init_gloo`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from ..models.gpt import Block, causal_attention
from .layout import DIMS, Sizes

#: Per tensor of a block, its placement on the (data, tensor) dimensions of the mesh (see the module's docstring).
BLOCK_PLACEMENTS: dict[str, tuple[Placement, Placement]] = {
    "x (input, residual stream)": (Shard(0), Replicate()),
    "ln_1, ln_2 (weight, bias)": (Replicate(), Replicate()),
    "q, k, v weights and biases": (Replicate(), Shard(0)),
    "attention output projection weight": (Replicate(), Shard(1)),
    "attention output before the sum": (Shard(0), Partial()),
    "MLP first layer weight and bias": (Replicate(), Shard(0)),
    "MLP hidden features": (Shard(0), Shard(2)),
    "MLP output projection weight": (Replicate(), Shard(1)),
    "MLP output before the sum": (Shard(0), Partial()),
    "output projections' biases": (Replicate(), Replicate()),
    "block output": (Shard(0), Replicate()),
}


def torch_mesh(sizes: Sizes) -> DeviceMesh:
    """The mesh of torch.distributed's ranks with these sizes, dimensions named as `DIMS` (in that order)."""
    return init_device_mesh("cpu", tuple(sizes[name] for name in DIMS), mesh_dim_names=DIMS)


def _on_tensor(whole: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    """The whole tensor (the same on every rank) laid out on the mesh's tensor dimension, replicated on the others."""
    placements = [placement if name == "tensor" else Replicate() for name in DIMS]
    return distribute_tensor(whole.detach(), mesh, placements)


def dtensor_block(block: Block, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A block's output for this data rank's samples x (B_r, T, h), from its weights as DTensors on `mesh`
    (Shard(0) column-parallel, Shard(1) row-parallel over "tensor"). The two sums over the tensor ranks are
    `Partial` -> `Replicate` redistributions. Without dropout."""
    attn, mlp, h = block.attn, block.mlp, block.config.n_embd
    heads = mesh["tensor"].size()
    if block.config.n_head % heads:
        raise ValueError(f"{block.config.n_head} heads do not split evenly over {heads} tensor ranks")
    assert attn.proj.bias is not None and mlp.fc.bias is not None and mlp.proj.bias is not None
    q, k, v = (_on_tensor(w, mesh, Shard(0)).to_local() for w in attn.qkv.weight.split(h))  # each rank: its heads' rows
    qb, kb, vb = (
        (_on_tensor(b, mesh, Shard(0)).to_local() for b in attn.qkv.bias.split(h))
        if attn.qkv.bias is not None
        else (None, None, None)
    )
    normed = block.ln_1(x)
    mine = causal_attention(
        F.linear(normed, q, qb),
        F.linear(normed, k, kb),
        F.linear(normed, v, vb),
        block.config.n_head // heads,
        0.0,
        None,
        0,
    )
    proj = _on_tensor(attn.proj.weight, mesh, Shard(1)).to_local()
    partial = DTensor.from_local(F.linear(mine, proj), mesh, _placements(Partial()))
    x = x + partial.redistribute(mesh, _placements(Replicate())).to_local() + attn.proj.bias
    fc_w = _on_tensor(mlp.fc.weight, mesh, Shard(0)).to_local()
    fc_b = _on_tensor(mlp.fc.bias, mesh, Shard(0)).to_local()
    out_w = _on_tensor(mlp.proj.weight, mesh, Shard(1)).to_local()
    partial = DTensor.from_local(
        F.linear(F.gelu(F.linear(block.ln_2(x), fc_w, fc_b)), out_w), mesh, _placements(Partial())
    )
    y = x + partial.redistribute(mesh, _placements(Replicate())).to_local() + mlp.proj.bias
    return DTensor.from_local(y, mesh, [Shard(0) if name == "data" else Replicate() for name in DIMS])


def _placements(on_tensor: Placement) -> list[Placement]:
    """A rank's activation: Shard(0) over data (its samples), `on_tensor` over tensor, Replicate elsewhere."""
    return [Shard(0) if name == "data" else on_tensor if name == "tensor" else Replicate() for name in DIMS]
