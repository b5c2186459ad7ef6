"""The transformer oracle on this machine: lab 16's mesh layouts predicted, to set beside what they measure.

`ddlab.oracle.transformer` prices a GPT step from its sizes and a platform. Here the GPT is
lab 16's (`GPTConfig`, untied output layer, no dropout, float32 or float64 AdamW) on the
mesh of `ddlab.mesh.train_on_mesh`, and the platform is this machine's, measured as lab 09
measures it, with two inputs more for this GPT: its compute rate and its cost per layer step.

Time (`mesh_time`): the parts of `step_time` (Narayanan et al., SC 2021: the iteration's
FLOPs, 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without recomputation, over the N ranks;
lab 07's bubble, (p - 1)/m of the compute; each dimension's collectives priced by lab 09's
measured curves; with c context ranks, ring attention's messages instead of `step_time`'s
collectives for them, `ring_time`: per layer and micro-batch c - 1 key/value blocks forward,
c - 1 backward and c of their gradients, each priced by the measured ping-pong curve; the
zig-zag layout gives every context rank 1/c of the causal work, so the FLOPs are split over
all N = d t p c ranks like the others), with two inputs measured on this machine for this GPT, the same for
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
  (1F1B: min(p - stage, m) on stage `stage`, lab 07), per layer and token, in elements:
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

ZeRO (lab 13's `Sharded`) charges its own buffers (master shards, gathered units); it is
not predicted here.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from mpi4py import MPI

from ..mesh import train_on_mesh
from ..mesh.layout import coordinates
from ..model_parallel import polite_barrier
from ..models.gpt import BatchAt
from ..runtime.blocks import block_range
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

    def __post_init__(self) -> None:
        if self.element_bytes not in _PRECISION:
            raise ValueError(f"element_bytes is 4 (float32) or 8 (float64), got {self.element_bytes}")
        if min(self.data, self.tensor, self.pipeline, self.context, self.micro_batches, self.batch, self.seq) < 1:
            raise ValueError(f"every size must be at least 1: {self}")
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
        """As `Mesh.label`: data x tensor x pipeline, and x context when it is used."""
        return f"{self.data}x{self.tensor}x{self.pipeline}" + (f"x{self.context}" if self.context > 1 else "")

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
        )


def case_of(sizes: dict[str, int], batch: int, seq: int, micro_batches: int = 1, element_bytes: int = 4) -> MeshCase:
    """The MeshCase of a layout given as `ddlab.mesh.layouts` gives it."""
    return MeshCase(
        sizes["data"],
        sizes["tensor"],
        sizes["pipeline"],
        batch,
        seq,
        micro_batches,
        element_bytes,
        sizes.get("context", 1),
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


def activation_elements(config: Any, case: MeshCase, stage: int, tensor_rank: int) -> dict[str, float]:
    """Per micro-batch, what autograd saves on that rank: float elements, and the integer ids' and masks' bytes."""
    b, h, t = case.batch // (case.data * case.micro_batches), config.n_embd, case.tensor
    s = case.seq // case.context  # the rank's rows of each sequence
    tokens = s * b
    layers = len(block_range(config.n_layer, stage, case.pipeline))
    floats, other = layers * layer_elements(config, case), 0.0
    if stage == 0:
        other += 8 * tokens + tokens + 8 * s  # token ids (int64), vocabulary mask (bool), positions (int64)
    if stage == case.pipeline - 1:
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


def rank_memory_local(config: Any, case: MeshCase, rank: int) -> dict[str, float]:
    """Bytes world rank `rank` holds at its peak, by the ledger's parts (see the module docstring)."""
    coords = coordinates(rank, case.sizes)
    stage, tensor_rank = coords["pipeline"], coords["tensor"]
    e = case.element_bytes
    elements, tensors = rank_parameters(config, case, stage, tensor_rank)
    _, grads, adam = PRECISIONS[_PRECISION[e]]
    saved = activation_elements(config, case, stage, tensor_rank)
    in_flight = min(case.pipeline - stage, case.micro_batches)
    return {
        "parameters": float(elements * e),
        "gradients": float(elements * grads),
        "optimizer": float(elements * adam + 4 * tensors),
        "activations": in_flight * (saved["floats"] * e + saved["other bytes"]),
    }


def exchanges(config: Any, case: MeshCase) -> int:
    """Blocking exchanges on a step's critical path: each pays the platform's sync on shared cores.

    Per micro-batch and layer of a stage 4 tensor allreduces, and per micro-batch 4 more
    around the embedding, the output layer and the loss (`ddlab.tensor_parallel.formulas`);
    2 pipeline messages per micro-batch; one gradient allreduce per step (over data x context);
    ring attention's (`ring_exchanges`)."""
    m, layers = case.micro_batches, config.n_layer // case.pipeline
    tensor = m * (4 * layers + 4) if case.tensor > 1 else 0
    replicas = case.data * case.context  # the gradient allreduce over data x context
    return tensor + (2 * m if case.pipeline > 1 else 0) + (1 if replicas > 1 else 0) + ring_exchanges(config, case)


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


def busy_ranks(case: MeshCase, platform: Platform) -> float:
    """Ranks computing at once on average: all but the bubble's, d t c p m / (m + p - 1) (lab 09's pipeline)."""
    p, m = case.pipeline, case.micro_batches
    return min(case.data * case.tensor * case.context * p * m / (m + p - 1), platform.devices_per_node)


def mesh_time(config: Any, case: MeshCase, platform: Platform) -> dict[str, float]:
    """Seconds of one step by part: compute, bubble, `step_time`'s tensor, pipeline and data, ring attention's
    messages (context, `ring_time`), and sync.

    compute: the iteration's FLOPs over the N ranks at `platform.flops`, plus the
    implementation's seconds per layer and micro-batch (`overheads["gpt layer"]`, 0 if not
    calibrated) for each of a stage's layers and micro-batches, slowed by the contention of
    the ranks computing at once (`busy_ranks`); bubble: (p - 1) / m of it (lab 07); sync:
    each blocking exchange (`exchanges`) pays the share of `platform.sync` those ranks cause
    (`ddlab.oracle.strategies.sync_share`)."""
    layout = case.layout()
    parts = step_time(GPT.from_config(config, seq=case.seq), layout, platform)
    busy = busy_ranks(case, platform)
    flops = iteration_flops(GPT.from_config(config, seq=case.seq), case.batch, "none") / layout.devices
    layers = len(block_range(config.n_layer, 0, case.pipeline))
    fixed = platform.overheads.get("gpt layer", 0.0) * layers * case.micro_batches
    compute = (flops / platform.flops + fixed) * platform.slowdown(busy)
    return {
        **parts,
        "context": ring_time(config, case, platform),
        "compute": compute,
        "bubble": (case.pipeline - 1) / case.micro_batches * compute,
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
    the load more than the rest). Every rank gets the same Platform."""
    p = comm.Get_size()
    if batch % p:
        raise ValueError(f"the batch of {batch} does not split over {p} ranks: use a multiple of {p}")
    small = _first(batch_at, batch // p)
    alone, alone_small, together = [], [], []
    for _ in range(rounds):
        polite_barrier(comm)
        mine = comm.Get_rank() == 0
        alone.append(one_process_seconds(make_model, batch_at, steps) if mine else 0.0)
        alone_small.append(one_process_seconds(make_model, small, steps) if mine else 0.0)
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
    sync = comm.bcast(measure_sync(comm), root=0) if p > 1 else 0.0
    return replace(platform, flops=flops, contention=contention, overheads=overheads, sync=sync)


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
