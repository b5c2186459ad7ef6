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
- context: the keys and values go round the ring: an allgather of 2 b s w / t elements
  (w = kv_width, the key/value heads' width: h without grouped-query attention) forward, an
  allgather and a reduce-scatter (their gradients) backward, another allgather when the
  forward is recomputed;
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
  stage 3 also holds the whole parameters of the unit it computes and, with `overlap`, of the one it gathers ahead
  ("gathered": the embeddings' unit, the output layer being the loss's, or a layer; and a layer);
- activations (Korthikanti et al., section 4, `ddlab.tensor_parallel.formulas`): a layer keeps
  sbh (10 + 24/t + 5as/(ht)) bytes at 2-byte activations, sbh (34/t + 5as/(ht)) with sequence
  parallelism, with s the rank's s/c tokens; selective recomputation drops the attention
  term 5as/(ht); full recomputation keeps only each layer's input, 2sbh (/t with sequence
  parallelism), plus one layer's whole activations while it is recomputed; under 1F1B the
  first stage holds min(p, m) micro-batches of its l/p layers; the last stage also keeps
  copies of its b (s/c) V / t logits for the loss (`LOSSES`: a float32 copy beside the 16-bit logits for
  Megatron-Core's own fused loss, three float32 copies at the backward of torch's eager cross entropy, the 16-bit
  logits alone under a kernel that writes the gradient over them), at a moment when no layer reruns;
  torchtitan's op-level checkpointing (`OP`) keeps each layer's input and what its policy saves.

The models of 2024-26 (`GPT`'s options, GPT-3's block by default): grouped- and multi-query attention,
gated MLPs of any width, RMSNorm, rotary positions, untied embeddings, mixtures of experts; their
parameters, FLOPs (`GPT.layer_flops`) and activation bytes per layer (`layer_activations`) derived term by
term and equal, within 1%, to what torch counts on a small model of each shape
(tests/test_oracle_transformer_models.py). Under context parallelism a rank keeps no (s/c) x (s/c) softmax
block: ring attention (lab 15) keeps its output and a float32 log-sum-exp per row and head, as the "flash"
kernel does (`Layout.kernel`). Recipes (`Layout.precision`, a name of `RECIPES` or a `Precision`): bytes of
weights, gradients, Adam's state, activations, all-gathered parameters and reduced gradients, and the
format the linear layers compute in (`Platform.rate`: float8 at its own rate, the attention's scores and the
output layer in 16 bits). `layout_time` adds to `step_time` what the exercise leaves out: the attention at its
kernel's pace (`attention_pace`: a flash kernel's causal half, at the rates measured on the GPU where there are
any), expert parallelism (`Layout.expert`, carved from the d c ranks of the same weights) with its all-to-alls,
and the data collectives overlapped with the compute (`Layout.overlap`: ZeRO-3/FSDP gathers layer by layer).

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

from dataclasses import dataclass, replace
from typing import Any

from ..pipeline.interleaved import warmup_forwards
from ..runtime.reference import reference
from ..tensor_parallel.formulas import activation_bytes_per_layer
from .platform import Platform
from .schedules import SCHEDULES, check_schedule, idle_per_rank, in_flight, split_flops

RECOMPUTE = ("none", "selective", "full")
#: torchtitan's op-level selective checkpointing (`selective_ac_option = "op"`; its parallelize_llama.py at 9dec370,
#: `_save_list` and `_custom_policy`), a fourth `Layout.recompute` beside `RECOMPUTE` (which lab 16's exercises and
#: the layout search take): a block reruns its forward in the backward, keeping only its input and what the policy
#: saves, the output of every other matrix multiplication (`aten.mm`: q, v, and a SwiGLU's gate and down projection
#: or a GELU MLP's first layer) and of the attention kernel (its output and a float32 log-sum-exp per row and head).
#: Priced for torchtitan's Llama blocks as they run there: dense, without biases (a linear layer with a bias is an
#: `addmm`, which the policy does not save) or dropout, on one tensor and one context rank, with a flash kernel.
OP = "op"
NORMS = ("layernorm", "rmsnorm")
#: Bytes per parameter (weights, gradients, Adam's state); activations take the weights' size.
PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8), "fp64": (8, 8, 16)}


@dataclass(frozen=True)
class Precision:
    """A training recipe's bytes per element of what a rank keeps and sends, and the rate its layers compute at.

    weights: the copy of a parameter the layers compute with; gradients: a parameter's gradient as it is kept;
    optimizer: Adam's state per parameter (a float32 master copy, momentum and variance: 12); activations:
    what a layer keeps for backward and what tensor, context, pipeline and expert parallelism send;
    allgather: a parameter as ZeRO-3 (FSDP) all-gathers it (1 when the all-gather sends float8 with its
    scales cast per tensor, as torchao's float8 FSDP does); reduce: a gradient as it is reduced;
    compute: which of the platform's rates the linear layers run at ("bf16", "fp8"; "fp32" and "fp64" take
    `platform.flops`); the attention's scores and the output layer stay in 16 bits (`Platform.rate`).
    """

    weights: float = 2
    gradients: float = 2
    optimizer: float = 12
    activations: float = 2
    allgather: float = 2
    reduce: float = 2
    compute: str = "bf16"


#: The named recipes `Layout.precision` takes (or a `Precision` of your own): "mixed" and "bf16" are
#: bfloat16 mixed precision with float32 Adam state (Rajbhandari et al.'s 2 + 2 + 12 bytes); "fp8" the same
#: state with float8 matrix multiplications and float8 all-gathers (activations kept in 16 bits; with the "fused"
#: kernels the linear layers' inputs in float8, `KERNELS`);
#: "fp32" and "fp64" everything in that type, 8 and 16 bytes of Adam state.
RECIPES = {
    "mixed": Precision(),
    "bf16": Precision(),
    "fp8": Precision(allgather=1, compute="fp8"),
    "fp32": Precision(4, 4, 8, 4, 4, 4, "fp32"),
    "fp64": Precision(8, 8, 16, 8, 8, 8, "fp64"),
}
#: The kernels `Layout.kernel` takes: "local" (lab 14's attention, keeping its s x s softmax), "flash" (the
#: attention keeps a log-sum-exp per row and head and skips the masked blocks), "fused" (flash attention and
#: Megatron-Core's fused SwiGLU, which keeps only its input, gate and up, for its backward, and recomputes
#: silu(gate) there: megatron/core/fusions/fused_bias_swiglu.py, `SwiGLUFunction`; the down projection keeps the
#: product, so a gated MLP keeps 3 ffn values per token instead of eager torch's 4; its experts' SwiGLU,
#: `WeightedSwiGLUFunction`, also keeps the token's gate, by which it weighs the activation, so no expert's output is
#: kept, as in Megatron-Core's experts on every path, where "local" and "flash" keep lab 15's layer, which weighs
#: the experts' outputs: `layer_activations`; and, under a float8 recipe,
#: Transformer Engine's linear layers, each keeping for its weight's gradient the float8 copy of its input it
#: multiplied, one byte an element, "row-wise data" discarded: transformer_engine/pytorch/module/linear.py,
#: `_Linear.forward`; `layer_activations`' `linear_input`).
KERNELS = ("local", "flash", "fused")
#: How the loss is computed (`Layout.loss`): the copies of the rank's b (s/c) V / t logits alive at its peak, as
#: (float32 or wider ones, ones at the activations' width beside them); with activations of 4 bytes or more the
#: logits are their own float32 copy, so the larger count of the two, at the activations' width. "fused": a cross
#: entropy that keeps its float32 softmax and forms the gradient in place, beside the 16-bit logits it copied
#: (Megatron-Core's vocabulary-parallel one, megatron/core/tensor_parallel/cross_entropy.py: `.float()` in
#: `calculate_logits_max`, its gradient cast back to 16 bits): (1, 1). "eager": torch's `cross_entropy` on a float32
#: copy of the logits, the logits dropped before the backward (torchtitan's train.py at 9dec370: `del pred`): its
#: log-softmax's saved output, the gradient coming in and the one going out, (3, 0). "in-place": Transformer
#: Engine's `parallel_cross_entropy` (transformer_engine/pytorch/cross_entropy.py; Megatron-Core's
#: `cross_entropy_fusion_impl="te"`, which Megatron-Bridge's performance scripts set for every run,
#: scripts/performance/utils/helpers.py, `set_common_perf_overrides`): its forward kernel writes the gradient over
#: the logits it was given, a row at a time, and keeps them, with a float32 loss a token, (0, 1). "parallel": torch's
#: `loss_parallel` (torch/distributed/tensor/parallel/loss.py; torchtitan's loss under tensor parallelism), the eager
#: loss on each rank's share of the vocabulary: its backward forms zeros, the exponent of the saved log-probabilities,
#: their sum and the product with the gradient, beside those log-probabilities, (4, 0).
#: tests/test_oracle_transformer_modern.py measures each on a small model.
LOSSES = {"fused": (1, 1), "eager": (3, 0), "in-place": (0, 1), "parallel": (4, 0)}
#: The share of a causal model's score blocks a "flash" kernel computes: it skips the blocks above the diagonal,
#: every key after every query (Dao, "FlashAttention-2", 2023, section 3.1: about half), so it does half the
#: attention's 4 s^2 h; Megatron-Bridge's model FLOPs count halves that term too (its llama3_flops:
#: 12 s/h x 0.5 for causal self-attention). The "local" kernel (lab 14's, Narayanan et al.'s count) computes the
#: whole s x s block and masks it.
CAUSAL_SHARE = 0.5
TIME_PARTS = ("compute", "bubble", "tensor", "context", "pipeline", "data")
#: The parts `layout_time` adds to `step_time`'s: the experts' all-to-alls.
EXTRA_PARTS = ("expert",)
MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class GPT:
    """A GPT as Narayanan et al. describe it (layers, hidden size, heads, sequence, vocabulary), and the options of
    the models of 2024-26; the defaults are GPT-3's block, so `GPT(layers, hidden, heads)` is Narayanan et al.'s.

    - `kv_heads`: heads of keys and values (0: as many as `heads`; 1: multi-query; between: grouped-query);
      `head_dim`: a head's width (0: hidden / heads; Qwen3's and Gemma's are wider, so q is heads x head_dim
      wide, not h);
    - `ffn`: the MLP's width (0: 4h); `gated`: a gated MLP (SwiGLU: gate and up projections of width `ffn`,
      their product into the down projection) instead of GELU's two layers;
    - `norm`: "layernorm" (a scale and a shift) or "rmsnorm" (a scale); `qk_norm`: a norm of that kind over each
      head's queries and keys before the rotary embedding, one of head_dim for the queries and one for the keys
      (Qwen3's: Yang et al., "Qwen3 Technical Report", 2025, section 2); `rotary`: rotary position embedding,
      no position parameters (else learned positions, s h of them); `tied`: the output layer is the word
      embedding (else a second V h matrix); `bias`: the linear layers have biases; `dropout`: dropout after
      the attention's softmax and on both residual branches (its masks kept for backward);
    - a mixture of experts (`experts` E > 0): every `moe_every`-th layer's MLP is a router (h x E) and E
      routed experts of width `expert_ffn` (0: `ffn`), each token sent to `top_k` of them, plus
      `shared_experts` that every token passes; `capacity`: the capacity factor (each expert computes
      capacity k T / E token slots, padded or dropped; 0: dropless, exactly k T slots).
    """

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    name: str = ""
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0
    gated: bool = False
    norm: str = "layernorm"
    qk_norm: bool = False
    rotary: bool = False
    tied: bool = True
    bias: bool = True
    dropout: bool = True
    experts: int = 0
    top_k: int = 1
    shared_experts: int = 0
    expert_ffn: int = 0
    capacity: float = 0.0
    moe_every: int = 1

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r}: choose one of {', '.join(NORMS)}")
        if min(self.layers, self.hidden, self.heads, self.seq, self.vocab) < 1:
            raise ValueError(f"layers, hidden, heads, seq and vocab must be at least 1: {self}")
        if min(self.kv_heads, self.head_dim, self.ffn, self.expert_ffn) < 0:
            raise ValueError(f"kv_heads, head_dim, ffn and expert_ffn are 0 (the default) or more: {self}")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(
                f"{self.heads} heads do not divide the hidden size {self.hidden}: give head_dim, a head's width"
            )
        if self.heads % self.kv_heads_:
            raise ValueError(
                f"{self.kv_heads_} key/value heads do not divide the {self.heads} heads: "
                "choose kv_heads among its divisors"
            )
        if self.experts and not (1 <= self.top_k <= self.experts and 1 <= self.moe_every <= self.layers):
            raise ValueError(
                f"a mixture of {self.experts} experts routes each token to 1 to {self.experts} of them (top_k = "
                f"{self.top_k}) on every n-th layer, 1 <= n <= {self.layers} (moe_every = {self.moe_every})"
            )
        if self.capacity < 0 or self.experts < 0 or self.shared_experts < 0:
            raise ValueError("experts, shared_experts and capacity are 0 or more")

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

    @property
    def kv_heads_(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim_(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention's output): heads times the head size (h unless head_dim)."""
        return self.heads * self.head_dim_

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values): key/value heads times the head size."""
        return self.kv_heads_ * self.head_dim_

    @property
    def ffn_(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def expert_ffn_(self) -> int:
        return self.expert_ffn or self.ffn_

    @property
    def moe_layers(self) -> int:
        """How many layers are mixtures of experts: every `moe_every`-th (0 for a dense GPT)."""
        return self.layers // self.moe_every if self.experts else 0

    @property
    def slots(self) -> float:
        """Expert slots a token takes in a MoE layer: top_k (dropless), times the capacity factor if one is set."""
        return self.top_k * (self.capacity or 1.0)

    @reference("block_counts")  # exercise 16.7
    def attention_parameters(self) -> int:
        """q and the output projection h x q_width each, k and v h x kv_width each, and their biases."""
        h, q, kv = self.hidden, self.q_width, self.kv_width
        return 2 * h * q + 2 * h * kv + self.bias * (q + h + 2 * kv)

    @reference("block_counts")  # exercise 16.7
    def mlp_parameters(self, width: int) -> int:
        """An MLP of `width`: 2 (GELU) or 3 (SwiGLU) matrices of h x width, and their biases."""
        h = self.hidden
        return (3 if self.gated else 2) * h * width + self.bias * ((2 if self.gated else 1) * width + h)

    @reference("block_counts")  # exercise 16.7
    def norm_parameters(self, width: int = 0) -> int:
        """A norm's parameters over `width` values (0: the hidden size)."""
        return (2 if self.norm == "layernorm" else 1) * (width or self.hidden)

    @reference("block_counts")  # exercise 16.7
    def layer_parameters(self, moe: bool = False) -> int:
        """A block's parameters: attention, 2 norms (and the queries' and keys' with `qk_norm`), and its MLP (dense,
        or router, E routed and the shared experts)."""
        mlp = self.mlp_parameters(self.ffn_)
        if moe:
            mlp = self.hidden * self.experts + (self.experts + self.shared_experts) * self.mlp_parameters(
                self.expert_ffn_
            )
        heads = 2 * self.norm_parameters(self.head_dim_) if self.qk_norm else 0
        return self.attention_parameters() + 2 * self.norm_parameters() + heads + mlp

    def embedding_parameters(self) -> int:
        """Word embedding, learned positions (none with rotary), the untied output layer, the final norm."""
        h = self.hidden
        return self.vocab * h * (1 if self.tied else 2) + (0 if self.rotary else self.seq * h) + self.norm_parameters()

    def parameters(self) -> float:
        """Every parameter: with GPT-3's defaults 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), Narayanan et al.'s
        count (their equation 2), plus the final LayerNorm's 2h."""
        moe = self.moe_layers
        return float(
            (self.layers - moe) * self.layer_parameters()
            + moe * self.layer_parameters(True)
            + self.embedding_parameters()
        )

    @reference("block_counts")  # exercise 16.7
    def layer_flops(self, moe: bool = False) -> float:
        """Forward FLOPs of a block per sequence: 2 per multiply-add of its matrices (q, k, v, projection: 2 s h (2
        q_width + 2 kv_width)), the attention's scores and weighted values (4 s^2 q_width, every query against
        every key as Narayanan et al. count them), and its MLP (2 s h ffn times 2 or 3 matrices; a MoE layer: the
        router's 2 s h E and the slots' and shared experts' MLPs). With GPT-3's defaults 24 s h^2 + 4 s^2 h."""
        s, h = self.seq, self.hidden
        attention = 2 * s * (2 * h * self.q_width + 2 * h * self.kv_width) + self.attention_score_flops()
        matrices = 3 if self.gated else 2
        if moe:
            mlp = (
                2 * s * h * self.experts + (self.slots + self.shared_experts) * 2 * s * matrices * h * self.expert_ffn_
            )
        else:
            mlp = 2 * s * matrices * h * self.ffn_
        return float(attention + mlp)

    def forward_flops(self) -> float:
        """Forward FLOPs of every block for one sequence."""
        moe = self.moe_layers
        return (self.layers - moe) * self.layer_flops() + moe * self.layer_flops(True)

    def op_rerun_flops(self) -> float:
        """Forward FLOPs per sequence of a dense block's matrix multiplications that op recomputation (`OP`) reruns:
        the even ones in the block's order (q, k, v, projection, then gate, up, down, or the MLP's two layers) whose
        output the backward needs: k, the projection, and a SwiGLU's up (torch's checkpoint stops its rerun once it has
        what the backward needs, so a GELU MLP's second layer never reruns)."""
        s, h = self.seq, self.hidden
        return float(2 * s * h * (self.kv_width + self.q_width + (self.ffn_ if self.gated else 0)))

    @reference("block_counts")  # exercise 16.7
    def attention_score_flops(self) -> float:
        """The attention's 4 s^2 q_width forward FLOPs per layer and sequence (what selective recomputation
        reruns; 4 s^2 h unless head_dim)."""
        return 4.0 * self.seq**2 * self.q_width


@dataclass(frozen=True)
class Layout:
    """How a step is cut: data x tensor x pipeline x context ranks (expert ranks among the data ranks), ZeRO
    stage, micro-batches, recomputation, precision, the attention kernel, overlap of the data collectives."""

    data: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    zero: int = 0
    micro_batch: int = 1
    batch: int = 1  # the global batch, in sequences
    recompute: str = "none"  # a name of `RECOMPUTE`, or `OP` (torchtitan's op-level checkpointing)
    # with recompute="full": how many layers of each chunk rerun (the first ones, Megatron's "block" method with
    # `recompute_num_layers`; the others keep their activations); 0: every layer
    recompute_layers: int = 0
    precision: str | Precision = "mixed"  # a name of RECIPES, or a Precision
    sequence_parallel: bool = False
    interleave: int = 1  # v: model chunks per pipeline rank (the interleaved 1F1B schedule; 1: plain 1F1B)
    expert: int = 1  # expert parallelism: the routed experts split over this many ranks of the same dense weights
    # tensor parallelism inside a routed expert: 1, each expert whole on its rank (its weights not cut by t; a
    # memory estimate that divides them by t as well under-reports a MoE, NVIDIA-NeMo/Megatron-Bridge#3744), or t
    expert_tensor: int = 1
    # `KERNELS`: "local" keeps the attention's s x s softmax, "flash" only a log-sum-exp per row, "fused" also
    # runs a gated MLP's SwiGLU as one kernel that keeps its input only
    kernel: str = "local"
    overlap: bool = False  # the data collectives run under the compute (ZeRO-3/FSDP: layer by layer)
    # the tensor-parallel collectives split into t pieces, each sent while the matrix multiplication it feeds (or
    # follows) computes on the one before (Megatron-Bridge's `tp_comm_overlap`)
    tensor_overlap: bool = False
    # the pipeline schedule (`schedules.SCHEDULES`): "1f1b" (with `interleave` v > 1 the interleaved 1F1B),
    # or a zero-bubble one, "zb-h1", "zb-h2", "zb-v" (lab 17's op lists, priced by `layout_time`)
    schedule: str = "1f1b"
    # stages as even as whole layers allow when p (x chunks) does not divide the layers, as Megatron splits them
    # (for example counting the embedding and the loss as a layer each); every rank is priced as the busiest
    uneven: bool = False
    loss: str = "fused"  # a name of `LOSSES`: the copies of the logits the loss holds at its peak

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
        extras += [f"{self.recompute_layers} a chunk"] if self.recompute == "full" and self.recompute_layers else []
        extras += ["SP"] if self.sequence_parallel else []
        extras += [f"v{self.interleave}"] if self.interleave > 1 else []
        extras += [] if self.precision == "mixed" else [str(self.precision)]
        extras += [f"ep{self.expert}"] if self.expert > 1 else []
        extras += [f"etp{self.expert_tensor}"] if self.expert_tensor > 1 else []
        extras += [] if self.kernel == "local" else [self.kernel]
        extras += ["overlap"] if self.overlap else []
        extras += ["tp-overlap"] if self.tensor_overlap else []
        extras += [] if self.schedule == "1f1b" else [self.schedule]
        extras += ["uneven"] if self.uneven else []
        extras += [] if self.loss == "fused" else [f"{self.loss} loss"]
        return f"d{self.data} t{self.tensor} p{self.pipeline} c{self.context} b{self.micro_batch}" + (
            " " + ", ".join(extras) if extras else ""
        )

    def with_(self, **changes: object) -> Layout:
        return replace(self, **changes)  # type: ignore[arg-type]


def recipe(precision: str | Precision) -> Precision:
    """The Precision of a layout's `precision` (a name of `RECIPES`, or a Precision)."""
    if isinstance(precision, Precision):
        return precision
    if precision not in RECIPES:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(RECIPES)}, or give a Precision")
    return RECIPES[precision]


@dataclass(frozen=True)
class TransformerPrediction:
    """One layout's predicted step: seconds by part (`TIME_PARTS`, `EXTRA_PARTS`), bytes of the busiest rank by part."""

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

    def tokens_per_device(self) -> float:
        """Tokens per second per device."""
        return self.layout.batch * self.gpt.seq / self.time / self.layout.devices


def problem(gpt: GPT, layout: Layout) -> str | None:
    """Why the layout cannot run this GPT (the first reason found), or None."""
    lay = layout
    for name in ("data", "tensor", "pipeline", "context", "micro_batch", "batch", "interleave", "expert"):
        value = getattr(lay, name)
        if value < 1:
            return f"{name} = {value}: every dimension needs at least 1"
    if lay.zero not in (0, 1, 2, 3):
        return f"ZeRO stage {lay.zero} does not exist: choose 0, 1, 2 or 3"
    if lay.recompute not in (*RECOMPUTE, OP):
        return f"recompute {lay.recompute!r}: choose one of {', '.join((*RECOMPUTE, OP))}"
    if lay.recompute == OP:
        if gpt.experts or gpt.bias or gpt.dropout:
            return "op recomputation (torchtitan's policy) is priced for dense blocks without biases or dropout"
        if lay.tensor > 1 or lay.context > 1 or lay.kernel == "local":
            return "op recomputation (torchtitan's policy) is priced on tensor 1 and context 1 with a flash kernel"
    if lay.recompute_layers < 0:
        return f"recompute_layers = {lay.recompute_layers}: how many layers of a chunk rerun, 0 (all) or more"
    if not isinstance(lay.precision, Precision) and lay.precision not in RECIPES:
        return f"precision {lay.precision!r}: choose one of {', '.join(RECIPES)}, or give a Precision"
    if lay.kernel not in KERNELS:
        return f"kernel {lay.kernel!r}: choose one of {', '.join(KERNELS)}"
    if lay.loss not in LOSSES:
        return f"loss {lay.loss!r}: choose one of {', '.join(LOSSES)}"
    if lay.tensor_overlap and lay.tensor > 1 and not lay.sequence_parallel:
        return "tensor_overlap cuts sequence parallelism's all-gathers and reduce-scatters: set sequence_parallel too"
    if gpt.heads % lay.tensor or gpt.hidden % lay.tensor:
        return f"tensor {lay.tensor} does not divide the {gpt.heads} heads and the hidden size {gpt.hidden}"
    if gpt.kv_heads_ % lay.tensor and lay.tensor % gpt.kv_heads_:
        return f"tensor {lay.tensor} does not divide the {gpt.kv_heads_} key/value heads, nor they the tensor ranks"
    if lay.schedule not in SCHEDULES:
        return f"schedule {lay.schedule!r}: choose one of {', '.join(SCHEDULES)}"
    if lay.schedule != "1f1b" and lay.interleave > 1:
        return f"schedule {lay.schedule} has its own chunks (zb-v two in a V, the others one): use interleave 1"
    chunks = lay.pipeline * chunks_per_rank(lay)
    if lay.uneven and gpt.layers < chunks:
        return f"pipeline {lay.pipeline} x {chunks // lay.pipeline} chunks: more chunks than the {gpt.layers} layers"
    if not lay.uneven and lay.schedule == "zb-v" and gpt.layers % chunks:
        return f"pipeline {lay.pipeline} x 2 chunks of zb-v's V does not divide the {gpt.layers} layers (or set uneven)"
    if not lay.uneven and gpt.layers % chunks:
        of = f" x {lay.interleave} chunks" if lay.interleave > 1 else ""
        return f"pipeline {lay.pipeline}{of} does not divide the {gpt.layers} layers (or set uneven)"
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
    if lay.schedule != "1f1b" and lay.pipeline > 1:
        reason = check_schedule(lay.schedule, lay.pipeline, lay.micro_batches)
        if reason:
            return reason
    if (lay.expert > 1 or lay.expert_tensor > 1) and not gpt.experts:
        return "expert parallelism splits a mixture of experts: this GPT has none (experts = 0)"
    if lay.interleave > 1 and lay.pipeline == 1:
        return f"interleave {lay.interleave} chunks a pipeline: with pipeline 1 there is none to interleave"
    if lay.expert_tensor not in (1, lay.tensor):
        return f"expert_tensor {lay.expert_tensor}: an expert is cut by the tensor ranks ({lay.tensor}) or not (1)"
    holders = lay.data * lay.context * lay.tensor // lay.expert_tensor  # ranks that could hold an expert whole
    if lay.expert > 1 and (gpt.experts % lay.expert or holders % lay.expert):
        return (
            f"expert {lay.expert} does not divide the {gpt.experts} experts and the {holders} ranks "
            "(data x context x tensor / expert_tensor) it is carved from"
        )
    return None


def chunks_per_rank(layout: Layout) -> int:
    """Model chunks a pipeline rank holds: zb-v's two (a V), else the interleaved schedule's v."""
    return 2 if layout.schedule == "zb-v" else layout.interleave


def busiest(gpt: GPT, layout: Layout) -> GPT:
    """The GPT every rank is priced as: `gpt` itself, or with `uneven` stages one whose every chunk holds as many
    layers as the busiest, ceil(l / (p k)) for k chunks a rank (the step waits for the slowest stage). Exact for
    splits that give every chunk the same count once the embedding and the loss count as layers (Megatron's
    `account_for_*_in_pipeline_split`, the 405B's 126 + 2 in 64 chunks); an upper bound where l / (p k) is small
    and the chunks could differ by one (65 layers in 8 x 8 chunks are priced as 128, where a rank needs 9).
    `stage_split`, `rank_memory`, `step_time` and `layout_time` price this GPT themselves."""
    chunks = layout.pipeline * chunks_per_rank(layout)
    if not layout.uneven or gpt.layers % chunks == 0:
        return gpt
    return replace(gpt, layers=-(-gpt.layers // chunks) * chunks)


def moe_visits(gpt: GPT, layout: Layout) -> float:
    """How many times a step runs a MoE layer on a rank of the busiest stage: its micro-batches times its l / p
    layers' MoE share (each visit sends its tokens to their experts and back)."""
    gpt = busiest(gpt, layout)
    return layout.micro_batches * (gpt.layers // layout.pipeline) * gpt.moe_layers / gpt.layers


def rerun_share(gpt: GPT, layout: Layout) -> float:
    """The share of the layers whose forward full recomputation reruns: 1, or `recompute_layers` of a chunk's
    l / (p k) (at most all); under op recomputation the share of the layers' linear FLOPs it reruns; else 0."""
    if layout.recompute == OP:
        return gpt.op_rerun_flops() / (gpt.layer_flops() - gpt.attention_score_flops())
    if layout.recompute != "full":
        return 0.0
    if not layout.recompute_layers:
        return 1.0
    chunk = busiest(gpt, layout).layers / (layout.pipeline * chunks_per_rank(layout))
    return min(1.0, layout.recompute_layers / chunk)


def iteration_flops(gpt: GPT, batch: int, recompute: str, share: float = 1.0) -> float:
    """FLOPs of one iteration of `batch` sequences (full recomputation: Narayanan et al.'s 96 B s l h^2 (...));
    `share` (`rerun_share`): of the layers full recomputation reruns, of the linear layers' FLOPs op recomputation
    reruns."""
    forward = gpt.forward_flops()
    scores = gpt.layers * gpt.attention_score_flops()
    rerun = {"none": 0.0, "selective": scores, "full": share * forward, OP: share * (forward - scores)}[recompute]
    return batch * (3 * forward + rerun + 3 * 2 * gpt.seq * gpt.hidden * gpt.vocab)


def attention_passes(recompute: str, share: float = 1.0) -> float:
    """Forward passes of the attention in an iteration: 1, and once more where recomputation reruns it (selective,
    or full on the `share` of the layers it reruns; op recomputation keeps the attention's output)."""
    return 1.0 + {"none": 0.0, "selective": 1.0, "full": share, OP: 0.0}[recompute]


def attention_flops(gpt: GPT, batch: int, recompute: str, share: float = 1.0) -> float:
    """The attention's scores and weighted values in an iteration of `batch` sequences: 4 s^2 h per layer and
    sequence forward (`attention_passes` of them), twice that backward."""
    return batch * gpt.layers * (attention_passes(recompute, share) + 2) * gpt.attention_score_flops()


def _per_rank(layout: Layout, platform: Platform) -> float:
    """What a rank's share of an iteration's FLOPs is divided by: its N devices, slowed by the contention of the
    min(N, devices per node) devices of a node computing at once."""
    return platform.slowdown(min(layout.devices, platform.devices_per_node)) / layout.devices


def attention_pace(gpt: GPT, layout: Layout, platform: Platform) -> tuple[float, float]:
    """Seconds per FLOP of the attention's forward count (4 s^2 h a layer and sequence: the whole score block) that
    one forward pass and one backward pass take on a device: the "local" kernel computes the whole block at the
    16-bit rate, forward, and twice that backward; a flash kernel computes its causal half (`CAUSAL_SHARE`), at the
    rates the platform measured for it (`Platform.attention_rates`, with heads `head_dim` wide on the s / c
    queries of a rank; those benchmarks count a backward as 2.5 forwards, five matrix multiplications to two),
    else at the 16-bit rate."""
    if layout.kernel == "local":
        return 1 / platform.flops, 2 / platform.flops
    rates = platform.attention_rates(layout.kernel, gpt.head_dim_, gpt.seq // layout.context)
    if rates is None:
        return CAUSAL_SHARE / platform.flops, 2 * CAUSAL_SHARE / platform.flops
    forward, backward = rates
    return CAUSAL_SHARE / forward, 2.5 * CAUSAL_SHARE / backward


def attention_seconds(gpt: GPT, layout: Layout, platform: Platform) -> tuple[float, float]:
    """(forward, backward) seconds a rank spends in the attention's kernels in an iteration of `gpt` (the GPT it
    is priced as: `busiest`): `attention_passes` forwards (with recomputation's reruns) and one backward, at
    `attention_pace`."""
    forward, backward = attention_pace(gpt, layout, platform)
    score = layout.batch * gpt.layers * gpt.attention_score_flops() * _per_rank(layout, platform)
    return attention_passes(layout.recompute, rerun_share(gpt, layout)) * score * forward, score * backward


def sixteen_bit_flops(gpt: GPT, batch: int, recompute: str, share: float = 1.0) -> float:
    """The part of `iteration_flops` that stays in 16 bits under a float8 recipe: the attention's scores and
    weighted values (with their rerun under recomputation) and the output layer."""
    return attention_flops(gpt, batch, recompute, share) + batch * 3 * 2 * gpt.seq * gpt.hidden * gpt.vocab


def stage_split(gpt: GPT, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters a rank of the busiest stage holds: its l/p layers (the MoE layers' share of them
    at their average) and the embeddings, / t; the routed experts / (expert ranks x expert_tensor) instead."""
    gpt = busiest(gpt, layout)
    layers = gpt.layers // layout.pipeline
    share = gpt.moe_layers / gpt.layers
    routed = gpt.experts * gpt.mlp_parameters(gpt.expert_ffn_)
    per_layer = gpt.layer_parameters() * (1 - share) + (gpt.layer_parameters(True) - routed) * share
    dense = (layers * per_layer + stage_embeddings(gpt, layout)) / layout.tensor
    return dense, layers * share * routed / (layout.expert_tensor * layout.expert)


def stage_embeddings(gpt: GPT, layout: Layout) -> float:
    """The embeddings' parameters the busiest stage holds, before the tensor split: the first stage's word (and
    learned position) embedding; the last keeps its copy of the word embedding, or the untied output layer, both on
    one stage when p = 1 (and under zb-v, whose rank 0 ends the V too)."""
    h = gpt.hidden
    embedding = gpt.vocab * h + (0 if gpt.rotary else gpt.seq * h)
    if (layout.pipeline == 1 or layout.schedule == "zb-v") and not gpt.tied:
        embedding += gpt.vocab * h
    return float(embedding)


def stage_parameters(gpt: GPT, layout: Layout) -> float:
    """Parameters a rank of the busiest stage holds: its l/p layers and the word (and position) embeddings, / t
    (the routed experts / the expert ranks too)."""
    return sum(stage_split(gpt, layout))


@reference("memory_per_rank")
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


def layer_activations(
    gpt: GPT,
    s: int,
    b: int,
    t: int,
    sequence_parallel: bool,
    e: float,
    recompute: str,
    moe: bool,
    kernel: str,
    expert_tensor: int | None = None,
    linear_input: float | None = None,
) -> float:
    """Bytes one block keeps for backward per micro-batch on a rank, Korthikanti et al.'s terms (section 4) for any
    block: per token, whole on every tensor rank (split too with sequence parallelism) the two norms' inputs and the
    attention's and MLP's inputs (4h elements of e bytes) and the residual dropout masks (2h bytes); split over t: q
    and the projection's input (q_width each: h unless head_dim), k and v (2 kv_width; with `qk_norm` q and k
    once more, the norms' inputs, and a float32 mean and reciprocal root mean square a head, or the latter only),
    the MLP's 2 ffn (GELU: its input and output) or 4 ffn (SwiGLU: gate, up, silu(gate), their product; 3 with the
    "fused" kernel, which recomputes silu(gate) in its backward), and the attention's (2e + 1) a s (softmax,
    dropped probabilities, their mask; e a s without dropout; with the "flash" or "fused" kernel, and always under
    context parallelism's ring, only a float32 log-sum-exp per head, 4a bytes; none under selective
    recomputation). A MoE layer keeps, whole, its router's float32 probabilities and top-k choices (4E + 8k bytes
    per token) and per expert slot the token sent and the expert's output (2h elements; the token only under the
    "fused" kernel with gated experts: Megatron-Core's weighted SwiGLU multiplies the activation by the gate,
    megatron/core/fusions/fused_bias_swiglu.py, `weighted_bias_swiglu_impl`, and its all-to-all dispatcher
    unpermutes without the gates, megatron/core/transformer/moe/token_dispatcher.py, `combine_postprocess`) and
    the routing's bookkeeping (the token's and its gate's int64 indices, the float32 gate: 20 bytes), and split each
    slot's and shared expert's MLP (the routed experts' over `expert_tensor` ranks, t if None, without sequence
    parallelism; with it every rank routes its own s/t tokens). The hidden-size norms' statistics (a few floats
    per token) are not counted, as Korthikanti et al. do not. With GPT-3's defaults: sbh (10 + 24/t + 5as/(ht)) at
    e = 2 (`memory_per_rank`).

    `linear_input`: bytes per element a linear layer keeps of its input for its weight's gradient, its own copy (a
    float8 kernel's: 1), where None keeps the input itself at e bytes. It prices the attention's input (one copy for
    q, k and v), the projection's (a flash kernel keeps its output, that input, at e bytes beside), the MLP's (the
    gate and up share one) and its down projection's, and each expert slot's token; a MoE layer's router keeps the
    MLP's input at e bytes, and each shared expert its copy.

    Under op recomputation (`OP`) a block keeps its input and what the policy saves: q, v, the attention's output
    and its float32 log-sum-exp per head, the MLP's gate (SwiGLU) or first layer's output, and a SwiGLU's down
    projection's output (h); on one tensor rank, a dense block (`problem` says so of a layout)."""
    h, a, kv = gpt.hidden, gpt.heads, gpt.kv_width
    if recompute == OP:
        if moe or t > 1:
            raise ValueError("op recomputation (torchtitan's policy) is priced for dense blocks on one tensor rank")
        return s * b * (e * (h + 2 * gpt.q_width + kv + gpt.ffn_ + (h if gpt.gated else 0)) + 4.0 * a)
    acts = (3 if kernel == "fused" else 4) if gpt.gated else 2
    f = e if linear_input is None else linear_input
    mlp = (acts - 1) * e + f  # an MLP's bytes per ffn value: the last one it keeps is the down projection's input
    whole = (2 * e + f) * h + (2 * h if gpt.dropout else 0)  # the norms' inputs, the attention's input
    # q and the attention's output (a flash kernel keeps it; lab 14's keeps its probabilities instead), the
    # projection's input (that output, or its own copy), k and v
    output = e if kernel != "local" and linear_input is not None else 0.0
    split = (e + f + output) * gpt.q_width + 2 * e * kv
    if gpt.qk_norm:  # the queries' and keys' norms keep their inputs and, per head, float32 statistics
        split += e * (gpt.q_width + kv) + (8 if gpt.norm == "layernorm" else 4) * (gpt.heads + gpt.kv_heads_)
    routed = 0.0  # the routed experts' MLP activations, on this rank
    if moe:
        shared_inputs = 0.0 if linear_input is None else gpt.shared_experts * f * h
        # Megatron-Core's fused kernels weigh a gated expert's activation by its gate (a weighted SwiGLU), so no
        # expert's output is kept for the gate's gradient
        expert_output = 0.0 if kernel == "fused" and gpt.gated else e
        whole += e * h + shared_inputs + 4 * gpt.experts + 8 * gpt.top_k + gpt.slots * ((expert_output + f) * h + 20)
        split += gpt.shared_experts * mlp * gpt.expert_ffn_
        cut = t if sequence_parallel or expert_tensor is None else expert_tensor
        routed = s * b * gpt.slots * mlp * gpt.expert_ffn_ / cut
    else:
        whole += f * h
        split += mlp * gpt.ffn_
    if recompute == "selective":
        scores = 0.0
    elif kernel != "local":  # flash attention
        scores = 4.0 * a
    else:
        scores = ((2 * e + 1) if gpt.dropout else e) * a * s
    if sequence_parallel:
        return s * b * (whole + split + scores) / t + routed
    return s * b * (whole + (split + scores) / t) + routed


def rank_memory(gpt: GPT, layout: Layout) -> dict[str, float]:
    """Bytes of the busiest rank: the first stage (min(p, m) micro-batches in flight under 1F1B; with v chunks,
    min(2(p-1) + (v-1)p + 1, v m) chunks of l/(p v) layers) or the last (its layers and the loss: `LOSSES`' copies
    of the logits, never beside a rerun layer's activations, as the loss's backward comes before any layer's; with v
    chunks the last rank holds (v-1)p + 1 of them then). A zero-bubble schedule keeps what its op list keeps alive
    (`schedules.in_flight`: F done, W not yet) on the first and the last stage; under zb-v rank 0 holds the V's
    first and last chunk (l/(2p) layers each), and the loss. Not counted: the logits' gradient that a zero-bubble
    schedule deferring the output layer's weight gradient would keep until its W.

    The state is split as ZeRO splits it over the d c ranks of the same weights (the routed experts over the d c t /
    (expert x expert_tensor) ranks that hold the same experts); activations as `layer_activations` counts them, the
    MoE layers at their share of a stage's layers. Under context parallelism the rank's s/c rows keep no (s/c) x
    (s/c) softmax block: ring attention (lab 15) keeps its output and a log-sum-exp per row and head, as the "flash"
    kernel does. ZeRO-3 over more than one rank also holds, at the recipe's all-gather width, the whole parameters
    of the unit it computes ("gathered": the embeddings' unit on a stage that holds embeddings, the output layer the
    last stage's loss needs for its backward, else a layer) and, with `overlap`, of the one it gathers ahead (FSDP's
    prefetch: a layer); 0 otherwise."""
    lay, gpt = layout, busiest(gpt, layout)
    prec = recipe(lay.precision)
    s_local = gpt.seq // lay.context
    v = lay.interleave
    chunks = min(warmup_forwards(lay.pipeline, lay.micro_batches, 0, v) + 1, v * lay.micro_batches)
    dense, expert = stage_split(gpt, lay)
    replicas = lay.data * lay.context
    shard = {0: (1, 1, 1), 1: (1, 1, replicas), 2: (1, replicas, replicas), 3: (replicas,) * 3}[lay.zero]
    expert_holders = replicas * lay.tensor // (lay.expert * lay.expert_tensor)
    expert_shard = [n if n == 1 else expert_holders for n in shard]
    state = {
        part: size * (dense / shard[i] + expert / expert_shard[i])
        for i, (part, size) in enumerate(
            (("parameters", prec.weights), ("gradients", prec.gradients), ("optimizer", prec.optimizer))
        )
    }
    # ZeRO-3 (FSDP) also holds the whole parameters of the unit computing (at the last stage's loss, the embeddings'
    # unit, with the output layer the loss's backward needs) and, overlapped, of the one it gathers ahead (a layer)
    state["gathered"] = 0.0
    if lay.zero == 3 and replicas > 1:
        embeddings = stage_embeddings(gpt, lay) / lay.tensor
        one_layer = (dense + expert - embeddings) / (gpt.layers // lay.pipeline)
        state["gathered"] = prec.allgather * (max(embeddings, one_layer) + (one_layer if lay.overlap else 0.0))
    kernel = "flash" if lay.context > 1 and lay.kernel == "local" else lay.kernel
    e = prec.activations
    float8_inputs = 1.0 if kernel == "fused" and prec.compute == "fp8" else None  # Transformer Engine's linear layers

    def layer(moe: bool, recompute: str) -> float:
        return layer_activations(
            gpt,
            s_local,
            lay.micro_batch,
            lay.tensor,
            lay.sequence_parallel,
            e,
            recompute,
            moe,
            kernel,
            lay.expert_tensor,
            float8_inputs,
        )

    share = gpt.moe_layers / gpt.layers

    def average(recompute: str) -> float:  # a layer's, the MoE layers at their share
        return layer(False, recompute) * (1 - share) + (layer(True, recompute) * share if share else 0.0)

    if lay.recompute == "full":
        rerun = rerun_share(gpt, lay)
        inputs = s_local * lay.micro_batch * gpt.hidden * e / (lay.tensor if lay.sequence_parallel else 1)
        kept = rerun * inputs + (1 - rerun) * average("none")  # the layers not rerun keep everything
        working = max(layer(False, "none"), layer(True, "none") if share else 0.0)
    elif lay.recompute == OP:
        # what the policy saved; while a layer's backward reruns it, that layer holds what it keeps without
        # recomputation and the down projection's output the policy saved beside (a SwiGLU's), no more
        kept = layer(False, OP)
        down = s_local * lay.micro_batch * gpt.hidden * e if gpt.gated else 0.0
        working = layer(False, "none") + down - kept
    else:
        kept = average(lay.recompute)
        working = 0.0

    # the loss's peak: before any layer reruns, so never beside `working`
    wide, narrow = LOSSES[lay.loss]
    per_logit = wide * 4 + narrow * e if e < 4 else max(wide, narrow) * e  # float32 logits are their own copy
    loss = per_logit * lay.micro_batch * s_local * gpt.vocab / lay.tensor

    def held(layers: float, loss: float = 0.0) -> dict[str, float]:
        return {**state, "activations": layers * kept + max(working, loss)}

    p, m = lay.pipeline, lay.micro_batches
    if lay.schedule == "zb-v" and p > 1:
        return held(gpt.layers // (2 * p) * in_flight("zb-v", p, m, 0), loss)
    if lay.schedule != "1f1b" and p > 1:
        first = held(gpt.layers // p * in_flight(lay.schedule, p, m, 0))
        last = held(gpt.layers // p * in_flight(lay.schedule, p, m, p - 1), loss)
    else:  # 1F1B, interleaved or not: the last rank's warm-up forwards, and the one whose backward starts at the loss
        first = held(gpt.layers // (p * v) * chunks)
        last = held(gpt.layers // (p * v) * min(warmup_forwards(p, m, p - 1, v) + 1, v * m), loss)
    return max(first, last, key=lambda m: sum(m.values()))


def _compute_seconds(gpt: GPT, layout: Layout, platform: Platform) -> tuple[float, float]:
    """A rank's seconds of compute in one iteration, its node's contention included: (the linear layers, at the
    recipe's rate; the attention's scores and the output layer, in 16 bits)."""
    share = rerun_share(gpt, layout)
    flops = iteration_flops(gpt, layout.batch, layout.recompute, share)
    wide = sixteen_bit_flops(gpt, layout.batch, layout.recompute, share)
    per_rank = _per_rank(layout, platform)
    return (flops - wide) / platform.rate(recipe(layout.precision).compute) * per_rank, wide / platform.flops * per_rank


@reference("step_time")
def step_time(gpt: GPT, layout: Layout, platform: Platform) -> dict[str, float]:
    """Seconds of one iteration by part (Exercise 16.5): compute, bubble, tensor, context, pipeline, data."""
    lay, gpt = layout, busiest(gpt, layout)
    prec = recipe(lay.precision)
    e = prec.activations
    m, b, h, s = lay.micro_batches, lay.micro_batch, gpt.hidden, gpt.seq
    stage_layers = gpt.layers // lay.pipeline
    reruns = rerun_share(gpt, lay)
    compute = sum(_compute_seconds(gpt, lay, platform))
    bubble = (lay.pipeline - 1) / (lay.interleave * m) * compute  # (p-1)/(v m) of the compute
    tokens = b * (s // lay.context) * h  # elements of one micro-batch's activation on a rank
    tensor = m * stage_layers * (4 + 2 * reruns) * platform.comm("allreduce", tokens * e, lay.tensor)
    kv = 2 * b * s * gpt.kv_width / lay.tensor * e  # keys and values of the whole sequence, this rank's heads
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
    params = stage_parameters(gpt, lay)
    if lay.zero == 3:
        # lab 13's engine: each unit's parameters allgathered before its forward and its backward, and its
        # gradient reduce-scattered after every backward, so once per micro-batch
        data = m * (
            2 * platform.comm("allgather", params * prec.allgather, replicas, stride)
            + platform.comm("reduce_scatter", params * prec.reduce, replicas, stride)
        )
    else:
        data = platform.comm("allreduce", params * prec.reduce, replicas, stride)
    return {
        "compute": compute,
        "bubble": bubble,
        "tensor": tensor,
        "context": context,
        "pipeline": pipeline,
        "data": data,
    }


def layout_time(gpt: GPT, layout: Layout, platform: Platform) -> dict[str, float]:
    """`step_time`'s parts, with what it leaves to this: expert parallelism and the overlap of the data collectives.

    - expert: per MoE layer of a stage and micro-batch, the tokens' trip to their experts and back forward
      (lab 15's dispatch and combine), and again backward (twice more when full recomputation reruns the
      forward): all-to-alls over the expert ranks (expert_tensor apart) of the rank's tokens
      (b s/c, / t with sequence parallelism) times their slots, h elements each;
    - data with expert ranks: the dense gradients over the d c ranks, the routed experts' over the
      d c t / (expert x expert_tensor) ranks that hold the same experts;
    - data with `overlap`: ZeRO-3 (FSDP) gathers layer i + 1's parameters while layer i computes and
      reduce-scatters layer i's gradients under layer i - 1's backward: per micro-batch the first layer's
      gather and the last reduce-scatter are exposed, and each layer only what its collectives take beyond
      its own forward (gather) and backward (gather and reduce-scatter) compute; ZeRO 0-2 reduce the
      gradients in buckets under the backward (PyTorch DDP), all but the last layer's share hidden as far as
      the backward lasts;
    - compute: the attention at its kernel's pace (`attention_seconds`) where `step_time` charged its whole score
      blocks at the 16-bit rate: a "flash" or "fused" kernel skips the blocks above the diagonal (`CAUSAL_SHARE`)
      and runs at the rates the platform measured for it, if any;
    - bubble and pipeline, for every schedule (`Layout.schedule`): the compute of a micro-batch on a
      stage split into F, B and W (`stage_op_times`: the linear layers at the recipe's rate, the output layer at
      16 bits, the attention at its kernel's pace), and the idle time of the schedule's op list
      (`schedules.idle_per_rank`); zb-v sends twice 1F1B's pipeline messages (two chunks per rank);
    - tensor with `tensor_overlap` (sequence parallelism's collectives): each all-gather (reduce-scatter) of the
      t tensor ranks is cut into t pieces, each sent while the matrix multiplication computes on another (Wang
      et al., "Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
      Models", ASPLOS 2023; Megatron's `tp_comm_overlap` runs such pipelines, Transformer Engine's userbuffers,
      with splits and a bulk overlap of its own choosing): of T seconds of collectives beside U of the linear
      layers' compute, max(T / t, T - U (t - 1) / t) show (the first piece, or what the pipeline cannot hide).
      The streaming multiprocessors the collectives take from the matrix multiplications are not priced."""
    gpt = busiest(gpt, layout)
    parts = step_time(gpt, layout, platform)
    rerun = rerun_share(gpt, layout)
    charged = attention_flops(gpt, layout.batch, layout.recompute, rerun) / platform.flops * _per_rank(layout, platform)
    parts["compute"] += sum(attention_seconds(gpt, layout, platform)) - charged  # the attention at its kernel's pace
    if layout.pipeline > 1:
        f, b, w = stage_op_times(gpt, layout, platform, parts["compute"])
        p, m, v = layout.pipeline, layout.micro_batches, layout.interleave
        parts["bubble"] = idle_per_rank(layout.schedule, p, m, f, b, w, v)
        parts["pipeline"] *= 2 if layout.schedule == "zb-v" else 1
    lay, prec = layout, recipe(layout.precision)
    if lay.tensor_overlap and lay.tensor > 1:
        under, _ = _compute_seconds(gpt, lay, platform)  # the linear layers'
        t = lay.tensor
        parts["tensor"] = max(parts["tensor"] / t, parts["tensor"] - under * (t - 1) / t)
    m = lay.micro_batches
    stage_layers = gpt.layers // lay.pipeline
    tokens = lay.micro_batch * (gpt.seq // lay.context) / (lay.tensor if lay.sequence_parallel else 1)
    trips = 4 + 2 * rerun
    send = tokens * gpt.slots * gpt.hidden * prec.activations
    parts["expert"] = moe_visits(gpt, lay) * trips * platform.comm("alltoall", send, lay.expert, lay.expert_tensor)
    replicas, stride = lay.data * lay.context, lay.tensor
    dense, expert = stage_split(gpt, lay)
    if lay.expert > 1 and lay.zero != 3:
        parts["data"] = platform.comm("allreduce", dense * prec.reduce, replicas, stride) + platform.comm(
            "allreduce",
            expert * prec.reduce,
            replicas * lay.tensor // (lay.expert * lay.expert_tensor),
            lay.expert * lay.expert_tensor,
        )
    if lay.overlap:
        forward = parts["compute"] / (3 + rerun) / (m * stage_layers)
        backward = parts["compute"] / (m * stage_layers) - forward
        if lay.zero == 3:
            units = stage_layers + 1  # the layers and the embeddings
            gather = platform.comm("allgather", (dense + expert) * prec.allgather / units, replicas, stride)
            scatter = platform.comm("reduce_scatter", (dense + expert) * prec.reduce / units, replicas, stride)
            exposed = (
                gather + scatter + stage_layers * (max(0.0, gather - forward) + max(0.0, gather + scatter - backward))
            )
            parts["data"] = m * exposed
        else:
            hidden = backward * m * stage_layers * (1 - 1 / stage_layers) if stage_layers > 1 else 0.0
            parts["data"] = max(parts["data"] / max(stage_layers, 1), parts["data"] - hidden)
    return parts


def stage_op_times(gpt: GPT, layout: Layout, platform: Platform, compute: float) -> tuple[float, float, float]:
    """(f, b, w): seconds of one micro-batch's F, B and W on a stage, `compute` (a rank's seconds of compute in a
    step) split as their times split (`schedules.split_flops`, in FLOPs at the 16-bit rate): the linear layers at
    the recipe's rate, the output layer at 16 bits, the attention's forward and backward each at its kernel's pace
    (`attention_pace`)."""
    prec = recipe(layout.precision)
    score = gpt.layers * gpt.attention_score_flops()
    linear = gpt.forward_flops() - score
    output = 2.0 * gpt.seq * gpt.hidden * gpt.vocab
    fast = platform.rate(prec.compute) / platform.flops  # the linear layers' speed-up (float8), 1 in 16 bits
    forward, backward = (pace * score * platform.flops for pace in attention_pace(gpt, layout, platform))
    parts = split_flops(linear / fast, forward, output, layout.recompute, rerun_share(gpt, layout), backward)
    total, per_micro = sum(parts), compute / layout.micro_batches
    f, b, w = (per_micro * part / total for part in parts)
    return f, b, w


def predict(gpt: GPT, layout: Layout, platform: Platform) -> TransformerPrediction:
    """Time by part and memory of the busiest rank of one iteration; ValueError if the layout cannot run."""
    reason = problem(gpt, layout)
    if reason:
        raise ValueError(f"{layout.label} cannot run {gpt.name or 'this GPT'}: {reason}")
    return TransformerPrediction(gpt, layout, layout_time(gpt, layout, platform), rank_memory(gpt, layout))


def predict_step(layout: Layout, model: GPT, platform: Platform) -> tuple[float, float]:
    """(seconds per iteration, bytes of the busiest rank): one layout of one GPT on a platform (lab 16's mesh)."""
    pred = predict(model, layout, platform)
    return pred.time, pred.peak
