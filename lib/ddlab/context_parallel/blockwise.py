"""Attention by blocks on one rank: the online softmax and the merge of two partial results.

A *partial* result of attention for some query rows over some of the keys is a triple
(out, m, l), arrays of shapes (..., n, d), (..., n) and (..., n):

- m: each row's largest score seen so far (-inf when the row has seen no key yet);
- l: each row's sum of exp(score - m);
- out: each row's sum of exp(score - m) times the value rows, not yet divided by l.

Two partials over disjoint keys merge exactly (`merge_partials`): rescale both to the
larger maximum, then add. That is the online softmax of Milakov & Gimelshein ("Online
normalizer calculation for softmax", 2018) that FlashAttention computes tile by tile
(Dao et al., "FlashAttention", 2022, which keeps m and l for the backward); `finish` divides at
the end and keeps each row's log-sum-exp, m + log l, as FlashAttention-2 does (Dao 2023): with
q, k, v and the output, all the backward pass needs.

Keys are causal by *global* position: query i sees key j when pos(j) <= pos(i). A block
computes only the rectangle of rows that see some key and keys some row sees
(`ddlab.context_parallel.layout.visible`), so a block wholly in the future costs nothing.
With causal=False (an encoder's attention) every query sees every key, padding rows included:
use it on lengths 2P divides. Arrays are NumPy, float64 in the checks; the sequence axis is -2.
"""

from __future__ import annotations

import numpy as np

from ..runtime.reference import reference
from .layout import visible

#: A partial attention result: (out, m, l) as the module's docstring defines them.
Partial = tuple[np.ndarray, np.ndarray, np.ndarray]


def empty_partial(q: np.ndarray, d_v: int) -> Partial:
    """The partial of rows that have seen no key: out 0, m -inf, l 0."""
    rows = q.shape[:-1]
    return np.zeros((*rows, d_v), dtype=q.dtype), np.full(rows, -np.inf, dtype=q.dtype), np.zeros(rows, dtype=q.dtype)


def _block_mask(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, columns, mask) of a block: the rectangle with any work in it, and which of its pairs are seen."""
    if not causal:
        rows, cols = np.arange(q_pos.size), np.arange(k_pos.size)
        return rows, cols, np.ones((rows.size, cols.size), dtype=bool)
    rows, cols = visible(q_pos, k_pos)
    return rows, cols, k_pos[cols][None, :] <= q_pos[rows][:, None]


def attend_block(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, causal: bool = True
) -> Partial:
    """The partial result of queries q (at global positions q_pos) over one block of keys and values."""
    result = empty_partial(q, v.shape[-1])
    rows, cols, mask = _block_mask(q_pos, k_pos, causal)
    if rows.size == 0 or cols.size == 0:
        return result
    scores = (
        q[..., rows, :] @ k[..., cols, :].swapaxes(-1, -2) * q.shape[-1] ** -0.5
    )  # a Python float: keeps float32 float32
    scores = np.where(mask, scores, -np.inf)
    m = scores.max(axis=-1)  # finite: every row kept sees at least one key
    p = np.exp(scores - m[..., None])
    out, m_all, l_all = result
    out[..., rows, :] = p @ v[..., cols, :]
    m_all[..., rows] = m
    l_all[..., rows] = p.sum(axis=-1)
    return result


@reference("merge_partials")
def merge_partials(a: Partial, b: Partial) -> Partial:
    """The partial over the keys of a and b together: both rescaled to the larger maximum, then added."""
    (out_a, m_a, l_a), (out_b, m_b, l_b) = a, b
    m = np.maximum(m_a, m_b)
    reference = np.where(np.isneginf(m), 0.0, m)  # rows that saw nothing in either: scales exp(-inf) = 0
    scale_a, scale_b = np.exp(m_a - reference), np.exp(m_b - reference)
    return out_a * scale_a[..., None] + out_b * scale_b[..., None], m, l_a * scale_a + l_b * scale_b


def finish(partial: Partial) -> tuple[np.ndarray, np.ndarray]:
    """(attention output, log-sum-exp of each row) from a partial over all the keys a row sees."""
    out, m, total = partial
    if np.any(total == 0):
        raise ValueError("a query row saw no key at all: every position must see itself (check the positions)")
    return out / total[..., None], m + np.log(total)


def attend_block_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    grad_out: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    causal: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This block's share of (dq, dk, dv), given each row's log-sum-exp and delta = rowsum(grad_out * out).

    The probabilities are recomputed from lse (FlashAttention's backward, Dao et al. 2022):
    p = exp(s - lse), dv = p^T dO, dp = dO v^T, ds = p (dp - delta), dq = ds k / sqrt(d), dk = ds^T q / sqrt(d).
    """
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    rows, cols, mask = _block_mask(q_pos, k_pos, causal)
    if rows.size == 0 or cols.size == 0:
        return dq, dk, dv
    scale = q.shape[-1] ** -0.5  # a Python float: keeps float32 float32
    q_r, k_c, v_c, g_r = q[..., rows, :], k[..., cols, :], v[..., cols, :], grad_out[..., rows, :]
    scores = q_r @ k_c.swapaxes(-1, -2) * scale
    p = np.where(mask, np.exp(np.where(mask, scores, 0.0) - lse[..., rows, None]), 0.0)
    dv[..., cols, :] = p.swapaxes(-1, -2) @ g_r
    ds = p * (g_r @ v_c.swapaxes(-1, -2) - delta[..., rows, None])
    dq[..., rows, :] = ds @ k_c * scale
    dk[..., cols, :] = ds.swapaxes(-1, -2) @ q_r * scale
    return dq, dk, dv


def blockwise_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of one sequence on one rank, keys taken `block` rows at a time: (output, lse)."""
    if block < 1:
        raise ValueError(f"block must be a positive number of rows, got {block}")
    positions = np.arange(q.shape[-2])
    partial = empty_partial(q, v.shape[-1])
    for start in range(0, k.shape[-2], block):
        keys = slice(start, start + block)
        partial = merge_partials(partial, attend_block(q, k[..., keys, :], v[..., keys, :], positions, positions[keys]))
    return finish(partial)


def reference_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray | None = None,
    k_pos: np.ndarray | None = None,
    causal: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention by the textbook formula, the whole score matrix at once, causal unless told: (output, lse)."""
    q_pos = np.arange(q.shape[-2]) if q_pos is None else q_pos
    k_pos = np.arange(k.shape[-2]) if k_pos is None else k_pos
    scores = q @ k.swapaxes(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = np.where(k_pos[None, :] <= q_pos[:, None], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - m)
    total = weights.sum(axis=-1, keepdims=True)
    return (weights / total) @ v, (m + np.log(total))[..., 0]
