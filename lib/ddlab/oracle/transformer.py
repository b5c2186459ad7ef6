"""The oracle for transformers (lab 16): time and memory per rank of one GPT training step, any layout.

A GPT (`GPT`: l layers of width h, a heads, sequence s, vocabulary V) trains with a global
batch of B sequences on N = d t p c devices (`Layout`): d data-parallel groups (ZeRO stage 0-3
over them), t-way tensor parallelism (Megatron's, optionally with sequence parallelism), p
pipeline stages of l/p layers run by 1F1B on m = B/(d b) micro-batches of b sequences, c-way
context parallelism (ring attention over sequence blocks of s/c), with or without activation
recomputation, in mixed precision (2-byte parameters, gradients and activations, 12 bytes of
Adam state per parameter), float32 or float64. Ranks are placed tensor innermost, then context, then
data, then pipeline (Megatron's order: tensor inside a node).

Compute: the FLOPs of one iteration (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021, section 5.1), counted term by term:
per layer and sequence the forward does 24 s h^2 + 4 s^2 h, the output layer 2 s h V; the
backward twice the forward; full recomputation reruns the layers' forward (with it,
96 B s l h^2 (1 + s/(6h) + V/(16 l h)), their count), selective recomputation (Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023) only
the attention's 4 s^2 h. Each of the N devices does 1/N of them at `platform.flops`, slowed by
`platform.slowdown` with min(N, devices per node) devices of a node computing at once (1 on a
GPU; on a laptop's shared cores lab 09 measures it).

Bubble: 1F1B idles (p-1)/m of the ideal compute time (lab 07), which is (p-1)/(m+p-1) of the step
(idle / (compute + idle) with idle = (p-1)/m compute). With the interleaved schedule (`interleave` = v
model chunks per rank, Narayanan et al., SC 2021, section 2.2.2; `ddlab.pipeline.interleaved_1f1b`)
it idles (p-1)/(v m) of the compute, for v times the pipeline messages; l must split into p v chunks
and m into groups of p.

Communication, on the critical path (no overlap), each collective priced by the platform
(`Platform.comm`: its measured curves, else `ddlab.allreduce.cost`), `e` bytes per element,
per micro-batch and per layer of a stage unless said:

- tensor: 2 allreduces of b (s/c) h elements forward, 2 backward, 2 more when full
  recomputation reruns the forward (with sequence parallelism the same bytes as allgathers
  and reduce-scatters: priced as the allreduce);
- context: the keys and values go round the ring: an allgather of 2 b s h / t elements
  forward, an allgather and a reduce-scatter (their gradients) backward, another allgather
  when the forward is recomputed;
- pipeline: each micro-batch's activation b (s/c) h / t elements forward to the next stage
  and its gradient back (Narayanan et al.'s scatter/gather: 1/t of it per rank), 2 m
  messages per stage, 2 v m interleaved (no messages if p = 1);
- data: once per iteration, the gradients of this rank's parameters psi over the d c ranks
  that hold the same weights: an allreduce of psi e bytes (ZeRO 1-2: a reduce-scatter then
  an allgather, the same bytes; ZeRO-3, as lab 13's engine runs it: the parameters allgathered
  before the forward and the backward of every micro-batch and the gradients reduce-scattered
  after every backward, 2 m allgathers and m reduce-scatters).

Memory of the busiest rank (the first or the last stage):

- state (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC 2020): with mixed-precision Adam 2 + 2 + 12 = 16 bytes per parameter;
  stage 1 shards the optimizer (4 + 12/D), stage 2 the gradients too (2 + 14/D), stage 3
  everything (16/D), D = d c the ranks holding the same weights; float32: 4 + 4 + 8, float64 8 + 8 + 16;
- activations (Korthikanti et al., section 4, `ddlab.tensor_parallel.formulas`): a layer keeps
  sbh (10 + 24/t + 5as/(ht)) bytes at 2-byte activations, sbh (34/t + 5as/(ht)) with sequence
  parallelism, with s the rank's s/c tokens; selective recomputation drops the attention
  term 5as/(ht); full recomputation keeps only each layer's input, 2sbh (/t with sequence
  parallelism), plus one layer's whole activations while it is recomputed; under 1F1B the
  first stage holds min(p, m) micro-batches of its l/p layers; the last stage also keeps
  the logits in float32 (or wider) for the loss, 4 b (s/c) V / t bytes.

Signatures (lab 16's exercises):
- Exercise 16.4 `memory_per_rank(psi, s, b, h, a, layers, t, d, zero, recompute,
  sequence_parallel=False) -> dict` with keys "parameters", "gradients", "optimizer",
  "activations", in bytes, for mixed-precision Adam: `psi` the parameters this rank holds
  (after tensor and pipeline splits), `layers` how many layers' activations it keeps at once
  (its layers times the micro-batches in flight), `d` the ranks ZeRO shards over, `zero`
  0-3, `recompute` "none", "selective" or "full" (full: 2sbh per layer kept, 2sbh/t with
  sequence parallelism, plus one layer's activations without recomputation);
  the reference is `memory_per_rank` here.
- Exercise 16.5 `step_time(gpt, layout, platform) -> dict` with keys "compute", "bubble",
  "tensor", "context", "pipeline", "data" in seconds, as above; the reference is `step_time`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ..pipeline.interleaved import warmup_forwards
from ..tensor_parallel.formulas import activation_bytes_per_layer
from .platform import Platform

RECOMPUTE = ("none", "selective", "full")
#: Bytes per parameter (weights, gradients, Adam's state); activations take the weights' size.
PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8), "fp64": (8, 8, 16)}
TIME_PARTS = ("compute", "bubble", "tensor", "context", "pipeline", "data")
MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class GPT:
    """A GPT as Narayanan et al. describe it: layers, hidden size, heads, sequence, vocabulary."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    name: str = ""

    @classmethod
    def from_config(cls, config: Any, seq: int | None = None, name: str = "") -> GPT:
        """The GPT of a `ddlab.models.gpt.GPTConfig` (labs 14-16), for sequences of `seq` tokens (its block size)."""
        return cls(
            layers=config.n_layer,
            hidden=config.n_embd,
            heads=config.n_head,
            seq=seq or config.block_size,
            vocab=config.vocab_size,
            name=name,
        )

    def parameters(self) -> float:
        """12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)): Narayanan et al.'s count (their equation 2)."""
        layers, h = self.layers, self.hidden
        return 12 * layers * h**2 * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * layers * h))


@dataclass(frozen=True)
class Layout:
    """How a step is cut: data x tensor x pipeline x context ranks, ZeRO stage, micro-batches, recomputation."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    zero: int = 0
    micro_batch: int = 1
    batch: int = 1  # the global batch, in sequences
    recompute: str = "none"
    precision: str = "mixed"
    sequence_parallel: bool = False
    interleave: int = 1  # v: model chunks per pipeline rank (the interleaved 1F1B schedule; 1: plain 1F1B)

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipeline * self.context

    @property
    def micro_batches(self) -> int:
        """m = B / (d b): micro-batches per pipeline and iteration."""
        return self.batch // (self.data * self.micro_batch)

    @property
    def label(self) -> str:
        extras = [f"ZeRO-{self.zero}"] if self.zero else []
        extras += [] if self.recompute == "none" else [f"{self.recompute} recompute"]
        extras += ["SP"] if self.sequence_parallel else []
        extras += [f"v{self.interleave}"] if self.interleave > 1 else []
        extras += [] if self.precision == "mixed" else [self.precision]
        return f"d{self.data} t{self.tensor} p{self.pipeline} c{self.context} b{self.micro_batch}" + (
            " " + ", ".join(extras) if extras else ""
        )

    def with_(self, **changes: object) -> Layout:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TransformerPrediction:
    """One layout's predicted step: seconds by part (`TIME_PARTS`), bytes of the busiest rank by part."""

    gpt: GPT
    layout: Layout
    seconds: dict[str, float]
    memory: dict[str, float]

    @property
    def time(self) -> float:
        return sum(self.seconds.values())

    @property
    def peak(self) -> float:
        return sum(self.memory.values())

    def model_flops_per_device(self) -> float:
        """FLOP/s per device as Narayanan et al. count them (full recomputation's FLOPs, whatever was run)."""
        return iteration_flops(self.gpt, self.layout.batch, "full") / self.time / self.layout.devices


def problem(gpt: GPT, layout: Layout) -> str | None:
    """Why the layout cannot run this GPT (the first reason found), or None."""
    lay = layout
    for name, value in asdict(lay).items():
        if name in ("data", "tensor", "pipeline", "context", "micro_batch", "batch", "interleave") and value < 1:
            return f"{name} = {value}: every dimension needs at least 1"
    if lay.zero not in (0, 1, 2, 3):
        return f"ZeRO stage {lay.zero} does not exist: choose 0, 1, 2 or 3"
    if lay.recompute not in RECOMPUTE:
        return f"recompute {lay.recompute!r}: choose one of {', '.join(RECOMPUTE)}"
    if lay.precision not in PRECISIONS:
        return f"precision {lay.precision!r}: choose one of {', '.join(PRECISIONS)}"
    if gpt.heads % lay.tensor or gpt.hidden % lay.tensor:
        return f"tensor {lay.tensor} does not divide the {gpt.heads} heads and the hidden size {gpt.hidden}"
    if gpt.layers % (lay.pipeline * lay.interleave):
        chunks = f" x {lay.interleave} chunks" if lay.interleave > 1 else ""
        return f"pipeline {lay.pipeline}{chunks} does not divide the {gpt.layers} layers"
    if gpt.seq % (2 * lay.context if lay.context > 1 else 1):
        return f"context {lay.context} does not divide the sequence of {gpt.seq} into 2c zig-zag blocks"
    if lay.batch % (lay.data * lay.micro_batch):
        return (
            f"data {lay.data} x micro-batch {lay.micro_batch} does not divide the global batch of {lay.batch} sequences"
        )
    if lay.interleave > 1 and lay.micro_batches % lay.pipeline:
        return (
            f"pipeline {lay.pipeline} does not divide the {lay.micro_batches} micro-batches, "
            "which the interleaved schedule takes in groups of p"
        )
    return None


def iteration_flops(gpt: GPT, batch: int, recompute: str) -> float:
    """FLOPs of one iteration of `batch` sequences (full recomputation: Narayanan et al.'s 96 B s l h^2 (...))."""
    s, h, v = gpt.seq, gpt.hidden, gpt.vocab
    layer_forward = 24 * s * h**2 + 4 * s**2 * h
    rerun = {"none": 0.0, "selective": 4 * s**2 * h, "full": layer_forward}[recompute]
    return batch * (gpt.layers * (3 * layer_forward + rerun) + 3 * 2 * s * h * v)


def stage_parameters(gpt: GPT, layout: Layout) -> float:
    """Parameters a rank of the busiest stage holds: its l/p layers and the word (and position) embeddings, / t."""
    h = gpt.hidden
    layer = 12 * h**2 + 13 * h
    embedding = gpt.vocab * h + gpt.seq * h  # the first stage; the last keeps its copy of the word embedding
    return (gpt.layers // layout.pipeline * layer + embedding) / layout.tensor


def memory_per_rank(
    psi: float,
    s: int,
    b: int,
    h: int,
    a: int,
    layers: float,
    t: int,
    d: int,
    zero: int,
    recompute: str,
    sequence_parallel: bool = False,
    precision: str = "mixed",
) -> dict[str, float]:
    """Bytes a rank holds (Exercise 16.4): ZeRO's split of 16 bytes per parameter, Korthikanti's activations."""
    weights, grads, optimizer = PRECISIONS[precision]
    shard = {0: (1, 1, 1), 1: (1, 1, d), 2: (1, d, d), 3: (d, d, d)}[zero]
    act_bytes = weights  # activations in the training precision
    if recompute == "full":
        kept = s * b * h * act_bytes / (t if sequence_parallel else 1)  # each layer's input
        working = activation_bytes_per_layer(s, b, h, a, t, sequence_parallel, act_bytes)
        activations = layers * kept + working
    else:
        per_layer = activation_bytes_per_layer(s, b, h, a, t, sequence_parallel, act_bytes)
        if recompute == "selective":
            per_layer -= (2 * act_bytes + 1) * a * s / h * s * b * h / t
        activations = layers * per_layer
    return {
        "parameters": weights * psi / shard[0],
        "gradients": grads * psi / shard[1],
        "optimizer": optimizer * psi / shard[2],
        "activations": activations,
    }


def rank_memory(gpt: GPT, layout: Layout) -> dict[str, float]:
    """Bytes of the busiest rank: the first stage (min(p, m) micro-batches in flight under 1F1B; with v chunks,
    min(2(p-1) + (v-1)p + 1, v m) chunks of l/(p v) layers) or the last (the logits)."""
    lay = layout
    s_local = gpt.seq // lay.context
    v = lay.interleave
    chunks = min(warmup_forwards(lay.pipeline, lay.micro_batches, 0, v) + 1, v * lay.micro_batches)
    psi = stage_parameters(gpt, lay)

    def held(layers: float) -> dict[str, float]:
        return memory_per_rank(
            psi,
            s_local,
            lay.micro_batch,
            gpt.hidden,
            gpt.heads,
            layers,
            lay.tensor,
            lay.data * lay.context,
            lay.zero,
            lay.recompute,
            lay.sequence_parallel,
            lay.precision,
        )

    first = held(gpt.layers // (lay.pipeline * v) * chunks)
    last = held(gpt.layers // lay.pipeline)
    logits = max(4, PRECISIONS[lay.precision][0])  # the loss's logits in float32 at least
    last["activations"] += logits * lay.micro_batch * s_local * gpt.vocab / lay.tensor
    return max(first, last, key=lambda m: sum(m.values()))


def step_time(gpt: GPT, layout: Layout, platform: Platform) -> dict[str, float]:
    """Seconds of one iteration by part (Exercise 16.5): compute, bubble, tensor, context, pipeline, data."""
    lay = layout
    e = PRECISIONS[lay.precision][0]
    m, b, h, s = lay.micro_batches, lay.micro_batch, gpt.hidden, gpt.seq
    stage_layers = gpt.layers // lay.pipeline
    reruns = 1 if lay.recompute == "full" else 0
    busy = min(lay.devices, platform.devices_per_node)
    compute = iteration_flops(gpt, lay.batch, lay.recompute) / lay.devices / platform.flops * platform.slowdown(busy)
    bubble = (lay.pipeline - 1) / (lay.interleave * m) * compute  # (p-1)/(v m) of the compute
    tokens = b * (s // lay.context) * h  # elements of one micro-batch's activation on a rank
    tensor = m * stage_layers * (4 + 2 * reruns) * platform.comm("allreduce", tokens * e, lay.tensor)
    kv = 2 * b * s * h / lay.tensor * e  # keys and values of the whole sequence, this rank's heads
    ring = lay.context, lay.tensor
    context = (
        m
        * stage_layers
        * ((2 + reruns) * platform.comm("allgather", kv, *ring) + platform.comm("reduce_scatter", kv, *ring))
    )
    pipeline = 0.0
    if lay.pipeline > 1:
        stride = lay.tensor * lay.context * lay.data
        pipeline = 2 * lay.interleave * m * platform.comm("p2p", tokens / lay.tensor * e, 2, stride=stride)
    replicas, stride = lay.data * lay.context, lay.tensor
    grads = stage_parameters(gpt, lay) * e
    if lay.zero == 3:
        # lab 13's engine: each unit's parameters allgathered before its forward and its backward, and its
        # gradient reduce-scattered after every backward, so once per micro-batch
        data = m * (
            2 * platform.comm("allgather", grads, replicas, stride)
            + platform.comm("reduce_scatter", grads, replicas, stride)
        )
    else:
        data = platform.comm("allreduce", grads, replicas, stride)
    return {
        "compute": compute,
        "bubble": bubble,
        "tensor": tensor,
        "context": context,
        "pipeline": pipeline,
        "data": data,
    }


def predict(gpt: GPT, layout: Layout, platform: Platform) -> TransformerPrediction:
    """Time by part and memory of the busiest rank of one iteration; ValueError if the layout cannot run."""
    reason = problem(gpt, layout)
    if reason:
        raise ValueError(f"{layout.label} cannot run {gpt.name or 'this GPT'}: {reason}")
    return TransformerPrediction(gpt, layout, step_time(gpt, layout, platform), rank_memory(gpt, layout))


def predict_step(layout: Layout, model: GPT, platform: Platform) -> tuple[float, float]:
    """(seconds per iteration, bytes of the busiest rank): one layout of one GPT on a platform (lab 16's mesh)."""
    pred = predict(model, layout, platform)
    return pred.time, pred.peak
