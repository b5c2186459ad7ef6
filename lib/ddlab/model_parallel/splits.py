"""Where to cut a chain of layers into stages, and which tensors then cross from stage to stage.

A split is given by its bounds: stage s holds layers bounds[s] to bounds[s+1]-1.
The naive split gives every stage the same number of layers; the balanced split
gives every stage about the same cost (bytes of memory, or seconds of compute), by
finding the smallest bottleneck for which packing the layers greedily, left to
right, needs no more than k stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..models.unet import UNet
from ..runtime.blocks import block_bounds
from ..runtime.reference import reference


def check_bounds(bounds: list[int], n_layers: int, k: int | None = None) -> None:
    """Raise ValueError unless bounds split n_layers into (k) contiguous, non-empty stages."""
    ok = len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == n_layers
    ok = ok and all(a < b for a, b in zip(bounds, bounds[1:]))
    if not ok or (k is not None and len(bounds) != k + 1):
        stages = f"{k} " if k is not None else ""
        raise ValueError(
            f"bounds {bounds} do not split {n_layers} layers into {stages}stages: they must start at 0, "
            f"end at {n_layers} and increase strictly (every stage holds at least one layer)"
        )


def naive_split(n_layers: int, k: int) -> list[int]:
    """Bounds giving each of k stages the same number of layers (the first ones one more)."""
    if not 1 <= k <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {k} non-empty stages")
    return block_bounds(n_layers, k)


def _pack(prefix: list[float], k: int, limit: float) -> list[int] | None:
    """Greedy left-to-right packing under `limit`, cutting early only to keep k stages non-empty."""
    n = len(prefix) - 1
    bounds = [0]
    for i in range(n):
        open_stage = i > bounds[-1]
        must_cut = n - i == k - len(bounds)  # every remaining layer needs a stage of its own
        if open_stage and (prefix[i + 1] - prefix[bounds[-1]] > limit or must_cut):
            bounds.append(i)
        if prefix[i + 1] - prefix[bounds[-1]] > limit or len(bounds) > k:
            return None
    return bounds + [n]


@reference("balanced_split")
def balanced_split(costs: Sequence[float], k: int) -> list[int]:
    """Bounds of k contiguous non-empty stages whose largest total cost is as small as possible."""
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be >= 0")
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    low, high = 0, len(candidates) - 1  # the largest candidate (all layers) always packs
    while low < high:
        middle = (low + high) // 2
        if _pack(prefix, k, candidates[middle]) is None:
            low = middle + 1
        else:
            high = middle
    bounds = _pack(prefix, k, candidates[low])
    assert bounds is not None  # the search ends on a limit that packs
    return bounds


def stage_costs(costs: Sequence[float], bounds: list[int]) -> list[float]:
    """Total cost of each stage."""
    return [float(sum(costs[a:b])) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class Edge:
    """A tensor that crosses stages: the activation "x" between neighbours, or a skip connection."""

    name: str
    src: int
    dst: int
    shape: tuple[int, ...]  # one sample's: (channels, height, width)
    index: int  # its position in the plan; part of its message tags


def trace_shapes(model: UNet, image_shape: tuple[int, ...]) -> tuple[list[tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """One sample's output shape of every layer, and of every skip, for images of image_shape.

    Runs the model on an empty batch, which costs no arithmetic.
    """
    dtype = next(model.parameters()).dtype
    x, outputs, skip_shapes = torch.zeros(0, *image_shape, dtype=dtype), [], {}
    skips: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for layer in model.layers:
            x = layer(x, skips)
            outputs.append(tuple(x.shape[1:]))
            if layer.saves:
                skip_shapes[layer.saves] = tuple(skips[layer.saves].shape[1:])
    return outputs, skip_shapes


class StagePlan:
    """A UNet cut at `bounds`: each stage's layers, and the edges between stages with their shapes."""

    def __init__(self, model: UNet, bounds: list[int], image_shape: tuple[int, ...]):
        check_bounds(bounds, len(model.layers))
        self.bounds, self.k = list(bounds), len(bounds) - 1
        outputs, skip_shapes = trace_shapes(model, image_shape)
        found: list[tuple[str, int, int, tuple[int, ...]]] = [
            ("x", s, s + 1, outputs[bounds[s + 1] - 1]) for s in range(self.k - 1)
        ]
        producer = {layer.saves: i for i, layer in enumerate(model.layers) if layer.saves}
        for j, layer in enumerate(model.layers):
            if layer.uses and self.stage_of(producer[layer.uses]) != self.stage_of(j):
                found.append(
                    (layer.uses, self.stage_of(producer[layer.uses]), self.stage_of(j), skip_shapes[layer.uses])
                )
        self.edges = [
            Edge(name, src, dst, shape, i)
            for i, (name, src, dst, shape) in enumerate(sorted(found, key=lambda e: (e[1], e[2], e[0])))
        ]

    def stage_of(self, layer: int) -> int:
        return next(s for s in range(self.k) if layer < self.bounds[s + 1])

    def layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def inputs(self, stage: int) -> list[Edge]:
        """Edges arriving at stage: the activation first, then skips."""
        return sorted((e for e in self.edges if e.dst == stage), key=lambda e: (e.name != "x", e.index))

    def outputs(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]

    def tag(self, edge: Edge, mb: int) -> int:
        """The MPI tag of edge's message for micro-batch mb (the same forward and backward)."""
        return mb * len(self.edges) + edge.index

    def describe(self) -> str:
        """One line per stage: its layers and what it sends where."""
        lines = []
        for s in range(self.k):
            sends = ", ".join(f"{e.name}->{e.dst}" for e in self.outputs(s)) or "nothing"
            lines.append(f"stage {s}: layers {self.bounds[s]}-{self.bounds[s + 1] - 1}, sends {sends}")
        return "\n".join(lines)


class Crossings:
    """Bytes of every tensor that enters or leaves a stage holding layers a..b-1: `crossings(a, b)`.

    A stage receives the activation before its first layer and sends the one after
    its last, and exchanges each skip connection with one end inside it and the
    other outside. That depends on a and b only, not on the other stages.
    """

    def __init__(self, model: UNet, image_shape: tuple[int, ...], batch: int = 1):
        outputs, skip_shapes = trace_shapes(model, image_shape)
        size = next(model.parameters()).element_size() * batch
        self.n = len(model.layers)
        self.activation = [torch.Size(shape).numel() * size for shape in outputs]
        made = {layer.saves: i for i, layer in enumerate(model.layers) if layer.saves}
        self.skips = [
            (made[layer.uses], j, torch.Size(skip_shapes[layer.uses]).numel() * size)
            for j, layer in enumerate(model.layers)
            if layer.uses
        ]

    def __call__(self, a: int, b: int) -> list[int]:
        sizes = ([self.activation[a - 1]] if a > 0 else []) + ([self.activation[b - 1]] if b < self.n else [])
        return sizes + [nbytes for p, q, nbytes in self.skips if (a <= p < b) != (a <= q < b)]
