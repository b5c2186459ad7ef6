"""Lab 14's GPT trained on a mesh: pipeline stages of tensor-parallel blocks, data (or ZeRO) over the rest.

Nothing here is a new mechanism; each dimension is an earlier lab's, on that dimension's communicator:

- tensor (lab 14): every block is a `ParallelBlock` (heads and MLP features split), the
  embedding a `VocabParallelEmbedding`, the output layer split by vocabulary and the loss
  `vocab_parallel_cross_entropy`, all over `mesh.tensor`; with `sequence_parallel` (lab 14's, Korthikanti
  et al., MLSys 2023), the residual stream between the blocks is this tensor rank's block of rows (of the
  context rank's rows), and the whole parameters' gradients are summed over `mesh.tensor` after backward;
- pipeline (lab 07): stage s holds blocks `block_range(n_layer, s, pipeline)` (the first
  stage the embeddings too, the last the final LayerNorm and the output layer) and runs
  a schedule (1F1B by default) with lab 07's `run_schedule` over `mesh.pipeline`; or, with
  `virtual` = v > 1, each pipeline rank r holds v chunks, chunk j being virtual stage j p + r of
  the v p (`ddlab.pipeline.virtual_stage`), and runs the interleaved 1F1B schedule
  (`interleaved_1f1b`, Narayanan et al., SC 2021, section 2.2.2) with `run_interleaved`, the same
  mailbox of lab 06 as `run_schedule`;
- data (lab 04) over `mesh.data`: each data rank takes its block of the batch and the
  gradients are averaged (`average_gradients`) before the step; or with `zero` = 1, 2, 3
  the stage is lab 13's `Sharded` over `mesh.data`, one unit per embedding, block and head;
- context (lab 15) over `mesh.context`: each context rank holds its zig-zag positions
  (`ddlab.context_parallel.layout.zigzag_positions`: chunks r and 2c-1-r of 2c) of every
  sequence, their position embeddings, and every block's attention of its heads is
  `ring_attention_heads` (lab 15's `RingAttention`) over `mesh.context` instead of the local
  one; activations between pipeline stages are (b, s/c, h). The sequence must split into 2c
  chunks (no padding). Every parameter then sees only its rank's tokens: each rank's loss is
  the mean over its s/c positions, and the gradients (and the loss) are averaged over
  `mesh.replicas`, the data x context ranks, with lab 04's `average_gradients` (all of a
  context plane's ranks hold the same number of tokens, so that average is the whole
  batch's mean); ZeRO shards over the same data x context ranks.

A step of batch B with M micro-batches: each data rank takes B / D samples, cut in M
micro-batches; each micro-batch's loss is its mean cross-entropy over M, so the
micro-batches' gradients add up to the data rank's mean, and averaging over the data
(x context) ranks gives the whole batch's mean: the step one process takes (without dropout).

The output layer is split from the embedding (`GPTConfig(tied=False)`): a tied GPT
across pipeline stages would need the two copies' gradients summed between the first
and last stages (Megatron's embedding group), which is not built here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from mpi4py import MPI
from torch import nn

from ..context_parallel import ring_attention_heads, zigzag_positions
from ..data_parallel import average_gradients
from ..models.gpt import GPT, BatchAt, Block
from ..pipeline import Schedule, interleaved_1f1b, one_f_one_b, run_interleaved, run_schedule, virtual_stage
from ..runtime.blocks import block_range
from ..runtime.comm import Comm
from ..runtime.memory import Ledger
from ..runtime.reference import reference
from ..sharded import Sharded
from ..tensor_parallel import (
    Copy,
    Gather,
    ParallelBlock,
    VocabParallelEmbedding,
    allreduce,
    vocab_parallel_cross_entropy,
    vocab_range,
)
from ..tensor_parallel.block import Attend
from .layout import Mesh

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def context_rows(length: int, context: Comm) -> torch.Tensor:
    """The positions of a sequence `length` long that this context rank holds: zig-zag chunks r and 2c-1-r of 2c."""
    c = context.Get_size()
    if c == 1:
        return torch.arange(length)
    if length % (2 * c):
        raise ValueError(
            f"a sequence of {length} tokens does not split into 2 x {c} zig-zag chunks of the {c} context ranks: "
            f"use a sequence (block size) that is a multiple of {2 * c}"
        )
    return torch.from_numpy(zigzag_positions(length, c, context.Get_rank()))


def sequence_rows(length: int, tensor: Comm) -> range:
    """With sequence parallelism, the rows of a (context rank's) sequence `length` long this tensor rank holds."""
    t = tensor.Get_size()
    if length % t:
        raise ValueError(
            f"sequence parallelism splits each rank's {length} positions over {t} tensor ranks: use a sequence "
            f"(block size) whose share per context rank is a multiple of {t}"
        )
    return block_range(length, tensor.Get_rank(), t)


class Embeddings(nn.Module):
    """The first stage's input: token embedding split by vocabulary over `tensor`, position embedding whole;
    with context ranks, the ids are this rank's zig-zag rows and take their positions' embeddings; with
    sequence parallelism the output is this tensor rank's block of those rows (a reduce-scatter, lab 14)."""

    def __init__(self, model: GPT, tensor: Comm, context: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.wte = VocabParallelEmbedding(model.wte, tensor, sequence_parallel)
        self.wpe = copy.deepcopy(model.wpe)
        self.tensor, self.context, self.sequence_parallel = tensor, context, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = context_rows(idx.shape[1] * self.context.Get_size(), self.context)
        if self.sequence_parallel:
            rows = sequence_rows(idx.shape[1], self.tensor)
            positions = positions[rows.start : rows.stop]
        return self.wte(idx) + self.wpe(positions)

    def replicated_parameters(self) -> list[torch.Tensor]:
        """The whole parameters (the position embedding): with sequence parallelism they see one block of rows."""
        return list(self.wpe.parameters())


class Head(nn.Module):
    """The last stage's output: final LayerNorm whole, this rank's vocabulary rows of the output layer."""

    def __init__(self, model: GPT, tensor: Comm, sequence_parallel: bool = False):
        super().__init__()
        if model.lm_head is None:
            raise ValueError(
                "the mesh splits the output layer from the embedding: build the GPT with GPTConfig(tied=False)"
            )
        self.tensor, self.sequence_parallel = tensor, sequence_parallel
        self.ln_f = copy.deepcopy(model.ln_f)
        self.vocab = vocab_range(model.config.vocab_size, tensor)
        self.out = nn.Linear(model.config.n_embd, len(self.vocab), bias=False, dtype=model.lm_head.weight.dtype)
        with torch.no_grad():
            self.out.weight.copy_(model.lm_head.weight[self.vocab.start : self.vocab.stop])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, n_embd) whole, or this rank's block of rows with sequence parallelism -> its logits (B, T, V / t)."""
        x = self.ln_f(x)
        if self.sequence_parallel:
            return self.out(Gather.apply(x, self.tensor, x.shape[1] * self.tensor.Get_size()))
        return self.out(Copy.apply(x, self.tensor))

    def replicated_parameters(self) -> list[torch.Tensor]:
        """The whole parameters (the final LayerNorm)."""
        return list(self.ln_f.parameters())


class Chain(nn.Module):
    """A pipeline stage's units run in order: `Embeddings` (first stage), `ParallelBlock`s, `Head` (last stage).

    With sequence parallelism a block's input is this tensor rank's block of rows of a sequence t times as long
    (the rows split evenly): the chain tells each block that length."""

    def __init__(self, units: list[nn.Module], tensor: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.chain = nn.ModuleList(units)
        self.tensor, self.sequence_parallel = tensor, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.chain:
            if isinstance(unit, ParallelBlock) and self.sequence_parallel:
                x = unit(x, length=x.shape[1] * self.tensor.Get_size())
            else:
                x = unit(x)
        return x

    def units(self) -> list[nn.Module]:
        """The modules forward calls in order, each a ZeRO unit."""
        return list(self.chain)

    def replicated_parameters(self) -> list[torch.Tensor]:
        """The parameters every rank of the tensor group holds whole (position embedding, LayerNorms,
        row-parallel biases): with sequence parallelism each saw one block of rows."""
        found: list[torch.Tensor] = []
        for unit in self.chain:
            if isinstance(unit, (Embeddings, ParallelBlock, Head)):
                found += unit.replicated_parameters()
        return found


class Chunks(nn.Module):
    """A pipeline rank's v chunks under the interleaved schedule (`GPTStage`s, chunk j virtual stage j p + r),
    held together so that their gradients are summed, averaged and stepped as one stage's."""

    def __init__(self, chunks: list[GPTStage]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def replicated_parameters(self) -> list[torch.Tensor]:
        """Every chunk's whole parameters (`Chain.replicated_parameters`)."""
        return [p for chunk in self.chunks if isinstance(chunk, Chain) for p in chunk.replicated_parameters()]


def sum_sequence_parallel_grads(stage: Chain | Chunks, tensor: Comm) -> None:
    """Sum over the tensor ranks the gradients of the stage's whole parameters (with sequence parallelism
    each rank's come from its block of rows only): one allreduce of them all, flattened."""
    params = [p for p in stage.replicated_parameters() if p.grad is not None]
    if not params or tensor.Get_size() == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    total = allreduce(tensor, torch.cat([g.reshape(-1) for g in grads]))
    offset = 0
    with torch.no_grad():
        for grad in grads:
            grad.copy_(total[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


class GPTStage(Chain):
    """Pipeline stage `mesh.coords['pipeline']` of a GPT, split over `mesh.tensor` (and its sequence, with
    sequence parallelism); built from one process's GPT.

    With `virtual` = v chunks per pipeline rank (the interleaved schedule), it is chunk `chunk` of that
    rank: virtual stage chunk x p + rank of the v p, holding n_layer / (v p) blocks (the first virtual
    stage the embeddings too, the last the head); n_layer must split into those v p chunks."""

    def __init__(self, model: GPT, mesh: Mesh, sequence_parallel: bool = False, chunk: int = 0, virtual: int = 1):
        config = model.config
        stages = mesh.sizes["pipeline"]
        total, index = stages * virtual, virtual_stage(stages, mesh.coords["pipeline"], chunk)
        if config.dropout > 0:
            raise ValueError("the mesh trains without dropout (GPTConfig(dropout=0.0)): set dropout to 0")
        if virtual < 1 or not 0 <= chunk < virtual:
            raise ValueError(
                f"need virtual >= 1 chunks per pipeline rank and 0 <= chunk < virtual, got {chunk}, {virtual}"
            )
        if config.n_layer < total or (virtual > 1 and config.n_layer % total):
            what = f"{virtual} chunks x {stages} pipeline stages" if virtual > 1 else f"{stages} pipeline stages"
            raise ValueError(
                f"{config.n_layer} blocks do not split into {what}: use "
                + (f"n_layer a multiple of {total}" if virtual > 1 else "at most n_layer stages")
            )
        attend: Attend | None = None
        if mesh.sizes["context"] > 1:  # this rank's heads attend over every context rank's keys (lab 15)
            attend = functools.partial(ring_attention_heads, mesh.context)
        layers = block_range(config.n_layer, index, total)
        units: list[nn.Module] = [Embeddings(model, mesh.tensor, mesh.context, sequence_parallel)] if index == 0 else []
        units += [ParallelBlock(_block(model, i), mesh.tensor, sequence_parallel, attend) for i in layers]
        if index == total - 1:
            units.append(Head(model, mesh.tensor, sequence_parallel))
        super().__init__(units, mesh.tensor, sequence_parallel)
        self.first, self.last, self.layers = index == 0, index == total - 1, layers
        self.width = config.n_embd
        self.head = units[-1] if self.last else None

    def loss(self, micro_batches: int) -> LossFn:
        """The last stage's loss of a micro-batch: mean cross-entropy (vocabulary-parallel) over micro_batches."""
        assert isinstance(self.head, Head), "only the last stage has a loss"
        return mesh_loss(self.head, micro_batches)


def mesh_loss(head: Head, micro_batches: int) -> LossFn:
    """A micro-batch's loss on the last stage: its mean cross-entropy over the vocabulary-split logits, / micro_batches."""
    start = head.vocab.start

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), head.tensor, start) / micro_batches

    return loss


def _block(model: GPT, index: int) -> Block:
    block = model.blocks[index]
    assert isinstance(block, Block)
    return block


@reference("mesh_trainer")
@dataclass
class MeshTrainer:
    """This rank's stage of a GPT on a mesh, its optimizer (AdamW, as `train_gpt`), and optionally ZeRO on data.

    zero: 0 for lab 04's gradient averaging over `mesh.replicas` (data x context), or a ZeRO stage 1-3
    (lab 13's `Sharded` over the same ranks).
    sequence_parallel: lab 14's sequence parallelism on the tensor dimension (not with ZeRO here: lab 13's
    engine reduces a unit's gradients during backward, before the tensor ranks' blocks of rows are summed).
    virtual: v model chunks per pipeline rank, run by the interleaved 1F1B schedule instead of `schedule`
    (v = 1: `schedule`, 1F1B by default); n_layer must split into v p chunks and the micro-batches into
    groups of p; not with ZeRO here (its engine walks one chain of units per rank).
    ledger: charged with this rank's parameters, gradients, optimizer state and activations.
    """

    model: GPT
    mesh: Mesh
    lr: float = 3e-3
    zero: int = 0
    schedule: Schedule = one_f_one_b
    ledger: Ledger | None = None
    sequence_parallel: bool = False
    virtual: int = 1
    stage: GPTStage = field(init=False)
    chunks: list[GPTStage] = field(init=False)
    held: GPTStage | Chunks = field(init=False)
    module: nn.Module = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero is 0 (plain data parallelism) or a ZeRO stage 1, 2, 3, got {self.zero!r}")
        if self.zero and self.sequence_parallel and self.mesh.sizes["tensor"] > 1:
            raise ValueError("sequence parallelism with ZeRO is not built here: use zero=0 or sequence_parallel=False")
        if not isinstance(self.virtual, int) or self.virtual < 1:
            raise ValueError(
                f"virtual is the number of model chunks per pipeline rank, 1 or more, got {self.virtual!r}"
            )
        if self.virtual > 1 and self.zero:
            raise ValueError("the interleaved schedule with ZeRO is not built here: use zero=0 or virtual=1")
        if self.virtual > 1 and self.schedule is not one_f_one_b:
            raise ValueError("with virtual > 1 the schedule is the interleaved 1F1B: leave `schedule` as one_f_one_b")
        self.chunks = [
            GPTStage(self.model, self.mesh, self.sequence_parallel, chunk, self.virtual)
            for chunk in range(self.virtual)
        ]
        self.stage = self.chunks[-1]  # the last chunk: on the last pipeline rank, the one with the loss
        self.held = self.stage if self.virtual == 1 else Chunks(self.chunks)
        if self.zero:
            sharded = Sharded(
                self.stage, self.mesh.replicas, stage=self.zero, units=self.stage.units(), ledger=self.ledger
            )
            self.module = sharded
            self.optimizer = sharded.attach(torch.optim.AdamW(sharded.shards(), lr=self.lr, weight_decay=0.0))
        else:
            self.module = self.held
            self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.lr, weight_decay=0.0)
            if self.ledger is not None:
                self.ledger.watch(self.module, self.optimizer)

    def step(self, idx: torch.Tensor, targets: torch.Tensor, micro_batches: int = 1) -> float:
        """One step on the global batch (idx, targets), whole on every rank; returns its mean loss on every rank.

        The sequence length must split into 2c zig-zag chunks (c context ranks), and with v > 1 chunks the
        micro-batches into groups of p pipeline ranks: ValueError otherwise."""
        data, pipeline = self.mesh.data, self.mesh.pipeline
        ways = data.Get_size() * micro_batches
        if micro_batches < 1 or idx.shape[0] % ways:
            raise ValueError(
                f"a batch of {idx.shape[0]} does not split into {data.Get_size()} data ranks x {micro_batches} "
                f"micro-batches: use a batch that is a multiple of {ways}"
            )
        p, r = pipeline.Get_size(), pipeline.Get_rank()
        # every rank refuses the same sizes here, before any message (interleaved: m a multiple of p)
        ops = interleaved_1f1b(p, micro_batches, r, self.virtual) if self.virtual > 1 else []
        plain = self.schedule(p, micro_batches, r) if self.virtual == 1 else []
        mine = block_range(idx.shape[0], data.Get_rank(), data.Get_size())
        idx, targets = idx[mine.start : mine.stop], targets[mine.start : mine.stop]
        if self.mesh.sizes["context"] > 1:  # this context rank's positions of every sequence
            rows = context_rows(idx.shape[1], self.mesh.context)
            idx, targets = idx[:, rows], targets[:, rows]
        inputs, outputs = list(idx.chunk(micro_batches)), list(targets.chunk(micro_batches))
        length = len(sequence_rows(idx.shape[1], self.mesh.tensor)) if self.sequence_parallel else idx.shape[1]
        activation = ((inputs[0].shape[0], length, self.stage.width), self.model_dtype)
        loss = self.stage.loss(micro_batches) if self.stage.last else _no_loss
        self.optimizer.zero_grad()
        with self.ledger.activations() if self.ledger is not None else contextlib.nullcontext():
            if self.virtual > 1:
                chunks: list[nn.Module] = list(self.chunks)
                losses = run_interleaved(pipeline, chunks, ops, inputs, outputs, loss, activation=activation)
            else:
                losses = run_schedule(pipeline, self.module, plain, inputs, outputs, loss, activation)
        if self.sequence_parallel:
            sum_sequence_parallel_grads(self.held, self.mesh.tensor)
        replicas = self.mesh.replicas
        if not self.zero and replicas.Get_size() > 1:
            average_gradients(self.module, replicas)
        self.optimizer.step()
        value = replicas.allreduce(sum(losses)) / replicas.Get_size() if self.stage.last else 0.0
        return float(pipeline.bcast(value, root=pipeline.Get_size() - 1))

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def close(self) -> None:
        """Stop ZeRO's helper thread and free its communicator (a collective over the data ranks)."""
        if isinstance(self.module, Sharded):
            self.module.close()


def _no_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise AssertionError("only the last pipeline stage computes the loss")


@dataclass
class MeshRun:
    """A layout's training run: the losses of every step, its step time and every rank's peak memory.

    virtual: the model chunks per pipeline rank (interleaved schedule when above 1).
    seconds: the median over the steps after the first of the slowest rank's time per step.
    peak_bytes: per world rank, the ledger's peak (parameters, gradients, optimizer state, activations).
    """

    label: str
    sizes: dict[str, int]
    zero: int
    losses: list[float]
    seconds: float
    peak_bytes: list[int]
    virtual: int = 1


@reference("mesh_trainer")
def train_on_mesh(
    comm: MPI.Comm,
    model: GPT,
    batch_at: BatchAt,
    steps: int,
    data: int = 1,
    tensor: int = 1,
    pipeline: int = 1,
    micro_batches: int = 1,
    zero: int = 0,
    lr: float = 3e-3,
    context: int = 1,
    sequence_parallel: bool = False,
    virtual: int = 1,
) -> MeshRun:
    """Train a copy of `model` for `steps` steps on the mesh data x tensor x pipeline x context of comm's ranks.

    virtual: v model chunks per pipeline rank, trained with the interleaved 1F1B schedule (`MeshTrainer`).
    A collective. Every rank passes the same one-process model (its weights are split here) and gets the
    same MeshRun."""
    mesh = Mesh.build(comm, data=data, tensor=tensor, pipeline=pipeline, context=context)
    ledger = Ledger(stage=f"rank {comm.Get_rank()} ({mesh.label})")
    try:
        trainer = MeshTrainer(
            model, mesh, lr=lr, zero=zero, ledger=ledger, sequence_parallel=sequence_parallel, virtual=virtual
        )
    except ValueError:  # refused on every rank alike: free what was built
        ledger.close()
        mesh.free()
        raise
    losses, times = [], []
    try:
        for step in range(steps):
            idx, targets = batch_at(step)
            comm.Barrier()
            start = time.perf_counter()
            losses.append(trainer.step(idx, targets, micro_batches))
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    finally:
        trainer.close()
        ledger.close()
        mesh.free()
    seconds = statistics.median(times[1:] if len(times) > 1 else times)
    label = mesh.label + (f" ZeRO-{zero}" if zero else "") + (f" v{virtual}" if virtual > 1 else "")
    label += " SP" if sequence_parallel else ""
    peaks = comm.allgather(ledger.report()["peak"])
    return MeshRun(label, dict(mesh.sizes), zero, losses, seconds, peaks, virtual)
