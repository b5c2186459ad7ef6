"""Checks for lab 16's oracle exercises: the transformer memory formula, the time of one layout, the search.

The student's function is compared with the reference (`ddlab.oracle.transformer`,
`ddlab.oracle.transformer_planner`) on generated cases: every ZeRO stage and recomputation,
tensor parallelism with and without sequence parallelism, pipelines with fewer and more
micro-batches than stages, context parallelism, small and published GPTs, a small GPT of 2024-26's
shape (grouped-query attention, a SwiGLU MLP of width 688, not 4h: a step time that assumes heads = key/value
heads or a 4h GELU MLP fails on it), the A100 platform and a flat one, budgets that cut some layouts. The functions are pure, so every rank runs all
cases; `each_size` gathers one verdict. Each call of the student's function has `DEADLINE` seconds:
a loop that never ends fails the check, naming the case, instead of hanging it.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, Callable

from mpi4py import MPI

from ..oracle.platform import Platform
from ..oracle.published import TABLE1, a100_cluster
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
    "search": "try every (d, t, p, c) whose product is the device count; a layout that does not run or does not fit "
    "goes to the rejected list with its reason; sort the others by time.",
}


def _flat(bandwidth: float) -> Platform:
    from ..allreduce.cost import Link

    link = Link(alpha=2e-5, beta=1 / bandwidth)
    return Platform(
        "flat",
        devices_per_node=4,
        flops=2e12,
        memory=2 * 10**9,
        intra=link,
        inter=Link(5e-5, 4 / bandwidth),
        contention=(1.0, 1.4, 1.8, 2.5),  # cores shared as on a laptop: compute slows with busy devices
    )


def memory_cases() -> list[tuple]:
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


def time_cases() -> list[tuple[GPT, Layout, Platform]]:
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
        )
        for pf in (a100, flat)
    ]
    # the published layouts with plain 1F1B (exercise 16.5 has no interleaved chunks)
    cases += [(run.gpt, run.layout.with_(interleave=1), a100) for run in (TABLE1[0], TABLE1[6], TABLE1[9])]
    return cases


def search_cases() -> list[tuple[GPT, int, Layout, Platform, float]]:
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


def _close(got: Any, want: float) -> bool:
    return is_number(got) and math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-12)


def _dict_problem(name: str, got: Any, want: dict[str, float], case: str) -> str | None:
    if not isinstance(got, dict):
        return f"{name}({case}) returned {type(got).__name__}; return a dict with keys {sorted(want)}"
    if set(got) != set(want):
        return f"{name}({case}) returned keys {sorted(got)}; expected {sorted(want)}"
    for key, value in want.items():
        if not is_number(got[key]):
            return f"{name}({case})[{key!r}] is {got[key]!r}, not a number"
        if not _close(got[key], value):
            ratio = float(got[key]) / value if value else float("inf")
            return (
                f"{name}({case})[{key!r}] = {float(got[key]):.6g}, expected {value:.6g} (ratio {ratio:.3g}). "
                f"Hint: {HINTS[name]}"
            )
    return None


def _memory_problem(fn: Callable) -> str | None:
    for case in memory_cases():
        want = memory_per_rank(*case)
        assert set(want) == set(MEMORY_PARTS)
        where = ", ".join(map(repr, case))
        with deadline(DEADLINE, f"memory_per_rank({where})"):
            got = fn(*case)
        problem_found = _dict_problem("memory_per_rank", got, want, where)
        if problem_found:
            return problem_found
    return None


def _time_problem(fn: Callable) -> str | None:
    for gpt, layout, platform in time_cases():
        want = step_time(gpt, layout, platform)
        assert set(want) == set(TIME_PARTS)
        where = f"{gpt.name}, {layout.label}, {platform.name}"
        with deadline(DEADLINE, f"step_time({where})"):
            got = fn(gpt, layout, platform)
        found = _dict_problem("step_time", got, want, where)
        if found:
            return found
    return None


def _search_problem(fn: Callable) -> str | None:
    for gpt, devices, template, platform, budget in search_cases():
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
            if word not in reasons[lay]:
                return f"{where}: the reason for {lay.label}, {reasons[lay]!r}, should say {word!r}"
            peak = predict(gpt, lay, platform).peak if word == "memory" else 0.0
            if word == "memory" and not _states_amount(reasons[lay], (peak - budget, peak)):
                return (
                    f"{where}: the reason for {lay.label}, {reasons[lay]!r}, should say by how much: it needs "
                    f"{peak:.4g} B, {peak - budget:.4g} B over the budget (in any unit: B, MB, MiB, GB, GiB)"
                )
    return None


def _states_amount(reason: str, amounts: tuple[float, ...]) -> bool:
    """Whether `reason` writes one of `amounts` (bytes) in some unit, to the digits it shows."""
    for match in re.finditer(r"\d+(?:\.(\d*))?(?:[eE][-+]?\d+)?", reason):
        written, decimals = float(match.group(0)), len(match.group(1) or "")
        for amount in amounts:
            for unit in (1, 1e3, 2**10, 1e6, 2**20, 1e9, 2**30):
                if abs(written - amount / unit) <= 0.5 * 10**-decimals + 0.01 * abs(amount / unit):
                    return True
    return False


def _check(name: str, body: Callable[[], str | None], count: int, comm: MPI.Comm | None) -> None:
    comm = comm or MPI.COMM_WORLD

    def guarded(sub: MPI.Comm) -> str | None:
        try:
            return body()
        except NotImplementedError:
            raise
        except CheckFailed as err:  # a case ran past its deadline
            return str(err)
        except Exception as err:  # the student's function failed on a case: say how
            return f"{name} raised {type(err).__name__}: {err}"

    each_size(comm, guarded, f"{name} differs from the reference", sizes=[comm.Get_size()])
    passed(comm, f"{name} agrees with the reference on {count} generated cases")


def check_memory_per_rank(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(psi, s, b, h, a, layers, t, d, zero, recompute, sequence_parallel) -> four parts (Exercise 16.4)."""
    _check("memory_per_rank", lambda: _memory_problem(fn), len(memory_cases()), comm)


def check_step_time(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(gpt, layout, platform) -> seconds by part (Exercise 16.5)."""
    _check("step_time", lambda: _time_problem(fn), len(time_cases()), comm)


def check_layout_search(fn: Callable, comm: MPI.Comm | None = None) -> None:
    """fn(gpt, devices, template, platform, budget) -> (ranked, rejected) (Exercise 16.6)."""
    _check("search", lambda: _search_problem(fn), len(search_cases()), comm)
