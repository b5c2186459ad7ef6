"""The transformer oracle's model options against real torch models of the same shape.

For each option (grouped- and multi-query attention, heads wider than h / heads, SwiGLU of any width, RMSNorm,
rotary positions, untied embeddings, no biases, no dropout, mixtures of experts with top-k routing, shared experts,
a capacity factor or none, every n-th layer) a small torch GPT is built to that shape, and its parameters (counted
by torch), the FLOPs of a training step (torch's `FlopCounterMode`, forward and backward) and the bytes one block
saves for backward (`ddlab.runtime.memory.Ledger`) must equal the oracle's `GPT.parameters`, `iteration_flops` and
`layer_activations` to within 1%. The torch models use the kernels the oracle assumes: a fused RMSNorm that keeps
its input and statistics, rotary embedding by multiplying with constant tables, grouped-query attention that
multiplies each key/value head with its group of query heads without copying it, dense expert buffers of the
capacity's slots.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from ddlab.oracle.transformer import (
    GPT,
    KERNELS,
    Layout,
    iteration_flops,
    layer_activations,
    memory_per_rank,
    rank_memory,
    stage_parameters,
)
from ddlab.runtime.memory import Ledger
from ddlab.tensor_parallel.formulas import activation_bytes_per_layer
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread (two threads on two shared cores are a hundred times slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as fused kernels run it: keeps its input and one reciprocal root mean square per token."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        grad_normed = grad * weight
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x, (grad * normed).sum(dim=tuple(range(grad.dim() - 1))), None


class _Dropout(torch.autograd.Function):
    """Dropout as GPU kernels run it: keeps a 1-byte mask (torch's CPU kernel keeps it in the input's type)."""

    @staticmethod
    def forward(ctx, x, p):  # type: ignore[override]
        mask = torch.rand_like(x) >= p
        ctx.save_for_backward(mask)
        ctx.scale = 1 / (1 - p)
        return x * mask * ctx.scale

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None


class _FusedSwiGLU(torch.autograd.Function):
    """SwiGLU as one kernel (the oracle's "fused"): keeps its input, gate and up, and recomputes silu(gate) in
    its backward; its output is kept by the down projection that takes it."""

    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _swiglu_backward(*ctx.saved_tensors, grad)


def _swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of silu(gate) * up for the gradient `grad` of its output, silu(gate) recomputed."""
    sig = torch.sigmoid(gate)
    return grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig


class _FusedWeightedSwiGLU(torch.autograd.Function):
    """The fused SwiGLU of gated experts (the oracle's "fused"): each slot's activation times its gate, in one kernel
    that keeps gate, up and the gate's weight; the expert's output is then not needed for the gate's gradient."""

    @staticmethod
    def forward(ctx, gate, up, weight):  # type: ignore[override]
        ctx.save_for_backward(gate, up, weight)
        return F.silu(gate) * up * weight[:, None]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        gate, up, weight = ctx.saved_tensors
        return *_swiglu_backward(gate, up, grad * weight[:, None]), (grad * F.silu(gate) * up).sum(-1)


class _Float8Linear(torch.autograd.Function):
    """A linear layer as Transformer Engine's float8 kernels run it: for the weight's gradient it keeps the float8
    copy of its input (`float8`, one byte an element, made once for the layers that share the input), not the input.
    The product itself is computed at the input's precision: only what is kept matters here."""

    @staticmethod
    def forward(ctx, x, float8, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(float8, weight)
        ctx.bias = bias is not None
        out = x @ weight.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        float8, weight = ctx.saved_tensors
        rows, x = grad.reshape(-1, grad.shape[-1]), float8.to(grad.dtype).reshape(-1, float8.shape[-1])
        return grad @ weight, None, rows.t() @ x, rows.sum(0) if ctx.bias else None


def _float8(x: torch.Tensor, on: bool) -> torch.Tensor | None:
    """The float8 copy of a linear layer's input that its layers keep (None: they keep x itself)."""
    return x.detach().to(torch.float8_e4m3fn) if on else None


def _linear(
    x: torch.Tensor, float8: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias, keeping x for the weight's gradient, or its float8 copy when given one."""
    return F.linear(x, weight, bias) if float8 is None else _Float8Linear.apply(x, float8, weight, bias)


def _layer(layer: nn.Linear, x: torch.Tensor, float8: torch.Tensor | None) -> torch.Tensor:
    return _linear(x, float8, layer.weight, layer.bias)


class _FlashAttention(torch.autograd.Function):
    """Attention as flash kernels run it: keeps q, k, v, its output (in the layout the projection takes) and a
    float32 log-sum-exp per row and head, and recomputes the probabilities in its backward. q is (b, kv, g s, d),
    each key/value head's g query heads stacked along the rows; k and v are (b, kv, s, d); mask is (g s, s)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):  # type: ignore[override]
        b, kv, rows, d = q.shape
        s = k.shape[2]
        scores = q @ k.transpose(-1, -2) + mask
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        out = torch.exp(scores - lse) @ v
        out = out.view(b, kv, rows // s, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, kv * rows // s * d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask = mask  # a constant, not an activation
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        b, kv, rows, d = q.shape
        s = k.shape[2]

        def stacked(x: torch.Tensor) -> torch.Tensor:  # (b, s, q_width) to (b, kv, g s, d)
            return x.reshape(b, s, kv, rows // s, d).permute(0, 2, 3, 1, 4).reshape(b, kv, rows, d)

        g = stacked(grad)
        probs = torch.exp(q @ k.transpose(-1, -2) + ctx.mask - lse)
        scores_grad = probs * (g @ v.transpose(-1, -2) - (g * stacked(out)).sum(-1, keepdim=True))
        return scores_grad @ k, scores_grad.transpose(-1, -2) @ q, probs.transpose(-1, -2) @ g, None


def _swiglu(gate: torch.Tensor, up: torch.Tensor, fused: bool) -> torch.Tensor:
    return _FusedSwiGLU.apply(gate, up) if fused else F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNorm.apply(x, self.weight, 1e-6)


def _norm(gpt: GPT, width: int = 0) -> nn.Module:
    width = width or gpt.hidden
    return nn.LayerNorm(width) if gpt.norm == "layernorm" else RMSNorm(width)


class MLP(nn.Module):
    def __init__(self, gpt: GPT, width: int, fused: bool = False, float8: bool = False):
        super().__init__()
        h, bias = gpt.hidden, gpt.bias
        self.gated, self.fused, self.float8 = gpt.gated, fused, float8
        self.up = nn.Linear(h, width, bias=bias)
        self.gate = nn.Linear(h, width, bias=bias) if gpt.gated else None
        self.down = nn.Linear(width, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x8 = _float8(x, self.float8)
        if self.gate is not None:
            act = _swiglu(_layer(self.gate, x, x8), _layer(self.up, x, x8), self.fused)
        else:
            act = F.gelu(_layer(self.up, x, x8))
        return _layer(self.down, act, _float8(act, self.float8))


class Experts(nn.Module):
    """Router, E routed experts (weights stacked), shared experts: top-k routing; each expert computes on its
    slots (with a capacity factor: capacity k T / E slots each, padded with a zero token or dropped)."""

    def __init__(self, gpt: GPT, fused: bool = False, float8: bool = False):
        super().__init__()
        h, f, e = gpt.hidden, gpt.expert_ffn_, gpt.experts
        self.gpt, self.fused, self.float8 = gpt, fused, float8
        self.router = nn.Linear(h, e, bias=False)
        mats = 3 if gpt.gated else 2
        self.w = nn.ParameterList([nn.Parameter(torch.randn(e, h, f) / math.sqrt(h)) for _ in range(mats - 1)])
        self.wd = nn.Parameter(torch.randn(e, f, h) / math.sqrt(f))
        self.bias = nn.ParameterList(
            [nn.Parameter(torch.zeros(e, f)) for _ in range(mats - 1)] + [nn.Parameter(torch.zeros(e, h))]
            if gpt.bias
            else []
        )
        self.shared = nn.ModuleList([MLP(gpt, f, fused, float8) for _ in range(gpt.shared_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpt, shape = self.gpt, x.shape
        flat = x.reshape(-1, shape[-1])
        tokens = flat.shape[0]
        probs = torch.softmax(self.router(flat), dim=-1)
        weight, chosen = probs.topk(gpt.top_k, dim=-1)
        with torch.no_grad():
            order = chosen.reshape(-1)
            slots = []
            capacity = int(gpt.capacity * gpt.top_k * tokens / gpt.experts) if gpt.capacity else None
            for expert in range(gpt.experts):
                mine = (order == expert).nonzero().reshape(-1)  # entries (token * k + choice) routed here
                if capacity is not None:
                    mine = torch.cat([mine[:capacity], torch.full((capacity - len(mine[:capacity]),), -1)])
                slots.append(mine)
        padded = torch.cat([flat, flat.new_zeros(1, shape[-1])])
        gates = torch.cat([weight.reshape(-1), weight.new_zeros(1)])
        entries = torch.cat(slots)
        token = torch.where(entries >= 0, entries // gpt.top_k, tokens)  # one int64 index per slot
        sent = padded[token]  # every slot's token, expert by expert
        sent8 = _float8(sent, self.float8)
        scale = gates[torch.where(entries >= 0, entries, len(gates) - 1)]  # the gate's int64 index and value
        weighted = self.fused and gpt.gated  # the gate inside the fused SwiGLU, not on the expert's output
        outputs, start = [], 0

        for expert, mine in enumerate(slots):
            part, rows = sent[start : start + len(mine)], slice(start, start + len(mine))
            start += len(mine)
            hidden = [
                _linear(
                    part,
                    None if sent8 is None else sent8[rows],
                    w[expert].t(),
                    self.bias[i][expert] if self.bias else None,
                )
                for i, w in enumerate(self.w)
            ]
            if weighted:
                act = _FusedWeightedSwiGLU.apply(hidden[0], hidden[1], scale[rows])
            else:
                act = _swiglu(hidden[0], hidden[1], self.fused) if gpt.gated else F.gelu(hidden[0])
            outputs.append(
                _linear(
                    act, _float8(act, self.float8), self.wd[expert].t(), self.bias[-1][expert] if self.bias else None
                )
            )
        routed = torch.cat(outputs) if weighted else torch.cat(outputs) * scale[:, None]
        out = padded.new_zeros(padded.shape).index_put((token,), routed, accumulate=True)[:tokens].reshape(shape)
        for mlp in self.shared:
            out = out + mlp(x)
        return out


class Block(nn.Module):
    """A block with the oracle's `kernel`: "local" (softmax kept), "flash" (`_FlashAttention`), "fused" (flash
    attention and the fused SwiGLU)."""

    def __init__(self, gpt: GPT, moe: bool = False, kernel: str = "local", float8: bool = False):
        super().__init__()
        h, q, kv, bias = gpt.hidden, gpt.q_width, gpt.kv_width, gpt.bias
        self.gpt, self.float8, self.flash = gpt, float8, kernel != "local"
        fused = kernel == "fused"
        self.norm1, self.norm2 = _norm(gpt), _norm(gpt)
        self.q_norm, self.k_norm = (
            (_norm(gpt, gpt.head_dim_), _norm(gpt, gpt.head_dim_)) if gpt.qk_norm else (None, None)
        )
        self.q, self.k, self.v = nn.Linear(h, q, bias=bias), nn.Linear(h, kv, bias=bias), nn.Linear(h, kv, bias=bias)
        self.proj = nn.Linear(q, h, bias=bias)
        self.mlp = Experts(gpt, fused, float8) if moe else MLP(gpt, gpt.ffn_, fused, float8)
        s, d = gpt.seq, gpt.head_dim_
        self.register_buffer("causal", torch.full((s, s), float("-inf")).triu(1))
        angle = torch.arange(s)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        # constant tables, shared by the layers in a real model: frozen, so the ledger does not count them
        self.cos = nn.Parameter(torch.cos(angle).repeat(1, 2)[:, None, :], requires_grad=False)  # (s, 1, d)
        self.sin = nn.Parameter(torch.sin(angle).repeat(1, 2)[:, None, :], requires_grad=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * self.cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * self.sin

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return _Dropout.apply(x, 0.1) if self.gpt.dropout else x

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        b, s, _ = x.shape
        kv, d = gpt.kv_heads_, gpt.head_dim_
        group = gpt.heads // kv
        x8 = _float8(x, self.float8)  # one copy for q, k and v
        q = _layer(self.q, x, x8).view(b, s, gpt.heads, d)
        k = _layer(self.k, x, x8).view(b, s, kv, d)
        if self.q_norm is not None and self.k_norm is not None:  # over each head's d values
            q, k = self.q_norm(q), self.k_norm(k)
        if gpt.rotary:
            q, k = self._rotate(q), self._rotate(k)
        # each key/value head meets its group of query heads, stacked along the rows: no copy of k or v
        q = (q / math.sqrt(d)).view(b, s, kv, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv, group * s, d)
        if self.flash:
            values = _layer(self.v, x, x8).view(b, s, kv, d).transpose(1, 2)
            out = _FlashAttention.apply(q, k.transpose(1, 2), values, self.causal.repeat(group, 1))
            return _layer(self.proj, out, _float8(out, self.float8))
        scores = (q @ k.permute(0, 2, 3, 1)).view(b, kv, group, s, s) + self.causal
        probs = self._dropout(torch.softmax(scores, dim=-1)).view(b, kv, group * s, s)
        out = probs @ _layer(self.v, x, x8).view(b, s, kv, d).transpose(1, 2)
        out = out.view(b, kv, group, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, gpt.q_width)
        return _layer(self.proj, out, _float8(out, self.float8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._dropout(self.attention(self.norm1(x)))
        return x + self._dropout(self.mlp(self.norm2(x)))


class Model(nn.Module):
    def __init__(self, gpt: GPT, kernel: str = "local", float8: bool = False):
        super().__init__()
        self.gpt = gpt
        self.wte = nn.Embedding(gpt.vocab, gpt.hidden)
        self.wpe = None if gpt.rotary else nn.Embedding(gpt.seq, gpt.hidden)
        moe = [gpt.experts > 0 and (i + 1) % gpt.moe_every == 0 for i in range(gpt.layers)]
        self.blocks = nn.ModuleList([Block(gpt, m, kernel, float8) for m in moe])
        self.norm = _norm(gpt)
        self.head = nn.Linear(gpt.hidden, gpt.vocab, bias=False)
        if gpt.tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


BASE = GPT(layers=2, hidden=128, heads=4, seq=32, vocab=256, name="GPT-3's block")
LLAMA = replace(
    BASE, kv_heads=2, ffn=344, gated=True, norm="rmsnorm", rotary=True, tied=False, bias=False, dropout=False
)
OPTIONS = {
    "gpt3": BASE,
    "gqa": replace(BASE, kv_heads=2),
    "mqa": replace(BASE, kv_heads=1, dropout=False),
    "swiglu": replace(BASE, gated=True, ffn=344),
    "rmsnorm rotary untied": replace(BASE, norm="rmsnorm", rotary=True, tied=False),
    "llama": LLAMA,
    "heads wider than h / heads": replace(LLAMA, head_dim=48),
    "qk norm, wide heads (Qwen3)": replace(LLAMA, head_dim=48, qk_norm=True),
    "qk layernorm": replace(BASE, qk_norm=True),
    "moe top-2 dropless": replace(LLAMA, experts=4, top_k=2, expert_ffn=64),
    "moe capacity shared every 2nd": replace(
        LLAMA, experts=8, top_k=2, expert_ffn=48, shared_experts=1, capacity=1.25, moe_every=2
    ),
    "moe gelu biases capacity 0.5": replace(BASE, experts=4, top_k=1, capacity=0.5, dropout=False),
}


def _model(gpt: GPT, kernel: str = "local", float8: bool = False) -> Model:
    torch.manual_seed(0)
    return Model(gpt, kernel, float8)


@pytest.mark.parametrize("option", OPTIONS)
def test_parameters_are_torchs_count(option):
    gpt = OPTIONS[option]
    counted = sum(p.numel() for p in _model(gpt).parameters() if p.requires_grad)
    assert gpt.parameters() == pytest.approx(counted, rel=0.01)
    assert gpt.parameters() == counted  # and in fact to the parameter


@pytest.mark.parametrize("option", OPTIONS)
def test_flops_of_a_step_are_torchs_count(option):
    gpt, batch = OPTIONS[option], 2
    model = _model(gpt)
    idx = torch.randint(0, gpt.vocab, (batch, gpt.seq))
    with FlopCounterMode(display=False) as counter:
        model(idx).float().logsumexp(-1).sum().backward()
    assert iteration_flops(gpt, batch, "none") == pytest.approx(counter.get_total_flops(), rel=0.01)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("option", OPTIONS)
def test_activation_bytes_of_a_block_are_the_ledgers_count(option, kernel):
    gpt, batch = OPTIONS[option], 2
    model = _model(gpt, kernel)
    for block in model.blocks:
        ledger = Ledger()
        ledger.ignore(model)
        x = torch.randn(batch, gpt.seq, gpt.hidden, requires_grad=True)
        with ledger.activations():
            y = block(x)
        moe = isinstance(block.mlp, Experts)
        want = layer_activations(gpt, gpt.seq, batch, 1, False, 4, "none", moe, kernel)
        assert want == pytest.approx(ledger.used["activations"], rel=0.01), f"moe={moe}"
        y.sum().backward()  # and backward releases every byte the ledger counted
        assert ledger.used["activations"] == 0


def _kept_by_blocks(model: Model, batch: int) -> list[int]:
    """Bytes each block keeps for backward, by the ledger."""
    kept = []
    for block in model.blocks:
        ledger = Ledger()
        ledger.ignore(model)
        x = torch.randn(batch, model.gpt.seq, model.gpt.hidden, requires_grad=True)
        with ledger.activations():
            y = block(x)
        kept.append(ledger.used["activations"])
        y.sum().backward()  # (the graph, and what it keeps, lives as long as y)
    return kept


def test_the_fused_swiglus_are_swiglu():
    gate, up, weight = (
        torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((6, 5),) * 2 + ((6,),)
    )
    assert torch.autograd.gradcheck(_FusedSwiGLU.apply, (gate, up))
    assert torch.autograd.gradcheck(_FusedWeightedSwiGLU.apply, (gate, up, weight))
    assert torch.allclose(_FusedWeightedSwiGLU.apply(gate, up, weight), F.silu(gate) * up * weight[:, None])


@pytest.mark.parametrize("option", [name for name, gpt in OPTIONS.items() if gpt.gated or gpt.experts])
def test_the_fused_kernel_keeps_what_the_ledger_counts_of_a_fused_swiglu(option):
    """The "fused" kernel's count differs from "flash"'s by the MLP alone: a SwiGLU kernel that keeps its input
    keeps one ffn per token (per slot) less than torch's eager SwiGLU, and a GELU MLP the same."""
    gpt, batch = OPTIONS[option], 2
    eager, fused = _kept_by_blocks(_model(gpt, "flash"), batch), _kept_by_blocks(_model(gpt, "fused"), batch)
    for i, block in enumerate(_model(gpt).blocks):
        moe = isinstance(block.mlp, Experts)
        counted = [layer_activations(gpt, gpt.seq, batch, 1, False, 4, "none", moe, k) for k in ("flash", "fused")]
        assert counted[0] - counted[1] == pytest.approx(eager[i] - fused[i], rel=0.01), f"block {i}, moe={moe}"
        assert (eager[i] > fused[i]) == gpt.gated


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("plain", ["heads wider than h / heads", "gpt3"])  # RMSNorm, LayerNorm
def test_the_norms_of_queries_and_keys_keep_what_the_ledger_counts(plain, kernel):
    """What `qk_norm` adds to a block, alone: q and k once more and each head's statistics (a float32 reciprocal
    root mean square, and a mean under LayerNorm), to 1% of the difference the ledger measures."""
    gpt, batch = OPTIONS[plain], 2
    normed = replace(gpt, qk_norm=True)
    measured = _kept_by_blocks(_model(normed, kernel), batch)[0] - _kept_by_blocks(_model(gpt, kernel), batch)[0]
    counted = (layer_activations(g, gpt.seq, batch, 1, False, 4, "none", False, kernel) for g in (normed, gpt))
    assert next(counted) - next(counted) == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("option", OPTIONS)
def test_float8_linear_layers_keep_a_byte_of_each_input_as_the_ledger_counts(option, kernel):
    """Transformer Engine's float8 linear layers keep their inputs' float8 copies (`linear_input=1`): every
    option's blocks, in float32 (e = 4), against the ledger's count of a model whose linear layers do the same."""
    gpt, batch = OPTIONS[option], 2
    kept = _kept_by_blocks(_model(gpt, kernel, float8=True), batch)
    for i, block in enumerate(_model(gpt).blocks):
        moe = isinstance(block.mlp, Experts)
        want = layer_activations(gpt, gpt.seq, batch, 1, False, 4, "none", moe, kernel, linear_input=1)
        assert want == pytest.approx(kept[i], rel=0.01), f"block {i}, moe={moe}"


def test_heads_of_any_width_are_stated_with_head_dim():
    with pytest.raises(ValueError, match="give head_dim"):
        GPT(layers=2, hidden=100, heads=3)
    with pytest.raises(ValueError, match="key/value heads do not divide the 3 heads"):
        GPT(layers=2, hidden=96, heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="0 \\(the default\\) or more"):
        GPT(layers=2, hidden=96, heads=3, head_dim=-1)
    gpt = GPT(layers=2, hidden=100, heads=3, head_dim=32, kv_heads=1)
    assert (gpt.q_width, gpt.kv_width) == (
        96,
        32,
    ) and gpt.attention_parameters() == 2 * 100 * 96 + 2 * 100 * 32 + 96 + 100 + 64


def test_gpt3s_defaults_keep_narayanans_and_korthikanis_counts():
    gpt = GPT(layers=24, hidden=2304, heads=24)
    h, s = gpt.hidden, gpt.seq
    assert gpt.layer_parameters() == 12 * h * h + 13 * h
    assert gpt.layer_flops() == 24 * s * h * h + 4 * s * s * h
    for t, sp in ((1, False), (8, False), (8, True)):
        assert layer_activations(gpt, s, 2, t, sp, 2, "none", False, "local") == pytest.approx(
            activation_bytes_per_layer(s, 2, h, gpt.heads, t, sp, 2), rel=1e-12
        )


@pytest.mark.parametrize(
    "layout",
    [
        Layout(data=4, tensor=2, pipeline=2, batch=32),
        Layout(data=2, tensor=8, pipeline=4, batch=64, zero=1, recompute="selective", sequence_parallel=True),
        Layout(data=8, tensor=1, pipeline=2, batch=16, zero=3, recompute="full", micro_batch=2),
        Layout(data=2, tensor=4, batch=8, zero=2, precision="fp32"),
    ],
)
def test_rank_memory_of_a_gpt3_is_exercise_16_4s_formula(layout):
    gpt = GPT(layers=24, hidden=2304, heads=24)
    got = rank_memory(gpt, layout)
    layers = gpt.layers // layout.pipeline
    want = memory_per_rank(
        stage_parameters(gpt, layout),
        gpt.seq,
        layout.micro_batch,
        gpt.hidden,
        gpt.heads,
        layers * min(layout.pipeline, layout.micro_batches),
        layout.tensor,
        layout.data,
        layout.zero,
        layout.recompute,
        layout.sequence_parallel,
        str(layout.precision),
    )
    for part in ("parameters", "gradients", "optimizer"):
        assert got[part] == pytest.approx(want[part], rel=1e-12)
    # the first stage, or the last with its logits: at least the first's activations
    assert got["activations"] >= want["activations"] * (1 - 1e-12)
