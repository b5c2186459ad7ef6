"""Lab 16's oracle for 2024-26 machines and recipes: the platforms, float8, expert parallelism, FSDP's overlap,
ring attention's memory, and the published runs it is validated against (never fitted to)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import weakref
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from ddlab.allreduce.cost import Link
from ddlab.oracle import plan_transformer
from ddlab.oracle.platform import Platform
from ddlab.oracle.published import (
    B200,
    EFFICIENCY,
    H100_96GB,
    H100_SXM,
    H200_SXM,
    LLAMA3_8B,
    LLAMA3_70B,
    MIXTRAL_8X22B,
    MODERN,
    RELEASES,
    TITAN_TABLE1,
    Releases,
    a100_cluster,
    accuracy,
    across_releases,
    calibrate_titan,
    gpu_platform,
    model_flops_per_token,
    titan_table1_layout,
    validate_modern,
)
from ddlab.oracle.transformer import (
    GPT,
    Layout,
    Precision,
    attention_seconds,
    busiest,
    iteration_flops,
    layer_activations,
    layout_time,
    predict,
    problem,
    rank_memory,
    rerun_share,
    sixteen_bit_flops,
    stage_op_times,
    stage_split,
    step_time,
)
from ddlab.runtime.loopback import interface
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode


def _flat() -> Platform:
    link = Link(alpha=1e-5, beta=1 / 1e10)
    return Platform("flat", 8, 1e14, 10**12, link, link, contention=(1.0,) * 8, rates={"fp8": 2e14})


def test_platforms_are_the_datasheets_at_the_efficiency_the_user_sets():
    h100 = gpu_platform(H100_SXM)
    assert h100.flops == EFFICIENCY * 989.5e12 and h100.rate("fp8") == EFFICIENCY * 1979e12
    assert h100.memory == 80 * 10**9 and gpu_platform(H200_SXM).memory == 141 * 10**9
    assert gpu_platform(B200, efficiency=0.5).rate("bf16") == 0.5 * 2.25e15  # no "bf16" rate: flops
    assert 1 / h100.intra.beta == 450e9 and 1 / h100.inter.beta == 50e9 and 1 / gpu_platform(B200).intra.beta == 900e9
    assert all(key in h100.sources for key in ("compute", "memory", "intra", "inter", "flops"))
    with pytest.raises(ValueError, match="share of the dense peak"):
        gpu_platform(H100_SXM, efficiency=1.5)
    a100 = a100_cluster()  # unchanged
    assert a100.flops == 0.570 * 312e12 and a100.rates == {} and a100.memory == 80 * 10**9


def test_an_attention_kernel_measured_on_the_gpu_is_read_at_the_ranks_query_length():
    h100, b200 = gpu_platform(H100_SXM), gpu_platform(B200)
    # Shah et al.'s FlashAttention-2 at 8K: 333 causal, 370 without the mask forward, 318 without it backward
    assert h100.attention_rates("flash", 128, 8192) == pytest.approx((333e12, 318e12 * 333 / 370))
    forward, backward = b200.attention_rates("fused", 128, 3000)  # between 2K and 4K, in log length
    share = (math.log(3000) - math.log(2048)) / (math.log(4096) - math.log(2048))
    assert forward == pytest.approx(478.9e12 + share * (855.7e12 - 478.9e12))
    assert backward == pytest.approx(371.5e12 + share * (701.3e12 - 371.5e12))
    assert b200.attention_rates("fused", 128, 2**20) == b200.attention_rates("fused", 128, 131072)  # the last row
    assert b200.attention_rates("flash", 128, 100) == (74.6e12, 83.0e12)  # before the first: the first row
    for kernel, head in (("local", 128), ("flash", 64)):
        assert h100.attention_rates(kernel, head, 8192) is None  # not measured: the 16-bit share of the peak
    assert gpu_platform(H200_SXM).attention_rates("fused", 128, 8192) is None
    assert a100_cluster().attention_rates("flash", 128, 2048) is None
    assert gpu_platform(H100_SXM, 0.2).attention == h100.attention  # measured rates, whatever the efficiency
    unsorted = replace(h100, attention={("flash", 128): ((8192, 1e14, 1e14), (4096, 1e14, 1e14))})
    with pytest.raises(ValueError, match="must increase"):
        unsorted.attention_rates("flash", 128, 6000)


def test_a_layers_attention_takes_what_nvidias_benchmark_measured():
    """One layer of 128 query heads on one sequence of 8K tokens, causal, "fused" on a B200: the forward and
    backward NVIDIA's SDPA benchmark timed (cudnn-frontend's B200 results: 1.877 and 5.833 ms)."""
    gpt = replace(LLAMA3_8B, layers=1, hidden=16384, heads=128, kv_heads=8, seq=8192)
    forward, backward = attention_seconds(gpt, Layout(kernel="fused"), gpu_platform(B200))
    assert (forward, backward) == (pytest.approx(1.877e-3, rel=2e-3), pytest.approx(5.833e-3, rel=2e-3))


def test_attention_runs_at_its_measured_rates_and_the_rest_at_the_share_of_the_peak():
    """The rank's causal half of the score blocks, forward (rerun under recomputation) over the forward rate read
    at its s / c queries, backward counted as the benchmarks count it (2.5 forwards) over the backward rate; the
    rest of the step as before."""
    gpt = replace(LLAMA3_8B, seq=24576)
    h100 = gpu_platform(H100_SXM)
    lay = Layout(data=2, tensor=2, context=4, batch=2, zero=3, recompute="selective", precision="fp8", kernel="flash")
    forward, backward = h100.attention_rates("flash", 128, 24576 // 4)  # 6K queries a rank: between two rows
    score = 0.5 * 2 * gpt.layers * gpt.attention_score_flops() / 16  # causal half, 2 sequences, 16 ranks
    assert attention_seconds(gpt, lay, h100) == (
        pytest.approx(2 * score / forward),  # the forward and selective recomputation's rerun
        pytest.approx(2.5 * score / backward),
    )
    unmeasured = replace(h100, attention={})
    assert attention_seconds(gpt, lay, unmeasured) == (
        pytest.approx(2 * score / h100.flops),
        pytest.approx(2 * score / h100.flops),
    )
    with_kernel, without = (layout_time(gpt, lay, p)["compute"] for p in (h100, unmeasured))
    assert with_kernel - without == pytest.approx(sum(attention_seconds(gpt, lay, h100)) - 4 * score / h100.flops)
    local = lay.with_(kernel="local")  # eager attention: the whole block at the 16-bit share, as step_time prices it
    assert layout_time(gpt, local, h100)["compute"] == pytest.approx(step_time(gpt, local, h100)["compute"])


def test_a_pipeline_stage_puts_the_attentions_forward_in_f_and_its_backward_in_b():
    """stage_op_times: F holds the attention's forward, B its backward and any rerun, at their own paces, so a
    kernel whose backward is slow makes B longer, not F."""
    gpt = replace(LLAMA3_8B, seq=32768)
    h100 = gpu_platform(H100_SXM)
    lay = Layout(data=1, pipeline=4, batch=8, precision="bf16", kernel="flash")
    slow_backward = replace(h100, attention={("flash", 128): ((1, 400e12, 100e12),)})
    fast_backward = replace(h100, attention={("flash", 128): ((1, 400e12, 1000e12),)})
    (fs, bs, ws), (ff, bf, wf) = (stage_op_times(gpt, lay, p, 1.0) for p in (slow_backward, fast_backward))
    assert fs + bs + ws == pytest.approx(1.0 / lay.micro_batches) == pytest.approx(ff + bf + wf)
    # no recomputation, 16 bits: F - W is the attention's forward, B - W its backward (2.5 forwards' FLOPs)
    assert (bs - ws) / (fs - ws) == pytest.approx(2.5 * 400 / 100)
    assert (bf - wf) / (ff - wf) == pytest.approx(2.5 * 400 / 1000)


def test_a_machine_without_a_datasheet_is_set_by_its_own_measurement():
    h100 = gpu_platform(H100_SXM, 0.4, fp8_efficiency=0.25)
    assert h100.flops == 0.4 * 989.5e12 and h100.rate("fp8") == 0.25 * 1979e12 and "fp8 25%" in h100.name
    with pytest.raises(ValueError, match="share of the dense peak"):
        gpu_platform(H100_SXM, fp8_efficiency=0.0)
    with pytest.raises(ValueError, match="the GPUs of a node"):
        gpu_platform(H100_SXM, nodes_of=0)
    bf16, fp8 = calibrate_titan()
    assert 0 < fp8 < bf16 < 1  # torchao's float8 gained less than its peak's doubling on that machine
    platform = gpu_platform(H100_96GB, bf16, fp8_efficiency=fp8)
    for precision, tokens in TITAN_TABLE1:
        layout = titan_table1_layout(precision)
        assert predict(LLAMA3_8B, layout, platform).tokens_per_device() == pytest.approx(tokens, rel=1e-4)


def test_float8_runs_the_linear_layers_at_its_rate_and_gathers_one_byte():
    gpt, platform = GPT(layers=4, hidden=1024, heads=16, seq=2048, vocab=32000), _flat()
    bf16, fp8 = Layout(data=8, batch=8, zero=3), Layout(data=8, batch=8, zero=3, precision="fp8")
    flops, wide = iteration_flops(gpt, 8, "none"), sixteen_bit_flops(gpt, 8, "none")
    assert step_time(gpt, bf16, platform)["compute"] == pytest.approx(flops / 8 / 1e14)
    assert step_time(gpt, fp8, platform)["compute"] == pytest.approx(((flops - wide) / 2e14 + wide / 1e14) / 8)
    gathers = step_time(gpt, fp8, platform)["data"], step_time(gpt, bf16, platform)["data"]
    assert gathers[0] < gathers[1]  # the all-gathers send 1 byte per parameter instead of 2
    own = Precision(weights=2, gradients=4, optimizer=12, activations=2, allgather=2, reduce=4)
    memory = rank_memory(gpt, bf16.with_(precision=own))
    assert memory["gradients"] == pytest.approx(2 * rank_memory(gpt, bf16)["gradients"])
    assert "choose one of" in problem(gpt, bf16.with_(precision="fp4"))


MOE = GPT(layers=4, hidden=512, heads=8, seq=1024, vocab=1000, experts=8, top_k=2, moe_every=2, gated=True, ffn=1536)


def test_expert_parallelism_splits_the_experts_and_prices_the_all_to_alls():
    platform = _flat()
    lay = Layout(data=8, batch=16, expert=4)
    dense, routed = stage_split(MOE, lay)
    assert routed == pytest.approx(MOE.moe_layers * 8 * MOE.mlp_parameters(1536) / 4)
    assert dense + routed * 4 == pytest.approx(MOE.parameters() - MOE.norm_parameters())  # all but the final norm
    send = 1 * 1024 * 2 * 512 * 2  # b s tokens, 2 slots each, h elements of 2 bytes
    want = 2 * 2 * 4 * platform.comm("alltoall", send, 4, 1)  # m = 2 micro-batches, 2 MoE layers, 4 trips
    assert layout_time(MOE, lay, platform)["expert"] == pytest.approx(want)
    assert layout_time(MOE, lay.with_(expert=1), platform)["expert"] == 0.0
    assert "expert 3 does not divide" in problem(MOE, lay.with_(expert=3))
    state = rank_memory(MOE, lay)["optimizer"], rank_memory(MOE, lay.with_(expert=1))["optimizer"]
    assert state[0] < state[1]


def test_an_all_to_all_across_nodes_sends_each_piece_on_its_own_path():
    """Inside a node the alpha-beta price; across nodes the pieces for the rank's own node ride NVLink while the
    others cross the network at once, so the network's share sets the time, not every piece at its rate."""
    h100, n = gpu_platform(H100_SXM), 2.0**30
    intra, inter = h100.intra, h100.inter
    assert h100.comm("alltoall", n, 8) == pytest.approx(7 * intra.alpha + 7 / 8 * n * intra.beta)
    across = h100.comm("alltoall", n, 32)  # 4 nodes of 8: 24 of the 32 pieces leave the node
    assert across == pytest.approx(31 * inter.alpha + 24 / 32 * n * inter.beta)
    assert across < 31 * inter.alpha + 31 / 32 * n * inter.beta  # what one link for every piece would charge
    pairs = h100.comm("alltoall", n, 8, stride=4)  # 2 of the 8 ranks in each of 4 nodes
    assert pairs == pytest.approx(7 * inter.alpha + 6 / 8 * n * inter.beta)
    alone = h100.comm("alltoall", n, 4, stride=8)  # one rank a node: every piece crosses
    assert alone == pytest.approx(3 * inter.alpha + 3 / 4 * n * inter.beta)
    apart = h100.comm("alltoall", n, 4, stride=16)  # one rank every other node
    assert apart == pytest.approx(3 * inter.alpha + 3 / 4 * n * inter.beta)
    ragged = h100.comm("alltoall", n, 12)  # 8 ranks in one node, 4 in the next: those 4 send 8 of 12 pieces out
    assert ragged == pytest.approx(11 * inter.alpha + 8 / 12 * n * inter.beta)
    halves = h100.comm("alltoall", n, 6, stride=2)  # 4 ranks in one node, 2 in the next
    assert halves == pytest.approx(5 * inter.alpha + 4 / 6 * n * inter.beta)
    slow_inside = Platform("slow NVLink", 4, 1e14, 10**12, Link(0.0, 1e-9), Link(0.0, 1e-10))
    assert slow_inside.comm("alltoall", n, 8) == pytest.approx(3 / 8 * n * 1e-9)  # then the node's share sets it
    shared = h100.comm("alltoall", n, 32, sharing=2)
    assert shared == pytest.approx(31 * inter.alpha + 24 / 32 * n * inter.beta * 2)


def test_fsdp_overlap_hides_the_gathers_under_the_layers():
    gpt = GPT(layers=8, hidden=2048, heads=16, seq=4096, vocab=32000)
    slow = Platform("slow", 8, 1e12, 10**12, Link(1e-5, 1e-10), Link(1e-5, 1e-10), contention=(1.0,) * 8)
    lay = Layout(data=8, batch=8, zero=3)
    plain, hidden = layout_time(gpt, lay, slow)["data"], layout_time(gpt, lay.with_(overlap=True), slow)["data"]
    assert hidden < plain / 5  # the layers compute far longer than their collectives take
    units = gpt.layers + 1
    params = sum(stage_split(gpt, lay)) * 2 / units
    first_and_last = slow.comm("allgather", params, 8) + slow.comm("reduce_scatter", params, 8)
    assert hidden == pytest.approx(first_and_last)  # one micro-batch: only the first gather and last scatter show


def test_fsdp_holds_the_whole_parameters_of_the_unit_computing_and_of_the_next():
    gpt = replace(LLAMA3_8B, layers=4)
    lay = Layout(data=8, batch=8, zero=3, kernel="flash", overlap=True)
    embeddings = 2 * gpt.vocab * gpt.hidden  # untied: word embedding and output layer, on the one stage
    layer = gpt.layer_parameters()
    assert rank_memory(gpt, lay)["gathered"] == pytest.approx(2 * (embeddings + layer))
    one_at_a_time = rank_memory(gpt, lay.with_(overlap=False))["gathered"]  # lab 13's engine: none gathered ahead
    assert one_at_a_time == pytest.approx(2 * embeddings)
    fp8 = rank_memory(gpt, lay.with_(precision="fp8"))["gathered"]  # gathered as sent: a byte each under float8
    assert fp8 == pytest.approx(embeddings + layer)
    tensor = rank_memory(gpt, lay.with_(data=4, tensor=2))["gathered"]
    assert tensor == pytest.approx((embeddings + layer) * 2 / 2)  # each tensor rank gathers its share
    staged = lay.with_(data=4, pipeline=4, batch=16)  # the first or last stage: one embedding
    assert rank_memory(replace(gpt, layers=8), staged)["gathered"] == pytest.approx(2 * (embeddings / 2 + layer))
    small_vocabulary = replace(gpt, layers=8, vocab=1000)  # a layer larger than the embeddings: two layers
    assert rank_memory(small_vocabulary, staged)["gathered"] == pytest.approx(2 * 2 * layer)
    for other in (lay.with_(zero=1), lay.with_(data=1, batch=1)):  # sharded or whole: nothing gathered
        assert rank_memory(gpt, other)["gathered"] == 0.0


def test_under_context_parallelism_no_softmax_block_is_kept():
    gpt = GPT(layers=8, hidden=1024, heads=16, seq=4096, vocab=32000)
    lay = Layout(context=4, batch=1)
    rows = gpt.seq // 4
    want = layer_activations(gpt, rows, 1, 1, False, 2, "none", False, "flash")
    assert want == pytest.approx(rows * (34 * 1024 + 4 * 16))  # Korthikanti's 34 sbh + a float32 lse per head
    logits = (4 + 2) * rows * gpt.vocab  # the loss's float32 copy of the logits, beside the 16-bit ones
    assert rank_memory(gpt, lay)["activations"] == pytest.approx(8 * want + logits)


def test_tensor_overlap_shows_one_piece_of_t_or_what_outlasts_the_linear_layers():
    gpt = GPT(layers=4, hidden=1024, heads=16, seq=2048, vocab=32000)
    lay = Layout(tensor=4, batch=8, sequence_parallel=True)
    fast_link = Link(alpha=1e-6, beta=1 / 1e12)
    fast = Platform("fast", 8, 1e14, 10**12, fast_link, fast_link, contention=(1.0,) * 8)
    exposed = layout_time(gpt, lay, fast)["tensor"]
    assert exposed > 0 and "tp-overlap" in lay.with_(tensor_overlap=True).label
    assert layout_time(gpt, lay.with_(tensor_overlap=True), fast)["tensor"] == pytest.approx(exposed / 4)
    # a slow link, float8 and full recomputation (its rerun forward's collectives and linear layers too), and
    # contention: what the pipeline of 4 pieces cannot hide, T - U (t - 1) / t
    slow_link = Link(alpha=1e-5, beta=1 / 1e7)
    slow = Platform(
        "slow", 8, 1e14, 10**12, slow_link, slow_link, contention=(1.0, 1.0, 1.0, 1.25), rates={"fp8": 3e14}
    )
    full = lay.with_(recompute="full", precision="fp8")
    linear = (iteration_flops(gpt, 8, "full") - sixteen_bit_flops(gpt, 8, "full")) / 3e14 / 4 * 1.25
    exposed = layout_time(gpt, full, slow)["tensor"]
    assert exposed > linear  # the collectives outlast the linear layers
    hidden = layout_time(gpt, full.with_(tensor_overlap=True), slow)["tensor"]
    assert hidden == pytest.approx(exposed - linear * 3 / 4)
    one = Layout(batch=8, tensor_overlap=True)  # no tensor ranks: nothing to hide
    assert layout_time(gpt, one, fast)["tensor"] == 0.0
    assert "set sequence_parallel too" in problem(gpt, lay.with_(sequence_parallel=False, tensor_overlap=True))


def test_recomputing_some_layers_of_a_chunk_is_between_none_and_all():
    gpt = GPT(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, gated=True, ffn=2816)
    lay = Layout(pipeline=2, batch=8, recompute="full", precision="fp8", kernel="fused", sequence_parallel=False)
    some, every, none = lay.with_(recompute_layers=1), lay, lay.with_(recompute="none")
    assert [rerun_share(gpt, x) for x in (some, every, none)] == [0.25, 1.0, 0.0]  # 1 of a chunk's 4 layers
    assert rerun_share(gpt, lay.with_(recompute_layers=9)) == 1.0 and "1 a chunk" in some.label
    flops = [iteration_flops(gpt, 8, "full", share) for share in (0.0, 0.25, 1.0)]
    assert flops[1] == pytest.approx(0.75 * flops[0] + 0.25 * flops[2])
    assert iteration_flops(gpt, 8, "none") == flops[0]
    times = [predict(gpt, x, _flat()).seconds["compute"] for x in (none, some, every)]
    assert times[0] < times[1] < times[2]
    assert times[1] == pytest.approx(0.75 * times[0] + 0.25 * times[2])  # the compute is linear in the reruns
    acts = [rank_memory(gpt, x)["activations"] for x in (none, some, every)]
    assert acts[2] < acts[1] < acts[0]
    assert rank_memory(gpt, lay.with_(recompute_layers=4)) == rank_memory(gpt, every)  # a whole chunk: all
    assert "recompute_layers = -1" in problem(gpt, lay.with_(recompute_layers=-1))


class _LivePeak(TorchDispatchMode):
    """The peak bytes of the storages ops create while it is on, each counted until torch frees it; the storages of
    `weights` (which a view such as a transpose shows to it) never."""

    def __init__(self, weights: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.live: dict[int, int] = {w.untyped_storage().data_ptr(): 0 for w in weights}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.live:
                storage = tensor.untyped_storage()
                self.live[storage.data_ptr()] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._free, storage.data_ptr())
        return out


class _VocabularyCrossEntropy(torch.autograd.Function):
    """A cross entropy as Megatron-Core's vocabulary-parallel one runs on one rank: a float32 copy of the logits
    becomes the softmax in place and is kept; the backward forms the gradient in it, in place."""

    @staticmethod
    def forward(ctx, logits, target):  # type: ignore[override]
        probs = logits.float()
        probs -= probs.max(-1, keepdim=True).values
        probs.exp_()
        probs /= probs.sum(-1, keepdim=True)
        ctx.save_for_backward(probs, target)
        return -probs.gather(-1, target[:, None]).log().mean()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        probs, target = ctx.saved_tensors
        probs[torch.arange(len(target)), target] -= 1
        return probs.mul_(grad / len(target)), None


class _InPlaceCrossEntropy(torch.autograd.Function):
    """A cross entropy as Transformer Engine's `parallel_cross_entropy` runs on one rank: its forward writes the
    gradient of the mean loss over the logits it was given, row by row (its kernel: one program a row, in float32
    registers), and keeps them; the backward scales them by the gradient coming in."""

    @staticmethod
    def forward(ctx, logits, target):  # type: ignore[override]
        losses = torch.empty(len(logits))
        for i, row in enumerate(logits):
            wide = row.float()
            lse = wide.logsumexp(-1)
            losses[i] = lse - wide[target[i]]
            probs = wide.sub_(lse).exp_()  # in place: the row itself when the logits are float32
            probs[target[i]] -= 1
            row.copy_(probs / len(target))
        ctx.save_for_backward(logits.detach())
        return losses.mean()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (logits,) = ctx.saved_tensors
        return logits.mul_(grad), None


def _eager_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.float(), labels)  # torchtitan's loss_fn


LOSS_FUNCTIONS = {"fused": _VocabularyCrossEntropy.apply, "eager": _eager_loss, "in-place": _InPlaceCrossEntropy.apply}


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
@pytest.mark.parametrize("loss", LOSS_FUNCTIONS)
def test_the_loss_holds_the_copies_of_the_logits_torch_allocates(loss, dtype, precision):
    s, h, vocab = 1024, 4, 4096  # h small: the weights' gradient (V h) is 0.4% of a copy (s V)
    x = torch.randn(s, h, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, h, dtype=dtype, requires_grad=True)
    labels = torch.randint(vocab, (s,))
    compute = LOSS_FUNCTIONS[loss]
    with _LivePeak() as live:
        pred = x @ w.t()
        value = compute(pred, labels)
        del pred  # as torchtitan's train step does; Megatron's model returns the loss, not the logits
        value.backward()
    gpt = GPT(layers=2, hidden=h, heads=1, seq=s, vocab=vocab)
    lay = Layout(loss=loss, precision=precision, recompute="full")  # every layer keeps its input only
    e = 2 if precision == "bf16" else 4
    counted = rank_memory(gpt, lay)["activations"] - 2 * s * h * e
    assert counted == pytest.approx(live.peak, rel=0.02)
    assert "choose one of fused, eager, in-place, parallel" in problem(gpt, Layout(loss="chunked"))
    # each stand-in is a cross entropy: its gradient is torch's
    wide = x.detach().float().requires_grad_()
    F.cross_entropy(wide @ w.detach().float().t(), labels).backward()
    assert torch.allclose(x.grad.float(), wide.grad, rtol=0.02, atol=1e-4)


class _TitanBlock(nn.Module):
    """A block as torchtitan's Llama runs it (torchtitan/models/llama/model.py at 9dec370): the norm in float32, q, k
    and v projected one by one, rotary positions, the key/value heads repeated for torch's scaled dot-product
    attention, the output projection, and w2(silu(w1 x) * w3 x), or a GELU MLP's two layers."""

    def __init__(self, gpt: GPT):
        super().__init__()
        h, d = gpt.hidden, gpt.head_dim_
        self.gpt = gpt
        self.norms = nn.ModuleList(nn.LayerNorm(h) if gpt.norm == "layernorm" else nn.RMSNorm(h) for _ in range(2))
        self.qk_norms = nn.ModuleList(nn.RMSNorm(d) for _ in range(2 if gpt.qk_norm else 0))
        self.wq, self.wk, self.wv = (
            nn.Linear(h, width, bias=False) for width in (gpt.q_width, gpt.kv_width, gpt.kv_width)
        )
        self.wo = nn.Linear(gpt.q_width, h, bias=False)
        self.mlp = nn.ModuleList(nn.Linear(*shape, bias=False) for shape in self._mlp_shapes())
        angle = torch.arange(gpt.seq)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        self.register_buffer("cos", torch.cos(angle).repeat(1, 2)[:, None, :])
        self.register_buffer("sin", torch.sin(angle).repeat(1, 2)[:, None, :])

    def _mlp_shapes(self) -> list[tuple[int, int]]:
        h, f = self.gpt.hidden, self.gpt.ffn_
        return [(h, f), (f, h), (h, f)] if self.gpt.gated else [(h, f), (f, h)]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * self.cos.to(x.dtype) + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * self.sin.to(x.dtype)

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm.float()(x.float()).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        b, s, _ = x.shape
        y = self._norm(self.norms[0], x)
        q, k, v = (proj(y).view(b, s, -1, gpt.head_dim_) for proj in (self.wq, self.wk, self.wv))
        if gpt.qk_norm:
            q, k = self._norm(self.qk_norms[0], q), self._norm(self.qk_norms[1], k)
        group = gpt.heads // gpt.kv_heads_
        k, v = (t.repeat_interleave(group, dim=2) for t in (self._rotate(k), v))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (self._rotate(q), k, v)), is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, gpt.q_width))
        y = self._norm(self.norms[1], x)
        first, down, *up = self.mlp
        hidden = F.silu(first(y)) * up[0](y) if gpt.gated else F.gelu(first(y))
        return x + down(hidden)


def _op_policy():
    """torchtitan's op-level policy, restated: every other `aten.mm` (the first, third, ...) of a block's forward, and
    the attention kernel (on a CPU its flash kernel, `_scaled_dot_product_flash_attention_for_cpu`), are saved; the
    rest reruns in the backward. Counted apart in the forward and in its rerun."""
    counts = {True: 0, False: 0}
    mm = torch.ops.aten.mm.default
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def policy(ctx, func, *args, **kwargs):
        counts[ctx.is_recompute] += func == mm
        saved = func == attention or (func == mm and counts[ctx.is_recompute] % 2 == 1)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


_TITAN_SMALL = replace(LLAMA3_8B, layers=1, seq=64, vocab=8)  # Llama 3's block (no biases, dropout), made small
TITAN_SHAPES = {
    "llama (gqa, swiglu)": replace(_TITAN_SMALL, hidden=128, heads=4, kv_heads=2, ffn=344),
    "gelu, layernorm": GPT(layers=1, hidden=96, heads=3, seq=64, vocab=8, bias=False, dropout=False),
    "qk norm, wide heads": replace(_TITAN_SMALL, hidden=64, heads=4, kv_heads=1, head_dim=48, ffn=160, qk_norm=True),
}


@pytest.mark.parametrize("dtype, e", [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("shape", TITAN_SHAPES)
def test_op_recomputation_keeps_what_torchtitans_policy_saves(shape, dtype, e):
    gpt, batch = TITAN_SHAPES[shape], 2
    torch.manual_seed(0)
    block = _TitanBlock(gpt).to(dtype)
    x = torch.randn(batch, gpt.seq, gpt.hidden, dtype=dtype, requires_grad=True)
    with _LivePeak(tuple(block.parameters())) as live:
        y = checkpoint(block, x, use_reentrant=False, context_fn=_op_policy)
        kept = live.now - y.untyped_storage().nbytes()
    want = layer_activations(gpt, gpt.seq, batch, 1, False, e, "op", False, "flash")
    input_bytes = x.numel() * e  # the block's input, which the oracle counts and the caller allocated here
    assert kept + input_bytes == pytest.approx(want, rel=0.01)
    y.sum().backward()
    reference = x.detach().clone().requires_grad_()
    block(reference).sum().backward()
    assert torch.allclose(x.grad, reference.grad)  # the rerun is the block's own backward


@pytest.mark.parametrize("shape", TITAN_SHAPES)
def test_op_recomputation_reruns_the_matrix_multiplications_it_did_not_save(shape):
    gpt, batch = TITAN_SHAPES[shape], 2
    block = _TitanBlock(gpt)
    x = torch.randn(batch, gpt.seq, gpt.hidden, requires_grad=True)
    counted = []
    for run in (block, lambda x: checkpoint(block, x, use_reentrant=False, context_fn=_op_policy)):
        with FlopCounterMode(display=False) as counter:  # (it does not count the CPU's attention kernel, saved)
            run(x).sum().backward()
        counted.append(counter.get_total_flops())
    lay = Layout(batch=batch, recompute="op", kernel="flash")
    reruns = iteration_flops(gpt, batch, "op", rerun_share(gpt, lay)) - iteration_flops(gpt, batch, "none")
    assert reruns == pytest.approx(counted[1] - counted[0], rel=0.01)
    assert reruns == batch * gpt.op_rerun_flops()


def test_op_recomputation_is_priced_where_torchtitan_runs_it():
    gpt = replace(TITAN_SHAPES["llama (gqa, swiglu)"], layers=4)
    lay = Layout(batch=2, recompute="op", kernel="flash")
    assert problem(gpt, lay) is None and "op recompute" in lay.label
    assert "on tensor 1 and context 1 with a flash kernel" in problem(gpt, lay.with_(kernel="local"))
    assert "tensor 1" in problem(replace(gpt, heads=4), lay.with_(tensor=2, data=1))
    assert "without biases or dropout" in problem(replace(gpt, bias=True), lay)
    assert "without biases or dropout" in problem(replace(gpt, experts=4, top_k=2), lay)
    with pytest.raises(ValueError, match="dense blocks on one tensor rank"):
        layer_activations(gpt, gpt.seq, 1, 2, False, 2, "op", False, "flash")
    none, op = (rank_memory(gpt, lay.with_(recompute=r))["activations"] for r in ("none", "op"))
    full = rank_memory(gpt, lay.with_(recompute="full"))["activations"]
    assert full < op < none
    times = [predict(gpt, lay.with_(recompute=r), _flat()).seconds["compute"] for r in ("none", "op", "full")]
    assert times[0] < times[1] < times[2]


#: One step of torch's cross entropy on a float32 copy of bfloat16 logits, eager or under `loss_parallel` (a DTensor
#: sharded over the vocabulary, on a mesh of one rank), whose work a dispatch mode does not see (it runs on the local
#: tensors inside the DTensor's own dispatch). So the process's resident memory is measured instead: with every buffer
#: above 64 KiB its own mapping (MALLOC_MMAP_THRESHOLD_), freed to the system when torch frees it, the peak resident
#: size (VmHWM, reset through /proc/self/clear_refs) above the step's start is the peak of the buffers it allocated.
_RESIDENT_PEAK = """
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

def resident():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return [int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")]

s, h, vocab = 4096, 8, 8192
torch.manual_seed(0)
x = torch.randn(s, h, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(vocab, h, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(vocab, (s,))
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
mesh = init_device_mesh("cpu", (1,))
x_d, w_d = DTensor.from_local(x, mesh, [Replicate()]), distribute_tensor(w.detach(), mesh, [Shard(0)])
w_d.requires_grad_()

def step(parallel):
    if parallel:
        pred = x_d @ w_d.t()  # sharded over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(pred.float(), labels)
            del pred  # as torchtitan's train step does
            loss.backward()
    else:
        pred = x @ w.t()
        loss = F.cross_entropy(pred.float(), labels)
        del pred
        loss.backward()

for parallel in (False, True):
    step(parallel)  # once first: the gradients' buffers and torch's own
    base, _ = resident()
    open("/proc/self/clear_refs", "w").write("5")
    step(parallel)
    print((resident()[1] - base) / (s * vocab))
dist.destroy_process_group()
"""


def test_torchs_loss_parallel_holds_four_float32_copies_of_the_logits():
    if sys.platform != "linux":
        pytest.skip("measures the resident memory through Linux's /proc")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "GLOO_SOCKET_IFNAME": interface(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _RESIDENT_PEAK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    eager, parallel = (float(line) for line in done.stdout.split())
    gpt, s, vocab = GPT(layers=2, hidden=8, heads=1, seq=4096, vocab=8192), 4096, 8192
    for loss, measured in (("eager", eager), ("parallel", parallel)):
        lay = Layout(loss=loss, precision="bf16", recompute="full")  # every layer keeps its input only
        counted = rank_memory(gpt, lay)["activations"] - 2 * s * 8 * 2
        assert counted / (s * vocab) == pytest.approx(measured, rel=0.02), loss  # the eager loss: the method's check


def test_the_loss_is_never_beside_a_rerun_layer():
    lay = Layout(batch=1, recompute="full", kernel="flash")
    for vocab in (1000, 200_000):  # a layer's activations larger than the loss's, then smaller
        gpt = GPT(layers=4, hidden=1024, heads=16, seq=2048, vocab=vocab, gated=True, ffn=2816)
        working = layer_activations(gpt, 2048, 1, 1, False, 2, "none", False, "flash")
        loss = (4 + 2) * 2048 * vocab  # a float32 copy of the logits, beside the 16-bit ones
        inputs = 4 * 2 * 2048 * 1024
        assert rank_memory(gpt, lay)["activations"] == pytest.approx(inputs + max(working, loss))


def test_layouts_a_model_cannot_take_and_plans_the_search_need_not_report():
    dense = GPT(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000)
    assert "this GPT has none" in problem(dense, Layout(data=4, batch=8, expert=2))
    assert "pipeline 1 there is none to interleave" in problem(dense, Layout(batch=8, interleave=2))
    with pytest.raises(ValueError, match="for 80 GB pass 80e9"):
        plan_transformer(dense, 8, 8, _flat(), budget=80)
    recipe = Layout(tensor_overlap=True)
    plan = plan_transformer(dense, 8, 8, _flat(), base=recipe, zero_stages=(1,), micro_batches=(1,))
    assert all(p.layout.sequence_parallel or p.layout.tensor == 1 for p in plan.ranked)
    assert not any("tensor_overlap" in why for _, why in plan.rejected)  # not reported as rejected either


def test_the_fused_kernel_times_as_flash_attention():
    gpt = GPT(layers=8, hidden=1024, heads=16, seq=2048, vocab=32000, gated=True, ffn=2816)
    lay = Layout(pipeline=4, batch=16, kernel="flash", precision="fp8")
    flash, fused = (layout_time(gpt, lay.with_(kernel=k), _flat()) for k in ("flash", "fused"))
    assert flash == fused and flash != layout_time(gpt, lay.with_(kernel="local"), _flat())
    assert rank_memory(gpt, lay.with_(kernel="fused"))["activations"] < rank_memory(gpt, lay)["activations"]


def test_the_last_rank_holds_its_warm_up_chunks_beside_the_loss():
    # vocabularies large enough that the last rank, with the loss, is the busiest
    large, larger = (GPT(layers=8, hidden=256, heads=4, seq=128, vocab=vocab) for vocab in (200_000, 300_000))
    per_layer = layer_activations(large, 128, 1, 1, False, 2, "none", False, "local")
    interleaved = Layout(pipeline=2, interleave=2, batch=8)  # chunks of 2 layers; the last rank's warm-up: 2 chunks
    assert rank_memory(large, interleaved)["activations"] == pytest.approx(3 * 2 * per_layer + 6 * 128 * 200_000)
    for schedule in ("1f1b", "zb-h1", "zb-h2", "zb-v"):  # every schedule's busiest rank holds the loss
        lay = Layout(pipeline=2, batch=8, schedule=schedule)
        grown = rank_memory(larger, lay)["activations"] - rank_memory(large, lay)["activations"]
        assert grown == pytest.approx(6 * 128 * 100_000), schedule


def test_the_fused_kernels_keep_float8_inputs_of_their_float8_linear_layers():
    gpt = GPT(layers=4, hidden=1024, heads=16, seq=2048, vocab=32000, gated=True, ffn=2816)
    lay = Layout(batch=1, kernel="fused", precision="fp8")
    per_layer = layer_activations(gpt, 2048, 1, 1, False, 2, "none", False, "fused", linear_input=1)
    assert rank_memory(gpt, lay)["activations"] == pytest.approx(4 * per_layer + (4 + 2) * 2048 * 32000)
    acts = {
        (k, p): rank_memory(gpt, lay.with_(kernel=k, precision=p))["activations"]
        for k in ("flash", "fused")
        for p in ("bf16", "fp8")
    }
    assert acts["flash", "fp8"] == acts["flash", "bf16"]  # torchao's keep 16-bit inputs (matmul_with_hp_or_float8_args)
    # a byte less of the attention's, the MLP's and the down projection's inputs; a byte more for the projection's,
    # whose 16-bit input the flash kernel keeps as its output
    saved = 4 * 2048 * (1024 + 1024 + 2816 - 1024)
    assert acts["fused", "bf16"] - acts["fused", "fp8"] == pytest.approx(saved)


def test_uneven_stages_are_priced_as_the_busiest_stage():
    gpt = GPT(layers=126, hidden=1024, heads=16, seq=2048, vocab=32000)
    lay = Layout(data=2, tensor=2, pipeline=8, batch=64, interleave=8, sequence_parallel=True)
    assert "pipeline 8 x 8 chunks does not divide the 126 layers (or set uneven)" in problem(gpt, lay)
    assert "more chunks than the 126 layers" in problem(gpt, lay.with_(uneven=True, pipeline=16))
    uneven, padded = lay.with_(uneven=True), GPT(layers=128, hidden=1024, heads=16, seq=2048, vocab=32000)
    assert busiest(gpt, uneven) == padded and busiest(padded, uneven) == padded  # 2 layers in each of 64 chunks
    pred, as_busiest = predict(gpt, uneven, _flat()), predict(padded, lay, _flat())
    assert pred.seconds == as_busiest.seconds and pred.memory == as_busiest.memory
    # each part prices the busiest itself, called alone as predict calls it
    assert rank_memory(gpt, uneven) == pred.memory and layout_time(gpt, uneven, _flat()) == pred.seconds
    assert stage_split(gpt, uneven) == stage_split(padded, lay)
    assert pred.tokens_per_device() == as_busiest.tokens_per_device()  # the same tokens, in the busiest's time
    assert pred.model_flops_per_device() < as_busiest.model_flops_per_device()  # but 126 layers' FLOPs
    even = Layout(data=2, tensor=2, pipeline=2, batch=64)  # 126 = 2 x 63: uneven changes nothing
    assert predict(gpt, even.with_(uneven=True), _flat()).seconds == predict(gpt, even, _flat()).seconds
    ten = GPT(layers=10, hidden=1024, heads=16, seq=2048, vocab=32000)
    zbv = Layout(pipeline=2, batch=16, schedule="zb-v", uneven=True)  # a V of two chunks a rank: 4 chunks of 3
    assert busiest(ten, zbv).layers == 12 and busiest(ten, zbv.with_(schedule="1f1b")).layers == 10
    # the chunks priced alike: an upper bound where l / (p v) is small (65 in 64 chunks: 128, a rank needing 9)
    assert busiest(replace(ten, layers=65), uneven).layers == 128 and "uneven" in zbv.label


def test_the_published_rows_are_whole_layouts_predicted_without_a_factor_per_row(capsys):
    rows = validate_modern()
    assert len(rows) == len(MODERN) >= 7 and len({run.source for run in MODERN}) >= 2
    for run, pred, acc, mem in rows:
        assert problem(run.gpt, run.layout) is None and pred.layout == run.layout
        assert acc <= 1 and (mem is None) == (run.memory is None)
        if not run.gpt.experts:  # the dense rows: each ran, so fits (the MoE rows' memory is over-counted)
            assert pred.peak <= run.hardware.memory, f"{run.gpt.name} ran on {run.hardware.name}: its layout fits"
    # Megatron-Bridge's rows (cuDNN/TE attention, causal blocks skipped): within the 15%
    assert all(
        acc >= 0.85 for run, _, acc, _ in rows if run.source.startswith("Megatron-Bridge") and not run.gpt.experts
    )
    assert (
        sum(bool(run.gpt.experts) for run in MODERN) == 4
        and sum(run.gpt.name.startswith("Llama 3.1") for run in MODERN) == 2
    )
    titan = [run for run in MODERN if run.hardware is H100_96GB]  # its Tables 2 (4 rows), 3 and 4 (2 each)
    assert len(titan) == 8 and all(run.memory for run in titan)
    assert [run.layout.recompute for run in titan].count("op") == 2  # Table 3 checkpoints as Table 1 does
    assert predict(LLAMA3_70B, MODERN[1].layout, gpu_platform(H100_SXM)).time == pytest.approx(
        MODERN[1].layout.batch * LLAMA3_70B.seq / 64 / rows[1][1].tokens_per_device()
    )


def test_the_models_flops_per_token_are_the_published_count():
    """Megatron-Bridge publishes each row's model FLOP/s beside its tokens/s: the oracle's model of Llama 3 and
    Qwen3 (attention at its causal share) costs a token what the source counts, within 1%, MoE rows included."""
    rows = [run for run in MODERN if run.tflops is not None]
    assert len(rows) == 9 and {run.gpt.name for run in rows} >= {"Qwen3-30B-A3B", "Llama 3.1 405B"}
    for run in rows:
        assert model_flops_per_token(run.gpt) == pytest.approx(run.published_flops_per_token(), rel=0.01), run
    assert model_flops_per_token(LLAMA3_8B) < iteration_flops(LLAMA3_8B, 1, "none") / LLAMA3_8B.seq  # causal half


def test_every_release_of_a_bridge_row_is_its_layout_and_the_dense_ones_hold():
    """`RELEASES`: each Megatron-Bridge row of `MODERN` is one layout there (no later layout states it again), with its
    25.11 figure; every layout ran, so is predicted to fit; the dense layouts' rates, release after release, stay
    within 15% of the one prediction, and the spread is the fastest over the slowest."""
    rows = across_releases()
    assert len(rows) == len(RELEASES) and all(len(runs.published) >= 2 for runs in RELEASES)
    for run in (run for run in MODERN if run.source.startswith("Megatron-Bridge")):
        same = [r for r in RELEASES if (r.gpt, r.layout, r.hardware) == (run.gpt, run.layout, run.hardware)]
        assert len(same) == 1 and dict(same[0].published)["25.11"] == run.tokens_per_gpu, run.gpt.name
    assert all(pred.peak <= runs.hardware.memory for runs, pred in rows)
    dense = [(runs, pred.tokens_per_device()) for runs, pred in rows if not runs.gpt.experts]
    assert len(dense) >= 7 and all(accuracy(pred, rate) >= 0.85 for runs, pred in dense for _, rate in runs.published)
    assert Releases(LLAMA3_8B, Layout(), B200, (("a", 100.0), ("b", 150.0), ("c", 120.0))).spread() == 1.5


def test_the_labs_searches_answer_a_70b_on_64_h100s_and_a_moe_on_256():
    """Lab 16's last cells: the layout search's answer, with its memory per GPU (bench/oracle_transformer.py
    times them)."""
    from ddlab.oracle import plan_transformer

    h100, recipe = gpu_platform(H100_SXM), Layout(precision="fp8", kernel="flash", overlap=True)
    for gpt, devices, batch, zero, micro in (
        (LLAMA3_70B, 64, 128, (1, 3), (1, 2)),
        (MIXTRAL_8X22B, 256, 512, (1,), (1,)),
    ):
        plan = plan_transformer(gpt, devices, batch, h100, base=recipe, zero_stages=zero, micro_batches=micro)
        best = plan.best
        assert best is not None and best.peak <= h100.memory and best.layout.precision == "fp8"
        assert all(pred.time >= best.time for pred in plan.ranked)
        assert (best.layout.expert > 1) == (gpt.experts > 0)  # the MoE's answer uses expert parallelism
        assert any("memory" in why for _, why in plan.rejected)


def test_routed_experts_are_not_cut_by_the_tensor_ranks_unless_said():
    """Megatron-Bridge#3744: an estimator that divided the routed experts by the tensor-parallel size under-reported
    a MoE's memory. Here they are whole on their rank (expert_tensor = 1) unless cut by t (expert_tensor = t)."""
    lay = Layout(data=4, tensor=2, batch=8, expert=4, sequence_parallel=True)
    whole, cut = stage_split(MOE, lay)[1], stage_split(MOE, lay.with_(expert_tensor=2))[1]
    assert whole == pytest.approx(MOE.moe_layers * 8 * MOE.mlp_parameters(1536) / 4) and cut == pytest.approx(whole / 2)
    assert rank_memory(MOE, lay)["parameters"] > rank_memory(MOE, lay.with_(expert_tensor=2))["parameters"]
    assert "expert_tensor 3" in problem(MOE, lay.with_(expert_tensor=3))
    assert problem(MOE, lay.with_(expert=8)) is None  # 8 experts over the 8 data x tensor ranks
    assert "expert 8 does not divide" in problem(MOE, lay.with_(expert=8, expert_tensor=2))
    no_sp = [layer_activations(MOE, 1024, 1, 2, False, 2, "none", True, "local", etp) for etp in (1, 2)]
    assert no_sp[0] > no_sp[1]  # without sequence parallelism whole experts keep their whole activations
