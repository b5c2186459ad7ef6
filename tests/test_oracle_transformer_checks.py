"""Lab 16's oracle checks fail wrong formulas and searches with a useful message and pass valid alternatives;
16.7's slips fail the notebook's blocks and every grading seed's, each named."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np
import pytest
from ddlab.checks import (
    CheckFailed,
    check_block_counts,
    check_layout_search,
    check_memory_per_rank,
    check_step_time,
)
from ddlab.checks._draw import Draw
from ddlab.checks.oracle_transformer import _block_problem, block_cases
from ddlab.oracle.transformer import iteration_flops, memory_per_rank, predict, problem, stage_parameters, step_time
from ddlab.oracle.transformer_planner import _search, meshes, search
from ddlab.runtime.reference import unguarded

# ---- Exercise 16.4: memory_per_rank


def valid_memory(psi, s, b, h, a, layers, t, d, zero, recompute, sequence_parallel=False):
    """Written from the lab's statement, term by term."""
    sbh = s * b * h
    state = {"parameters": 2.0 * psi, "gradients": 2.0 * psi, "optimizer": 12.0 * psi}
    for part, stage in (("optimizer", 1), ("gradients", 2), ("parameters", 3)):
        if zero >= stage:
            state[part] /= d
    replicated = t if sequence_parallel else 1
    layer = sbh * (10 / replicated + 24 / t + 5 * a * s / (h * t))
    if recompute == "full":
        activations = layers * 2 * sbh / replicated + layer
    elif recompute == "selective":
        activations = layers * sbh * (10 / replicated + 24 / t)
    else:
        activations = layers * layer
    return {"activations": activations, **state}


def _changed(fn, change):
    def wrong(*args, **kwargs):
        out = dict(fn(*args, **kwargs))
        change(out, *args)
        return out

    return wrong


def zero2_like_zero1(psi, s, b, h, a, layers, t, d, zero, recompute, sp=False):
    out = valid_memory(psi, s, b, h, a, layers, t, d, min(zero, 1) if zero == 2 else zero, recompute, sp)
    return out


def zero1_shards_parameters(psi, s, b, h, a, layers, t, d, zero, recompute, sp=False):
    out = valid_memory(psi, s, b, h, a, layers, t, d, zero, recompute, sp)
    if zero == 1:
        out["parameters"] /= d
    return out


def everything_split(psi, s, b, h, a, layers, t, d, zero, recompute, sp=False):  # 34/t without sequence parallelism
    return valid_memory(psi, s, b, h, a, layers, t, d, zero, recompute, True)


def full_without_working_layer(psi, s, b, h, a, layers, t, d, zero, recompute, sp=False):
    out = valid_memory(psi, s, b, h, a, layers, t, d, zero, recompute, sp)
    if recompute == "full":
        out["activations"] = layers * 2 * s * b * h / (t if sp else 1)
    return out


def selective_keeps_attention(psi, s, b, h, a, layers, t, d, zero, recompute, sp=False):
    return valid_memory(psi, s, b, h, a, layers, t, d, zero, "none" if recompute == "selective" else recompute, sp)


def attention_not_split(psi, s, b, h, a, layers, t, d, zero, recompute, sp=False):
    out = valid_memory(psi, s, b, h, a, layers, t, d, zero, recompute, sp)
    if recompute == "none":
        out["activations"] += layers * s * b * h * 5 * a * s / h * (1 - 1 / t)
    return out


# ---- Exercise 16.5: step_time


def gpt3_flops(gpt, layout):
    """Narayanan et al.'s closed form: right for GPT-3's block only (heads = key/value heads, a 4h MLP)."""
    B, s, h, v, L = layout.batch, gpt.seq, gpt.hidden, gpt.vocab, gpt.layers
    if layout.recompute == "full":
        return 96 * B * s * L * h**2 * (1 + s / (6 * h) + v / (16 * L * h))
    flops = 72 * B * s * L * h**2 * (1 + s / (6 * h) + v / (12 * L * h))
    return flops + 4 * B * s**2 * h * L * (layout.recompute == "selective")


def valid_time(gpt, layout, platform, flops_of=lambda gpt, lay: iteration_flops(gpt, lay.batch, lay.recompute)):
    """From the lab's statement: iteration_flops, the collectives counted per micro-batch and layer."""
    B, s, h, L = layout.batch, gpt.seq, gpt.hidden, gpt.layers
    flops = flops_of(gpt, layout)
    d, t, p, c = layout.data, layout.tensor, layout.pipeline, layout.context
    m = B // (d * layout.micro_batch)
    compute = (
        flops / (d * t * p * c) / platform.flops * platform.slowdown(min(d * t * p * c, platform.devices_per_node))
    )
    activation = layout.micro_batch * s // c * h * 2
    full = layout.recompute == "full"
    per_layer = (6 if full else 4) * platform.comm("allreduce", activation, t)
    kv = 2 * layout.micro_batch * s * gpt.kv_width / t * 2
    ring = (3 if full else 2) * platform.comm("allgather", kv, c, t) + platform.comm("reduce_scatter", kv, c, t)
    grads = stage_parameters(gpt, layout) * 2
    if layout.zero == 3:
        data = m * (2 * platform.comm("allgather", grads, d * c, t) + platform.comm("reduce_scatter", grads, d * c, t))
    else:
        data = platform.comm("allreduce", grads, d * c, t)
    pipe = 2 * m * platform.comm("p2p", activation / t, 2, stride=t * c * d) if p > 1 else 0.0
    return {
        "data": data,
        "pipeline": pipe,
        "context": m * L // p * ring,
        "tensor": m * L // p * per_layer,
        "bubble": compute * (p - 1) / m,
        "compute": compute,
    }


def assumes_gpt3s_block(gpt, layout, platform):  # 24 s h^2 + 4 s^2 h per layer: wrong for GQA and SwiGLU
    return valid_time(gpt, layout, platform, gpt3_flops)


def assumes_gpt3s_parameters(gpt, layout, platform):  # 12 h^2 + 13 h per layer: wrong for GQA and SwiGLU
    out = valid_time(gpt, layout, platform)
    h, d, c, t = gpt.hidden, layout.data, layout.context, layout.tensor
    grads = 2 * (gpt.layers // layout.pipeline * (12 * h * h + 13 * h) + gpt.vocab * h + gpt.seq * h) / t
    if layout.zero != 3:
        out["data"] = platform.comm("allreduce", grads, d * c, t)
    return out


def bubble_over_m_plus_p(gpt, layout, platform):
    out = valid_time(gpt, layout, platform)
    p, m = layout.pipeline, layout.micro_batches
    out["bubble"] = (p - 1) / (m + p - 1) * out["compute"]
    return out


def tensor_forgets_recompute(gpt, layout, platform):
    out = valid_time(gpt, layout, platform)
    out["tensor"] *= 4 / 6 if layout.recompute == "full" else 1
    return out


def pipeline_sends_whole_activation(gpt, layout, platform):
    out = valid_time(gpt, layout, platform)
    if layout.pipeline > 1:
        n = layout.micro_batch * gpt.seq // layout.context * gpt.hidden * 2
        stride = layout.tensor * layout.context * layout.data
        out["pipeline"] = 2 * layout.micro_batches * platform.comm("p2p", n, 2, stride=stride)
    return out


def compute_without_recompute(gpt, layout, platform):
    out = valid_time(gpt, layout, platform)
    out["compute"] = iteration_flops(gpt, layout.batch, "none") / layout.devices / platform.flops
    return out


def no_slowdown(gpt, layout, platform):  # ignores the devices sharing a node's cores
    return valid_time(gpt, layout, replace(platform, contention=(1.0,)))


def zero3_as_allreduce(gpt, layout, platform):
    return valid_time(gpt, layout.with_(zero=0), platform)


def zero3_reduces_once(gpt, layout, platform):  # one reduce-scatter per step, not lab 13's one per micro-batch
    out = valid_time(gpt, layout, platform)
    if layout.zero == 3:
        d, c, t, m = layout.data, layout.context, layout.tensor, layout.micro_batches
        grads = stage_parameters(gpt, layout) * 2
        out["data"] -= (m - 1) * platform.comm("reduce_scatter", grads, d * c, t)
    return out


def no_context_term(gpt, layout, platform):  # leaves out ring attention's collectives
    return {**valid_time(gpt, layout, platform), "context": 0.0}


def context_of_every_head(gpt, layout, platform):  # keys and values counted as 2bsh/t: heads = key/value heads
    out = valid_time(gpt, layout, platform)
    out["context"] *= gpt.hidden / gpt.kv_width if layout.context > 1 else 1
    return out


def full_recompute_context_as_none(gpt, layout, platform):  # the recomputed forward's allgather forgotten
    out = valid_time(gpt, layout, platform)
    if layout.recompute == "full":
        out["context"] = valid_time(gpt, layout.with_(recompute="none"), platform)["context"]
    return out


# ---- Exercise 16.7: block_counts


def counted(gpt, moe, kv=None, dh=None, ffn=None, expert_ffn=None, gated=None, shared=None, slip=""):
    """A block's counts from the lab's statement, matrix by matrix; with one field read wrong, or one `slip` made."""
    h, s, a = gpt.hidden, gpt.seq, gpt.heads
    dh = gpt.head_dim_ if dh is None else dh
    kv = gpt.kv_heads_ if kv is None else kv
    matrices = 3 if (gpt.gated if gated is None else gated) else 2
    attention = 2 * h * a * dh + 2 * h * kv * dh
    if moe:
        width = gpt.expert_ffn_ if expert_ffn is None else expert_ffn
        shared = gpt.shared_experts if shared is None else shared
        router = 0 if slip == "router" else h * gpt.experts
        held = (gpt.top_k if slip == "top-k held" else gpt.experts) + shared
        run = (gpt.experts if slip == "all run" else gpt.top_k) + shared
        held, run = router + held * matrices * h * width, router + run * matrices * h * width
    else:
        held = run = matrices * h * (gpt.ffn_ if ffn is None else ffn)
    width = {"scores of h": h, "scores of kv": kv * dh}.get(slip, a * dh)
    scores = 4 * s * s * width / (2 if slip == "causal" else 1)
    return attention + (0 if slip == "norms" else 2 * h) + held, 2 * s * (attention + run) + scores


def valid_block(gpt, moe):
    return counted(gpt, moe)


def block_per_token_summed(gpt, moe):
    """The same counts another way: FLOPs per token summed over the tokens, in numpy integers and floats."""
    params, _ = valid_block(gpt, moe)
    active = params - 2 * gpt.hidden
    if moe:
        active -= (gpt.experts - gpt.top_k) * (3 if gpt.gated else 2) * gpt.hidden * gpt.expert_ffn_
    per_token = [2.0 * active + 4 * gpt.seq * gpt.q_width] * gpt.seq
    return np.int64(params), np.float64(sum(per_token))


#: 16.7's slips: (name, the answer, words its failure names).
SLIPS = [
    ("raw kv_heads", lambda g, moe: counted(g, moe, kv=g.kv_heads), "gpt.kv_heads, 0 when"),
    ("raw head_dim", lambda g, moe: counted(g, moe, dh=g.head_dim), "gpt.head_dim, 0 when"),
    ("raw ffn", lambda g, moe: counted(g, moe, ffn=g.ffn), "gpt.ffn, 0 when"),
    ("raw expert_ffn", lambda g, moe: counted(g, moe, expert_ffn=g.expert_ffn), "gpt.expert_ffn, 0 when"),
    ("every head", lambda g, moe: counted(g, moe, kv=g.heads), "k and v for every head"),
    ("h / a", lambda g, moe: counted(g, moe, dh=g.hidden // g.heads), "heads of h / a"),
    ("4h", lambda g, moe: counted(g, moe, ffn=4 * g.hidden), "an MLP of 4h"),
    ("gated", lambda g, moe: counted(g, moe, gated=not g.gated), "the other MLP"),
    ("shared", lambda g, moe: counted(g, moe, shared=0), "no shared experts"),
    *((slip, lambda g, moe, slip=slip: counted(g, moe, slip=slip), words) for slip, words in (
        ("router", "no router"), ("top-k held", "the top-k experts' parameters"), ("all run", "every expert's FLOPs"),
        ("scores of h", "the scores as 4 s^2 h"), ("causal", "half the scores"), ("norms", "no norms"),
    )),
]  # fmt: skip
SLIP = {name: answer for name, answer, _ in SLIPS}


@pytest.mark.parametrize("answer, words", [slip[1:] for slip in SLIPS], ids=[slip[0] for slip in SLIPS])
def test_every_slip_of_16_7_fails_every_seed_and_is_named(grading_seeds, answer, words):
    assert _block_problem(valid_block, block_cases(), None) is None
    for value in grading_seeds:
        found = _block_problem(answer, block_cases(Draw(value, "block_counts")), None)
        assert found is not None and f"It looks like you counted {words}" in found, (value, found)


def block_of_the_library(gpt, moe):
    return gpt.layer_parameters(moe), gpt.layer_flops(moe)


def block_of_its_parts(gpt, moe):  # the library's attention and MLP, its own sum
    mlp = gpt.mlp_parameters(gpt.ffn_)
    return gpt.attention_parameters() + 2 * gpt.hidden + mlp, 0.0


# ---- Exercise 16.6: search


def valid_search(gpt, devices, template, platform, budget):
    """Recursive factorisation, sorted by time only."""

    def split(n, k):
        if k == 1:
            return [(n,)]
        return [(f, *rest) for f in range(1, n + 1) if n % f == 0 for rest in split(n // f, k - 1)]

    ranked, rejected = [], []
    for d, t, p, c in split(devices, 4):
        layout = template.with_(data=d, tensor=t, pipeline=p, context=c)
        why = problem(gpt, layout)
        if why:
            rejected.append((layout, "cannot run: " + why))
            continue
        pred = predict(gpt, layout, platform)
        if pred.peak > budget:
            rejected.append((layout, f"memory: {pred.peak - budget:.0f} bytes too many"))
        else:
            ranked.append(pred)
    return sorted(ranked, key=lambda pred: pred.time), rejected


def in_whole_bytes(*args):
    """Bytes rounded down to whole ones: within a byte of the lab's count, it passes."""
    return {part: float(int(amount)) for part, amount in valid_memory(*args).items()}


def capitalised_with_thousands(gpt, devices, template, platform, budget):
    """Reasons that start with a capital and group the amount's thousands ("Memory: 1,234,567 bytes over")."""
    ranked, rejected = valid_search(gpt, devices, template, platform, budget)
    over = [
        (lay, f"Memory: {predict(gpt, lay, platform).peak - budget:,.0f} bytes over") if "memory" in why else (lay, why)
        for lay, why in rejected
    ]
    return ranked, over


def in_reversed_key_order(fn):
    """The text says "a dict": the same values with the keys in another order pass."""

    def reordered(*args):
        return dict(reversed(list(fn(*args).items())))

    return reordered


def rejected_in_another_order(gpt, devices, template, platform, budget):
    """The text asks for "a list" of the rejected layouts, in no order: reversed, it passes."""
    ranked, rejected = valid_search(gpt, devices, template, platform, budget)
    return ranked, rejected[::-1]


def test_the_search_cases_have_a_device_count_with_an_odd_factor():
    from ddlab.checks.oracle_transformer import search_cases

    assert any(devices % 3 == 0 for _, devices, *_ in search_cases())


def slowest_first(*args):
    ranked, rejected = valid_search(*args)
    return ranked[::-1], rejected


def ignores_the_budget(gpt, devices, template, platform, budget):
    return valid_search(gpt, devices, template, platform, float("inf"))


def no_context(gpt, devices, template, platform, budget):
    ranked, rejected = valid_search(gpt, devices, template, platform, budget)
    return [p for p in ranked if p.layout.context == 1], [r for r in rejected if r[0].context == 1]


def vague_reasons(*args):
    ranked, rejected = valid_search(*args)
    return ranked, [(layout, "not possible") for layout, _ in rejected]


def memory_without_the_amount(*args):
    ranked, rejected = unguarded(search)(*args)
    return ranked, [(layout, "out of memory" if "memory" in why else why) for layout, why in rejected]


def listed_twice(*args):
    ranked, rejected = valid_search(*args)
    return ranked + ranked[:1], rejected


@pytest.mark.parametrize(
    "check, wrong, words",
    [
        (check_memory_per_rank, zero2_like_zero1, "gradients"),
        (check_memory_per_rank, zero1_shards_parameters, "parameters"),
        (check_memory_per_rank, everything_split, "activations"),
        (check_memory_per_rank, full_without_working_layer, "activations"),
        (check_memory_per_rank, selective_keeps_attention, "activations"),
        (check_memory_per_rank, attention_not_split, "activations"),
        (check_memory_per_rank, lambda *a: [1, 2], "dict"),
        (check_memory_per_rank, lambda *a: {"parameters": 1}, "keys"),
        (check_step_time, assumes_gpt3s_block, "small GQA \\+ SwiGLU.*compute"),
        (check_step_time, assumes_gpt3s_parameters, "small GQA \\+ SwiGLU.*data"),
        (check_step_time, bubble_over_m_plus_p, "bubble"),
        (check_step_time, tensor_forgets_recompute, "tensor"),
        (check_step_time, pipeline_sends_whole_activation, "pipeline"),
        (check_step_time, compute_without_recompute, "compute"),
        (check_step_time, zero3_as_allreduce, "data"),
        (check_step_time, zero3_reduces_once, "data"),
        (check_step_time, no_context_term, "context"),
        (check_step_time, full_recompute_context_as_none, "context"),
        (check_step_time, context_of_every_head, "small GQA \\+ SwiGLU.*context"),
        (check_step_time, no_slowdown, "compute"),
        (check_step_time, lambda *a: 1 / 0, "ZeroDivisionError"),
        (check_block_counts, SLIP["every head"], "parameters.*you counted k and v for every head"),
        (check_block_counts, SLIP["4h"], "parameters.*you counted an MLP of 4h"),
        (check_block_counts, lambda g, moe: counted(g, moe, gated=False), "parameters.*you counted the other MLP"),
        (check_block_counts, SLIP["h / a"], "heads of 128.*you counted heads of h / a"),
        (check_block_counts, SLIP["top-k held"], "moe=True\\): parameters.*the top-k experts' parameters"),
        (check_block_counts, SLIP["all run"], "moe=True\\): forward FLOPs.*every expert's FLOPs"),
        (check_block_counts, SLIP["router"], "moe=True\\): parameters"),
        (check_block_counts, SLIP["shared"], "moe=True\\): parameters.*no shared experts"),
        (check_block_counts, SLIP["norms"], "parameters"),
        (check_block_counts, lambda g, moe: counted(g, moe, slip="scores of kv"), "forward FLOPs"),
        (check_block_counts, lambda g, moe: [1, 2], "two numbers"),
        (check_block_counts, block_of_the_library, "the library's own answer"),
        (check_block_counts, block_of_its_parts, "the library's own answer"),
        (check_block_counts, lambda g, moe: (g.parameters() / g.layers, 0.0), "the library's own answer"),
        (check_layout_search, slowest_first, "fastest first"),
        (check_layout_search, ignores_the_budget, "should be rejected"),
        (check_layout_search, no_context, "not in ranked"),
        (check_layout_search, vague_reasons, "should say 'divide'"),
        (check_layout_search, memory_without_the_amount, "should say by how much"),
        (check_layout_search, listed_twice, "twice"),
        (check_layout_search, lambda *a: valid_search(*a)[0], "return \\(ranked, rejected\\)"),
        (check_memory_per_rank, lambda *a: memory_per_rank(*a), "the library's own answer"),
        (check_step_time, lambda *a: step_time(*a), "the library's own answer"),
        (check_step_time, in_reversed_key_order(step_time), "the library's own answer"),
        (check_layout_search, lambda *a: search(*a), "the library's own answer"),
        (check_layout_search, lambda g, n, *a: _search(g, meshes(n), *a), "the library's own answer"),
    ],
)
def test_wrong_answers_fail(check, wrong, words):
    with pytest.raises(CheckFailed, match=words):
        check(wrong)


@pytest.mark.parametrize(
    "check, valid",
    [
        (check_memory_per_rank, valid_memory),
        (check_memory_per_rank, in_reversed_key_order(valid_memory)),
        (check_memory_per_rank, in_whole_bytes),
        (check_block_counts, valid_block),
        (check_block_counts, block_per_token_summed),
        (check_step_time, valid_time),
        (check_step_time, in_reversed_key_order(valid_time)),
        (check_layout_search, valid_search),
        (check_layout_search, rejected_in_another_order),
        (check_layout_search, capitalised_with_thousands),
    ],
)
def test_valid_answers_pass(check, valid, capsys):
    check(valid)
    assert capsys.readouterr().out.startswith("passed:")


@pytest.mark.parametrize("check", [check_memory_per_rank, check_step_time, check_layout_search, check_block_counts])
def test_stub_error_passes_through(check):
    def stub(*args):
        raise NotImplementedError("Exercise 16: write it")

    with pytest.raises(NotImplementedError):
        check(stub)


def test_cases_cover_every_choice():
    from ddlab.checks.oracle_transformer import memory_cases, search_cases, time_cases

    cases = memory_cases()
    assert {c[8] for c in cases} == {0, 1, 2, 3}
    assert {(c[9], c[10]) for c in cases} == set(itertools.product(("none", "selective", "full"), (False, True)))
    assert {c[6] for c in cases} >= {1, 8}
    layouts = [lay for _, lay, _ in time_cases()]
    assert {lay.zero for lay in layouts} == {0, 1, 2, 3} and any(lay.micro_batches < lay.pipeline for lay in layouts)
    assert all(any(getattr(lay, dim) > 1 for lay in layouts) for dim in ("data", "tensor", "pipeline", "context"))
    memory = [sum("memory" in why for _, why in search(*case)[1]) for case in search_cases()]
    assert any(memory) and all(search(*case)[0] for case in search_cases())


# ---- A student function that never returns fails at the check's deadline, naming the case


def never_returns(*args):
    while True:
        pass


@pytest.mark.parametrize(
    "check, name",
    [
        (check_memory_per_rank, "memory_per_rank"),
        (check_step_time, "step_time"),
        (check_layout_search, "search"),
        (check_block_counts, "block_counts"),
    ],
)
def test_a_loop_that_never_ends_fails_at_the_deadline(check, name, monkeypatch):
    from ddlab.checks import oracle_transformer

    monkeypatch.setattr(oracle_transformer, "DEADLINE", 0.5)
    start = time.monotonic()
    with pytest.raises(CheckFailed, match=rf"{name}\(.*did not return within .*a loop that never ends"):
        check(never_returns)
    assert time.monotonic() - start < 30


def swallows_every_error(*args):
    """A loop that retries whatever fails, as a student might around a call they are unsure of."""
    while True:
        try:
            time.sleep(0.01)
        except Exception:
            pass


def catches_everything_once(*args):
    """A bare except that takes the deadline's interruption for its own failure, then returns a wrong kind."""
    try:
        while True:
            pass
    except:  # noqa: E722
        return None


@pytest.mark.parametrize("answer", [swallows_every_error, catches_everything_once])
def test_an_answer_that_catches_the_interruption_still_fails_at_the_deadline(answer, monkeypatch):
    from ddlab.checks import oracle_transformer

    monkeypatch.setattr(oracle_transformer, "DEADLINE", 0.5)
    start = time.monotonic()
    with pytest.raises(CheckFailed, match=r"step_time\(.*did not return within"):
        check_step_time(answer)
    assert time.monotonic() - start < 30


def test_the_step_time_hint_counts_the_context_collectives_the_reference_does():
    from ddlab.checks.oracle_transformer import HINTS, time_cases

    gpt, layout, platform = next(
        (g, lay, pf) for g, lay, pf in time_cases() if lay.context > 1 and lay.recompute != "full"
    )
    t, c, b = layout.tensor, layout.context, layout.micro_batch
    m = layout.batch // (layout.data * b)
    kv = 2 * b * gpt.seq * gpt.hidden / t * 2
    per_layer = 2 * platform.comm("allgather", kv, c, t) + platform.comm("reduce_scatter", kv, c, t)
    assert step_time(gpt, layout, platform)["context"] == pytest.approx(m * gpt.layers // layout.pipeline * per_layer)
    assert (
        "2 context allgathers and a reduce-scatter (one allgather more with full recomputation)" in HINTS["step_time"]
    )
