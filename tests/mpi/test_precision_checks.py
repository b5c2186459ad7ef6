"""Lab 18's checks accept valid answers and fail the wrong ones issue 52 lists (item 5): a scaler whose ranks
decide alone, a cast without saturation or with the scale applied the wrong way, a gather that sends the float32
shard or drops the scales, every dtype the trainer passes, an input changed in place, and the library's own answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import precision
from ddlab.checks import (
    CheckFailed,
    check_float8_allgather,
    check_loss_scale_step,
    check_quantize_float8,
    check_reduce_scatter_rounded,
)
from ddlab.precision import LossScale
from mpi4py import MPI

SHORT_DEADLINE = {"timeout": 3.0}


def expect_failure(check, fn, *words: str) -> str:
    with pytest.raises(CheckFailed) as caught:
        check(fn)
    for word in words:
        assert word in str(caught.value), str(caught.value)
    return str(caught.value)


# --- 18.1 loss scaling ---------------------------------------------------------------------------


def scaler(comm, grads, state, *, agree=True, float32=True, in_place=False, grow_at=0):
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    if agree:
        flag = np.array([int(finite)], dtype=np.int32)
        everywhere = np.empty_like(flag)
        comm.Allreduce(flag, everywhere, op=MPI.MIN)
        finite = bool(everywhere[0])
    if not finite:
        return None, LossScale(state.scale / state.factor, state.factor, state.interval, 0, state.skipped + 1)
    if in_place:
        unscaled = [g.div_(state.scale) for g in grads]
    else:
        unscaled = [(g.float() if float32 else g) / state.scale for g in grads]
    good = state.good_steps + 1
    if good == state.interval + grow_at:
        return unscaled, LossScale(state.scale * state.factor, state.factor, state.interval, 0, state.skipped)
    return unscaled, LossScale(state.scale, state.factor, state.interval, good, state.skipped)


def scaler_object_allreduce(comm, grads, state):
    """Valid too: the object allreduce of one bool, and unscaling by multiplying with 1 / S."""
    finite = comm.allreduce(all(bool(torch.isfinite(g).all()) for g in grads), op=MPI.LAND)
    if not finite:
        return None, LossScale(state.scale / state.factor, state.factor, state.interval, 0, state.skipped + 1)
    inverse = 1.0 / state.scale
    grown = state.good_steps + 1 == state.interval
    new = LossScale(
        state.scale * state.factor if grown else state.scale,
        state.factor,
        state.interval,
        0 if grown else state.good_steps + 1,
        state.skipped,
    )
    return [g.to(torch.float32) * inverse for g in grads], new


def test_scaler_accepts_valid_answers():
    check_loss_scale_step(scaler)
    check_loss_scale_step(scaler_object_allreduce)


def test_scaler_whose_ranks_decide_alone_fails_naming_them():
    message = expect_failure(check_loss_scale_step, lambda c, g, s: scaler(c, g, s, agree=False), "decided alone")
    assert "[3] skipped" in message and "[0, 1, 2] stepped" in message, message


def test_scaler_that_unscales_in_float16_fails():
    expect_failure(check_loss_scale_step, lambda c, g, s: scaler(c, g, s, float32=False), "float16", "float32")


def test_scaler_that_applies_the_scale_the_wrong_way_fails():
    def multiplies(comm, grads, state):
        unscaled, new = scaler(comm, grads, state)
        return (None if unscaled is None else [u * state.scale * state.scale for u in unscaled]), new

    expect_failure(check_loss_scale_step, multiplies, "grad / scale")


def test_scaler_that_unscales_in_place_fails():
    expect_failure(check_loss_scale_step, lambda c, g, s: scaler(c, g, s, in_place=True), "changed")


def test_scaler_that_grows_late_fails():
    expect_failure(check_loss_scale_step, lambda c, g, s: scaler(c, g, s, grow_at=1), "new state")


def test_scaler_that_agrees_by_another_collective_fails():
    def by_allgather(comm, grads, state):
        if all(comm.allgather(all(bool(torch.isfinite(g).all()) for g in grads))):
            return scaler(MPI.COMM_SELF, grads, state)
        return None, LossScale(state.scale / state.factor, state.factor, state.interval, 0, state.skipped + 1)

    expect_failure(check_loss_scale_step, by_allgather, "comm.allgather", "Allreduce")


def test_scaler_on_the_notebooks_world_fails():
    expect_failure(check_loss_scale_step, lambda c, g, s: scaler(MPI.COMM_WORLD, g, s), "global")


def test_scaler_that_never_returns_fails_within_its_deadline():
    def hangs(comm, grads, state):
        if comm.Get_rank() == 0:
            comm.Recv(np.empty(1), source=1, tag=18)
        return scaler(comm, grads, state)

    with pytest.raises(CheckFailed):
        check_loss_scale_step(hangs, **SHORT_DEADLINE)


def test_scaler_that_delegates_to_the_library_fails():
    expect_failure(check_loss_scale_step, lambda *a: precision.loss_scale_step(*a), "the library's own answer")


# --- 18.2 float8 casts ---------------------------------------------------------------------------


def cast(x, dtype, block, amax=None, *, saturate=True, wrong_way=False, in_place=False, one_scale=False):
    top = torch.finfo(dtype).max
    m, n = x.shape
    bm, bn = (m, n) if one_scale else block
    rows, cols = -(-m // bm), -(-n // bn)
    if amax is None or one_scale:
        padded = torch.zeros(rows * bm, cols * bn)
        padded[:m, :n] = x.abs()
        amax = padded.view(rows, bm, cols, bn).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:m, :n]
    target = x if in_place else x.clone()
    scaled = target.mul_(full) if wrong_way else target.div_(full)
    if saturate:
        scaled = scaled.clamp(-top, top)
    if one_scale:
        grid = (-(-m // block[0]), -(-n // block[1]))
        scale = scale.expand(grid).clone()
    return scaled.to(dtype), scale.float()


def cast_by_reciprocal(x, dtype, block, amax=None):
    """Valid too: blocks looped over, multiplied by 1 / scale."""
    top = torch.finfo(dtype).max
    bm, bn = block
    rows, cols = -(-x.shape[0] // bm), -(-x.shape[1] // bn)
    q = torch.empty(x.shape, dtype=dtype)
    scale = torch.ones(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            a = float(tile.abs().max()) if amax is None else float(amax[i, j])
            if a > 0:
                scale[i, j] = torch.tensor(a) / top
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (tile * (1 / scale[i, j])).clamp(-top, top).to(dtype)
    return q, scale


def test_cast_accepts_valid_answers():
    check_quantize_float8(cast)
    check_quantize_float8(cast_by_reciprocal)


def test_cast_without_saturation_fails():
    expect_failure(check_quantize_float8, lambda *a: cast(*a, saturate=False), "saturate")


def test_cast_with_the_scale_applied_the_wrong_way_fails():
    expect_failure(check_quantize_float8, lambda *a: cast(*a, wrong_way=True), "q is wrong")


def test_cast_that_changes_x_in_place_fails():
    expect_failure(check_quantize_float8, lambda *a: cast(*a, in_place=True), "x was changed")


def test_cast_with_one_scale_for_every_block_fails():
    expect_failure(check_quantize_float8, lambda *a: cast(*a, one_scale=True), "scale is wrong")


def test_cast_that_ignores_the_delayed_amax_fails():
    expect_failure(check_quantize_float8, lambda x, d, b, amax=None: cast(x, d, b), "delayed", "scale is wrong")


def test_cast_that_delegates_to_the_library_fails():
    expect_failure(check_quantize_float8, lambda *a: precision.quantize_float8(*a), "the library's own answer")


# --- 18.3 float8 all-gather ----------------------------------------------------------------------


def gather(comm, mine, bounds, dtype, allgather, *, send="float8", scales=True, in_place=False):
    size = comm.Get_size()
    top = torch.finfo(dtype).max
    amax = float(np.abs(mine).max()) if len(mine) else 0.0
    scale = np.float32(amax / top if amax > 0 else 1.0)
    if send == "float32":
        return allgather(comm, mine.copy(), bounds)
    source = torch.from_numpy(mine) if in_place else torch.from_numpy(mine.copy())
    q = source.div_(float(scale)).clamp(-top, top).to(dtype)
    values = torch.from_numpy(allgather(comm, q.view(torch.uint8).numpy(), bounds)).view(dtype).float().numpy()
    if scales:
        every = allgather(comm, np.array([scale], dtype=np.float32), list(range(size + 1)))
        for r in range(size):
            values[bounds[r] : bounds[r + 1]] *= every[r]
    return values


def test_gather_accepts_valid_answers():
    check_float8_allgather(gather)


def gather_scales_in_front(comm, mine, bounds, dtype, allgather):
    """Valid too: each rank's scale travels as 4 bytes in front of its float8 bytes, in one gather."""
    size = comm.Get_size()
    top = torch.finfo(dtype).max
    amax = float(np.abs(mine).max()) if len(mine) else 0.0
    scale = np.array([amax / top if amax > 0 else 1.0], dtype=np.float32)
    q = (torch.from_numpy(mine) * float(1.0 / scale[0])).clamp(-top, top).to(dtype)
    piece = np.concatenate([scale.view(np.uint8), q.view(torch.uint8).numpy()])
    packed = [b + 4 * r for r, b in enumerate(bounds)]
    everything = allgather(comm, piece, packed)
    out = np.empty(bounds[-1], dtype=np.float32)
    for r in range(size):
        at = packed[r]
        theirs = everything[at : at + 4].copy().view(np.float32)[0]
        codes = torch.from_numpy(everything[at + 4 : packed[r + 1]].copy()).view(dtype).float().numpy()
        out[bounds[r] : bounds[r + 1]] = codes * theirs
    return out


def test_gather_accepts_the_scales_sent_with_the_bytes():
    check_float8_allgather(gather_scales_in_front)


def test_gather_that_sends_bfloat16_fails_on_bytes():
    def bfloat16(comm, mine, bounds, dtype, allgather):
        return precision.bfloat16_allgather(comm, mine, bounds, allgather)

    expect_failure(check_float8_allgather, bfloat16, "bytes")


def test_gather_that_sends_the_float32_shard_fails_on_bytes():
    expect_failure(check_float8_allgather, lambda *a: gather(*a, send="float32"), "bytes")


def test_gather_that_drops_the_scales_fails_on_values():
    expect_failure(check_float8_allgather, lambda *a: gather(*a, scales=False), "scale travel")


def test_gather_with_mpis_own_allgather_fails():
    from ddlab.sharded import allgather_mpi

    expect_failure(check_float8_allgather, lambda c, m, b, d, _: gather(c, m, b, d, allgather_mpi), "comm.Allgatherv")


def test_gather_that_changes_mine_fails():
    expect_failure(check_float8_allgather, lambda *a: gather(*a, in_place=True), "`mine` was changed")


def test_gather_that_cannot_cast_an_empty_shard_fails():
    """The lab promises scale 1 for an empty shard; the uneven case gives the last rank one, so max() of it raises."""

    def no_empty_guard(comm, mine, bounds, dtype, allgather):
        if len(mine) == 0:
            mine.max()  # what `t.abs().max()` without the lab's "1 for an empty shard" does: ValueError
        return gather(comm, mine, bounds, dtype, allgather)

    expect_failure(check_float8_allgather, no_empty_guard, "uneven shards", "ValueError")


def test_gather_that_delegates_to_the_library_fails():
    expect_failure(check_float8_allgather, lambda *a: precision.float8_allgather(*a), "the library's own answer")


# --- 18.4 rounded reduce-scatter -----------------------------------------------------------------

WIRE = {torch.bfloat16: torch.int16, torch.float32: torch.float32}


def rounded(comm, x, bounds, dtype, *, round_each=True, wire=None, in_place=False):
    rank, size = comm.Get_rank(), comm.Get_size()
    wire_dtype = wire or dtype
    work = x if in_place else x.copy()

    def chunk(c):
        c %= size
        return torch.from_numpy(work[bounds[c] : bounds[c + 1]])

    partial = chunk(rank - 1).to(dtype if round_each else torch.float32)
    for step in range(size - 1):
        c = (rank - step - 2) % size
        out = partial.to(wire_dtype)
        got = torch.empty(bounds[c + 1] - bounds[c], dtype=wire_dtype)
        view = WIRE.get(wire_dtype, wire_dtype)
        comm.Sendrecv(
            out.view(view).numpy(), dest=(rank + 1) % size, recvbuf=got.view(view).numpy(), source=(rank - 1) % size
        )
        total = got.float() + chunk(c).to(dtype).float()
        partial = total.to(dtype) if round_each else total
        if in_place:
            work[bounds[c] : bounds[c + 1]] = partial.float().numpy()
    return partial.to(dtype).float().numpy().copy() if not round_each else partial.float().numpy().copy()


def test_rounded_reduce_scatter_accepts_valid_answers():
    check_reduce_scatter_rounded(rounded)


def rounded_the_other_way(comm, x, bounds, dtype):
    """Valid too: the ring turning the other way (each partial sum sent left), so the sums add in another order."""
    rank, size = comm.Get_rank(), comm.Get_size()
    wire = WIRE[dtype]

    def own(c):
        c %= size
        return torch.from_numpy(x[bounds[c] : bounds[c + 1]].copy()).to(dtype)

    partial = own(rank + 1)
    for step in range(size - 1):
        c = (rank + step + 2) % size
        got = torch.empty(bounds[c + 1] - bounds[c], dtype=dtype)
        comm.Sendrecv(
            partial.view(wire).numpy(), dest=(rank - 1) % size, recvbuf=got.view(wire).numpy(), source=(rank + 1) % size
        )
        partial = (own(c).float() + got.float()).to(dtype)
    return partial.float().numpy()


def test_rounded_reduce_scatter_accepts_the_ring_turning_the_other_way():
    check_reduce_scatter_rounded(rounded_the_other_way)


def rounded_with_uncast_inputs(comm, x, bounds, dtype):
    """Valid too (the lab says so): each float32 chunk of x added to the received sum uncast, the total rounded."""
    rank, size = comm.Get_rank(), comm.Get_size()
    wire = WIRE[dtype]

    def own(c):
        c %= size
        return torch.from_numpy(x[bounds[c] : bounds[c + 1]].copy())

    partial = own(rank - 1).to(dtype)
    for step in range(size - 1):
        c = (rank - step - 2) % size
        got = torch.empty(bounds[c + 1] - bounds[c], dtype=dtype)
        comm.Sendrecv(
            partial.view(wire).numpy(), dest=(rank + 1) % size, recvbuf=got.view(wire).numpy(), source=(rank - 1) % size
        )
        partial = (got.float() + own(c)).to(dtype)
    return partial.float().numpy()


def test_rounded_reduce_scatter_accepts_uncast_inputs():
    check_reduce_scatter_rounded(rounded_with_uncast_inputs)


def test_rounded_reduce_scatter_in_float32_on_the_wire_fails_on_bytes():
    expect_failure(check_reduce_scatter_rounded, lambda *a: rounded(*a, wire=torch.float32), "bytes")


def test_rounded_reduce_scatter_on_the_notebooks_world_fails():
    expect_failure(check_reduce_scatter_rounded, lambda c, *a: rounded(MPI.COMM_WORLD, *a), "global")


def test_rounded_reduce_scatter_that_changes_x_fails():
    expect_failure(check_reduce_scatter_rounded, lambda *a: rounded(*a, in_place=True), "x was changed")


def test_rounded_reduce_scatter_that_returns_float32_sums_fails():
    def unrounded(comm, x, bounds, dtype):
        rank = comm.Get_rank()
        result = rounded(comm, x, bounds, dtype)
        return result + np.float32(1e-3) * (rank + 1) if dtype == torch.bfloat16 else result

    expect_failure(check_reduce_scatter_rounded, unrounded, "not torch.bfloat16 values")


def test_rounded_reduce_scatter_that_delegates_to_the_library_fails():
    expect_failure(
        check_reduce_scatter_rounded, lambda *a: precision.reduce_scatter_rounded(*a), "the library's own answer"
    )
