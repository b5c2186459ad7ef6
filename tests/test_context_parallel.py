"""Lab 15's context parallelism on one process: blocks, layouts, and the one-process checks.

The online softmax by blocks equals softmax attention at every block size; the zig-zag layout
balances the causal work where the contiguous one does not; the backward of one block equals
autograd's; and check_merge_partials and check_zigzag accept valid answers written differently
and fail the wrong ones (the issue's: a merge that forgets to rescale the old sum).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab.checks import CheckFailed, check_merge_partials, check_zigzag
from ddlab.context_parallel import (
    all_positions,
    attend_block,
    attend_block_backward,
    blockwise_attention,
    causal_pairs,
    causal_work,
    finish,
    merge_partials,
    padded_length,
    reference_attention,
    take_rows,
)


def _qkv(shape=(2, 3, 13, 4), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(3)]


@pytest.mark.parametrize("block", [1, 3, 5, 13, 20])
def test_blockwise_equals_softmax_attention(block):
    q, k, v = _qkv()
    scores = np.einsum("...id,...jd->...ij", q, k) / 2.0 + np.triu(np.full((13, 13), -np.inf), 1)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = weights / weights.sum(-1, keepdims=True) @ v
    out, lse = blockwise_attention(q, k, v, block)
    assert np.allclose(out, want, rtol=0, atol=1e-12)
    assert np.allclose(lse, np.log(np.exp(scores).sum(-1)), rtol=0, atol=1e-12)


def test_merge_is_exact_in_either_order_and_keeps_empty_rows():
    q, k, v = _qkv((6, 3))
    pos = np.arange(6)
    early, late = attend_block(q, k[:2], v[:2], pos, pos[:2]), attend_block(q, k[2:], v[2:], pos, pos[2:])
    assert np.isneginf(late[1][:2]).all()  # rows 0 and 1 see none of the late keys
    for merged in (merge_partials(early, late), merge_partials(late, early)):
        assert np.allclose(finish(merged)[0], reference_attention(q, k, v)[0], rtol=0, atol=1e-12)
    nothing = attend_block(q, k, v, pos, pos + 10)
    out, m, total = merge_partials(nothing, nothing)
    assert not out.any() and np.isneginf(m).all() and not total.any()


def test_block_backward_equals_autograd():
    q, k, v = _qkv((2, 7, 3), seed=1)
    grad = np.random.default_rng(2).standard_normal(q.shape)
    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    scores = qt @ kt.transpose(-1, -2) / np.sqrt(3) + torch.full((7, 7), float("-inf"), dtype=torch.float64).triu(1)
    out = torch.softmax(scores, -1) @ vt
    out.backward(torch.tensor(grad))
    o, lse = reference_attention(q, k, v)
    pos = np.arange(7)
    got = attend_block_backward(q, k, v, grad, lse, (grad * o).sum(-1), pos, pos)
    for g, t in zip(got, (qt, kt, vt)):
        assert np.allclose(g, t.grad.numpy(), rtol=0, atol=1e-12)


def test_layouts_pad_and_balance():
    assert [padded_length(n, 4) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
    zigzag, naive = all_positions(64, 4), all_positions(64, 4, zigzag=False)
    assert zigzag[1].tolist() == [*range(8, 16), *range(48, 56)]
    assert sorted(zigzag.ravel().tolist()) == list(range(64)) == sorted(naive.ravel().tolist())
    assert len(set(causal_work(zigzag).tolist())) == 1 and len(set(causal_pairs(zigzag, 64).tolist())) == 1
    pairs = causal_pairs(naive, 64)
    assert pairs.max() / pairs.mean() == pytest.approx(904 / 520)  # (P - 1/2) n^2 over P n^2 / 2 + n/2 terms
    x = np.arange(10.0).reshape(5, 2)
    assert take_rows(x, np.array([4, 5, 0]))[1].tolist() == [0.0, 0.0]  # padding rows are zeros


# Exercise 15.1's answers ---------------------------------------------------------------------
def merge_reference(o1, m1, l1, o2, m2, l2):
    """The notebook's answer."""
    m = np.maximum(m1, m2)
    safe = np.where(np.isneginf(m), 0.0, m)
    a1, a2 = np.exp(m1 - safe), np.exp(m2 - safe)
    return o1 * a1[..., None] + o2 * a2[..., None], m, l1 * a1 + l2 * a2


def merge_by_cases(o1, m1, l1, o2, m2, l2):
    """Valid, written differently: scale only the side whose maximum is smaller, row by row."""
    m = np.where(m1 >= m2, m1, m2)
    with np.errstate(invalid="ignore"):
        a1 = np.where(m1 >= m2, 1.0, np.exp(m1 - m2))
        a2 = np.where(m1 >= m2, np.exp(m2 - m1), 1.0)
    a1 = np.nan_to_num(a1, nan=0.0)
    a2 = np.where(np.isneginf(m1) & np.isneginf(m2), 0.0, a2)
    return (o1 * a1[..., None] + o2 * a2[..., None]).copy(), m.copy(), l1 * a1 + l2 * a2


def merge_forgets_old_sum(o1, m1, l1, o2, m2, l2):
    """Wrong (the issue's): rescales the new block's sum to the new maximum but not the old one."""
    o, m, _ = merge_reference(o1, m1, l1, o2, m2, l2)
    safe = np.where(np.isneginf(m), 0.0, m)
    return o, m, l1 + l2 * np.exp(m2 - safe)


def merge_nan_on_empty_rows(o1, m1, l1, o2, m2, l2):
    """Wrong: exp(m1 - m) is nan where both maxima are -inf."""
    m = np.maximum(m1, m2)
    with np.errstate(invalid="ignore"):
        a1, a2 = np.exp(m1 - m), np.exp(m2 - m)
    return o1 * a1[..., None] + o2 * a2[..., None], m, l1 * a1 + l2 * a2


def merge_in_place(o1, m1, l1, o2, m2, l2):
    """Wrong: overwrites the first partial and returns it."""
    o, m, total = merge_reference(o1, m1, l1, o2, m2, l2)
    o1[...], m1[...], l1[...] = o, m, total
    return o1, m1, l1


def merge_without_max(o1, m1, l1, o2, m2, l2):
    """Wrong: adds the partials as they are, as if they shared one maximum."""
    return o1 + o2, np.maximum(m1, m2), l1 + l2


@pytest.mark.parametrize("answer", [merge_reference, merge_by_cases])
def test_merge_check_accepts(answer, capsys):
    check_merge_partials(answer)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "answer,message",
    [
        (merge_forgets_old_sum, "l is wrong"),
        (merge_nan_on_empty_rows, "wrong at"),
        (merge_in_place, "input was changed"),
        (merge_without_max, "wrong at"),
    ],
)
def test_merge_check_fails(answer, message):
    with pytest.raises(CheckFailed, match=message):
        check_merge_partials(answer)


# Exercise 15.3's answers ----------------------------------------------------------------------
def zigzag_split_reference(x, size, rank):
    """The notebook's answer."""
    length = x.shape[-2]
    chunk = -(-length // (2 * size))
    padded = np.zeros((*x.shape[:-2], 2 * size * chunk, x.shape[-1]), dtype=x.dtype)
    padded[..., :length, :] = x
    late = 2 * size - 1 - rank
    return np.concatenate(
        [padded[..., rank * chunk : (rank + 1) * chunk, :], padded[..., late * chunk : (late + 1) * chunk, :]], axis=-2
    )


def zigzag_unsplit_reference(parts, length):
    size = len(parts)
    chunk = parts[0].shape[-2] // 2
    chunks = [None] * (2 * size)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * size - 1 - rank] = part[..., :chunk, :], part[..., chunk:, :]
    return np.concatenate(chunks, axis=-2)[..., :length, :]


def zigzag_split_by_index(x, size, rank):
    """Valid, written differently: an index array, padding by np.pad."""
    length = x.shape[-2]
    chunk = -(-length // (2 * size))
    padding = [(0, 0)] * x.ndim
    padding[-2] = (0, 2 * size * chunk - length)
    index = np.r_[rank * chunk : (rank + 1) * chunk, (2 * size - 1 - rank) * chunk : (2 * size - rank) * chunk]
    return np.pad(x, padding)[..., index, :]


def zigzag_unsplit_by_index(parts, length):
    size, chunk = len(parts), parts[0].shape[-2] // 2
    out = np.empty((*parts[0].shape[:-2], 2 * size * chunk, parts[0].shape[-1]), dtype=parts[0].dtype)
    for rank, part in enumerate(parts):
        index = np.r_[rank * chunk : (rank + 1) * chunk, (2 * size - 1 - rank) * chunk : (2 * size - rank) * chunk]
        out[..., index, :] = part
    return out[..., :length, :].copy()


def zigzag_split_no_padding(x, size, rank):
    """Wrong: chunks of length // 2P rows, so the last rows are lost when 2P does not divide the length."""
    chunk = max(1, x.shape[-2] // (2 * size))
    late = 2 * size - 1 - rank
    return np.concatenate(
        [x[..., rank * chunk : (rank + 1) * chunk, :], x[..., late * chunk : (late + 1) * chunk, :]], axis=-2
    )


def zigzag_split_late_first(x, size, rank):
    """Wrong: the late chunk first."""
    part = zigzag_split_reference(x, size, rank)
    half = part.shape[-2] // 2
    return np.concatenate([part[..., half:, :], part[..., :half, :]], axis=-2)


def zigzag_unsplit_keeps_padding(parts, length):
    """Wrong: the padding rows stay at the end."""
    return zigzag_unsplit_reference(parts, 10**9)


@pytest.mark.parametrize(
    "split,unsplit",
    [(zigzag_split_reference, zigzag_unsplit_reference), (zigzag_split_by_index, zigzag_unsplit_by_index)],
)
def test_zigzag_check_accepts(split, unsplit, capsys):
    check_zigzag(split, unsplit)
    assert "passed" in capsys.readouterr().out


def zigzag_split_returns_x_on_one_rank(x, size, rank):
    """Wrong: on one rank with nothing to pad, x itself comes back (the text asks for a new array)."""
    return x if size == 1 and x.shape[-2] % 2 == 0 else zigzag_split_reference(x, size, rank)


@pytest.mark.parametrize(
    "split,unsplit,message",
    [
        (zigzag_split_returns_x_on_one_rank, zigzag_unsplit_reference, "shares memory with x"),
        (zigzag_split_no_padding, zigzag_unsplit_reference, "split has shape"),
        (zigzag_split_late_first, zigzag_unsplit_reference, "split is wrong"),
        (zigzag_split_reference, zigzag_unsplit_keeps_padding, "unsplit has shape"),
    ],
)
def test_zigzag_check_fails(split, unsplit, message):
    with pytest.raises(CheckFailed, match=message):
        check_zigzag(split, unsplit)


def test_figures_draw_the_ring_and_the_layouts():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ddlab.context_parallel.figures import layouts, ring_steps

    ring = ring_steps(3, alt="the ring of 3 ranks, step by step")
    assert sum(t.get_text().startswith("KV") for t in ring.axes[0].texts) == 9  # 3 ranks x 3 steps
    both = layouts(12, 3, alt="contiguous and zig-zag rows on 3 ranks")
    assert [ax.get_title().split(":")[0] for ax in both.axes] == ["contiguous", "zig-zag"]
    assert "max/mean 1.00" in both.axes[1].get_title()
    plt.close("all")
