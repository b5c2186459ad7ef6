"""The transformer oracle on this machine: lab 16's mesh layouts predicted, to set beside what they measure.

`ddlab.oracle.transformer` prices a GPT step from its sizes and a platform. Here the GPT is
lab 16's (`GPTConfig`, untied output layer, no dropout, float32 or float64 AdamW) on the
mesh of `ddlab.mesh.train_on_mesh`, and the platform is this machine's, measured as lab 09
measures it, with two inputs more for this GPT: its compute rate and its cost per layer step.

Time (`mesh_time`): the parts of `step_time` (Narayanan et al., SC 2021: the iteration's
FLOPs, 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without recomputation, over the N ranks;
lab 07's bubble, (p - 1)/m of the compute, or (p - 1)/(v m) with the interleaved schedule's v chunks
per rank (`MeshCase.virtual`, section 2.2.2 of the same paper, v times the pipeline's messages);
each dimension's collectives priced by lab 09's measured curves; with c context ranks, ring attention's messages instead of `step_time`'s
collectives for them, `ring_time`: per layer and micro-batch c - 1 key/value blocks forward,
c - 1 backward and c of their gradients, each priced by the measured ping-pong curve; the
zig-zag layout gives every context rank 1/c of the causal work, so the FLOPs are split over
all N = d t p c ranks like the others; the attention's part of them a context rank runs in lab 15's
blockwise NumPy code instead, which is timed alone as the GPT is: `ring_arithmetic`), with two inputs
measured on this machine for this GPT, the same for
every layout (`calibrate`, from one process training it alone, at the whole batch B and
at B/P): the FLOP rate, and the seconds the implementation spends per layer and
micro-batch whatever their size (Python, kernel launches, the optimizer's loop: at lab 16's
sizes as much as the arithmetic). A tensor-parallel (or context-parallel) rank runs every layer of its
stage for 1/t (1/c) of the FLOPs, so it pays that cost whole. The ranks share the cores: the compute is
slowed by the contention measured with every rank training at once, at the number of
ranks computing at once on average (all but the bubble's, as lab 09's pipeline), and every
blocking exchange the step makes (`exchanges`) pays the platform's `sync` in that share
(lab 09: a partner that is not running must be scheduled before it answers).

Memory (`rank_memory_local`): per world rank, what `ddlab.runtime.memory.Ledger` counts
in a run, in the same four parts:

- parameters: the exact elements of the rank's stage after the tensor split (lab 14:
  the q/k/v and first MLP layers split by columns, the projections by rows, their biases,
  the LayerNorms and the position embedding whole; the word embedding and the untied
  output layer split by vocabulary), times the element size;
- gradients: the same bytes (one gradient per parameter, charged at its first backward);
- optimizer: AdamW's two moments (2 elements per parameter) and its step count, a 4-byte
  float32 tensor per parameter tensor (Rajbhandari et al., SC 2020, count 8 bytes per
  parameter of float32 Adam state; the step counts are what the ledger sees beside them);
- activations: what autograd saves, each storage once, for the micro-batches in flight
  (1F1B: min(p - stage, m) on stage `stage`, lab 07; the interleaved schedule's v chunks per rank:
  its op list walked, each (chunk, micro-batch) held from its forward to its backward, the peak
  taken, since the warm-up keeps more in flight and the chunks save different bytes: only the first
  virtual stage keeps the token ids, only the last the logits), per layer and token, in elements:
  4h whole (the LayerNorms' and the column-parallel layers' inputs) + 12h/t (q, k, v, the
  projection's input, the GELU's and the second MLP layer's inputs) + a s/t (the softmax's
  output; with context parallelism ring attention keeps instead its output and log-sum-exp,
  (h + a)/t, and s is the rank's s/c rows: `attention_elements`): Korthikanti et al.'s
  terms (MLSys 2023, section 4) without dropout, so without its masks and its second copy
  of the probabilities; and what they do not count: the
  LayerNorms' mean and reciprocal deviation (2 per token each), the first stage's token
  ids (int64), their vocabulary mask (bool) and positions (int64), the last stage's final
  LayerNorm input and statistics, the output layer's input, its logits' softmax (s V / t
  per sequence) and the targets (int64, twice).

Checked against the ledger on every 4-rank layout (float32 and float64; with context too, by
bench/mesh.py): equal to the byte on one process and on the ranks of the first tensor coordinate;
the other tensor ranks measure a few hundred bytes less (under 0.3% at lab 16's sizes). A block's
saved tensors with local and with ring attention are tested to the byte on one process.

ZeRO on the data dimension (`MeshCase.zero` 1-3, lab 13's `Sharded`, one unit per embedding,
block and head): the state is split as Rajbhandari et al. (SC 2020, section 5) split it (the
optimizer state over the data ranks in every stage, the gradients from stage 2, the parameters
in stage 3), but the engine also moves bytes in and out during the step (gathered units, flat
gradient buffers in flight), so `zero_memory` walks a step as the engine does and returns the
ledger's parts at its peak: equal to the ledger's to the byte on every rank of 4 and 3 data
ranks with padded shards, float32 and float64 (tests/mpi/test_oracle_zero.py). Time: the data part is the engine's own collectives, unit by unit
(`zero_collectives`: reduce-scatters of the gradients, and in stage 3 allgathers of the
parameters; stages 1-2 allgather after the step, behind `train_on_mesh`'s barrier), each priced
by the platform's measured curves, and each is a blocking exchange (`exchanges`). The engine's
own work (flat copies, hooks, the optimizer on shards) is not an input yet (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

from ..context_parallel import all_positions, attend_block, attend_block_backward, empty_partial, finish, merge_partials
from ..mesh import train_on_mesh
from ..mesh.layout import coordinates
from ..model_parallel import polite_barrier
from ..models.gpt import BatchAt
from ..pipeline import interleaved_1f1b, one_f_one_b, virtual_stage
from ..runtime.blocks import block_range
from ..sharded.zero import REDUCES_IN_FLIGHT
from .measure import SIZES, measure_platform, measure_sync
from .platform import Platform
from .strategies import sync_share
from .transformer import GPT, PRECISIONS, Layout, iteration_flops, step_time
from .validate import accuracy

#: A fresh GPT (the same weights every call), as `ddlab.models.gpt.make_gpt` makes it.
MakeModel = Callable[[], Any]
_PRECISION = {4: "fp32", 8: "fp64"}


@dataclass(frozen=True)
class MeshCase:
    """One `train_on_mesh` run: data x tensor x pipeline (x context) ranks, micro-batches, global batch, sequence,
    element bytes."""

    data: int
    tensor: int
    pipeline: int
    batch: int
    seq: int
    micro_batches: int = 1
    element_bytes: int = 4
    context: int = 1
    zero: int = 0  # 0: lab 04's gradient averaging over the data ranks; 1-3: lab 13's Sharded over them
    virtual: int = 1  # v model chunks per pipeline rank: the interleaved 1F1B schedule when above 1

    def __post_init__(self) -> None:
        if self.element_bytes not in _PRECISION:
            raise ValueError(f"element_bytes is 4 (float32) or 8 (float64), got {self.element_bytes}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero is 0 (plain data parallelism) or a ZeRO stage 1, 2, 3, got {self.zero!r}")
        if self.zero and self.context > 1:
            raise ValueError("ZeRO is predicted with context = 1 only (its shards would span data x context)")
        if min(self.data, self.tensor, self.pipeline, self.context, self.micro_batches, self.batch, self.seq) < 1:
            raise ValueError(f"every size must be at least 1: {self}")
        if self.virtual < 1 or (self.virtual > 1 and self.zero):
            raise ValueError(f"virtual is 1 or more model chunks per pipeline rank, and 1 with ZeRO: {self}")
        if self.virtual > 1 and self.micro_batches % self.pipeline:
            raise ValueError(
                f"the interleaved schedule takes micro-batches in groups of p = {self.pipeline}: "
                f"use a multiple of {self.pipeline}, got {self.micro_batches}"
            )
        if self.context > 1 and self.seq % (2 * self.context):
            raise ValueError(
                f"a sequence of {self.seq} does not split into 2 x {self.context} zig-zag chunks: "
                f"use a multiple of {2 * self.context}"
            )
        if self.batch % (self.data * self.micro_batches):
            raise ValueError(
                f"a batch of {self.batch} does not split into {self.data} data ranks x {self.micro_batches} "
                f"micro-batches: use a multiple of {self.data * self.micro_batches}"
            )

    @property
    def sizes(self) -> dict[str, int]:
        return {"pipeline": self.pipeline, "data": self.data, "context": self.context, "tensor": self.tensor}

    @property
    def ranks(self) -> int:
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def label(self) -> str:
        """As `MeshRun.label`: data x tensor x pipeline, x context when it is used, the ZeRO stage if any, and
        v chunks if interleaved."""
        base = f"{self.data}x{self.tensor}x{self.pipeline}" + (f"x{self.context}" if self.context > 1 else "")
        return base + (f" ZeRO-{self.zero}" if self.zero else "") + (f" v{self.virtual}" if self.virtual > 1 else "")

    def layout(self) -> Layout:
        """The oracle's Layout: micro-batches of B / (d m) sequences, no recomputation, the run's precision."""
        return Layout(
            data=self.data,
            tensor=self.tensor,
            pipeline=self.pipeline,
            context=self.context,
            micro_batch=self.batch // (self.data * self.micro_batches),
            batch=self.batch,
            precision=_PRECISION[self.element_bytes],
            zero=self.zero,
            interleave=self.virtual,
        )


def case_of(
    sizes: dict[str, int],
    batch: int,
    seq: int,
    micro_batches: int = 1,
    element_bytes: int = 4,
    zero: int = 0,
    virtual: int = 1,
) -> MeshCase:
    """The MeshCase of a layout given as `ddlab.mesh.layouts` gives it, with ZeRO stage `zero` on its data ranks
    and `virtual` model chunks per pipeline rank."""
    return MeshCase(
        sizes["data"],
        sizes["tensor"],
        sizes["pipeline"],
        batch,
        seq,
        micro_batches,
        element_bytes,
        context=sizes.get("context", 1),
        zero=zero,
        virtual=virtual,
    )


def rank_parameters(config: Any, case: MeshCase, stage: int, tensor_rank: int) -> tuple[int, int]:
    """(elements, parameter tensors) the rank of pipeline stage `stage` and tensor rank `tensor_rank` holds."""
    h, t, bias = config.n_embd, case.tensor, int(config.bias)
    head = h // config.n_head
    heads = len(block_range(config.n_head, tensor_rank, t))
    features = len(block_range(4 * h, tensor_rank, t))
    vocab = len(block_range(config.vocab_size, tensor_rank, t))
    norm = (h + bias * h, 1 + bias)  # a LayerNorm: elements, tensors
    attention = 3 * heads * head * (h + bias) + heads * head * h + bias * h  # qkv rows, proj columns, proj bias
    mlp = features * (h + bias) + features * h + bias * h
    block = (2 * norm[0] + attention + mlp, 2 * norm[1] + 4 + 4 * bias)
    layers = len(block_range(config.n_layer, stage, case.pipeline))
    elements, tensors = layers * block[0], layers * block[1]
    if stage == 0:  # word embedding (its vocabulary rows) and position embedding
        elements, tensors = elements + vocab * h + config.block_size * h, tensors + 2
    if stage == case.pipeline - 1:  # final LayerNorm, the output layer's vocabulary rows
        elements, tensors = elements + norm[0] + vocab * h, tensors + norm[1] + 1
    return elements, tensors


def activation_elements(config: Any, case: MeshCase, stage: int, tensor_rank: int, chunk: int = 0) -> dict[str, float]:
    """Per micro-batch, what autograd saves on that rank (on its chunk `chunk`, virtual stage chunk x p + stage,
    with the interleaved schedule): float elements, and the integer ids' and masks' bytes."""
    b, h, t = case.batch // (case.data * case.micro_batches), config.n_embd, case.tensor
    s = case.seq // case.context  # the rank's rows of each sequence
    tokens = s * b
    stages, index = case.pipeline * case.virtual, virtual_stage(case.pipeline, stage, chunk)
    layers = len(block_range(config.n_layer, index, stages))
    floats, other = layers * layer_elements(config, case), 0.0
    if index == 0:
        other += 8 * tokens + tokens + 8 * s  # token ids (int64), vocabulary mask (bool), positions (int64)
    if index == stages - 1:
        vocab = len(block_range(config.vocab_size, tensor_rank, t))
        floats += tokens * (2 * h + 2 + vocab)  # ln_f input + stats, the output layer's input, the softmax
        other += 2 * 8 * tokens  # the targets, twice (int64)
    return {"floats": floats, "other bytes": other}


def layer_elements(config: Any, case: MeshCase) -> float:
    """Float elements a block keeps per micro-batch on a rank: Korthikanti et al.'s terms without dropout
    (4h whole, 12h/t split, the attention's), and the LayerNorms' statistics (4 per token)."""
    b, h, t = case.batch // (case.data * case.micro_batches), config.n_embd, case.tensor
    tokens = b * case.seq // case.context
    return tokens * (4 * h + 12 * h / t + 4) + attention_elements(config, case)


def attention_elements(config: Any, case: MeshCase) -> float:
    """Elements a layer's attention keeps per micro-batch beyond q, k, v and the projection's input.

    Local attention (context 1) keeps its softmax, a s / t per token; ring attention (lab 15's
    `RingAttention`) keeps instead its output, h / t per token (the projection's input is a copy
    of it), and its log-sum-exp, a / t per token, of the rank's s / c tokens: no s x s matrix."""
    b, h, a, t = case.batch // (case.data * case.micro_batches), config.n_embd, config.n_head, case.tensor
    s = case.seq // case.context
    return b * s * (a * s / t if case.context == 1 else h / t + a / t)


@dataclass(frozen=True)
class ZeroUnit:
    """One of lab 13's units on a rank (`GPTStage.units`), per micro-batch: what it saves, what its backward does.

    backward: in the order autograd runs it, ("free", bytes) when a node drops what it saved,
    ("grad", elements) when a parameter's gradient is accumulated (autograd accumulates a
    parameter's gradient right after the node that computes it, once that node has dropped
    its saved tensors). saved: the bytes of its "free"s; loss: the bytes the loss saves after it."""

    elements: int
    tensors: int
    backward: tuple[tuple[str, float], ...]
    loss: float = 0.0

    @property
    def saved(self) -> float:
        return sum(amount for kind, amount in self.backward if kind == "free")


def zero_units(config: Any, case: MeshCase, stage: int, tensor_rank: int) -> list[ZeroUnit]:
    """The units `Sharded` makes of that rank's stage: the embeddings, each block, the head, in forward order.

    The saved bytes are `activation_elements`' terms, cut where autograd drops them."""
    s, b, h, e = case.seq, case.batch // (case.data * case.micro_batches), config.n_embd, case.element_bytes
    bias, t, tokens = int(config.bias), case.tensor, s * b
    heads = len(block_range(config.n_head, tensor_rank, t))
    width, features = heads * (h // config.n_head), len(block_range(4 * h, tensor_rank, t))
    vocab = len(block_range(config.vocab_size, tensor_rank, t))

    def free(per_token: float) -> tuple[str, float]:
        return ("free", per_token * tokens * e)

    norm = ("grad", h + bias * h)
    block = (
        ("grad", bias * h),  # the MLP's row-parallel bias, added after its matrix product
        free(features),  # the GELU's output, the second MLP layer's input
        ("grad", features * h),
        free(features),  # the first MLP layer's output, the GELU's input
        free(h),  # ln_2's output, the first MLP layer's input
        ("grad", features * h + bias * features),
        free(h + 2),  # ln_2's input, mean and reciprocal deviation
        norm,
        ("grad", bias * h),  # the attention projection's bias
        free(width),  # the heads' output, the projection's input
        ("grad", width * h),
        free(heads * s),  # the softmax's output
        free(3 * width),  # q, k, v
        free(h),  # ln_1's output, the qkv layer's input
        ("grad", 3 * width * h + bias * 3 * width),
        free(h + 2),  # ln_1's input and statistics
        norm,
    )
    tensors = 2 * (1 + bias) + 4 + 4 * bias  # two LayerNorms, four weights, their biases
    layers = block_range(config.n_layer, stage, case.pipeline)
    units = [ZeroUnit(int(sum(n for k, n in block if k == "grad")), tensors, block) for _ in layers]
    if stage == 0:
        embed = (
            ("free", 8 * s),  # the positions (int64)
            ("grad", config.block_size * h),
            ("free", tokens),  # the vocabulary mask (bool)
            ("free", 8 * tokens),  # the token ids (int64)
            ("grad", vocab * h),
        )
        units.insert(0, ZeroUnit(config.block_size * h + vocab * h, 2, embed))
    if stage == case.pipeline - 1:
        head = (free(h), ("grad", vocab * h), free(h + 2), norm)  # the output layer's input; ln_f's
        loss = (vocab * e + 2 * 8) * tokens  # the softmax; the targets, twice (int64)
        units.append(ZeroUnit(vocab * h + h + bias * h, 2 + bias, head, loss))
    return units


def zero_memory(config: Any, case: MeshCase, rank: int) -> dict[str, float]:
    """The ledger's parts at the peak of a step of lab 13's `Sharded` (stage `case.zero`) on that rank.

    ZeRO moves bytes in and out during the step, so the peak is found by walking it as the
    engine does, for a step after the first (the optimizer's state and the gradient shards
    exist), unit by unit in 1F1B's order (lab 07), charging and releasing what `Sharded`
    charges the ledger (lab 06):

    - every unit is a flat buffer of its N parameters padded to P ceil(N/P) elements, P the
      data ranks (`FlatSpace`); this rank's shard, ceil(N/P) elements, is its master copy
      (optimizer), AdamW's two moments and step count are on the shards only, and so is
      the averaged gradient (gradients), charged once per unit;
    - stages 1 and 2 keep every unit's full buffer (parameters); stage 3 charges it from
      just before the unit's forward to just after (and again from when backward reaches it
      until its gradient is sent);
    - stage 1 keeps every parameter's gradient; stages 2 and 3 charge a unit's gradients as
      autograd makes them and release them when the last one is there;
    - each unit's gradient is sent from a new padded flat buffer (gradients), at the end of
      backward (stage 1) or when the unit's last gradient is made (2, 3), and released when
      its reduce-scatter completes: at most REDUCES_IN_FLIGHT in flight after a new one
      starts (so REDUCES_IN_FLIGHT + 1 for a moment);
    - the activations as `activation_elements` counts them, saved unit by unit and dropped
      in the order of each unit's backward (`zero_units`).
    """
    coords = coordinates(rank, case.sizes)
    stage, e = coords["pipeline"], case.element_bytes
    units = zero_units(config, case, stage, coords["tensor"])
    shards = [max(1, -(-unit.elements // case.data)) for unit in units]  # FlatSpace.shard_numel
    full = [n * case.data * e for n in shards]
    used = {
        "parameters": float(sum(full)) if case.zero < 3 else 0.0,
        "gradients": float(sum(shards) * e + (sum(u.elements for u in units) * e if case.zero == 1 else 0)),
        "optimizer": float(3 * sum(shards) * e + 4 * len(units)),  # master shards, AdamW's moments and steps
        "activations": 0.0,
    }
    peak = dict(used)
    reducing: deque[float] = deque()

    def add(part: str, nbytes: float) -> None:
        used[part] += nbytes
        if sum(used.values()) > sum(peak.values()):
            peak.update(used)

    def reduce(index: int) -> None:
        add("gradients", full[index])
        reducing.append(full[index])
        while len(reducing) > REDUCES_IN_FLIGHT:
            add("gradients", -reducing.popleft())

    gathered = 1 if case.zero == 3 else 0
    for kind, _ in one_f_one_b(case.pipeline, case.micro_batches, stage):
        if kind == "F":
            for index, unit in enumerate(units):
                add("parameters", gathered * full[index])
                add("activations", unit.saved)
                add("parameters", -gathered * full[index])
                add("activations", unit.loss)
            continue
        for index in reversed(range(len(units))):
            unit = units[index]
            add("activations", -unit.loss)
            add("parameters", gathered * full[index])
            for what, amount in unit.backward:
                if what == "free":
                    add("activations", -amount)
                elif case.zero > 1:
                    add("gradients", amount * e)
            if case.zero > 1:
                add("gradients", -unit.elements * e)
                reduce(index)
            add("parameters", -gathered * full[index])
        if case.zero == 1:  # the whole gradient, unit by unit, at the end of backward
            for index in reversed(range(len(units))):
                reduce(index)
        while reducing:
            add("gradients", -reducing.popleft())
    return peak


def rank_memory_local(config: Any, case: MeshCase, rank: int) -> dict[str, float]:
    """Bytes world rank `rank` holds at its peak, by the ledger's parts (see the module docstring)."""
    if case.zero:
        return zero_memory(config, case, rank)
    coords = coordinates(rank, case.sizes)
    stage, tensor_rank = coords["pipeline"], coords["tensor"]
    e = case.element_bytes
    elements, tensors = rank_parameters(config, case, stage, tensor_rank)
    _, grads, adam = PRECISIONS[_PRECISION[e]]
    saved = [activation_elements(config, case, stage, tensor_rank, j) for j in range(case.virtual)]
    held = most = 0.0  # the schedule walked: a (chunk, micro-batch)'s activations from its forward to its backward
    for kind, chunk, _ in interleaved_1f1b(case.pipeline, case.micro_batches, stage, case.virtual):
        held += (1 if kind == "F" else -1) * (saved[chunk]["floats"] * e + saved[chunk]["other bytes"])
        most = max(most, held)
    return {
        "parameters": float(elements * e),
        "gradients": float(elements * grads),
        "optimizer": float(elements * adam + 4 * tensors),
        "activations": most,
    }


def exchanges(config: Any, case: MeshCase) -> int:
    """Blocking exchanges on a step's critical path: each pays the platform's sync on shared cores.

    Per micro-batch and layer of a stage 4 tensor allreduces, and per micro-batch 4 more
    around the embedding, the output layer and the loss (`ddlab.tensor_parallel.formulas`);
    2 pipeline messages per micro-batch (2 v with v chunks: a micro-batch goes round the ranks v times); one
    gradient allreduce per step (over data x context), or
    with ZeRO each of its collectives on the timed step (`zero_collectives`), each waited for; ring
    attention's (`ring_exchanges`)."""
    m, layers = case.micro_batches, config.n_layer // case.pipeline
    tensor = m * (4 * layers + 4) if case.tensor > 1 else 0
    if case.zero:
        data = sum(count for *_, count, timed in zero_collectives(config, case) if timed) if case.data > 1 else 0
    else:
        data = 1 if case.data * case.context > 1 else 0  # the gradient allreduce over data x context
    return tensor + (2 * case.virtual * m if case.pipeline > 1 else 0) + data + ring_exchanges(config, case)


def ring_exchanges(config: Any, case: MeshCase) -> int:
    """Ring attention's blocking exchanges per step: per micro-batch and layer of a stage, c - 1 waits forward
    and c backward (`ddlab.context_parallel.ring`), and in each of the two calls the ring's own watch:
    a Dup of the context communicator and an allgather when it is freed (`ddlab.runtime.waiting.Watch`)."""
    if case.context == 1:
        return 0
    per_call = (case.context - 1) + case.context + 2 * 2
    return case.micro_batches * (config.n_layer // case.pipeline) * per_call


def ring_time(config: Any, case: MeshCase, platform: Platform) -> float:
    """Seconds of ring attention's messages in a step, priced by the platform's point-to-point curve.

    Per micro-batch and layer of a stage, every context rank sends its neighbour c - 1 blocks of keys
    and values forward, c - 1 again backward and c blocks of their gradients (`ddlab.context_parallel.ring`),
    each block 2 b (s/c) h / t elements (keys and values of its rows and heads, one message). On this
    machine every pair of ranks is on one node: the measured ping-pong curve prices them."""
    c = case.context
    if c == 1:
        return 0.0
    b = case.batch // (case.data * case.micro_batches)
    block = 2 * b * (case.seq // c) * config.n_embd / case.tensor * case.element_bytes
    messages = (c - 1) + (c - 1) + c
    return case.micro_batches * (config.n_layer // case.pipeline) * messages * platform.comm("p2p", block, 2)


def zero_collectives(config: Any, case: MeshCase) -> list[tuple[str, int, int, bool]]:
    """(operation, bytes of its whole buffer, calls per step, on the timed step?) of lab 13's engine.

    Every unit (`zero_units`, the first stage's) is one padded flat buffer, and each moves on
    its own: in every micro-batch's backward its gradient is reduce-scattered (stage 1 at the
    end of backward, 2 and 3 as soon as the unit's gradient is complete); stage 3 allgathers
    it before its forward and again before its backward, in every micro-batch (Rajbhandari
    et al., SC 2020, section 7: 1.5 times data parallelism's volume); stages 1 and 2 allgather
    it once after the optimizer's step, non-blocking, and the next step's forward waits for
    it: `train_on_mesh` times its steps between barriers, which let those allgathers finish,
    so they are not on the step it measures (False)."""
    m, e = case.micro_batches, case.element_bytes
    calls = []
    for unit in zero_units(config, case, 0, 0):
        nbytes = max(1, -(-unit.elements // case.data)) * case.data * e
        calls.append(("reduce_scatter", nbytes, m, True))
        calls.append(("allgather", nbytes, 2 * m, True) if case.zero == 3 else ("allgather", nbytes, 1, False))
    return calls


def zero_seconds(config: Any, case: MeshCase, platform: Platform) -> float:
    """Seconds of the timed step's `zero_collectives` over the data ranks (tensor ranks apart), priced by the platform."""
    return sum(
        count * platform.comm(op, nbytes, case.data, case.tensor)
        for op, nbytes, count, timed in zero_collectives(config, case)
        if timed
    )


def ring_block_flops(batch: int, heads: int, rows: int, head_size: int) -> float:
    """FLOPs of one block of ring attention, forward and backward, on a rank: its `rows` queries over `rows` keys,
    4 n^2 d per head forward (scores, then their weights times the values) and twice that backward."""
    return 12.0 * batch * heads * rows * rows * head_size


def ring_arithmetic_seconds(batch: int, heads: int, rows: int, head_size: int, context: int, repeats: int = 3) -> float:
    """Median seconds, on this process, of one context rank's ring attention arithmetic for one layer and
    micro-batch, forward and backward: lab 15's blockwise code (`attend_block`, `merge_partials`, `finish`,
    `attend_block_backward`) over the `context` blocks rank 0 of the zig-zag ring meets, without messages."""
    rng = np.random.default_rng(0)
    q, k, v, grad_out = (rng.standard_normal((batch, heads, rows, head_size)) for _ in range(4))
    positions = all_positions(rows * context, context)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        partial = empty_partial(q, head_size)
        for source in range(context):
            partial = merge_partials(partial, attend_block(q, k, v, positions[0], positions[source]))
        out, lse = finish(partial)
        delta = np.sum(grad_out * out, axis=-1)
        for source in range(context):
            attend_block_backward(q, k, v, grad_out, lse, delta, positions[0], positions[source])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ring_arithmetic(config: Any, case: MeshCase, platform: Platform) -> float:
    """Seconds a context rank spends per step in ring attention's own arithmetic, beyond what the GPT's rate
    gives its attention (0 with one context rank, or a platform not calibrated for it, `calibrate`).

    Per layer of a stage and micro-batch, c blocks of (s/c) x (s/c) for its a/t heads, each
    `overheads["ring block"]` + its FLOPs x `overheads["ring flop"]` (lab 15's NumPy code, timed alone);
    less the attention's FLOPs the compute already prices at the GPT's rate (4 s^2 h per sequence and layer
    forward, Narayanan et al.'s count, three times with backward, over the N ranks)."""
    if case.context == 1 or "ring block" not in platform.overheads:
        return 0.0
    c, t, m = case.context, case.tensor, case.micro_batches
    b, rows = case.batch // (case.data * m), case.seq // c
    heads, head_size = config.n_head // t, config.n_embd // config.n_head
    block = (
        platform.overheads["ring block"] + ring_block_flops(b, heads, rows, head_size) * platform.overheads["ring flop"]
    )
    layers = len(block_range(config.n_layer, 0, case.pipeline))
    torch_share = 12.0 * case.batch * config.n_layer * case.seq**2 * config.n_embd / case.ranks / platform.flops
    return layers * m * c * block - torch_share


def busy_ranks(case: MeshCase, platform: Platform) -> float:
    """Ranks computing at once on average: all but the bubble's, d t c p m / (m + p - 1) (lab 09's pipeline);
    with v chunks per rank d t c p v m / (v m + p - 1)."""
    p, vm = case.pipeline, case.virtual * case.micro_batches
    return min(case.data * case.tensor * case.context * p * vm / (vm + p - 1), platform.devices_per_node)


def mesh_time(config: Any, case: MeshCase, platform: Platform) -> dict[str, float]:
    """Seconds of one step by part: compute, bubble, `step_time`'s tensor, pipeline and data, ring attention's
    messages (context, `ring_time`), and sync.

    compute: the iteration's FLOPs over the N ranks at `platform.flops`, plus the
    implementation's seconds per layer and micro-batch (`overheads["gpt layer"]`, 0 if not
    calibrated) for each of a stage's layers and micro-batches, slowed by the contention of
    the ranks computing at once (`busy_ranks`); bubble: (p - 1) / m of it (lab 07), (p - 1) / (v m) with
    v chunks per rank (Narayanan et al., SC 2021, section 2.2.2); sync:
    each blocking exchange (`exchanges`) pays the share of `platform.sync` those ranks cause
    (`ddlab.oracle.strategies.sync_share`); data, with ZeRO: its collectives (`zero_seconds`)."""
    layout = case.layout()
    parts = step_time(GPT.from_config(config, seq=case.seq), layout, platform)
    busy = busy_ranks(case, platform)
    flops = iteration_flops(GPT.from_config(config, seq=case.seq), case.batch, "none") / layout.devices
    layers = len(block_range(config.n_layer, 0, case.pipeline))
    fixed = platform.overheads.get("gpt layer", 0.0) * layers * case.micro_batches
    compute = (flops / platform.flops + fixed + ring_arithmetic(config, case, platform)) * platform.slowdown(busy)
    if case.zero:
        parts["data"] = zero_seconds(config, case, platform)
    return {
        **parts,
        "context": ring_time(config, case, platform),
        "compute": compute,
        "bubble": (case.pipeline - 1) / (case.virtual * case.micro_batches) * compute,
        "sync": exchanges(config, case) * platform.sync * sync_share(busy, platform),
    }


@dataclass(frozen=True)
class MeshPrediction:
    """A layout's predicted step: seconds by part, and each world rank's bytes by part."""

    case: MeshCase
    seconds: dict[str, float]
    memory: list[dict[str, float]]

    @property
    def time(self) -> float:
        return sum(self.seconds.values())

    def peaks(self) -> list[float]:
        return [sum(parts.values()) for parts in self.memory]

    def time_accuracy(self, measured: float) -> float:
        """ParaDL's accuracy, 1 - |predicted - measured| / measured, of the step time."""
        return accuracy(self.time, measured)

    def memory_accuracy(self, measured: list[int]) -> float:
        """The worst rank's accuracy of its peak bytes."""
        if len(measured) != len(self.memory):
            raise ValueError(f"{len(measured)} measured ranks for a layout of {len(self.memory)}")
        return min(accuracy(p, m) for p, m in zip(self.peaks(), measured))


def predict_mesh(config: Any, case: MeshCase, platform: Platform) -> MeshPrediction:
    """Time and per-rank memory of `train_on_mesh(..., case's sizes)` with this GPTConfig on this platform."""
    if config.dropout > 0:
        raise ValueError("the mesh trains without dropout: predict a GPTConfig with dropout=0.0")
    if config.tied:
        raise ValueError("the mesh splits the output layer from the embedding: predict a GPTConfig with tied=False")
    if case.virtual > 1 and config.n_layer % (case.virtual * case.pipeline):
        raise ValueError(
            f"{config.n_layer} blocks do not split into {case.virtual} chunks x {case.pipeline} pipeline stages: "
            f"predict n_layer a multiple of {case.virtual * case.pipeline}"
        )
    memory = [rank_memory_local(config, case, rank) for rank in range(case.ranks)]
    return MeshPrediction(case, mesh_time(config, case, platform), memory)


def _first(batch_at: BatchAt, samples: int) -> BatchAt:
    def at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx, targets = batch_at(step)
        return idx[:samples], targets[:samples]

    return at


def one_process_seconds(make_model: MakeModel, batch_at: BatchAt, steps: int) -> float:
    """Median seconds of a step (after one warm-up) of the GPT trained alone by the mesh trainer on 1 rank."""
    return train_on_mesh(MPI.COMM_SELF, make_model(), batch_at, steps + 1).seconds


def calibrate(
    comm: MPI.Comm,
    platform: Platform,
    config: Any,
    make_model: MakeModel,
    batch_at: BatchAt,
    batch: int,
    seq: int,
    steps: int = 2,
    rounds: int = 3,
) -> Platform:
    """The platform with this GPT's compute rate, its cost per layer step, and contention. A collective.

    In `rounds` alternating rounds rank 0 trains the GPT alone (the others sleep) on the
    batch B and on its first B/P sequences, then every rank trains B/P at once. A step of
    one process is taken as L o + F(b) / flops (F: `iteration_flops`, L layers): from the
    two batches flops = (F(B) - F(B/P)) / (T(B) - T(B/P)), and what is left, L o, the
    seconds the implementation spends per step whatever the batch (Python, kernel launches,
    the optimizer's loop), o per layer and micro-batch (`overheads["gpt layer"]`). c(P),
    the slowdown with all P ranks computing, is together / alone at B/P (the slowest rank's),
    c(n) linear from 1 to c(P). Medians over the rounds; `sync` is measured again (it moves with
    the load more than the rest). With a sequence that splits into 2 x 2 zig-zag chunks, rank 0 also
    times ring attention's own arithmetic alone (lab 15's blockwise NumPy code, which context layouts run
    instead of the GPT's torch attention) at B/P and B sequences, and the same two-point fit gives its
    seconds per block (`overheads["ring block"]`) and per FLOP (`overheads["ring flop"]`): see `ring_arithmetic`.
    Every rank gets the same Platform."""
    p = comm.Get_size()
    if batch % p:
        raise ValueError(f"the batch of {batch} does not split over {p} ranks: use a multiple of {p}")
    small = _first(batch_at, batch // p)
    alone, alone_small, together = [], [], []
    rings: list[tuple[float, float]] = []
    for _ in range(rounds):
        polite_barrier(comm)
        mine = comm.Get_rank() == 0
        alone.append(one_process_seconds(make_model, batch_at, steps) if mine else 0.0)
        alone_small.append(one_process_seconds(make_model, small, steps) if mine else 0.0)
        if mine and seq % 4 == 0:
            rings.append((_ring_seconds(config, batch // p, seq), _ring_seconds(config, batch, seq)))
        polite_barrier(comm)
        together.append(comm.allreduce(one_process_seconds(make_model, small, steps), op=MPI.MAX))
    whole, part = comm.bcast((statistics.median(alone), statistics.median(alone_small)), root=0)
    gpt = GPT.from_config(config, seq=seq)
    big, little = iteration_flops(gpt, batch, "none"), iteration_flops(gpt, batch // p, "none")
    if big > little and whole > part:
        flops = (big - little) / (whole - part)
        fixed = max(0.0, part - little / flops)
    else:  # one rank (or a load spike): the rate alone, no cost per layer
        flops, fixed = big / whole, 0.0
    worst = max(1.0, statistics.median(together) / part)
    contention = tuple(1.0 + (worst - 1.0) * (n - 1) / max(p - 1, 1) for n in range(1, p + 1))
    overheads = {**platform.overheads, "gpt layer": fixed / config.n_layer}
    ring = comm.bcast(_ring_fit(config, batch, seq, p, rings) if rings else None, root=0)
    if ring is not None:
        overheads["ring block"], overheads["ring flop"] = ring
    sync = comm.bcast(measure_sync(comm), root=0) if p > 1 else 0.0
    return replace(platform, flops=flops, contention=contention, overheads=overheads, sync=sync)


def _ring_seconds(config: Any, batch: int, seq: int) -> float:
    """A block of ring attention on this process: two context ranks' zig-zag rows of `seq`, all heads."""
    return ring_arithmetic_seconds(batch, config.n_head, seq // 2, config.n_embd // config.n_head, 2) / 2


def _ring_fit(config: Any, batch: int, seq: int, p: int, rings: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds per block, seconds per FLOP) of ring attention's arithmetic, from its blocks at B/P and B
    sequences (medians over the rounds), as the GPT's rate and cost per layer are found."""
    small, big = (statistics.median(r[i] for r in rings) for i in (0, 1))
    head_size = config.n_embd // config.n_head
    little, large = (ring_block_flops(b, config.n_head, seq // 2, head_size) for b in (batch // p, batch))
    if large > little and big > small:
        per_flop = (big - small) / (large - little)
        return max(0.0, small - little * per_flop), per_flop
    return 0.0, big / large


def local_platform(
    comm: MPI.Comm,
    config: Any,
    make_model: MakeModel,
    batch_at: BatchAt,
    batch: int,
    seq: int,
    sizes: tuple[int, ...] = SIZES,
    repeats: int = 5,
    rounds: int = 3,
) -> Platform:
    """This machine as lab 09 measures it (`measure_platform`), calibrated to this GPT (`calibrate`). A collective."""
    start = time.perf_counter()
    platform = measure_platform(comm, sizes, repeats, name="this machine (lab 16's GPT)")
    platform = calibrate(comm, platform, config, make_model, batch_at, batch, seq, rounds=rounds)
    platform.sources["flops"] = "one process training this GPT alone (ddlab.oracle.transformer_local.calibrate)"
    platform.sources["measured in"] = f"{time.perf_counter() - start:.1f} s"
    return platform
