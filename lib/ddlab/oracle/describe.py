"""A model as the oracle sees it: per layer, FLOPs, parameter bytes, saved activations, shapes.

`describe(model, sample_shape)` runs one forward pass of a real `torch.nn` model on a
batch of one zero sample and records, for every call of a leaf module (a module with no
children: Conv2d, Linear, ReLU, a UNet `Down` ...), in call order:

- FLOPs of its forward pass, from its type and shapes (a multiply-add counts 2), and of
  its backward: twice the forward for layers with weights (the gradient of the input
  and of the weights each cost one forward), once for the others;
- bytes of its own parameters;
- bytes autograd saves for backward while it and the functional operations after it
  run (ReLU after a convolution, a residual add, a concatenation), counted by the lab
  06 `Ledger`, each storage once: the same count the ledger makes in a real run;
- its input and output shapes (one sample), the halo rows a convolution reads
  from neighbouring rows (k // 2 for a k x k kernel), and whether its input was
  already saved by an earlier layer (a stage that receives it holds a copy of its own).

Everything is per sample: the oracle multiplies by the samples a rank holds.
`profile_seconds` adds measured compute seconds per layer (ParaDL too profiles each
layer's compute time per sample on the target device: Kahira, Nguyen et al., "A
Model-driven Analysis of the Practical Limits of Large-scale DNN Training", technical
report, sec. IV).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from ..runtime.memory import Ledger

LossFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerInfo:
    """One call of a leaf module, for one sample."""

    name: str
    kind: str
    flops_forward: float
    flops_backward: float
    parameter_bytes: int
    activation_bytes: int
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    itemsize: int
    halo: int = 0  # rows a convolution reads beyond its own on each side (k // 2)
    input_saved_before: bool = False  # its input was already saved by an earlier layer (then not counted here)
    seconds_forward: float = 0.0  # measured compute per sample (0: not measured)
    seconds_backward: float = 0.0

    @property
    def input_bytes(self) -> int:
        return math.prod(self.input_shape) * self.itemsize

    @property
    def output_bytes(self) -> int:
        return math.prod(self.output_shape) * self.itemsize

    @property
    def has_weights(self) -> bool:
        return self.parameter_bytes > 0


@dataclass(frozen=True)
class ModelInfo:
    """A model's layers in call order, for samples of `sample_shape`; `update_seconds`: one optimizer step."""

    name: str
    sample_shape: tuple[int, ...]
    layers: tuple[LayerInfo, ...]
    update_seconds: float = 0.0
    profiled: bool = False

    @property
    def parameter_bytes(self) -> int:
        return sum(layer.parameter_bytes for layer in self.layers)

    @property
    def activation_bytes(self) -> int:
        """Saved for backward, per sample."""
        return sum(layer.activation_bytes for layer in self.layers)

    @property
    def flops(self) -> float:
        """Forward plus backward FLOPs per sample."""
        return sum(layer.flops_forward + layer.flops_backward for layer in self.layers)

    def step_seconds(self, samples: float) -> float:
        """Profiled seconds of a step on `samples` samples: the layers' forward and backward, and the update."""
        return (
            samples * sum(layer.seconds_forward + layer.seconds_backward for layer in self.layers) + self.update_seconds
        )

    def scaled(self, factor: float) -> ModelInfo:
        """The same model with every profiled time (layers and update) multiplied by factor."""
        layers = tuple(
            replace(
                layer, seconds_forward=layer.seconds_forward * factor, seconds_backward=layer.seconds_backward * factor
            )
            for layer in self.layers
        )
        return replace(self, layers=layers, update_seconds=self.update_seconds * factor)

    def at_side(self, side: int) -> ModelInfo:
        """The same model for square images of `side` (sample_shape (C, H, H)), without tracing again.

        Layers on feature maps scale their FLOPs, activations and shapes with the area; the
        layers after global pooling stay as they are. Exact for convolutions and pooling
        up to rounding at odd sizes; compute seconds scale with the FLOPs.
        """
        if len(self.sample_shape) != 3:
            raise ValueError(f"at_side needs images (C, H, W), this model takes {self.sample_shape}")
        factor = side / self.sample_shape[1]
        area = factor * factor

        def grow(shape: tuple[int, ...]) -> tuple[int, ...]:
            return (
                shape
                if len(shape) != 3
                else (shape[0], max(1, round(shape[1] * factor)), max(1, round(shape[2] * factor)))
            )

        layers = []
        for layer in self.layers:
            k = area if len(layer.input_shape) == 3 and layer.input_shape[1] > 1 else 1.0
            layers.append(
                replace(
                    layer,
                    flops_forward=layer.flops_forward * k,
                    flops_backward=layer.flops_backward * k,
                    activation_bytes=round(layer.activation_bytes * k),
                    seconds_forward=layer.seconds_forward * k,
                    seconds_backward=layer.seconds_backward * k,
                    input_shape=grow(layer.input_shape),
                    output_shape=grow(layer.output_shape),
                )
            )
        return replace(self, sample_shape=grow(self.sample_shape), layers=tuple(layers))


def _flops(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward FLOPs of module on input x giving y (one sample each)."""
    if isinstance(module, nn.Linear):
        rows = y.numel() // module.out_features
        return rows * module.out_features * (2 * module.in_features + (module.bias is not None))
    if isinstance(module, nn.Conv2d):
        per_output = 2 * module.in_channels // module.groups * math.prod(module.kernel_size)
        return y.numel() * (per_output + (module.bias is not None))
    if isinstance(module, nn.ConvTranspose2d):
        per_input = 2 * module.out_channels // module.groups * math.prod(module.kernel_size)
        return x.numel() * per_input + (y.numel() if module.bias is not None else 0)
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        return 4 * y.numel()  # subtract mean, divide by deviation, scale, shift
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):
        k = module.kernel_size if isinstance(module.kernel_size, int) else math.prod(module.kernel_size)
        return y.numel() * (k * k if isinstance(module.kernel_size, int) else k)
    if isinstance(module, (nn.Flatten, nn.Identity, nn.Dropout)):
        return 0
    return x.numel()  # elementwise (ReLU, adaptive pooling, the UNet's Down): one operation per input


def _halo(module: nn.Module) -> int:
    if isinstance(module, nn.Conv2d):
        return module.kernel_size[0] // 2
    return 0


def _first_tensor(value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next(_first_tensor(v) for v in value if isinstance(v, (torch.Tensor, tuple, list)))
    raise TypeError(f"cannot find a tensor in {type(value).__name__}")


def describe(
    model: nn.Module,
    sample_shape: tuple[int, ...],
    name: str = "",
    loss: LossFn | None = None,
    dtype: torch.dtype | None = None,
) -> ModelInfo:
    """Trace one forward pass of model on one zero sample of sample_shape; see the module docstring.

    `loss(output)`, if given, runs inside the trace; what it saves goes to the last layer.
    The model is not changed (hooks are removed; no gradients are kept).
    """
    dtype = dtype or next(model.parameters()).dtype
    names = {module: path for path, module in model.named_modules()}
    leaves = [m for m in model.modules() if not list(m.children()) and not isinstance(m, nn.Sequential)]
    calls: list[dict] = []
    ledger = Ledger()
    ledger.ignore(model)
    counted: set[int] = set()

    def before(module: nn.Module, args: tuple) -> None:
        if calls:
            calls[-1]["saved_end"] = ledger.used["activations"]
        x = _first_tensor(args)
        seen = x.untyped_storage().data_ptr() in ledger._live
        calls.append({"module": module, "saved_start": ledger.used["activations"], "x": x, "seen": seen})

    def after(module: nn.Module, args: tuple, output: object) -> None:
        calls[-1]["y"] = _first_tensor(output)

    hooks = [h for leaf in leaves for h in (leaf.register_forward_pre_hook(before), leaf.register_forward_hook(after))]
    try:
        with ledger.activations():
            x = torch.zeros(1, *sample_shape, dtype=dtype, requires_grad=False)
            out = model(x)
            if loss is not None:
                out = loss(out)
            if calls:
                calls[-1]["saved_end"] = ledger.used["activations"]
    finally:
        for hook in hooks:
            hook.remove()
    layers = []
    for call in calls:
        module, x, y = call["module"], call["x"], call["y"]
        fwd = float(_flops(module, x[0], y[0]))
        params = (
            0 if id(module) in counted else sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        )
        counted.add(id(module))
        layers.append(
            LayerInfo(
                name=f"{names.get(module, '?')}",
                kind=type(module).__name__,
                flops_forward=fwd,
                flops_backward=fwd * (2 if params else 1),
                parameter_bytes=params,
                activation_bytes=call["saved_end"] - call["saved_start"],
                input_shape=tuple(x.shape[1:]),
                output_shape=tuple(y.shape[1:]),
                itemsize=y.element_size(),
                halo=_halo(module),
                input_saved_before=call["seen"],
            )
        )
    del out
    return ModelInfo(name or type(model).__name__, tuple(sample_shape), tuple(layers))


def profile_seconds(
    info: ModelInfo,
    model: nn.Module,
    batch: torch.Tensor,
    loss: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
) -> ModelInfo:
    """info with measured compute seconds per layer and sample, for this batch, on this process.

    Each leaf's forward time is the wall-clock time from its start to the next leaf's
    start; the backward of the whole model is timed once and shared out in proportion
    to the layers' backward FLOPs. The median of `repeats` steps counts (the wall clock
    and the median, as the runs the predictions are compared with are timed; on a busy
    machine other programs slow both alike). The layers must be those `describe` found.
    """
    leaves = [m for m in model.modules() if not list(m.children()) and not isinstance(m, nn.Sequential)]
    n = len(info.layers)
    fwds: list[list[float]] = []
    bwds: list[float] = []
    updates: list[float] = []
    for repeat in range(repeats + 1):  # the first run pays for allocations
        stamps: list[float] = []
        hooks = [
            leaf.register_forward_pre_hook(lambda *_, stamps=stamps: stamps.append(time.perf_counter()))
            for leaf in leaves
        ]
        try:
            start = time.perf_counter()
            value = loss(model(batch))
            end = time.perf_counter()
        finally:
            for hook in hooks:
                hook.remove()
        if len(stamps) != n:
            raise ValueError(f"the model ran {len(stamps)} leaf modules but info has {n} layers: describe this model")
        stamps.append(end)
        start = time.perf_counter()
        value.backward()
        bwd = time.perf_counter() - start
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        update = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if repeat:
            fwds.append([t1 - t0 for t0, t1 in zip(stamps, stamps[1:])])
            bwds.append(bwd)
            updates.append(update)
    best_fwd = [statistics.median(column) for column in zip(*fwds)]
    best_bwd, best_update = statistics.median(bwds), statistics.median(updates)
    samples = batch.shape[0]
    total_flops = sum(layer.flops_backward for layer in info.layers) or 1.0
    layers = tuple(
        replace(
            layer, seconds_forward=f / samples, seconds_backward=best_bwd * layer.flops_backward / total_flops / samples
        )
        for layer, f in zip(info.layers, best_fwd)
    )
    return replace(info, layers=layers, update_seconds=best_update, profiled=True)
