"""Checks for lab 16's oracle exercises: the transformer memory formula, the time of one layout, the search.

The student's function is compared with the reference (`ddlab.oracle.transformer`,
`ddlab.oracle.transformer_planner`) on generated cases: every ZeRO stage and recomputation,
tensor parallelism with and without sequence parallelism, pipelines with fewer and more
micro-batches than stages, context parallelism, small and published GPTs, a small GPT of 2024-26's
shape (grouped-query attention, a SwiGLU MLP of width 688, not 4h: a step time that assumes heads = key/value
heads or a 4h GELU MLP fails on it), the A100 platform and a flat one, budgets that cut some layouts. The functions are pure, so every rank runs all
cases; `each_size` gathers one verdict. Each call of the student's function has `DEADLINE` seconds:
a loop that never ends fails the check, naming the case, instead of hanging it.

Under the grader's seed (ddlab.checks._draw) each check draws its cases instead, from the domain the lab
states for its exercise (see each check's "The grader's draw"); every failure then names the drawn case and
the seed.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import replace
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..oracle.platform import Platform
from ..oracle.published import LLAMA3_70B, MIXTRAL_8X22B, TABLE1, a100_cluster
from ..oracle.transformer import (
    GPT,
    MEMORY_PARTS,
    RECOMPUTE,
    TIME_PARTS,
    Layout,
    memory_per_rank,
    predict,
    problem,
    step_time,
)
from ..oracle.transformer_planner import search
from ._core import deadline, each_size, is_number, passed
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

DEADLINE = 30.0  # seconds for one case: closed forms and a search over a few hundred layouts

HINTS = {
    "memory_per_rank": "ZeRO-1 shards the optimizer state over d, ZeRO-2 the gradients too, ZeRO-3 the parameters "
    "too; a layer keeps sbh(10 + 24/t + 5as/(ht)) bytes (sbh(34/t + 5as/(ht)) with sequence parallelism); "
    "selective recomputation drops the attention term; full keeps 2sbh per layer (/t with sequence parallelism) "
    "plus one layer's activations.",
    "step_time": "the compute is iteration_flops(gpt, B, recompute) / N / platform.flops (it counts grouped-query "
    "attention and any MLP width), slowed by platform.slowdown(devices of a node computing at once); count per micro-batch and per layer of a stage: 4 tensor allreduces (6 with full recomputation), "
    "2 context allgathers and a reduce-scatter (one allgather more with full recomputation); 2 pipeline messages "
    "per micro-batch; the bubble is (p-1)/m of the compute.",
    "block_counts": "q and the projection h x a d_h each, k and v h x g d_h each (g key/value heads), two norms of h, "
    "an MLP of 3 (gated) or 2 matrices h x f; a MoE layer: the router h x E and E + S experts' MLPs of f_e, a token "
    "running through k + S of them; 2 FLOPs per multiply-add and token, plus 4 s^2 a d_h for the scores and the "
    "weighted values.",
    "search": "try every (d, t, p, c) whose product is the device count; a layout that does not run or does not fit "
    "goes to the rejected list with its reason; sort the others by time.",
}


def _flat(
    bandwidth: float,
    devices_per_node: int = 4,
    contention: tuple[float, ...] = (1.0, 1.4, 1.8, 2.5),
    name: str = "flat",
) -> Platform:
    """A platform of laptop-like devices: compute slows by `contention` as a node's devices get busy (shared cores)."""
    from ..allreduce.cost import Link

    link = Link(alpha=2e-5, beta=1 / bandwidth)
    return Platform(
        name,
        devices_per_node=devices_per_node,
        flops=2e12,
        memory=2 * 10**9,
        intra=link,
        inter=Link(5e-5, 4 / bandwidth),
        contention=contention,
    )


def _drawn_flat(draw: Draw, devices_per_node: int, *keys: object) -> Platform:
    """A flat platform of `devices_per_node` devices, its bandwidth and its rising contention drawn (all in its name)."""
    rng = draw.rng("platform", *keys)
    rises = rng.uniform(0.05, 0.6, devices_per_node - 1)
    contention = tuple(round(float(c), 3) for c in np.concatenate(([1.0], 1.0 + np.cumsum(rises))))
    bandwidth = round(float(rng.uniform(1e9, 2e10)), -6)
    name = f"flat: {devices_per_node} devices a node, contention {contention}, {bandwidth / 1e9:g} GB/s"
    return _flat(bandwidth, devices_per_node, contention, name)


def memory_cases(draw: Draw | None = None) -> list[tuple]:
    """48 cases: every ZeRO stage x recomputation x sequence parallelism, 4 times.

    The grader's draw: psi up to 1e10, s up to 4096 tokens, b up to 4, t up to 8 (dividing the heads and the
    hidden size, any heads per rank and head size), layers up to 32, d up to 64, every stage and recomputation,
    with and without sequence parallelism, each independently (the notebook's t goes with its ZeRO stage)."""
    if draw is not None:
        return _drawn_memory_cases(draw)
    rng = random.Random(16)
    cases = []
    for trial in range(48):
        t = [1, 2, 4, 8][trial % 4]
        h, a = 64 * t * rng.choice([1, 2, 4]), 2 * t
        case = (
            float(rng.choice([1e6, 3.5e8, 2e9])),
            rng.choice([128, 2048]),
            rng.choice([1, 2]),
            h,
            a,
            rng.choice([1, 3, 16]),
            t,
            rng.choice([1, 4, 6]),
            trial % 4,
            RECOMPUTE[trial // 4 % 3],
            bool(trial // 12 % 2),
        )
        cases.append(case)
    return cases


def _drawn_memory_cases(draw: Draw) -> list[tuple]:
    rng = draw.rng("memory")
    cases = []
    for trial in range(48):
        t = int(rng.integers(1, 9))
        a = t * int(rng.integers(1, 5))
        h = a * int(rng.choice([16, 32, 64, 128]))
        cases.append(
            (
                float(rng.integers(10**5, 10**10)),
                int(rng.integers(16, 4097)),
                int(rng.integers(1, 5)),
                h,
                a,
                int(rng.integers(1, 33)),
                t,
                int(rng.integers(1, 65)),
                trial % 4,
                RECOMPUTE[trial // 4 % 3],
                bool(trial // 12 % 2),
            )
        )
    return cases


#: The published runs exercise 16.5 is also checked on (plain 1F1B).
PUBLISHED_TIMES = (TABLE1[0], TABLE1[6], TABLE1[9])


def time_cases(draw: Draw | None = None) -> list[tuple[GPT, Layout, Platform]]:
    """The notebook's: a small GPT and one of 2024-26's shape on 7 and 2 layouts, each on the A100 and the flat
    platform, and three published runs.

    The grader's draw: 12 GPTs of up to 16 layers, 12 heads of 16 to 64 and sequences up to 1024 (every other
    one grouped-query with a SwiGLU MLP of any width), each on a layout of up to 8 ranks per dimension that runs
    it (any micro-batch, batch, ZeRO stage and recomputation), on the A100 or on a flat platform of 2 to 8 devices
    a node whose bandwidth and contention are drawn (the first with fewer ranks than its node's devices); the
    three published runs."""
    if draw is not None:
        cases = [_drawn_time_case(draw, i) for i in range(12)]
        return cases + [(run.gpt, run.layout.with_(interleave=1), a100_cluster()) for run in PUBLISHED_TIMES]
    small = GPT(layers=8, hidden=256, heads=8, seq=512, vocab=1000, name="small")
    a100, flat = a100_cluster(), _flat(5e9)
    layouts = [
        Layout(data=8, batch=64),
        Layout(tensor=4, pipeline=2, batch=16, recompute="full"),
        Layout(pipeline=8, batch=4, micro_batch=2, recompute="selective"),
        Layout(data=2, context=4, batch=8, zero=3, micro_batch=2),
        Layout(data=2, tensor=2, pipeline=2, context=2, batch=32, zero=2, recompute="full", sequence_parallel=True),
        Layout(data=4, pipeline=4, batch=64, zero=3, recompute="full"),
        Layout(data=2, tensor=8, batch=6, micro_batch=3, zero=1),
    ]
    cases = [(small, lay, pf) for lay in layouts for pf in (a100, flat)]
    # 2024-26's block: 2 key/value heads for 8 query heads, SwiGLU of width 688 (not 4h = 1024)
    modern = GPT(
        layers=8,
        hidden=256,
        heads=8,
        seq=512,
        vocab=1000,
        name="small GQA + SwiGLU",
        kv_heads=2,
        ffn=688,
        gated=True,
        norm="rmsnorm",
        rotary=True,
        tied=False,
        bias=False,
        dropout=False,
    )
    cases += [
        (modern, lay, pf)
        for lay in (
            Layout(data=2, tensor=2, pipeline=2, batch=16, zero=1, recompute="selective"),
            Layout(data=4, pipeline=2, batch=16, zero=3, recompute="full"),
            # the keys and values a ring passes are the key/value heads' (kv_width), not h
            Layout(data=2, tensor=2, context=2, batch=8, zero=1, recompute="full"),
        )
        for pf in (a100, flat)
    ]
    # the published layouts with plain 1F1B (exercise 16.5 has no interleaved chunks)
    cases += [(run.gpt, run.layout.with_(interleave=1), a100) for run in PUBLISHED_TIMES]
    return cases


def _divisors(n: int, most: int) -> list[int]:
    return [k for k in range(1, min(n, most) + 1) if n % k == 0]


def _drawn_gpt(rng: np.random.Generator, name: str, modern: bool, heads: list[int], layers: int, seq: int) -> GPT:
    """A GPT of `layers` layers and a drawn number of `heads` (a modern one: grouped-query, SwiGLU of any width)."""
    a = int(rng.choice(heads))
    h = a * int(rng.choice([8, 16, 32, 64]))
    vocab = int(rng.integers(100, 5001))
    if not modern:
        return GPT(layers=layers, hidden=h, heads=a, seq=seq, vocab=vocab, name=name)
    kv = int(rng.choice(_divisors(a, a)))
    return GPT(
        layers=layers,
        hidden=h,
        heads=a,
        seq=seq,
        vocab=vocab,
        name=name,
        kv_heads=kv,
        ffn=int(rng.integers(h, 4 * h + 1)),
        gated=True,
        norm="rmsnorm",
        rotary=True,
        tied=False,
        bias=False,
        dropout=False,
    )


def _drawn_time_case(draw: Draw, i: int) -> tuple[GPT, Layout, Platform]:
    """Case i of the grader's step_time cases: a GPT, a layout that runs it, a platform."""
    rng = draw.rng("time", i)
    modern = i % 2 == 1
    gpt = _drawn_gpt(
        rng,
        f"drawn GPT {i + 1}",
        modern,
        [2, 3, 4, 6, 8, 12],
        int(rng.integers(1, 17)),
        int(rng.choice([64, 128, 256, 512, 1024])),
    )
    t = int(
        rng.choice(
            [k for k in _divisors(gpt.heads, 8) if gpt.hidden % k == 0 and problem(gpt, Layout(tensor=k)) is None]
        )
    )
    p = int(rng.choice(_divisors(gpt.layers, 8)))
    c = int(rng.choice([k for k in (1, 2, 4, 8) if gpt.seq % (2 * k) == 0]))
    d, b, m = (int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 9)))
    if i == 0:  # a few ranks, fewer than the node's devices (below)
        d = p = c = 1
    layout = Layout(
        data=d,
        tensor=t,
        pipeline=p,
        context=c,
        micro_batch=b,
        batch=d * b * m,
        zero=int(rng.integers(0, 4)),
        recompute=RECOMPUTE[int(rng.integers(0, 3))],
        sequence_parallel=bool(rng.integers(0, 2)) and t > 1,
    )
    if i == 0:  # fewer ranks than the node's devices: the slowdown of those computing at once, not of a full node
        return gpt, layout, _drawn_flat(draw, layout.devices + int(rng.integers(1, 5)), i)
    if i % 3 == 2:
        return gpt, layout, a100_cluster()
    return gpt, layout, _drawn_flat(draw, int(rng.integers(2, 9)), i)


def search_cases(draw: Draw | None = None) -> list[tuple[GPT, int, Layout, Platform, float]]:
    """The notebook's: a small GPT on 4 to 12 devices (a budget cuts half the layouts of one), a published one on 64.

    The grader's draw: 4 small GPTs (up to 12 layers, 6 heads) on 2 to 16 devices (primes too), a template of any
    batch, micro-batch, ZeRO stage, recomputation and sequence parallelism, on a flat platform of drawn
    bandwidth and contention, and a budget between two layouts' peaks that cuts some of them (the first
    case keeps every layout that runs)."""
    if draw is not None:
        return [_drawn_search_case(draw, i) for i in range(4)]
    small = GPT(layers=6, hidden=96, heads=6, seq=64, vocab=500, name="small")
    flat = _flat(5e9)
    return [
        (small, 4, Layout(batch=4), flat, 2e9),
        (small, 6, Layout(batch=6, recompute="full"), flat, 2e9),
        (small, 8, Layout(batch=8, zero=3, micro_batch=2), flat, 2e9),
        (small, 12, Layout(batch=12, sequence_parallel=True, recompute="selective"), flat, 2e9),
        (small, 8, Layout(batch=16), flat, 7.0e6),  # a budget that cuts: half the layouts out of memory
        (TABLE1[4].gpt, 64, Layout(batch=128, recompute="full"), a100_cluster(), 80e9),
    ]


def _drawn_search_case(draw: Draw, i: int) -> tuple[GPT, int, Layout, Platform, float]:
    rng = draw.rng("search", i)
    gpt = _drawn_gpt(
        rng,
        f"drawn small GPT {i + 1}",
        i % 2 == 1,
        [2, 3, 4, 6],
        int(rng.integers(2, 13)),
        int(rng.choice([16, 32, 64])),
    )
    devices = int(rng.integers(2, 17))
    b = int(rng.integers(1, 3))
    template = Layout(
        batch=b * devices * int(rng.integers(1, 3)),
        micro_batch=b,
        zero=int(rng.integers(0, 4)),
        recompute=RECOMPUTE[int(rng.integers(0, 3))],
        sequence_parallel=bool(rng.integers(0, 2)),
    )
    platform = _drawn_flat(draw, int(rng.integers(2, 9)), "search", i)
    peaks = sorted({p.peak for p in search(gpt, devices, template, platform, math.inf)[0]})
    if i == 0 or len(peaks) < 2:
        return gpt, devices, template, platform, 2 * peaks[-1] if peaks else 1e9
    cut = int(rng.integers(1, len(peaks)))  # between two peaks: layouts above it out of memory
    return gpt, devices, template, platform, math.sqrt(peaks[cut - 1] * peaks[cut])


def _block(name: str, hidden: int, heads: int, seq: int, **shape: Any) -> GPT:
    """A block as exercise 16.7 states them: RMSNorm, no biases, rotary positions, no norm over the heads, every
    token sent to its top_k experts (no capacity); `shape`, the other fields (kv_heads, head_dim, gated, ffn,
    experts, top_k, shared_experts, expert_ffn)."""
    return GPT(
        layers=2, hidden=hidden, heads=heads, seq=seq, vocab=1000, name=name, norm="rmsnorm", rotary=True,
        tied=False, bias=False, dropout=False, **shape,
    )  # fmt: skip


def block_cases(draw: Draw | None = None) -> list[tuple[GPT, bool]]:
    """The notebook's: multi-head, grouped-query and multi-query attention, heads wider than h / a, gated and GELU
    MLPs of 4h and of other widths, mixtures of experts with and without shared experts (their dense layer too), and two
    published shapes (a Llama 3 70B block, a Mixtral 8x22B one).

    The grader's draw: 8 blocks of 2 to 16 heads of 16 to 128 (h a multiple of the heads, not always a d_h), key/value
    heads any divisor of the heads (or left to default to them), a gated or GELU MLP of width h to 4h (or the default
    4h), sequences of 64 to 4096; four of them mixtures of 4 to 64 experts, top-1 to top-8 (fewer than all), 0 to 2
    shared, of width h/8 to 2h (or the dense MLP's), asked for a MoE layer or a dense one; each with the features
    `_BLOCK_FEATURES` gives it."""
    if draw is not None:
        return [_drawn_block(draw, i) for i in range(8)]
    small_moe = dict(kv_heads=4, gated=True, ffn=688, experts=16, top_k=2, shared_experts=1, expert_ffn=128)
    return [
        (_block("GQA + SwiGLU 688", 256, 8, 512, kv_heads=2, gated=True, ffn=688), False),
        (_block("multi-head + GELU 4h", 256, 8, 128), False),
        (_block("multi-query + GELU 4h", 256, 8, 128, kv_heads=1), False),
        (_block("heads 128 wide + SwiGLU 512", 256, 4, 256, kv_heads=2, head_dim=128, gated=True, ffn=512), False),
        (_block("MoE: 16 experts, top-2, 1 shared", 256, 8, 512, **small_moe), True),
        (_block("MoE: 16 experts, top-2, 1 shared", 256, 8, 512, **small_moe), False),
        (_block("MoE of GELU experts: 8, top-1", 128, 4, 64, kv_heads=2, experts=8, top_k=1), True),
        (replace(LLAMA3_70B, layers=2), False),
        (replace(MIXTRAL_8X22B, layers=2), True),
    ]


#: What each of the grader's 8 blocks must have, whatever else is drawn: every field left to its default at least once
#: (kv_heads, ffn, head_dim, expert_ffn: an answer using the field for its default fails), an MLP not 4h wide, heads
#: not h / a wide, grouped and multi-query attention, gated and GELU MLPs, MoE layers with and without shared
#: experts, a MoE model's dense layer.
_BLOCK_FEATURES: tuple[dict[str, Any], ...] = (
    dict(kv_heads=0, ffn=0, head_dim=0),
    dict(experts=True, moe=True, expert_ffn=0, shared_experts=2, gated=True),
    dict(kv_heads="grouped", wide_heads=True, gated=True, ffn="not 4h"),
    dict(experts=True, moe=True, shared_experts=0, gated=False),
    dict(kv_heads=1, gated=False),
    dict(experts=True, moe=False, ffn=0),
    {},
    dict(experts=True),
)


def _drawn_block(draw: Draw, i: int) -> tuple[GPT, bool]:
    """Block i of the grader's: sizes drawn, with `_BLOCK_FEATURES[i]`."""
    rng, want = draw.rng("block", i), _BLOCK_FEATURES[i]
    a = int(rng.choice([2, 4, 6, 8, 12, 16]))
    h = a * int(rng.choice([16, 32, 64, 128]))
    kv_choices = {"grouped": [k for k in _divisors(a, a) if 1 < k < a] or [1], 1: [1], 0: [0]}
    shape: dict[str, Any] = dict(
        kv_heads=int(rng.choice(kv_choices.get(want.get("kv_heads", -1), [0, *_divisors(a, a)]))),  # 0: a heads
        head_dim=int(rng.choice([16, 32, 64, 128])) if rng.integers(0, 2) else 0,
        gated=bool(want.get("gated", rng.integers(0, 2))),
        ffn=int(rng.integers(h, 4 * h + 1)) if rng.integers(0, 3) or want.get("ffn") == "not 4h" else 0,
    )
    if shape["ffn"] == 4 * h and want.get("ffn") == "not 4h":
        shape["ffn"] -= h
    if want.get("wide_heads"):  # heads not h / a wide
        shape["head_dim"] = 2 * h // a
    shape.update({key: want[key] for key in ("ffn", "head_dim") if want.get(key) == 0})
    moe = bool(want.get("experts", i % 2))
    if moe:
        experts = int(rng.integers(4, 65))
        shape.update(
            experts=experts,
            top_k=int(rng.integers(1, min(experts - 1, 8) + 1)),
            shared_experts=int(want.get("shared_experts", rng.integers(0, 3))),
            expert_ffn=int(want.get("expert_ffn", rng.integers(h // 8, 2 * h + 1))),
        )
    gpt = _block(f"drawn block {i + 1}", h, a, int(rng.choice([64, 256, 1024, 4096])), **shape)
    return gpt, moe and bool(want.get("moe", rng.integers(0, 4)))


def _block_shape(gpt: GPT, moe: bool) -> str:
    """What exercise 16.7's student needs to know of a block: every field the count depends on."""
    shape = (
        f"h {gpt.hidden}, {gpt.heads} heads of {gpt.head_dim_} ({gpt.kv_heads_} key/value), "
        f"{'gated' if gpt.gated else 'GELU'} MLP of {gpt.ffn_}, s {gpt.seq}"
    )
    if gpt.experts:
        shape += f", {gpt.experts} experts of {gpt.expert_ffn_}, top-{gpt.top_k}, {gpt.shared_experts} shared"
    return f"{gpt.name} ({shape}), moe={moe}"


def _block_mistake(gpt: GPT, moe: bool, got: tuple[float, float], right: tuple[float, float]) -> str:
    """The usual slip that gives both of `got`'s counts for this block (`right` its counts), if one does: what to
    count instead."""

    def counts(wrong: GPT) -> tuple[float, float]:
        return wrong.layer_parameters(moe), wrong.layer_flops(moe)

    (params, flops), h, s = right, gpt.hidden, gpt.seq
    mlp = gpt.mlp_parameters(gpt.expert_ffn_ if moe else gpt.ffn_)  # one (expert's) MLP
    q, kv = gpt.q_width, gpt.kv_width
    mistakes = [
        (counts(replace(gpt, kv_heads=0)), f"k and v for every head: this block has {gpt.kv_heads_} key/value heads"),
        (counts(replace(gpt, ffn=0)), f"an MLP of 4h: this block's is {gpt.ffn_} wide (gpt.ffn_)"),
        (counts(replace(gpt, gated=not gpt.gated)), "the other MLP: a gated one (SwiGLU) has 3 matrices, GELU's 2"),
        (counts(replace(gpt, head_dim=0)), f"heads of h / a: this block's are {gpt.head_dim_} wide (gpt.head_dim_)"),
        ((params - 2 * h, flops), "no norms: each of the two RMSNorms has h weights"),
        ((params, flops - 4 * s * s * (q - h)), "the scores as 4 s^2 h: they are 4 s^2 a d_h (gpt.q_width)"),
        (
            (params, flops - 2 * s * s * q),
            "half the scores, as a causal mask would: count every query against every key",
        ),
    ]
    if not gpt.kv_heads:
        raw_kv = (params - 2 * h * kv, flops - 4 * s * h * kv)
        mistakes.append((raw_kv, "gpt.kv_heads, 0 when it defaults to the heads: use gpt.kv_heads_"))
    if not gpt.head_dim:
        raw_heads = (params - 2 * h * (q + kv), flops - 4 * s * (h + s) * q - 4 * s * h * kv)
        mistakes.append((raw_heads, "gpt.head_dim, 0 when it defaults to h / a: use gpt.head_dim_"))
    if moe:
        run, router = gpt.top_k + gpt.shared_experts, h * gpt.experts  # experts a token runs through; the router
        mistakes += [
            (counts(replace(gpt, expert_ffn=0)), f"experts as wide as the dense MLP: theirs are {gpt.expert_ffn_}"),
            (counts(replace(gpt, shared_experts=0)), "no shared experts: every token runs through them too"),
            ((params - (gpt.experts - gpt.top_k) * mlp, flops), "the top-k experts' parameters: the layer holds all E"),
            ((params, flops + 2 * s * (gpt.experts - gpt.top_k) * mlp), "every expert's FLOPs: a token runs its top-k"),
            ((params - router, flops - 2 * s * router), "no router: h x E, and every token runs through it"),
        ]  # fmt: skip
        if not gpt.expert_ffn:
            raw_experts = (params - (gpt.experts + gpt.shared_experts) * mlp, flops - 2 * s * run * mlp)
            mistakes.append(
                (raw_experts, "gpt.expert_ffn, 0 when it defaults to the dense MLP's width: use gpt.expert_ffn_")
            )
    elif not gpt.ffn:
        mistakes.append(((params - mlp, flops - 2 * s * mlp), "gpt.ffn, 0 when it defaults to 4h: use gpt.ffn_"))
    for wrong, what in mistakes:
        if wrong != (params, flops) and all(math.isclose(float(g), w, rel_tol=1e-9) for g, w in zip(got, wrong)):
            return f" It looks like you counted {what}."
    return ""


def _block_problem(fn: Callable, cases: list[tuple[GPT, bool]], draw: Draw | None) -> str | None:
    for gpt, moe in cases:
        where = f"block_counts({_block_shape(gpt, moe)})"
        want = (gpt.layer_parameters(moe), gpt.layer_flops(moe))
        with deadline(DEADLINE, where):
            got = fn(gpt, moe)
        if not isinstance(got, tuple) or len(got) != 2 or not all(is_number(x) for x in got):
            return f"{where} returned {got!r:.80}; return a tuple of two numbers, (parameters, flops)"
        for what, g, w in zip(("parameters", "forward FLOPs"), got, want):
            if not math.isclose(float(g), float(w), rel_tol=1e-9):
                return (
                    f"{where}: {what} {float(g):.10g}, expected {float(w):.10g} (ratio {float(g) / w:.6g})."
                    f"{_block_mistake(gpt, moe, got, want)} Hint: {HINTS['block_counts']}"
                )
    return None


#: How far an answer may be from the reference, besides its rounding (relative): bytes may be whole, to one byte.
ABS_TOL = {"memory_per_rank": 1.0, "step_time": 1e-12}


def _close(got: Any, want: float, abs_tol: float) -> bool:
    return is_number(got) and math.isclose(float(got), want, rel_tol=1e-9, abs_tol=abs_tol)


def _dict_problem(name: str, got: Any, want: dict[str, float], case: str) -> str | None:
    if not isinstance(got, dict):
        return f"{name}({case}) returned {type(got).__name__}; return a dict with keys {sorted(want)}"
    if set(got) != set(want):
        return f"{name}({case}) returned keys {sorted(got)}; expected {sorted(want)}"
    for key, value in want.items():
        if not is_number(got[key]):
            return f"{name}({case})[{key!r}] is {got[key]!r}, not a number"
        if not _close(got[key], value, ABS_TOL[name]):
            ratio = float(got[key]) / value if value else float("inf")
            return (
                f"{name}({case})[{key!r}] = {float(got[key]):.10g}, expected {value:.10g} (ratio {ratio:.6g}). "
                f"Hint: {HINTS[name]}"
            )
    return None


def _described(gpt: GPT, draw: Draw | None) -> str:
    """The GPT's name, and under the grader's draw its shape too (the student never saw it)."""
    if draw is None:
        return gpt.name
    shape = f"{gpt.layers} layers, hidden {gpt.hidden}, {gpt.heads} heads, seq {gpt.seq}, vocab {gpt.vocab}"
    if gpt.gated:
        shape += f", {gpt.kv_heads_} key/value heads, SwiGLU of width {gpt.ffn}"
    return f"{gpt.name} ({shape})"


def _memory_problem(fn: Callable, cases: list[tuple]) -> str | None:
    for case in cases:
        want = memory_per_rank(*case)
        assert set(want) == set(MEMORY_PARTS)
        where = ", ".join(map(repr, case))
        with deadline(DEADLINE, f"memory_per_rank({where})"):
            got = fn(*case)
        problem_found = _dict_problem("memory_per_rank", got, want, where)
        if problem_found:
            return problem_found
    return None


def _time_problem(fn: Callable, cases: list[tuple[GPT, Layout, Platform]], draw: Draw | None) -> str | None:
    for gpt, layout, platform in cases:
        want = step_time(gpt, layout, platform)
        assert set(want) == set(TIME_PARTS)
        where = f"{_described(gpt, draw)}, {layout.label}{'' if draw is None else f', batch {layout.batch}'}, {platform.name}"
        with deadline(DEADLINE, f"step_time({where})"):
            got = fn(gpt, layout, platform)
        found = _dict_problem("step_time", got, want, where)
        if found:
            return found
    return None


def _search_problem(
    fn: Callable, cases: list[tuple[GPT, int, Layout, Platform, float]], draw: Draw | None
) -> str | None:
    for gpt, devices, template, platform, budget in cases:
        shown = f"{template.label}{'' if draw is None else f', batch {template.batch}'}"
        where = f"search({_described(gpt, draw)}, {devices} devices, {shown}, {platform.name}, budget {budget:.6g} B)"
        if draw is None:
            where = f"search({gpt.name}, {devices} devices, {template.label}, budget {budget:.3g} B)"
        ranked, rejected = search(gpt, devices, template, platform, budget)
        with deadline(DEADLINE, where):
            out = fn(gpt, devices, template, platform, budget)
        if not isinstance(out, tuple) or len(out) != 2:
            return f"{where} returned {type(out).__name__}; return (ranked, rejected)"
        got_ranked, got_rejected = list(out[0]), list(out[1])
        if not all(hasattr(p, "layout") and hasattr(p, "time") for p in got_ranked):
            return f"{where}: ranked should hold the predictions of ddlab.oracle.transformer.predict"
        layouts = [p.layout for p in got_ranked]
        want_layouts = {p.layout for p in ranked}
        if len(set(layouts)) != len(layouts):
            return f"{where}: ranked lists a layout twice"
        extra = set(layouts) - want_layouts
        if extra:
            lay = sorted(extra, key=lambda lay: lay.label)[0]
            why = problem(gpt, lay) or "its busiest rank needs more memory than the budget"
            return f"{where}: ranked holds {lay.label}, which should be rejected: {why}. Hint: {HINTS['search']}"
        missing = want_layouts - set(layouts)
        if missing:
            lay = sorted(missing, key=lambda lay: lay.label)[0]
            return f"{where}: {lay.label} runs and fits but is not in ranked. Hint: {HINTS['search']}"
        times = [p.time for p in got_ranked]
        if any(b < a * (1 - 1e-12) for a, b in zip(times, times[1:])):
            return f"{where}: ranked is not fastest first (times {[f'{t:.4g}' for t in times[:6]]}...)"
        reasons = {}
        for entry in got_rejected:
            if not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[1], str):
                return f"{where}: each rejected entry should be (layout, reason), got {entry!r:.80}"
            reasons[entry[0]] = entry[1]
        if set(reasons) != {lay for lay, _ in rejected} or len(reasons) != len(got_rejected):
            return (
                f"{where}: rejected holds {len(got_rejected)} layouts ({len(reasons)} different); expected "
                f"{len(rejected)}, every mesh of {devices} devices that does not run or fit, once"
            )
        for lay, _ in rejected:
            word = "divide" if problem(gpt, lay) else "memory"
            if word not in reasons[lay].lower():
                return f"{where}: the reason for {lay.label}, {reasons[lay]!r}, should say {word!r}"
            peak = predict(gpt, lay, platform).peak if word == "memory" else 0.0
            if word == "memory" and not _states_amount(reasons[lay], (peak - budget, peak)):
                return (
                    f"{where}: the reason for {lay.label}, {reasons[lay]!r}, should say by how much: it needs "
                    f"{peak:.4g} B, {peak - budget:.4g} B over the budget (in any unit: B, MB, MiB, GB, GiB)"
                )
    return None


def _states_amount(reason: str, amounts: tuple[float, ...]) -> bool:
    """Whether `reason` writes one of `amounts` (bytes) in some unit, to the digits it shows (thousands may be
    separated by commas)."""
    for match in re.finditer(r"\d+(?:\.(\d*))?(?:[eE][-+]?\d+)?", re.sub(r"(?<=\d),(?=\d{3})", "", reason)):
        written, decimals = float(match.group(0)), len(match.group(1) or "")
        for amount in amounts:
            for unit in (1, 1e3, 2**10, 1e6, 2**20, 1e9, 2**30):
                if abs(written - amount / unit) <= 0.5 * 10**-decimals + 0.01 * abs(amount / unit):
                    return True
    return False


def _check(
    name: str,
    body: Callable[[Any, Draw | None], str | None],
    cases: Callable[[Draw | None], list],
    comm: MPI.Comm | None,
) -> None:
    """body(cases, draw) on every rank: the notebook's cases, or under a seed the grader's (the same on every rank)."""
    comm = comm or MPI.COMM_WORLD
    draw = grading_draw(comm, name)
    chosen = cases(draw)

    def guarded(sub: MPI.Comm) -> str | None:
        try:
            return body(chosen, draw)
        except NotImplementedError:
            raise
        except CheckFailed as err:  # a case ran past its deadline
            return str(err)
        except Exception as err:  # the student's function failed on a case: say how
            return f"{name} raised {type(err).__name__}: {err}"

    each_size(comm, guarded, f"{name} differs from the reference{named(draw)}", sizes=[comm.Get_size()])
    passed(comm, f"{name} agrees with the reference on {len(chosen)} generated cases{named(draw)}")


def check_memory_per_rank(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(psi, s, b, h, a, layers, t, d, zero, recompute, sequence_parallel) -> four parts (Exercise 16.4).

    The grader's draw: 48 cases of drawn sizes, tensor ranks and shards, every stage and recomputation
    (see memory_cases)."""
    _check("memory_per_rank", lambda cases, draw: _memory_problem(fn, cases), memory_cases, comm)


def check_step_time(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(gpt, layout, platform) -> seconds by part (Exercise 16.5).

    The grader's draw: 12 drawn GPTs, layouts and platforms, and the three published runs (see time_cases)."""
    _check("step_time", lambda cases, draw: _time_problem(fn, cases, draw), time_cases, comm)


def check_block_counts(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(gpt, moe) -> (parameters, forward FLOPs per sequence) of one block (Exercise 16.7).

    The grader's draw: 8 drawn blocks, half of them mixtures of experts (see block_cases)."""
    _check("block_counts", lambda cases, draw: _block_problem(fn, cases, draw), block_cases, comm)


def check_layout_search(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(gpt, devices, template, platform, budget) -> (ranked, rejected) (Exercise 16.6).

    The grader's draw: 4 drawn small GPTs, device counts, templates, platforms and budgets (see search_cases)."""
    _check("search", lambda cases, draw: _search_problem(fn, cases, draw), search_cases, comm)
