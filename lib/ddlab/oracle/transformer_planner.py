"""The transformer planner (lab 16): every layout of N devices for a GPT, fastest first, and why the others fail.

`search` tries every mesh d x t x p x c = N with the other choices of a template layout (ZeRO
stage, micro-batch, recomputation, precision, sequence parallelism) and returns the
feasible predictions, fastest first (ties: less memory first), and each rejected layout
with its reason: a dimension that does not divide what it cuts (`transformer.problem`), or
out of memory on the busiest rank, by how much. `plan_transformer` runs `search` for every
template of the options (`ZERO_STAGES` 0-3, `MICRO_BATCHES` 1-8, the three recomputations, sequence
parallelism on or off, the pipeline schedule: `PLAN_SCHEDULES`, 1F1B, interleaved, ZB-H1, ZB-H2, ZB-V) and
merges them. `explain` says, part by part, why one prediction
is faster than another.

Exercise 16.6 signature: `search(gpt, devices, template, platform, budget) -> (ranked,
rejected)`: `ranked` a list of `TransformerPrediction` (from `transformer.predict`) of every
layout `template.with_(data=d, tensor=t, pipeline=p, context=c)` with d t p c = devices
that runs and fits in `budget` bytes, fastest first; `rejected` a list of (layout, reason)
of all the others, the reason containing "divide" when a dimension does not divide what it
cuts and "memory" when the busiest rank needs more than the budget (saying by how much).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from ..runtime.reference import reference
from .planner import divisors
from .platform import Platform
from .transformer import GPT, RECOMPUTE, Layout, Precision, TransformerPrediction, predict, problem

GIB = 2**30

#: The choices `plan_transformer` tries beside the mesh.
ZERO_STAGES = (0, 1, 2, 3)
MICRO_BATCHES = (1, 2, 4, 8)
#: The pipeline schedules `plan_transformer` tries: (Layout.schedule, Layout.interleave); ("1f1b", 2) is the
#: interleaved 1F1B with two chunks per rank (the base layout's v instead when it sets one above 1).
PLAN_SCHEDULES = (("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 1))


def meshes(devices: int) -> list[tuple[int, int, int, int]]:
    """Every (d, t, p, c) with d t p c = devices."""
    if devices < 1:
        raise ValueError(f"need at least one device, got {devices}")
    out = []
    for t, p, c in itertools.product(divisors(devices), repeat=3):
        if devices % (t * p * c) == 0:
            out.append((devices // (t * p * c), t, p, c))
    return out


@reference("layout_search")
def search(
    gpt: GPT, devices: int, template: Layout, platform: Platform, budget: float | None = None
) -> tuple[list[TransformerPrediction], list[tuple[Layout, str]]]:
    """Feasible predictions of every mesh of `devices` (template's other choices), fastest first; rejected, why."""
    return _search(gpt, meshes(devices), template, platform, budget)


@reference("layout_search")  # lab 16's plan_transformer runs it too
def _search(
    gpt: GPT, grid: list[tuple[int, int, int, int]], template: Layout, platform: Platform, budget: float | None
) -> tuple[list[TransformerPrediction], list[tuple[Layout, str]]]:
    """`search` over the meshes (d, t, p, c) of `grid`."""
    budget = platform.memory if budget is None else budget
    ranked: list[TransformerPrediction] = []
    rejected: list[tuple[Layout, str]] = []
    for d, t, p, c in grid:
        layout = template.with_(data=d, tensor=t, pipeline=p, context=c)
        reason = problem(gpt, layout)
        if reason:
            rejected.append((layout, reason))
            continue
        pred = predict(gpt, layout, platform)
        if pred.peak > budget:
            rejected.append(
                (
                    layout,
                    f"out of memory: needs {pred.peak / GIB:.1f} GiB on its busiest rank, "
                    f"{(pred.peak - budget) / GIB:.1f} GiB over the {budget / GIB:.1f} GiB budget",
                )
            )
            continue
        ranked.append(pred)
    ranked.sort(key=lambda pred: (pred.time, pred.peak))
    return ranked, rejected


@dataclass
class TransformerPlan:
    """Feasible predictions fastest first, and (layout, reason) for every rejected layout."""

    gpt: GPT
    devices: int
    ranked: list[TransformerPrediction] = field(default_factory=list)
    rejected: list[tuple[Layout, str]] = field(default_factory=list)

    @property
    def best(self) -> TransformerPrediction | None:
        return self.ranked[0] if self.ranked else None

    def reasons(self) -> dict[str, int]:
        """How many layouts each kind of reason rejected (the reason up to its first colon or figure)."""
        counts: dict[str, int] = {}
        for _, reason in self.rejected:
            if reason.startswith("out of memory"):
                kind = "out of memory"
            elif "does not divide" in reason:
                kind = reason.split(" ")[0] + " does not divide"
            elif "more chunks than" in reason:
                kind = "more chunks than layers"
            else:
                kind = reason.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def table(self, top: int = 5) -> str:
        """The `top` fastest layouts (step time, tokens/s and TFLOP/s per device as Narayanan et al. count them,
        peak memory) and how many layouts each reason rejected."""
        lines = [f"{self.gpt.name or 'GPT'} on {self.devices} devices: {len(self.ranked)} layouts fit"]
        shown = self.ranked[:top]
        width = max([44, *(len(pred.layout.label) for pred in shown)])
        for pred in shown:
            lines.append(
                f"  {pred.layout.label:{width}} {pred.time:8.2f} s  {pred.tokens_per_device():8.0f} tokens/s  "
                f"{pred.model_flops_per_device() / 1e12:6.1f} TFLOP/s  {pred.peak / GIB:6.1f} GiB"
            )
        lines += [f"  rejected, {kind}: {n}" for kind, n in sorted(self.reasons().items())]
        return "\n".join(lines)


def plan_transformer(
    gpt: GPT,
    devices: int,
    batch: int,
    platform: Platform,
    budget: float | None = None,
    precision: str | Precision = "mixed",
    base: Layout | None = None,
    zero_stages: tuple[int, ...] = ZERO_STAGES,
    micro_batches: tuple[int, ...] = MICRO_BATCHES,
    schedules: tuple[tuple[str, int], ...] = PLAN_SCHEDULES,
) -> TransformerPlan:
    """Every layout of `devices` devices for a global batch of `batch` sequences, fastest first (ZeRO stages,
    micro-batches, recomputations, sequence parallelism or not, and for a mixture of experts every expert
    parallelism that divides its experts, every pipeline schedule of `schedules`: (schedule, chunks per rank)).
    `base` gives the choices it keeps fixed (kernel, overlap; its precision unless `precision` is given
    otherwise; its interleave for the interleaved schedule, when above 1). A layout without a pipeline (p = 1)
    is kept under "1f1b" only, as one without tensor parallelism is kept without SP: the same layout."""
    if budget is not None and budget < 2**20:
        raise ValueError(f"budget is bytes per device, not {budget!r}: for 80 GB pass 80e9")
    plan = TransformerPlan(gpt, devices)
    base = base or Layout()
    precision = base.precision if precision == "mixed" else precision
    experts = [e for e in divisors(gpt.experts) if devices % e == 0] if gpt.experts else [1]
    chosen = {(name, base.interleave if v > 1 and base.interleave > 1 else v) for name, v in schedules}
    every = meshes(devices)
    piped = [mesh for mesh in every if mesh[2] > 1]  # a schedule other than the first changes only these
    for zero, b, recompute, sp, ep, (schedule, v) in itertools.product(
        zero_stages, micro_batches, RECOMPUTE, (False, True), experts, sorted(chosen)
    ):
        template = base.with_(
            schedule=schedule,
            interleave=v,
            zero=zero,
            micro_batch=b,
            batch=batch,
            recompute=recompute,
            precision=precision,
            sequence_parallel=sp,
            expert=ep,
        )
        alone = (schedule, v) == min(chosen)  # the one schedule a layout without a pipeline keeps
        ranked, rejected = _search(gpt, every if alone else piped, template, platform, budget)
        plan.ranked += [pred for pred in ranked if _distinct(pred.layout, sp)]
        plan.rejected += [(lay, why) for lay, why in rejected if _distinct(lay, sp)]
    plan.ranked.sort(key=lambda pred: (pred.time, pred.peak))
    return plan


def _distinct(layout: Layout, sp: bool) -> bool:
    """False for a layout the search need not report: SP on t = 1 (the template without SP gives it too), and
    without SP on t > 1 when the recipe overlaps the tensor collectives (sequence parallelism's, which it needs)."""
    if layout.tensor == 1:
        return not sp
    return sp or not layout.tensor_overlap


def explain(chosen: TransformerPrediction, other: TransformerPrediction) -> str:
    """Why `chosen` is faster (or not) than `other`: the parts that differ, largest first, and the layouts' changes."""
    changes = [
        f"{name} {getattr(other.layout, name)} -> {getattr(chosen.layout, name)}"
        for name in (
            "data",
            "tensor",
            "pipeline",
            "context",
            "expert",
            "zero",
            "micro_batch",
            "recompute",
            "sequence_parallel",
            "schedule",
            "interleave",
            "precision",
            "kernel",
            "overlap",
            "tensor_overlap",
            "uneven",
        )
        if getattr(other.layout, name) != getattr(chosen.layout, name)
    ]
    deltas = sorted(((chosen.seconds[k] - other.seconds[k], k) for k in chosen.seconds), key=lambda x: x[0])
    parts = [f"{k} {'-' if dt < 0 else '+'}{abs(dt):.2f} s" for dt, k in deltas if abs(dt) >= 0.005 * other.time]
    if not changes:
        return "the same layout"
    saving = other.time - chosen.time
    pace = "faster" if saving >= 0 else "slower"
    return (
        f"{', '.join(changes)}: {abs(saving):.2f} s {pace} per iteration ({abs(saving) / other.time:.1%} of its time)"
        + (f"; by part, this minus that: {', '.join(parts)}" if parts else "; no part differs by 0.5% (same time)")
        + f"; memory {other.peak / GIB:.1f} -> {chosen.peak / GIB:.1f} GiB"
    )
