"""Checks of lab 18 (low precision across ranks).

- `check_loss_scale_step(fn)`: fn(comm, grads, state) -> (unscaled or None, new state): one decision
  for every rank (skip and back off when any rank's gradients hold an inf or a NaN, else unscale in
  float32 and grow after `interval` clean steps); only MPI's Allreduce / allreduce; float32 and
  float16 gradients; `grads` left alone, new tensors returned.
- `check_quantize_float8(fn)`: fn(x, dtype, block, amax=None) -> (q, scale): per tensor, 1 x 128 tiles,
  128 x 128 blocks and uneven blocks, E4M3 and E5M2, with each block's own amax and with a smaller
  (delayed) amax that makes values saturate; `x` left alone.
- `check_float8_allgather(fn)`: fn(comm, mine, bounds, dtype, allgather) -> float32 array: every shard
  cast with its own scale, gathered as float8 bytes with the scales; values as a local cast; no more
  bytes than half of bfloat16's gather plus the scales; `mine` left alone.
- `check_reduce_scatter_rounded(fn)`: fn(comm, x, bounds, dtype) -> rank r's chunk of the sum with every
  partial sum rounded to dtype (bfloat16 or float32) and sent in it: results representable in dtype,
  within Higham's bound, in the ring's bytes of dtype; `x` left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

from ..allreduce import allgather_ring
from ..precision.float8 import FORMATS, block_amax, dequantize, fmax, grid, quantize_float8
from ..precision.gather import bfloat16_allgather
from ..precision.reduction import UNIT_ROUNDOFF, WIRE
from ..precision.scaling import LossScale
from ..runtime.blocks import block_bounds
from ._core import NOTHING_SENT, count, deadline, each_size, fail_together, passed, reordered_hint, run_counted
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

#: Mantissa bits and smallest normal of each float8 format (the spacing of its values).
_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def _step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of float8 values around each of `values` (in float8 units, before scaling)."""
    tiny = float(torch.finfo(dtype).smallest_normal)
    exponent = torch.floor(torch.log2(values.abs().clamp_min(tiny)))
    return torch.pow(2.0, exponent - _MANTISSA[dtype])


def _sizes(comm: MPI.Comm, draw: Draw | None) -> list[int]:
    """The rank counts a check runs on: the world's first (an answer on the notebook's `comm` shows there), then
    every smaller one; under the grader's draw, the world's and one smaller drawn (drawn ranks, so a draw costs less
    than the notebook's run)."""
    size = comm.Get_size()
    if draw is None or size == 1:
        return [size, *range(1, size)]
    return [size, draw.integer(1, size - 1, "ranks")]


def _float8_problem(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> str | None:
    """None if the float8 values `got` are within one step of `want` everywhere (both float32, unscaled)."""
    if bool(torch.isnan(got).any()) or bool(torch.isinf(got).any()):
        bad = int((~torch.isfinite(got)).sum())
        return (
            f"{what} holds {bad} NaN or inf values: values beyond fmax must saturate (clamp to +-fmax before the "
            "cast; E4M3 turns an overflow into NaN)"
        )
    off = (got - want).abs() > _step(want, dtype)
    if bool(off.any()):
        i = int(torch.nonzero(off.reshape(-1))[0])
        return (
            f"{what} is wrong at {int(off.sum())} of {want.numel()} elements: [{i}] got {float(got.reshape(-1)[i])} "
            f"expected {float(want.reshape(-1)[i])} (q = cast(clamp(x / scale, -fmax, fmax)), scale = amax / fmax)"
        )
    return None


# --- exercise 18.1 -------------------------------------------------------------------------------

#: (description, which rank's gradients overflow: "none", "last", "first", state before); overflows first, so an
#: answer whose ranks decide alone is named as such before anything else
_SCALER_CASES: list[tuple[str, str, LossScale]] = [
    ("an inf on the last rank only", "last", LossScale(scale=2.0**12, interval=3, good_steps=2, skipped=1)),
    ("a NaN on the first rank only", "first", LossScale(scale=3.0, factor=4.0, interval=5, good_steps=1)),
    ("all finite", "none", LossScale(scale=2.0**10, interval=3, good_steps=0, skipped=2)),
    ("all finite, the interval's last clean step", "none", LossScale(scale=2.0**10, interval=3, good_steps=2)),
    ("all finite, scale 3 (not a power of two)", "none", LossScale(scale=3.0, interval=5, good_steps=1)),
]

#: The notebook's gradients: three tensors of these shapes, the bad value at [2] of the second.
_SHAPES: list[tuple[int, ...]] = [(3, 4), (4,), (5,)]


@dataclass(frozen=True)
class _ScalerCase:
    """One case of 18.1's check: the state, the gradients' shapes and seed, and where a bad value sits."""

    description: str
    state: LossScale
    shapes: list[tuple[int, ...]]
    seed: int  # each rank's gradients are drawn from seed + rank
    bad_rank: int | None = None  # the rank whose gradients hold an inf or a NaN (None: all finite)
    bad: float = float("inf")
    at: tuple[int, int] = (1, 2)  # which tensor, which item of it (flat)


def _scaler_cases(size: int, draw: Draw | None) -> list[_ScalerCase]:
    """The notebook's five cases, or five the grader draws (ddlab.checks._draw): an inf and a NaN on drawn ranks,
    three finite (one the interval's last clean step); drawn scales, factors, intervals, counts, shapes and seeds."""
    if draw is None:
        bad_rank = {"last": size - 1, "first": 0, "none": None}
        return [
            _ScalerCase(d, state, _SHAPES, 100, bad_rank[where], float("nan") if where == "first" else float("inf"))
            for d, where, state in _SCALER_CASES
        ]
    cases = []
    for i, (what, bad) in enumerate(
        (("an inf", float("inf")), ("a NaN", float("nan")), ("", 0.0), ("", 0.0), ("", 0.0))
    ):
        interval = draw.integer(1, 8, "interval", size, i)
        good = interval - 1 if i == 3 else draw.integer(0, interval - 1, "good", size, i)
        power = draw.integer(0, 24, "power", size, i)
        scale = 2.0**power if i != 4 else draw.integer(3, 2**power + 3, "odd", size, i) + 0.5  # not a power of two
        factor = (2.0, 4.0, 1.5, 3.0)[draw.integer(0, 3, "factor", size, i)]
        state = LossScale(scale, factor, interval, good, draw.integer(0, 9, "skipped", size, i))
        shapes = [
            tuple(draw.integer(1, 6, "dim", size, i, t, d) for d in range(draw.integer(0, 2, "ndim", size, i, t)))
            for t in range(draw.integer(1, 4, "tensors", size, i))
        ]
        seed = draw.data_seed("grads", size, i)
        if bad:
            tensor = draw.integer(0, len(shapes) - 1, "bad tensor", size, i)
            item = draw.integer(0, math.prod(shapes[tensor]) - 1, "bad item", size, i)
            rank = draw.integer(0, size - 1, "bad rank", size, i)
            description = f"{what} on rank {rank} only, in tensor {tensor} at item {item}"
            cases.append(_ScalerCase(description, state, shapes, seed, rank, bad, (tensor, item)))
        else:
            last = ", the interval's last clean step" if i == 3 else ""
            cases.append(_ScalerCase(f"all finite{last}", state, shapes, seed))
    return cases


def _expected(state: LossScale, overflow: bool) -> LossScale:
    if overflow:
        return LossScale(state.scale / state.factor, state.factor, state.interval, 0, state.skipped + 1)
    if state.good_steps + 1 == state.interval:
        return LossScale(state.scale * state.factor, state.factor, state.interval, 0, state.skipped)
    return LossScale(state.scale, state.factor, state.interval, state.good_steps + 1, state.skipped)


def _grads(rank: int, case: _ScalerCase, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(case.seed + rank)
    grads = [(torch.randn(shape, generator=generator) * 50).to(dtype) for shape in case.shapes]
    if case.bad_rank == rank:
        tensor, item = case.at
        grads[tensor].view(-1)[item] = case.bad
    return grads


def _scaler_problem(
    got: Any, grads: list[torch.Tensor], before: list[torch.Tensor], state: LossScale, overflow: bool
) -> str | None:
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"return a pair (unscaled or None, new state), got {type(got).__name__}"
    unscaled, new = got
    for g, b in zip(grads, before):
        if not torch.equal(g, b) and not (torch.isnan(g).any() and torch.equal(g.nan_to_num(), b.nan_to_num())):
            return "`grads` was changed: return new tensors (the caller may need the scaled gradients)"
    if not isinstance(new, LossScale):
        return f"the new state should be a LossScale, got {type(new).__name__}"
    want = _expected(state, overflow)
    if new != want:
        return f"the new state is {new}, expected {want}"
    if overflow:
        return None if unscaled is None else "some rank's gradients overflowed: return None (skip the step)"
    if not isinstance(unscaled, list) or len(unscaled) != len(grads):
        return f"return a list of {len(grads)} unscaled tensors, got {type(unscaled).__name__}"
    for i, (u, g) in enumerate(zip(unscaled, before)):
        if not isinstance(u, torch.Tensor) or u.dtype != torch.float32 or u.shape != g.shape:
            what = f"{u.dtype}, shape {tuple(u.shape)}" if isinstance(u, torch.Tensor) else type(u).__name__
            return (
                f"unscaled gradient {i} should be a float32 tensor of shape {tuple(g.shape)}, got {what} "
                "(unscale in float32: a float16 gradient divided by S in float16 underflows)"
            )
        if any(u.untyped_storage().data_ptr() == h.untyped_storage().data_ptr() for h in grads):
            return f"unscaled gradient {i} shares memory with a gradient passed in: return new tensors"
        if not torch.allclose(u, g.float() / state.scale, rtol=1e-6, atol=0):
            return f"unscaled gradient {i} is not grad / scale (scale {state.scale}): divide by the scale, in float32"
    return None


def check_loss_scale_step(
    fn: Callable[[Any, list[torch.Tensor], LossScale], tuple[list[torch.Tensor] | None, LossScale]],
    timeout: float = 20.0,
) -> None:
    """fn(comm, grads, state) -> (unscaled or None, new state), one decision agreed by every rank.

    The grader's draw: the world's ranks and one smaller count of drawn ranks (_sizes), and five cases per count:
    an inf and a NaN on a drawn rank (in a drawn tensor and item), three all finite (one the interval's last clean
    step, one a scale not a power of two); drawn scales, factors (2, 4, 1.5, 3), intervals (1 to 8), clean steps,
    skips, 1 to 4 gradients of drawn shapes (0 to 2 dimensions) and their seed; float32 and float16 gradients, as
    the lab states."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "loss_scale_step")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        hint = reordered_hint(sub, comm) if draw is None else ""  # under a draw, each_size names the ranks
        for case in _scaler_cases(size, draw):
            state = case.state
            for dtype in (torch.float32, torch.float16):
                drawn = "" if draw is None else f", {state}, gradients of shapes {case.shapes}, seed {case.seed}"
                context = (
                    f"loss_scale_step ({case.description}, {str(dtype).removeprefix('torch.')} gradients{drawn})"
                    f"{named(draw)}"
                )
                grads = _grads(rank, case, dtype)
                before = [g.clone() for g in grads]
                got, traffic = run_counted(sub, fn, (grads, state), context, timeout, allow=("Allreduce", "allreduce"))
                decisions = sub.allgather(isinstance(got, tuple) and len(got) == 2 and got[0] is None)
                if len(set(decisions)) > 1:
                    skipped = [r for r, d in enumerate(decisions) if d]
                    stepped = [r for r, d in enumerate(decisions) if not d]
                    fail_together(
                        sub,
                        f"{context}: the ranks decided alone: {count(len(skipped), 'rank')} {skipped} skipped while "
                        f"{count(len(stepped), 'rank')} {stepped} stepped; agree with one small allreduce of "
                        "'my gradients are finite' (MPI.LAND, or a MIN of 0/1)",
                        "loss_scale_step",
                        hint,
                    )
                problem = _scaler_problem(got, grads, before, state, case.bad_rank is not None)
                if problem is None and size > 1 and not any(t.calls for t in traffic):
                    problem = NOTHING_SENT.replace("no message went", "no allreduce went")
                fail_together(sub, problem and f"{context}: {problem}", "loss_scale_step", hint)
        return None

    sizes = _sizes(comm, draw)
    each_size(comm, body, "loss_scale_step", sizes=sizes, reordered=True, draw=draw)
    passed(
        comm,
        f"loss_scale_step: every rank skips and backs off together, unscales in float32, grows on time{named(draw)}",
    )


# --- exercise 18.2 -------------------------------------------------------------------------------


def _cast_cases(draw: Draw | None = None) -> list[tuple[str, torch.Tensor, tuple[int, int], float]]:
    """(description, x, block, delayed: 0 for each block's own amax, else the divisor of its own that gives the
    delayed one) of exercise 18.2's check: the notebook's, or the grader's draw (ddlab.checks._draw): a tensor of
    drawn shape (up to 96 x 300) with columns of drawn magnitudes and an outlier, cast per tensor, in 1 x bn tiles,
    in bm x bn blocks, delayed per tensor and per tile (drawn divisors from 1.5 to 8), and drawn blocks of a small
    tensor (up to 12 x 16) with a block of zeros; sizes, blocks and data drawn."""
    if draw is None:
        generator = torch.Generator().manual_seed(18)
        wide = torch.randn(130, 260, generator=generator) * torch.logspace(-3, 2, 260)  # columns of very unlike size
        wide[5, 7] = 3000.0  # an outlier
        uneven = torch.randn(7, 11, generator=generator)
        uneven[:3, :4] = 0.0  # a block of zeros: its scale is 1
        return [
            ("per tensor", wide, (130, 260), 0.0),
            ("1 x 128 tiles", wide, (1, 128), 0.0),
            ("128 x 128 blocks (the last ones short)", wide, (128, 128), 0.0),
            ("3 x 4 blocks of a 7 x 11 tensor with a block of zeros", uneven, (3, 4), 0.0),
            ("per tensor, a delayed amax half the tensor's own (values saturate)", wide, (130, 260), 2.0),
            ("1 x 128 tiles, delayed amaxes a quarter of their own", wide, (1, 128), 4.0),
        ]
    generator = torch.Generator().manual_seed(draw.data_seed("x"))
    m, n = draw.integer(2, 96, "m"), draw.integer(2, 300, "n")
    low, high = -draw.integer(0, 4, "low"), draw.integer(0, 3, "high")
    wide = torch.randn(m, n, generator=generator) * torch.logspace(low, high, n)
    wide[draw.integer(0, m - 1, "row"), draw.integer(0, n - 1, "column")] = float(draw.integer(500, 5000, "outlier"))
    tile = (1, draw.integer(2, 160, "tile"))
    square = (draw.integer(2, 128, "bm"), draw.integer(2, 128, "bn"))
    um, un = draw.integer(1, 12, "um"), draw.integer(1, 16, "un")
    uneven = torch.randn(um, un, generator=generator)
    small = (draw.integer(1, um, "small bm"), draw.integer(1, un, "small bn"))
    zero = (draw.integer(0, -(-um // small[0]) - 1, "zero row"), draw.integer(0, -(-un // small[1]) - 1, "zero col"))
    uneven[zero[0] * small[0] : (zero[0] + 1) * small[0], zero[1] * small[1] : (zero[1] + 1) * small[1]] = 0.0
    whole, per_tile = draw.integer(3, 8, "whole") / 2, draw.integer(4, 16, "per tile") / 2
    shape = f"a {m} x {n} tensor, columns from 1e{low} to 1e{high}"
    return [
        (f"per tensor, {shape}", wide, (m, n), 0.0),
        (f"{tile[0]} x {tile[1]} tiles, {shape}", wide, tile, 0.0),
        (f"{square[0]} x {square[1]} blocks, {shape}", wide, square, 0.0),
        (f"{small[0]} x {small[1]} blocks of a {um} x {un} tensor, block {zero} all zeros", uneven, small, 0.0),
        (f"per tensor, {shape}, a delayed amax 1/{whole:g} of the tensor's own", wide, (m, n), whole),
        (f"{tile[0]} x {tile[1]} tiles, {shape}, delayed amaxes 1/{per_tile:g} of their own", wide, tile, per_tile),
    ]


def check_quantize_float8(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], timeout: float = 20.0) -> None:
    """fn(x, dtype, block, amax=None) -> (q, scale): x cast to float8 with one scale per block.

    The grader's draw: the tensors' shapes, magnitudes and data, the tiles, blocks and delayed amaxes (see
    _cast_cases), in both float8 formats, as the lab states; the same on every rank (each casts alone)."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "quantize_float8")
    problem, context = None, "quantize_float8"
    try:
        for description, x, block, delayed in _cast_cases(draw):
            for dtype in FORMATS:
                context = (
                    f"quantize_float8 ({description}, {str(dtype).removeprefix('torch.')}, block {block}){named(draw)}"
                )
                amax = block_amax(x, block) / delayed if delayed else None
                want_q, want_scale = quantize_float8(x, dtype, block, None if amax is None else amax.clone())
                before = x.clone()
                args = (x, dtype, block) if amax is None else (x, dtype, block, amax.clone())
                with deadline(timeout, context):
                    got = fn(*args)
                problem = _cast_problem(got, x, before, dtype, block, want_q, want_scale)
                if problem is not None:
                    problem = f"{context}: {problem}"
                    break
            if problem is not None:
                break
    except CheckFailed as err:
        problem = str(err)
    except NotImplementedError:
        raise
    except Exception as err:  # the student's code failed
        problem = f"quantize_float8 raised {type(err).__name__}: {err}" + ("" if draw is None else f", in {context}")
    fail_together(comm, problem, "quantize_float8")
    passed(
        comm,
        f"quantize_float8: per tensor, per tile, per block and delayed, saturating, in both float8 formats{named(draw)}",
    )


def _cast_problem(
    got: Any,
    x: torch.Tensor,
    before: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int],
    want_q: torch.Tensor,
    want_scale: torch.Tensor,
) -> str | None:
    if not torch.equal(x, before):
        return "x was changed: cast a copy (the caller still needs the float32 tensor)"
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return "return a pair of tensors (q, scale)"
    q, scale = got
    if q.dtype != dtype or q.shape != x.shape:
        return f"q should be {dtype} of shape {tuple(x.shape)}, got {q.dtype} of shape {tuple(q.shape)}"
    if scale.dtype != torch.float32 or tuple(scale.shape) != grid(tuple(x.shape), block):
        return (
            f"scale should be float32 of shape {grid(tuple(x.shape), block)} (one per block), "
            f"got {scale.dtype} of shape {tuple(scale.shape)}"
        )
    if not torch.allclose(scale, want_scale, rtol=1e-6, atol=0):
        i = int(torch.nonzero(~torch.isclose(scale, want_scale, rtol=1e-6, atol=0).reshape(-1))[0])
        return (
            f"scale is wrong at block {i}: got {float(scale.reshape(-1)[i])} expected {float(want_scale.reshape(-1)[i])} "
            f"(scale = amax / fmax, fmax = {fmax(dtype)}; 1 for a block of zeros)"
        )
    return _float8_problem(q.float(), want_q.float(), dtype, "q")


# --- exercise 18.3 -------------------------------------------------------------------------------


def _gather_cases(size: int, draw: Draw | None = None, what: str = "") -> list[tuple[str, list[int]]]:
    """(description, bounds) of 18.3's and 18.4's checks: the notebook's equal and uneven shards, or the grader's
    draw: equal shards of 1 to 60 items, and uneven ones of 0 to 60 with an empty one on a drawn rank."""
    if draw is None:
        equal = 40
        uneven = [*block_bounds(37 * size - 5, size - 1), 37 * size - 5] if size > 1 else [0, 37]
        return [
            (f"shards of {equal}", [r * equal for r in range(size + 1)]),
            (f"{uneven[-1]} items, uneven shards", uneven),
        ]
    equal = draw.integer(1, 60, what, "equal", size)
    lengths = [draw.integer(0, 60, what, "uneven", size, r) for r in range(size)]
    if size > 1:
        lengths[draw.integer(0, size - 1, what, "empty", size)] = 0
    if not any(lengths):
        lengths[0] = draw.integer(1, 60, what, "first", size)
    return [
        (f"shards of {equal}", [r * equal for r in range(size + 1)]),
        (f"uneven shards of {lengths} items", [sum(lengths[:r]) for r in range(size + 1)]),
    ]


def _shards(bounds: list[int], size: int, draw: Draw | None = None) -> tuple[torch.Tensor, str]:
    """A flat buffer whose shards have very different magnitudes (each needs its own scale), one of them zero;
    and what the grader drew for it ("" without a draw: 10^(2 - r) on rank r, the last rank's zero)."""
    if draw is None:
        seed, exponents, zero = bounds[-1], [2 - r for r in range(size)], size - 1
    else:
        seed = draw.data_seed("shards", *bounds)
        exponents = [draw.integer(-4, 4, "exponent", *bounds, r) for r in range(size)]
        zero = draw.integer(0, size - 1, "zero", *bounds)
    full = torch.randn(bounds[-1], generator=torch.Generator().manual_seed(seed))
    for r in range(size):
        full[bounds[r] : bounds[r + 1]] *= 10.0 ** exponents[r]
    if size > 2:
        full[bounds[zero] : bounds[zero + 1]] = 0.0
    if draw is None:
        return full, ""
    zeroed = f", rank {zero}'s all zero" if size > 2 else ""
    return full, f", magnitudes 1e{exponents} by rank{zeroed}, data seed {seed}"


def check_float8_allgather(fn: Callable[..., np.ndarray], timeout: float = 20.0) -> None:
    """fn(comm, mine, bounds, dtype, allgather) -> a float32 array: the shards gathered as float8 with their scales.

    The grader's draw: the world's ranks and one smaller count of drawn ranks (_sizes), equal and uneven shard
    lengths (an empty shard on a drawn rank), each rank's magnitude (1e-4 to 1e4), which rank's shard is all zero,
    the data's seed; both float8 formats, as the lab states."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "float8_allgather")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        hint = reordered_hint(sub, comm) if draw is None else ""  # under a draw, each_size names the ranks
        for description, bounds in _gather_cases(size, draw, "gather"):
            full, drawn = _shards(bounds, size, draw)
            for dtype in FORMATS:
                context = f"float8_allgather ({description}, {str(dtype).removeprefix('torch.')}{drawn}){named(draw)}"
                mine = full[bounds[rank] : bounds[rank + 1]].numpy().copy()
                before = mine.copy()
                got, traffic = run_counted(sub, fn, (mine, list(bounds), dtype, allgather_ring), context, timeout)
                _, bf16 = run_counted(sub, bfloat16_allgather, (before.copy(), list(bounds), allgather_ring), "bf16")
                problem = _gathered_problem(got, mine, before, full, bounds, dtype)
                sent, half = sum(t.bytes_sent for t in traffic), sum(t.bytes_sent for t in bf16) // 2
                limit = half + 4 * size * (size - 1) + 64
                if problem is None and size > 1 and sent == 0:
                    problem = NOTHING_SENT
                elif problem is None and sent > limit:
                    problem = (
                        f"the ranks sent {sent} bytes, bfloat16's gather sends {2 * half}: a float8 gather sends one "
                        f"byte per item (half of bfloat16's, {half}) plus one float32 scale per rank ({limit} at most); "
                        "send q's bytes (q.view(torch.uint8)), not the float32 or bfloat16 shard"
                    )
                fail_together(sub, problem and f"{context}: {problem}", "float8_allgather", hint)
        return None

    sizes = _sizes(comm, draw)
    each_size(comm, body, "float8_allgather", sizes=sizes, reordered=True, draw=draw)
    passed(
        comm, f"float8_allgather: each shard cast with its own scale, one byte per item plus the scales{named(draw)}"
    )


def _gathered_problem(
    got: Any, mine: np.ndarray, before: np.ndarray, full: torch.Tensor, bounds: list[int], dtype: torch.dtype
) -> str | None:
    if not np.array_equal(mine, before):
        return "`mine` was changed: cast a copy (the rank still needs its float32 shard)"
    if not isinstance(got, np.ndarray) or got.dtype != np.float32 or got.shape != (bounds[-1],):
        what = f"{got.dtype} of shape {got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
        return f"return a new float32 NumPy array of {bounds[-1]} items, got {what}"
    if np.shares_memory(got, mine):
        return "the result shares memory with `mine`: return a new array"
    for r in range(len(bounds) - 1):
        piece = full[bounds[r] : bounds[r + 1]].view(1, -1)
        if piece.numel() == 0:
            continue
        q, scale = quantize_float8(piece, dtype, (1, piece.numel()))
        want = dequantize(q, scale, (1, piece.numel())).view(-1)
        mine_got = torch.from_numpy(got[bounds[r] : bounds[r + 1]].copy())
        problem = _float8_problem(mine_got / float(scale), want / float(scale), dtype, f"rank {r}'s shard")
        if problem is not None:
            return problem + " (did its scale travel with it? rank r's values are q * rank r's scale)"
    return None


# --- exercise 18.4 -------------------------------------------------------------------------------


def check_reduce_scatter_rounded(fn: Callable[..., np.ndarray], timeout: float = 20.0) -> None:
    """fn(comm, x, bounds, dtype) -> rank r's chunk of the sum, each partial sum rounded to dtype and sent in it.

    The grader's draw: the world's ranks and one smaller count of drawn ranks (_sizes), equal and uneven chunk
    lengths (an empty chunk on a drawn rank), the values' range (positive) and seed; bfloat16 and float32, as the
    lab states."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "reduce_scatter_rounded")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        hint = reordered_hint(sub, comm) if draw is None else ""  # under a draw, each_size names the ranks
        for description, bounds in _gather_cases(size, draw, "reduce"):
            seed, low, high = _summands(bounds, draw)
            drawn = "" if draw is None else f", values in [{low:g}, {high:g}), data seed {seed}"
            for dtype in (torch.bfloat16, torch.float32):
                context = (
                    f"reduce_scatter_rounded ({description}, {str(dtype).removeprefix('torch.')}{drawn}){named(draw)}"
                )
                x = np.random.default_rng([seed, rank]).uniform(low, high, bounds[-1]).astype(np.float32)
                before = x.copy()
                got, traffic = run_counted(sub, fn, (x, list(bounds), dtype), context, timeout)
                exact = np.empty(bounds[-1], dtype=np.float64)
                sub.Allreduce(before.astype(np.float64), exact, op=MPI.SUM)
                problem = _rounded_problem(got, x, before, exact, bounds, rank, size, dtype)
                sent = sum(t.bytes_sent for t in traffic)
                ring = (size - 1) * bounds[-1] * torch.tensor([], dtype=WIRE[dtype]).element_size()
                if problem is None and size > 1 and sent == 0:
                    problem = NOTHING_SENT
                elif problem is None and sent > ring * 1.05 + 64:
                    problem = (
                        f"the ranks sent {sent} bytes, the ring sends {ring} in {dtype}: send each partial sum "
                        "once, in dtype (bfloat16 as its int16 bits: t.view(torch.int16).numpy())"
                    )
                fail_together(sub, problem and f"{context}: {problem}", "reduce_scatter_rounded", hint)
        return None

    sizes = _sizes(comm, draw)
    each_size(comm, body, "reduce_scatter_rounded", sizes=sizes, reordered=True, draw=draw)
    passed(
        comm,
        "reduce_scatter_rounded: sums rounded to bfloat16 or float32 at every hop, within the bound, in its bytes"
        + named(draw),
    )


def _summands(bounds: list[int], draw: Draw | None) -> tuple[int, float, float]:
    """(data seed, low, high): each rank's x is uniform in [low, high) from (seed, rank); positive, so that the
    bound's sum of |x_i| is the sum. The notebook's (the length, 0.5, 1.5), or drawn (low 0.01 to 2, high up to 50x)."""
    if draw is None:
        return bounds[-1], 0.5, 1.5
    low = draw.integer(1, 200, "low", *bounds) / 100
    return draw.data_seed("x", *bounds), low, low * draw.integer(2, 50, "spread", *bounds)


def _rounded_problem(
    got: Any,
    x: np.ndarray,
    before: np.ndarray,
    exact: np.ndarray,
    bounds: list[int],
    rank: int,
    size: int,
    dtype: torch.dtype,
) -> str | None:
    if not np.array_equal(x, before):
        return "x was changed: work on copies of its chunks"
    n = bounds[rank + 1] - bounds[rank]
    if not isinstance(got, np.ndarray) or got.dtype != np.float32 or got.shape != (n,):
        what = f"{got.dtype} of shape {got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
        return f"return a new float32 NumPy array of {n} items (rank {rank}'s chunk), got {what}"
    if np.shares_memory(got, x):
        return "the result shares memory with x: return a new array"
    representable = torch.from_numpy(got.copy()).to(dtype).float().numpy()
    if not np.array_equal(got, representable):
        return f"the sums are not {dtype} values: round every partial sum to {dtype} (t.to({dtype}))"
    pu = size * UNIT_ROUNDOFF[dtype]
    bound = pu / (1 - pu) * exact[bounds[rank] : bounds[rank + 1]]  # the inputs are positive: sum |x_i| = sum x_i
    off = np.abs(got - exact[bounds[rank] : bounds[rank + 1]]) > bound
    if off.any():
        i = int(np.flatnonzero(off)[0])
        return (
            f"the sum is wrong at {int(off.sum())} of {n} elements: [{i}] got {got[i]} expected "
            f"{exact[bounds[rank] + i]:.6g} within {bound[i]:.3g} (P u / (1 - P u) of the sum of |x_i|)"
        )
    return None
