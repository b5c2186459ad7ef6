"""The planner: for a model, a batch, a platform and P devices, which strategies fit, fastest first.

Every strategy is tried in every layout of P = D x (S, F or K) devices the model allows.
A layout is infeasible for a structural reason (fewer samples than data groups, slabs
thinner than a convolution's halo, fewer channels than ranks, fewer layers than stages)
or because its busiest rank needs more memory than the budget. Of each strategy the
fastest feasible layout is offered; the others are listed with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model_parallel.splits import balanced_split
from .describe import ModelInfo
from .platform import Platform
from .strategies import (
    Prediction,
    channel_parallel,
    data,
    filter_parallel,
    layer_seconds,
    pipeline,
    spatial,
    split_layers,
)

GIB = 2**30


@dataclass
class Plan:
    """Feasible predictions, fastest first (best layout per strategy), and (strategy, reason) for the others."""

    devices: int
    ranked: list[Prediction] = field(default_factory=list)
    infeasible: list[tuple[str, str]] = field(default_factory=list)

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    def table(self) -> str:
        lines = [f"{self.devices} devices:"]
        for pred in self.ranked:
            lines.append(
                f"  {pred.label:34} {pred.time * 1e3:9.2f} ms  (compute {pred.compute * 1e3:.2f}, "
                f"comm {pred.communication * 1e3:.2f}, bubble {pred.bubble * 1e3:.2f})  "
                f"peak {pred.peak / GIB:.2f} GiB"
            )
        for name, reason in self.infeasible:
            lines.append(f"  {name:34} infeasible: {reason}")
        return "\n".join(lines)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _slab_problem(model: ModelInfo, s: int) -> str | None:
    for layer in model.layers:
        if layer.halo and len(layer.input_shape) == 3 and layer.input_shape[1] < s * max(layer.halo, 1):
            return (
                f"{s} slabs of the {layer.input_shape[1]} rows at layer {layer.name} ({layer.kind}) "
                f"are thinner than its halo of {layer.halo}"
            )
    if not any(layer.halo for layer in model.layers):
        return "the model has no convolutions over rows to cut"
    return None


def _channel_problem(model: ModelInfo, f: int) -> str | None:
    if f > 1 and not any(split_layers(model, f)):
        return f"no convolution or linear layer has {f} channels to split"
    narrow = [layer for layer in model.layers if layer.kind in ("Conv2d", "Linear") and layer.output_shape[0] < f]
    if narrow:
        return f"layer {narrow[0].name} has {narrow[0].output_shape[0]} channels, fewer than {f} ranks"
    return None


def candidates(
    model: ModelInfo, batch: int, devices: int, platform: Platform, optimizer_copies: int = 1
) -> list[tuple[str, Prediction | str]]:
    """(strategy, prediction or structural reason) for every layout of `devices`."""
    out: list[tuple[str, Prediction | str]] = []
    copies = optimizer_copies
    costs = [layer_seconds(layer, platform) for layer in model.layers]
    for d in divisors(devices):
        inner = devices // d
        if batch < d:
            reason = f"a batch of {batch} cannot feed {d} data groups"
            names = ["data"] if inner == 1 else ["data x spatial", "data x filter", "data x pipeline"]
            out += [(name, reason) for name in names]
            continue
        if inner == 1:
            out.append(("data", data(model, batch, d, platform, copies)))
            continue
        prefix = "" if d == 1 else "data x "
        problem = _slab_problem(model, inner)
        out.append((prefix + "spatial", problem or spatial(model, batch, inner, platform, copies, data_ways=d)))
        problem = _channel_problem(model, inner)
        for name, fn in (("filter", filter_parallel), ("channel", channel_parallel)):
            if name == "channel" and d > 1:
                continue  # data x channel is not one of the strategies studied
            out.append((prefix + name, problem or fn(model, batch, inner, platform, copies, data_ways=d)))
        if inner > len(model.layers):
            out.append((prefix + "pipeline", f"{inner} stages for {len(model.layers)} layers"))
            continue
        samples = batch // d
        bounds = balanced_split(costs, inner)
        best = None
        m = inner
        while m <= samples:
            if samples % m == 0:
                pred = pipeline(model, batch, inner, m, platform, copies, data_ways=d, bounds=bounds)
                if best is None or pred.time < best.time:
                    best = pred
            m *= 2
        out.append(
            (prefix + "pipeline", best or f"a batch of {samples} per group is fewer micro-batches than {inner} stages")
        )
    return out


def plan(
    model: ModelInfo,
    batch: int,
    devices: int,
    platform: Platform,
    budget: float | None = None,
    optimizer_copies: int = 1,
) -> Plan:
    """The feasible strategies for `devices` devices, fastest first; budget: bytes per device (default the platform's)."""
    budget = platform.memory if budget is None else budget
    best: dict[str, Prediction] = {}
    reasons: dict[str, str] = {}
    for name, result in candidates(model, batch, devices, platform, optimizer_copies):
        if isinstance(result, str):
            reasons.setdefault(name, result)
        elif result.peak > budget:
            reasons.setdefault(
                name,
                f"{result.label} needs {result.peak / GIB:.2f} GiB on its busiest rank, "
                f"over the {budget / GIB:.2f} GiB budget",
            )
        elif name not in best or result.time < best[name].time:
            best[name] = result
    ranked = sorted(best.values(), key=lambda p: p.time)
    infeasible = [(name, reason) for name, reason in reasons.items() if name not in best]
    return Plan(devices, ranked, infeasible)
