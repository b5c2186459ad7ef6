"""The oracle at scale: NVIDIA A100 80 GB nodes from published figures, and Narayanan et al.'s Table 1.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), Table 1: ten GPT models from 1.7 B parameters on
32 GPUs to 1008 B on 3072, sequence 2048, vocabulary 51,200, trained on Selene's DGX A100
nodes (8 A100 80 GB per node); their measured teraFLOP/s per GPU count the FLOPs of
96 B s l h^2 (1 + s/(6h) + V/(16 l h)), recomputation included, and all ran with activation
recomputation. The table gives t, p, the GPUs and the global batch of each row; d is
GPUs / (t p). It does not give the micro-batch size: `TABLE1` takes b = 1, an assumption
(in the oracle b changes only the bubble, through m = B/(d b), and the activation memory).

The platform (`a100_cluster`) takes only published hardware figures, each named in
`sources`, and one achieved-compute figure: the hardware FLOPs utilisation Korthikanti et
al. ("Reducing Activation Recomputation in Large Transformer Models", MLSys 2023) measured
for their 1-trillion-parameter GPT on A100s with data-parallel size 1, 57.0% of peak (their
paper, arXiv:2205.05198, as Megatron-LM's README quotes it: model FLOPs utilisation 56.3%,
hardware 57.0%). Nothing is fitted to the rows of Table 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..allreduce.cost import Link
from .platform import AttentionRows, Platform
from .transformer import CAUSAL_SHARE, GPT, Layout, TransformerPrediction, attention_flops, iteration_flops, predict

A100_PEAK = 312e12  # FLOP/s, dense BF16/FP16 on the tensor cores (NVIDIA A100 datasheet)
ACHIEVED = 0.570  # Korthikanti et al., MLSys 2023: hardware FLOPs utilisation of the 1 T GPT, data-parallel size 1
ALPHA = 5e-6  # seconds per message: assumed, not a hardware figure (with 0, accuracies move by < 0.03)


@dataclass(frozen=True)
class PublishedRun:
    """One row of Narayanan et al.'s Table 1: the model, its layout, the measured teraFLOP/s per GPU."""

    gpt: GPT
    layout: Layout
    measured_tflops: float  # per GPU


def _row(
    billions: float, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int, tflops: float, v: int
):
    gpt = GPT(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, name=f"GPT {billions:g} B")
    layout = Layout(
        data=gpus // (t * p), tensor=t, pipeline=p, batch=batch, micro_batch=1, recompute="full", interleave=v
    )
    return PublishedRun(gpt, layout, tflops)


#: Table 1 of Narayanan et al. (SC 2021): parameters (billions), heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU;
#: and v, the model chunks per pipeline rank of the interleaved schedule, which the table does not print: the layers
#: per stage over `--num-layers-per-virtual-pipeline-stage` in the scripts that produced the table (NVIDIA
#: Megatron-LM repository, examples/sc21/run_table_1.sh: 5 of 15 for 76 B, 5 of 10 for 145.6 B, 3 of 6 for 310.1 B,
#: 1 of 3 for 529.6 B; not set, plain 1F1B, for the others).
TABLE1 = (
    _row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 1),
    _row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 1),
    _row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 1),
    _row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 1),
    _row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 1),
    _row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 3),
    _row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2),
    _row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 2),
    _row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 3),
    _row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1),
)


def a100_cluster(achieved: float = ACHIEVED) -> Platform:
    """DGX A100 80 GB nodes: 8 GPUs on NVLink 3 / NVSwitch, 8 HDR InfiniBand adapters (one per GPU)."""
    return Platform(
        name="DGX A100 80 GB cluster (Selene-like)",
        devices_per_node=8,
        flops=achieved * A100_PEAK,
        memory=80 * 10**9,
        intra=Link(alpha=ALPHA, beta=1 / 300e9),
        inter=Link(alpha=ALPHA, beta=1 / 25e9),
        contention=(1.0,) * 8,
        sources={
            "devices_per_node": "NVIDIA DGX A100 datasheet: 8 A100 80 GB GPUs per system (Selene's nodes)",
            "flops": (
                "NVIDIA A100 datasheet: 312 TFLOP/s BF16/FP16 tensor-core peak (dense); times 57.0%, the hardware "
                "FLOPs utilisation Korthikanti et al. (MLSys 2023) measured for a 1 T GPT on A100s"
            ),
            "memory": "NVIDIA A100 80 GB datasheet: 80 GB HBM2e",
            "intra": (
                "NVIDIA A100 datasheet: NVLink 3, 600 GB/s per GPU both directions together (300 GB/s each way), "
                "every pair through NVSwitch (DGX A100 datasheet); alpha 5 us assumed"
            ),
            "inter": (
                "DGX A100 datasheet: 8 single-port ConnectX-6 HDR InfiniBand, 200 Gb/s = 25 GB/s each, one per "
                "GPU: a GPU's inter-node traffic has its own adapter; alpha 5 us assumed"
            ),
            "contention": "one process per GPU (1.0)",
        },
    )


#: Llama 3's measured model FLOPs utilisation in bfloat16 on 8,192 H100s (Dubey et al., "The Llama 3 Herd of
#: Models", 2024, Table 4: 430 TFLOP/s per GPU, 43% of the dense peak), the default share of a format's dense
#: peak the H100, H200 and B200 platforms achieve (its runs are therefore not among the validation rows).
EFFICIENCY = 0.43


@dataclass(frozen=True)
class Hardware:
    """One GPU of an 8-GPU node as its vendor's datasheet gives it: dense peaks, memory, links (bytes/s per way)."""

    name: str
    bf16: float  # dense FLOP/s, bfloat16 tensor cores
    fp8: float  # dense FLOP/s, float8 tensor cores
    memory: int  # bytes of HBM
    hbm: float  # bytes/s of HBM bandwidth (not used by the oracle's time yet: it prices FLOPs and messages)
    nvlink: float  # bytes/s each way between two GPUs of a node (half the datasheet's bidirectional figure)
    network: float  # bytes/s each way per GPU across nodes (its own adapter)
    sources: tuple[tuple[str, str], ...]
    # attention kernels measured on this GPU: (kernel of `Layout.kernel`, head size, rows); the others run at the
    # platform's 16-bit share of the peak
    attention: tuple[tuple[str, int, AttentionRows], ...] = ()


def _tflops(*rows: tuple[int, float, float]) -> AttentionRows:
    """Rows of (sequence length, forward, backward) given in TFLOP/s, in FLOP/s."""
    return tuple((seq, forward * 1e12, backward * 1e12) for seq, forward, backward in rows)


def _causal_backward(*rows: tuple[int, float, float, float]) -> AttentionRows:
    """Rows of (sequence length, forward with the causal mask, forward without it, backward without it) given in
    TFLOP/s, as (sequence length, forward, backward) in FLOP/s with the backward's causal rate estimated: its rate
    without the mask times the ratio the mask gives the forward at that length. (On a GB200, where NVIDIA measured
    both masks both ways, the two ratios agree within 7% at 2K-16K tokens: NVIDIA/cudnn-frontend at 60e572b,
    benchmark/sdpa_benchmark_training/results/llama3.1/gb200/llama3.1_20260424_100750.csv.)"""
    return tuple((seq, causal * 1e12, backward * causal / full * 1e12) for seq, causal, full, backward in rows)


#: Attention kernels on an H100 SXM5 in bfloat16 with heads 128 wide, as Shah et al. measured them ("FlashAttention-3",
#: 2024, Figure 5, the forward with and without the causal mask, and Figure 6, the backward without it; 16 heads,
#: 16K tokens a batch), at 512 to 16K tokens, FLOPs counted as those benchmarks count them: the causal forward at
#: half the 4 s^2 d of a head, the backward at 2.5 times the forward (five matrix multiplications to its two); the
#: causal backward estimated (`_causal_backward`). "flash" is FlashAttention-2, which PyTorch's
#: `scaled_dot_product_attention` ran on an H100 in torchtitan's runs of December 2024 (its cuDNN backend came last
#: in the priority order from pytorch/pytorch#138522, 2024); "fused" is cuDNN's fused attention, which Transformer
#: Engine gives Megatron on Hopper (its `get_attention_backend` disables FlashAttention "to give FusedAttention
#: preference on Hopper+"). The B200's are `B200_ATTENTION`; the H200, which computes as an H100 but was not
#: measured, and the A100 run their attention at the 16-bit share of the peak.
H100_ATTENTION = (
    (
        "flash",
        128,
        _causal_backward(
            (512, 191, 309, 214),
            (1024, 260, 350, 260),
            (2048, 298, 362, 291),
            (4096, 319, 368, 310),
            (8192, 333, 370, 318),
            (16384, 335, 370, 322),
        ),
    ),
    (
        "fused",
        128,
        _causal_backward(
            (512, 315, 497, 305),
            (1024, 410, 574, 408),
            (2048, 484, 617, 465),
            (4096, 518, 609, 499),
            (8192, 529, 600, 518),
            (16384, 539, 595, 516),
        ),
    ),
)

#: The same kernels on a B200, as NVIDIA measured them through PyTorch's `scaled_dot_product_attention`
#: (NVIDIA/cudnn-frontend at bb37575, benchmark/sdpa_benchmark_training/artifacts/
#: sdpa_bf16_benchmark_results_NVIDIA_B200.csv: PyTorch 2.9 of NGC 25.09, cuDNN 9.13; bfloat16, causal, one sequence
#: of 128 query heads sharing 8 key/value heads 128 wide; FLOPs counted as Shah et al. count them): "flash", its
#: FlashAttention-2 backend; "fused", its cuDNN backend.
B200_ATTENTION = (
    (
        "flash",
        128,
        _tflops(
            (512, 74.6, 83.0),
            (1024, 165.5, 107.7),
            (2048, 242.4, 186.3),
            (4096, 324.9, 256.4),
            (8192, 373.4, 298.9),
            (16384, 394.5, 320.0),
            (32768, 403.7, 330.8),
            (65536, 408.7, 335.4),
            (131072, 411.0, 336.0),
        ),
    ),
    (
        "fused",
        128,
        _tflops(
            (512, 84.0, 134.2),
            (1024, 254.5, 308.5),
            (2048, 478.9, 371.5),
            (4096, 855.7, 701.3),
            (8192, 1171.3, 942.5),
            (16384, 1332.4, 1074.8),
            (32768, 1419.0, 1108.7),
            (65536, 1382.3, 1073.1),
            (131072, 1355.4, 1047.8),
        ),
    ),
)

#: The datasheets' tensor-core peaks are printed with 2:4 sparsity; dense is half (the datasheets' footnotes).
H100_SXM = Hardware(
    "H100 SXM 80 GB",
    bf16=989.5e12,
    fp8=1979e12,
    memory=80 * 10**9,
    hbm=3.35e12,
    nvlink=450e9,
    network=50e9,
    sources=(
        ("compute", "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 and FP8 3,958 TFLOPS with sparsity"),
        ("memory", "NVIDIA H100 datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s"),
        ("intra", "NVIDIA H100 datasheet: NVLink 900 GB/s (both directions), every pair through NVSwitch (DGX H100)"),
        ("inter", "NVIDIA DGX H100 datasheet: 8 ConnectX-7 400 Gb/s adapters, one per GPU: 50 GB/s"),
        (
            "attention",
            "Shah et al., FlashAttention-3, 2024, Figures 5-6: FlashAttention-2 and cuDNN on an H100 SXM5, the "
            "causal backward estimated",
        ),
    ),
    attention=H100_ATTENTION,
)
H200_SXM = Hardware(
    "H200 SXM 141 GB",
    bf16=989.5e12,
    fp8=1979e12,
    memory=141 * 10**9,
    hbm=4.8e12,
    nvlink=450e9,
    network=50e9,
    sources=(
        ("compute", "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 1,979 and FP8 3,958 TFLOPS with sparsity"),
        ("memory", "NVIDIA H200 datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s"),
        ("intra", "NVIDIA H200 datasheet: NVLink 900 GB/s (both directions); HGX H200 8 GPUs through NVSwitch"),
        ("inter", "NVIDIA DGX H200 datasheet: 8 ConnectX-7 400 Gb/s adapters, one per GPU: 50 GB/s"),
    ),
)
B200 = Hardware(
    "B200 180 GB (DGX/HGX B200)",
    bf16=2.25e15,
    fp8=4.5e15,
    memory=180 * 10**9,
    hbm=7.7e12,
    nvlink=900e9,
    network=50e9,
    sources=(
        (
            "compute",
            "NVIDIA HGX B200 specifications, per GPU: FP16/BF16 4.5 and FP8 9 PFLOPS with sparsity",
        ),
        ("memory", "NVIDIA HGX B200 specifications, per GPU: 180 GB HBM3e, 7.7 TB/s"),
        ("intra", "NVIDIA HGX B200 specifications: fifth-generation NVLink 1.8 TB/s per GPU (both directions)"),
        ("inter", "NVIDIA DGX B200 datasheet: 8 ConnectX-7 400 Gb/s adapters for the compute fabric: 50 GB/s per GPU"),
        ("attention", "NVIDIA/cudnn-frontend's SDPA training benchmark on a B200 (PyTorch 2.9, cuDNN 9.13)"),
    ),
    attention=B200_ATTENTION,
)


def gpu_platform(
    hardware: Hardware, efficiency: float = EFFICIENCY, nodes_of: int = 8, fp8_efficiency: float | None = None
) -> Platform:
    """8-GPU nodes of `hardware` (`H100_SXM`, `H200_SXM`, `B200`): every format computes at `efficiency` of its
    dense peak (`EFFICIENCY` by default: set your own measured share), bfloat16 as `flops`, float8 as
    `rates["fp8"]` (at `fp8_efficiency` of its peak if given: a float8 recipe's casts and scales cost some
    stacks more than others); the attention kernels measured on the GPU (`Hardware.attention`) at their measured
    rates, whatever `efficiency`; NVLink inside a node, one network adapter per GPU between nodes, alpha 5 us
    (assumed)."""
    if nodes_of < 1:
        raise ValueError(f"nodes_of is the GPUs of a node, 1 or more (8 in DGX and HGX nodes): got {nodes_of}")
    fp8 = efficiency if fp8_efficiency is None else fp8_efficiency
    if not (0 < efficiency <= 1 and 0 < fp8 <= 1):
        raise ValueError(
            f"efficiency is the share of the dense peak a GPU achieves, in (0, 1]: got {efficiency} (fp8: {fp8})"
        )
    shares = f"{efficiency:.0%}" if fp8 == efficiency else f"{efficiency:.0%} (fp8 {fp8:.0%})"
    return Platform(
        name=f"{nodes_of} x {hardware.name} nodes at {shares} of peak",
        devices_per_node=nodes_of,
        flops=efficiency * hardware.bf16,
        memory=hardware.memory,
        intra=Link(alpha=ALPHA, beta=1 / hardware.nvlink),
        inter=Link(alpha=ALPHA, beta=1 / hardware.network),
        contention=(1.0,) * nodes_of,
        rates={"fp8": fp8 * hardware.fp8},
        attention={(kernel, head): rows for kernel, head, rows in hardware.attention},
        sources={
            **dict(hardware.sources),
            "flops": (
                f"{shares} of the dense peaks ({hardware.bf16 / 1e12:.0f} BF16, {hardware.fp8 / 1e12:.0f} FP8 "
                "TFLOP/s); default 43%: Llama 3's bfloat16 model FLOPs utilisation on 8,192 H100s "
                "(Dubey et al., 2024, Table 4)"
            ),
            "contention": "one process per GPU (1.0)",
        },
    )


def accuracy(predicted: float, measured: float) -> float:
    """1 - |predicted - measured| / measured (ParaDL's accuracy, Kahira et al., HPDC 2021)."""
    return 1 - abs(predicted - measured) / measured


def reproduce(platform: Platform | None = None) -> list[tuple[PublishedRun, TransformerPrediction, float]]:
    """(row, prediction of its published layout, accuracy of the predicted TFLOP/s per GPU) for each row."""
    platform = platform or a100_cluster()
    out = []
    for run in TABLE1:
        pred = predict(run.gpt, run.layout, platform)
        out.append((run, pred, accuracy(pred.model_flops_per_device() / 1e12, run.measured_tflops)))
    return out


def _llama(layers: int, hidden: int, heads: int, ffn: int, seq: int, name: str) -> GPT:
    """A Llama 3 model (Dubey et al., 2024, Table 3: layers, width, FFN width, heads, 8 key/value heads; SwiGLU,
    RMSNorm, rotary positions, no biases or dropout, untied output layer; vocabulary 128,256 in its released
    configuration), for sequences of `seq` tokens."""
    return GPT(
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        vocab=128256,
        name=name,
        kv_heads=8,
        ffn=ffn,
        gated=True,
        norm="rmsnorm",
        rotary=True,
        tied=False,
        bias=False,
        dropout=False,
    )


@dataclass(frozen=True)
class ModernRun:
    """A published run of 2024-26 that states its whole layout: tokens per second per GPU, and the peak memory per
    GPU when published (bytes), on `hardware`, with the row's source; `tflops`, the model FLOP/s per GPU the source
    publishes beside (Megatron-Bridge's "Model TFLOP / sec / GPU"), in FLOP/s."""

    gpt: GPT
    layout: Layout
    hardware: Hardware
    tokens_per_gpu: float
    memory: float | None
    source: str
    tflops: float | None = None

    def published_flops_per_token(self) -> float | None:
        """The FLOPs a token costs by the source's own count: its model FLOP/s over its tokens/s."""
        return None if self.tflops is None else self.tflops / self.tokens_per_gpu


def model_flops_per_token(gpt: GPT) -> float:
    """FLOPs of one token's training step as Megatron-Bridge counts model FLOPs: forward and backward, no
    recomputation, the attention's score blocks at their causal share (`CAUSAL_SHARE`)."""
    skipped = (1 - CAUSAL_SHARE) * attention_flops(gpt, 1, "none")
    return (iteration_flops(gpt, 1, "none") - skipped) / gpt.seq


_BRIDGE = (
    "Megatron-Bridge docs/performance-summary.md (v0.2.1; later in its archive), 25.11 NeMo container, pre-training"
)
_TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
#: torchtitan's H100s: 96 GB HBM2e at 500 W, a peak "between SXM and NVL" (their note): the SXM's peaks taken.
H100_96GB = Hardware(
    "H100 96 GB HBM2e (Grand Teton, 500 W)",
    bf16=H100_SXM.bf16,
    fp8=H100_SXM.fp8,
    memory=96 * 2**30,
    hbm=2.4e12,
    nvlink=H100_SXM.nvlink,
    network=50e9,
    sources=(
        ("hardware", "torchtitan's benchmark file: 96 GB HBM2e, 2.4 TB/s, NVLink, 400 Gb/s per GPU"),
        ("attention", "the H100 SXM5's kernels (`H100_ATTENTION`), measured at 700 W: at 500 W an upper bound"),
    ),
    attention=H100_ATTENTION,
)


def _megatron(
    gpt: GPT, gpus: int, batch: int, micro: int, t: int, p: int, v: int, fsdp: int, c: int = 1, rerun: int = 0
) -> Layout:
    """A Megatron-Bridge recipe (its Llama recipes, src/megatron/bridge/recipes/llama/llama3.py, and its models,
    src/megatron/bridge/models/llama/llama_bridge.py):

    - FP8 (current scaling) and the "fused" kernels: flash attention (causal, `transformer.CAUSAL_SHARE`) and the
      fused SwiGLU its Llama models set (`bias_activation_fusion=True`);
    - sequence parallelism with TP, and the tensor-parallel collectives overlapped with the linear layers (the 70B
      and 405B recipes: `CommOverlapConfig(tp_comm_overlap=True)`, Transformer Engine's userbuffers);
    - the data collectives overlapped; FSDP = 1 is ZeRO-3, FSDP = 0 the distributed optimizer, ZeRO-1
      (`ddp.use_distributed_optimizer = True`, `overlap_grad_reduce` and `overlap_param_gather` on);
    - no recomputation (none listed), or full recomputation of the first `rerun` layers of each chunk (the
      summary does not list it; the 8B H100 recipe's `recompute_num_layers=5`, "block"); c context ranks;
    - stages as even as whole layers allow where p v does not divide the layers (the 405B recipe counts the
      embedding and the loss as a layer each, `account_for_embedding_in_pipeline_split` and
      `account_for_loss_in_pipeline_split`: 126 + 2 = 128 units, 2 in each of 64 chunks, the busiest rank 16
      layers);
    - Transformer Engine's cross entropy, writing the gradient over the logits (`cross_entropy_fusion_impl="te"`,
      set for every run by scripts/performance/utils/helpers.py: the "in-place" loss, `transformer.LOSSES`)."""
    return Layout(
        data=gpus // (t * p * c),
        tensor=t,
        pipeline=p,
        context=c,
        uneven=gpt.layers % (p * v) != 0,
        batch=batch,
        micro_batch=micro,
        interleave=v,
        zero=3 if fsdp else 1,
        precision="fp8",
        kernel="fused",
        sequence_parallel=t > 1,
        overlap=True,
        tensor_overlap=t > 1,
        recompute="full" if rerun else "none",
        recompute_layers=rerun,
        loss="in-place",
    )


def _titan(seq: int, fsdp: int, cp: int) -> Layout:
    """torchtitan's Table 2: FSDP (ZeRO-3 with per-layer overlap) x CP, local batch 1, full recomputation, float8,
    torch's cross entropy on a float32 copy of the logits (its train.py at 9dec370: the "eager" loss)."""
    return Layout(
        data=fsdp,
        context=cp,
        batch=fsdp,
        zero=3,
        recompute="full",
        precision="fp8",
        kernel="flash",
        overlap=True,
        loss="eager",
    )


def _titan_2d(async_tp: bool) -> Layout:
    """torchtitan's Table 4: the 70B on 256 GPUs, FSDP 32 x TP 8 (sequence parallel: its TP plan shards the norms'
    tokens), local batch 16 in one micro-batch, full recomputation, float8, the loss on each rank's share of the
    vocabulary (torch's `loss_parallel`, which torchtitan's train.py at 9dec370 enters under tensor parallelism: the
    "parallel" loss), with AsyncTP (the collectives cut into pieces under the matrix multiplications) or without.
    Its sequence: the 8,192 of train_configs/llama3_70b.toml at 9dec370, as for Table 1."""
    return Layout(
        data=32,
        tensor=8,
        batch=512,
        micro_batch=16,
        zero=3,
        recompute="full",
        precision="fp8",
        kernel="flash",
        sequence_parallel=True,
        overlap=True,
        tensor_overlap=async_tp,
        loss="parallel",
    )


LLAMA3_8B = _llama(32, 4096, 32, 14336, 8192, "Llama 3 8B")

#: torchtitan's own measurement of its machine, not a validation row (the same benchmark file, Table 1: Llama 3.1 8B
#: on 8 GPUs, FSDP, local batch 2, selective checkpointing, torch.compile): tokens/s per GPU in bfloat16 and with
#: float8 linear layers. `calibrate_titan` sets that machine's two efficiencies from them. The table states no
#: sequence length: the 8,192 of torchtitan's train_configs/llama3_8b.toml at its commit 9dec370 is assumed, with its
#: checkpointing, `selective_ac_option = 'op'` (`transformer.OP`). The peak memory the table publishes beside
#: (`TITAN_TABLE1_MEMORY`, GiB) was not used: `bench/oracle_transformer.py` compares it with the prediction.
TITAN_TABLE1 = (("bf16", 6667.0), ("fp8", 8532.0))
TITAN_TABLE1_MEMORY = {"bf16": 77.0, "fp8": 76.8}


def titan_table1_layout(precision: str, gpus: int = 8) -> Layout:
    """The layout of `TITAN_TABLE1`'s rows (and, on 128 GPUs, of Table 3's): FSDP over the GPUs, local batch 2,
    torchtitan's op-level checkpointing."""
    return Layout(
        data=gpus,
        batch=2 * gpus,
        micro_batch=2,
        zero=3,
        recompute="op",
        precision=precision,
        kernel="flash",
        overlap=True,
        loss="eager",
    )


def calibrate_titan() -> tuple[float, float]:
    """(bfloat16, float8) shares of the SXM peaks at which the oracle reproduces `TITAN_TABLE1`: the bfloat16 row
    sets the first, then the float8 row the second (bisection, to 1e-6). A machine without a datasheet (torchtitan's
    500 W H100s) is stated this way: by its own measurement, then asked about other runs."""

    def solve(tokens: float, platform_at: Callable[[float], Platform], precision: str) -> float:
        low, high = 1e-3, 1.0
        while high - low > 1e-6:
            mid = (low + high) / 2
            fast = predict(LLAMA3_8B, titan_table1_layout(precision), platform_at(mid)).tokens_per_device() > tokens
            low, high = (low, mid) if fast else (mid, high)
        return (low + high) / 2

    (_, bf16_tokens), (_, fp8_tokens) = TITAN_TABLE1
    bf16 = solve(bf16_tokens, lambda e: gpu_platform(H100_96GB, e), "bf16")
    return bf16, solve(fp8_tokens, lambda e: gpu_platform(H100_96GB, bf16, fp8_efficiency=e), "fp8")


LLAMA3_70B = _llama(80, 8192, 64, 28672, 8192, "Llama 3 70B")
LLAMA31_405B = _llama(126, 16384, 128, 53248, 8192, "Llama 3.1 405B")
#: A mixture of experts of Mixtral 8x22B's shape (Mistral AI's released configuration: 56 layers of width 6144, 48
#: heads sharing 8 key/value heads, 8 SwiGLU experts of width 16,384 on every layer, each token routed to 2, a
#: vocabulary of 32,768; RMSNorm, rotary positions, no biases, untied output layer), on sequences of 4096 tokens:
#: lab 16's search on 256 H100s, its test and `bench/oracle_transformer.py`.
MIXTRAL_8X22B = replace(_llama(56, 6144, 48, 16384, 4096, "Mixtral-8x22B-like"), vocab=32768, experts=8, top_k=2)


def _qwen3(layers: int, hidden: int, heads: int, expert_ffn: int, name: str) -> GPT:
    """A Qwen3 mixture of experts (Yang et al., "Qwen3 Technical Report", 2025, Table 2: layers, query heads, 4
    key/value heads, 128 experts of which 8 a token; and its released configuration: heads 128 wide, whatever the
    width h, every layer's MLP a mixture of SwiGLU experts of `expert_ffn`, vocabulary 151,936, untied; section 2:
    QK-Norm, an RMSNorm of each head's queries and keys), on sequences of 4096 tokens."""
    return replace(
        _llama(layers, hidden, heads, expert_ffn, 4096, name),
        qk_norm=True,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        experts=128,
        top_k=8,
    )


QWEN3_30B_A3B = _qwen3(48, 2048, 32, 768, "Qwen3-30B-A3B")
QWEN3_235B_A22B = _qwen3(94, 4096, 64, 1536, "Qwen3-235B-A22B")


def _megatron_moe(gpt: GPT, gpus: int, batch: int, micro: int, t: int, p: int, v: int, ep: int) -> Layout:
    """Megatron-Bridge's Qwen3 recipes (v0.2.1, scripts/performance/configs/qwen3/qwen3_llm_pretrain.py): as
    `_megatron` (FP8, the "fused" kernels, the distributed optimizer, the data collectives overlapped, no
    recomputation), the routed experts whole on their rank (`expert_tensor_parallel_size=1`) over ep ranks, the
    routing forced to balance (`moe_router_force_load_balancing`: every expert gets its k T / E tokens, as the
    oracle assumes), the tensor-parallel collectives not overlapped (`tp_comm_overlap=False` on H100)."""
    return replace(_megatron(gpt, gpus, batch, micro, t, p, v, 0), expert=ep, tensor_overlap=False)


def _titan_run(gpt: GPT, layout: Layout, tokens: float, gib: float, table: str) -> ModernRun:
    """A row of torchtitan's benchmark file: its tokens/s per GPU and peak memory (GiB), on its H100s; `table`, the
    table's number and title."""
    return ModernRun(gpt, layout, H100_96GB, tokens, gib * 2**30, f"{_TITAN}, Table {table}")


#: The validation rows: never used to set a figure of the oracle or its platforms. Every DGX-H100 and DGX-B200 row of
#: Megatron-Bridge's 25.11 summary whose model the oracle states (Llama 3 8B and 70B; Llama 3.1 405B: Dubey et al.,
#: 2024, Table 3, 126 layers of width 16,384, FFN 53,248, 128 heads, 8 key/value heads; the Qwen3 mixtures of
#: experts), and of torchtitan's benchmark file the four rows of its Table 2 (the 8B, FSDP x CP), the two of its
#: Table 3 that run as its Table 1 does (the 8B on 16 nodes, torch.compile, bfloat16 or float8) and the two of its
#: Table 4 (the 70B, FSDP x TP); for Tables 3 and 4, as for Table 1, the sequence of the model's configuration file
#: is assumed. Left out: models whose attention or blocks the oracle cannot state (GPT-OSS's sliding windows and
#: sinks, DeepSeek-V3's latent attention), GB200/GB300 (NVL72 domains), the summary's "tokendrop" rows (a capacity
#: the summary does not state), torchtitan's rows without torch.compile (the oracle does not price what compiling
#: the blocks saves) and its tables that do not say how a pipeline cuts the local batch into micro-batches (5, 6).
#: What the summary's columns do not say, the recipes of the same release say (Megatron-Bridge v0.2.1,
#: scripts/performance/configs/): the 8B H100 row recomputes the first 5 of its 32 layers (`recompute_num_layers=5`,
#: the "block" method: `Layout.recompute_layers`); for two Qwen3 rows the recipes' virtual stages differ from the
#: summary's (30B on H100s: 12, not 24; 235B on B200s: 4, not 2): the summary's are taken.
MODERN = (
    *(
        ModernRun(gpt, layout, hardware, tokens, None, _BRIDGE + f", DGX-{hardware.name[:4]}", tflops * 1e12)
        for gpt, layout, hardware, tokens, tflops in (
            (LLAMA3_8B, _megatron(LLAMA3_8B, 8, 128, 1, 1, 1, 1, 1, rerun=5), H100_SXM, 14451, 744),
            (LLAMA3_70B, _megatron(LLAMA3_70B, 64, 128, 1, 4, 8, 5, 0), H100_SXM, 1602, 719),
            (LLAMA3_8B, _megatron(LLAMA3_8B, 8, 128, 2, 1, 1, 1, 0), B200, 30624, 1576),
            (LLAMA31_405B, _megatron(LLAMA31_405B, 1024, 512, 1, 8, 8, 8, 0, 2), H100_SXM, 292, 737),
            (LLAMA31_405B, _megatron(LLAMA31_405B, 128, 64, 1, 4, 8, 8, 0, 2), B200, 661, 1667),
            (QWEN3_30B_A3B, _megatron_moe(QWEN3_30B_A3B, 16, 512, 2, 1, 2, 24, 8), H100_SXM, 5275, 121),
            (QWEN3_235B_A22B, _megatron_moe(QWEN3_235B_A22B, 256, 2048, 1, 2, 8, 4, 32), H100_SXM, 1575, 233),
            (QWEN3_30B_A3B, _megatron_moe(QWEN3_30B_A3B, 8, 512, 1, 1, 1, 1, 8), B200, 9299, 214),
            (QWEN3_235B_A22B, _megatron_moe(QWEN3_235B_A22B, 64, 1024, 1, 1, 8, 2, 8), B200, 3269, 484),
        )
    ),
    *(
        _titan_run(
            replace(LLAMA3_8B, seq=seq), _titan(seq, fsdp, cp), tps, gib, "2 (FSDP + CP + torch.compile + Float8)"
        )
        for seq, fsdp, cp, tps, gib in (
            (32768, 8, 1, 3890, 83.9),
            (65536, 4, 2, 2540, 84.2),
            (131072, 2, 4, 1071, 84.0),
            (262144, 1, 8, 548, 84.5),
        )
    ),
    *(
        _titan_run(
            LLAMA3_8B, titan_table1_layout(precision, 128), tps, gib, "3 (FSDP on 128 GPUs + torch.compile, + Float8)"
        )
        for precision, tps, gib in (("bf16", 6514, 62.0), ("fp8", 8380, 61.8))
    ),
    *(
        _titan_run(
            LLAMA3_70B, _titan_2d(overlap), tps, gib, "4 (FSDP 32 x TP 8 + torch.compile + Float8, AsyncTP or not)"
        )
        for overlap, tps, gib in ((False, 829, 71.9), (True, 876, 67.6))
    ),
)


@dataclass(frozen=True)
class Releases:
    """One layout as Megatron-Bridge's performance summary published it release after release: (release, tokens per
    second per GPU); "dropping" marks the 25.09 rows that dropped tokens beyond an expert's capacity (the summary
    states no capacity factor; the oracle prices them as the dropless layout)."""

    gpt: GPT
    layout: Layout
    hardware: Hardware
    published: tuple[tuple[str, float], ...]

    def spread(self) -> float:
        """The fastest release's rate over the slowest's."""
        rates = [rate for _, rate in self.published]
        return max(rates) / min(rates)


RELEASES_SOURCE = (
    "Megatron-Bridge docs/performance-summary.md and performance-summary-archive.md (067f987), 25.09 to 26.08"
)
#: The figures of the other releases beside each Megatron-Bridge row of `MODERN`, in its order: (before 25.11, after).
_AROUND_MODERN: tuple[tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]], ...] = (
    ((("25.09", 14079),), ()),  # Llama 3 8B, 8 H100s
    ((("25.09", 1619),), ()),  # Llama 3 70B, 64 H100s
    ((("25.09", 29994),), ()),  # Llama 3 8B, 8 B200s
    ((("25.09", 302),), ()),  # Llama 3.1 405B, 1024 H100s
    ((("25.09", 664),), ()),  # Llama 3.1 405B, 128 B200s
    ((("25.09 dropping", 10494),), ()),  # Qwen3-30B-A3B, 16 H100s
    ((("25.09 dropping", 1204),), ()),  # Qwen3-235B-A22B, 256 H100s
    ((("25.09 dropping", 18066),), (("26.02", 9691),)),  # Qwen3-30B-A3B, 8 B200s
    ((("25.09 dropping", 4104),), ()),  # Qwen3-235B-A22B, 64 B200s
)
#: Not validation rows: what the published figures of one layout moved by from release to release. Every pre-training
#: row on DGX-H100 or DGX-B200 of a model `MODERN` states, from every release of Megatron-Bridge's summary (the 25.09 to
#: 26.08 NeMo containers; none of 26.06.01's or 26.08's is on these systems), grouped by layout (GPUs, batch,
#: micro-batch, t p c v ep): `MODERN`'s rows with their 25.11 figures, then the layouts of later releases, each as
#: `_megatron` or `_megatron_moe` states it (the options of v0.2.1's recipes: the later releases' recipes are not read
#: here). 25.09's table has no precision column: its first figure is taken (FP8 with current scaling; the one in
#: parentheses is MXFP8 on B200s, blockwise on H100s).
RELEASES = (
    *(
        Releases(run.gpt, run.layout, run.hardware, (*before, ("25.11", run.tokens_per_gpu), *after))
        for run, (before, after) in zip(
            (run for run in MODERN if run.source.startswith(_BRIDGE)), _AROUND_MODERN, strict=True
        )
    ),
    *(
        Releases(gpt, layout, hardware, published)
        for gpt, layout, hardware, published in (
            (
                LLAMA3_70B,
                _megatron(LLAMA3_70B, 64, 256, 1, 4, 8, 5, 0),
                H100_SXM,
                (("26.02", 1621), ("26.02.01", 1639), ("26.04", 1633), ("26.04.01", 1664)),
            ),
            (
                LLAMA31_405B,
                _megatron(LLAMA31_405B, 1024, 1536, 1, 8, 8, 8, 0, 2),
                H100_SXM,
                (("26.02", 311), ("26.04.01", 328), ("26.06", 326)),
            ),
            (
                QWEN3_30B_A3B,
                _megatron_moe(QWEN3_30B_A3B, 8, 512, 4, 1, 1, 1, 8),
                B200,
                (("26.02.01", 26695), ("26.04", 26859), ("26.04.01", 27136)),
            ),
            (
                QWEN3_30B_A3B,
                _megatron_moe(QWEN3_30B_A3B, 16, 1024, 1, 1, 2, 12, 8),
                H100_SXM,
                (("26.02", 5113), ("26.02.01", 9058)),
            ),
            (
                QWEN3_30B_A3B,
                _megatron_moe(QWEN3_30B_A3B, 16, 1024, 1, 1, 1, 1, 16),
                H100_SXM,
                (("26.04", 8901), ("26.04.01", 8960), ("26.06", 8826)),
            ),
            (
                QWEN3_235B_A22B,
                _megatron_moe(QWEN3_235B_A22B, 256, 8192, 1, 2, 8, 4, 32),
                H100_SXM,
                (("26.02", 1633), ("26.02.01", 1611), ("26.04", 1686), ("26.04.01", 1712)),
            ),
            (
                QWEN3_235B_A22B,
                _megatron_moe(QWEN3_235B_A22B, 256, 8192, 1, 1, 8, 1, 8),
                B200,
                (("26.02", 3805), ("26.04.01", 3776)),
            ),
        )
    ),
)


def across_releases(efficiency: float = EFFICIENCY) -> list[tuple[Releases, TransformerPrediction]]:
    """(layout, the one prediction of it) for each of `RELEASES`, its platform at `efficiency`."""
    return [(runs, predict(runs.gpt, runs.layout, gpu_platform(runs.hardware, efficiency))) for runs in RELEASES]


def validate_modern(
    efficiency: float = EFFICIENCY,
) -> list[tuple[ModernRun, TransformerPrediction, float, float | None]]:
    """(row, prediction of its published layout, accuracy of tokens per second per GPU, accuracy of the peak
    memory or None) for each of `MODERN`, every platform at `efficiency` of its peaks."""
    out = []
    for run in MODERN:
        pred = predict(run.gpt, run.layout, gpu_platform(run.hardware, efficiency))
        memory = None if run.memory is None else accuracy(pred.peak, run.memory)
        out.append((run, pred, accuracy(pred.tokens_per_device(), run.tokens_per_gpu), memory))
    return out
