"""Compressors on one process: each within its stated error bound; error feedback conserves the sum."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.allreduce.cost import Link
from ddlab.compression import (
    CompressedAllreduce,
    ErrorFeedback,
    bandwidth_crossover_density,
    crossover_density,
    densify,
    dequantize_8bit,
    flat_ring_seconds,
    held_blocks,
    hierarchical_seconds,
    keep_count,
    quantize_8bit,
    random_k,
    sign_1bit,
    top_k,
    unsign_1bit,
)
from ddlab.compression.compressors import LEVELS
from mpi4py import MPI


def _x(n: int = 1000, seed: int = 0, dtype: type = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


@pytest.mark.parametrize("k", [0, 1, 10, 500, 1000])
def test_top_k_keeps_the_largest_and_meets_its_bound(k: int) -> None:
    x = _x()
    message = top_k(x, k)
    assert message.indices.dtype == np.int32 and len(set(message.indices.tolist())) == k
    d = densify(message)
    if 0 < k < x.size:
        assert np.abs(x[message.indices]).min() >= np.abs(np.delete(x, message.indices)).max()
    assert np.sum((x - d) ** 2) <= (1 - k / x.size) * np.sum(x**2) * (1 + 1e-6)


def test_random_k_bound_always_and_on_average() -> None:
    x, k = _x(), 100
    rng = np.random.default_rng(1)
    errors = []
    for _ in range(200):
        d = densify(random_k(x, k, rng))
        errors.append(np.sum((x - d) ** 2) / np.sum(x**2))
    assert max(errors) <= 1.0
    assert np.mean(errors) == pytest.approx(1 - k / x.size, abs=0.02)


def test_quantize_8bit_is_within_one_level_and_unbiased() -> None:
    x = _x(dtype=np.float64)
    rng = np.random.default_rng(2)
    step = np.abs(x).max() / LEVELS
    draws = np.array([dequantize_8bit(quantize_8bit(x, rng)) for _ in range(400)])
    assert quantize_8bit(x, rng).levels.dtype == np.int8
    assert np.abs(draws - x).max() <= step * (1 + 1e-9)
    assert np.abs(draws.mean(axis=0) - x).max() < 4 * step / np.sqrt(400)  # unbiased within noise


def test_quantize_8bit_of_zeros() -> None:
    assert not dequantize_8bit(quantize_8bit(np.zeros(5, np.float32), np.random.default_rng(0))).any()


def test_sign_1bit_packs_and_contracts() -> None:
    x = _x(n=1001)
    message = sign_1bit(x)
    assert message.bits.nbytes == 126
    d = unsign_1bit(message)
    assert np.array_equal(np.sign(d), np.where(x >= 0, 1, -1))
    want = np.sum(x.astype(np.float64) ** 2) - np.sum(np.abs(x.astype(np.float64))) ** 2 / x.size
    assert np.sum((x - d).astype(np.float64) ** 2) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("compress", ["topk", "randomk", "sign"])
def test_error_feedback_conserves_the_sum(compress: str) -> None:
    memory, rng = ErrorFeedback(), np.random.default_rng(3)
    true_sum, applied = np.zeros(300), np.zeros(300)
    compressors = {
        "topk": lambda fed: densify(top_k(fed, 5)),
        "randomk": lambda fed: densify(random_k(fed, 5, rng)),
        "sign": lambda fed: unsign_1bit(sign_1bit(fed)),
    }
    for _ in range(20):
        g = rng.standard_normal(300)
        fed = memory.feed(g)
        sent = compressors[compress](fed)
        memory.keep(fed, sent)
        true_sum += g
        applied += sent
        np.testing.assert_allclose(applied + memory.residual, true_sum, atol=1e-9)


def test_compressed_allreduce_on_one_rank_keeps_the_residual() -> None:
    reduce = CompressedAllreduce("topk", density=0.1)
    x = _x(n=100, dtype=np.float64)
    out = reduce(MPI.COMM_SELF, x)
    assert np.count_nonzero(out) == 10
    np.testing.assert_allclose(out + reduce.memory[100].residual, x)
    assert reduce.bytes_sent == 0  # one rank sends nothing


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="density"):
        keep_count(10, 0.0)
    with pytest.raises(ValueError, match="choose one of"):
        CompressedAllreduce("zip")
    with pytest.raises(ValueError, match="k must be"):
        top_k(_x(n=5), 6)


def test_crossover_density() -> None:
    assert bandwidth_crossover_density(4) == pytest.approx(0.25)
    free_messages = Link(alpha=0.0, beta=1e-9, gamma=0.0)
    assert crossover_density(10**6, 4, free_messages) == pytest.approx(0.25)
    costly = Link(alpha=1e-3, beta=1e-9, gamma=0.0)
    assert crossover_density(1000, 4, costly) == 0.0  # 3(P-1) latencies never beat 2(P-1)


def test_held_blocks_cover_every_block_once() -> None:
    for g in range(1, 6):
        for s in range(1, g + 1):
            held = [b for local in range(s) for b in held_blocks(local, s, g)]
            assert held == list(range(g))


def test_hierarchical_model_prices_one_link_per_node() -> None:
    fast, slow = Link(1e-6, 1e-10), Link(1e-4, 1e-8)
    n = 64 * 2**20
    inside = hierarchical_seconds(n, 2, 2, fast, slow)  # one node: the group steps only
    assert inside == pytest.approx(flat_ring_seconds(n, 2, 2, fast, slow))
    for size, g in ((4, 2), (6, 2), (6, 3), (8, 4)):
        nodes = size // g
        # g rings of n/g at once through each node's one link: one ring of n over the nodes,
        # 2(N-1) steps of n/N bytes each, not n/(gN)
        across = 2 * (nodes - 1) * (slow.alpha + n / nodes * slow.beta)
        inside = hierarchical_seconds(n, g, g, fast, slow)
        assert hierarchical_seconds(n, size, g, fast, slow) == pytest.approx(inside + across)
        assert hierarchical_seconds(n, size, g, fast, slow) < flat_ring_seconds(n, size, g, fast, slow)


def test_bias_and_error_tells_biased_from_unbiased_compressors():
    from ddlab.compression import bias_and_error, densify, qsgd, random_k, top_k, unqsgd

    x = np.random.default_rng(0).standard_normal(200)
    k = 20
    top = bias_and_error(lambda v, rng: densify(top_k(v, k)), x, 50)
    kept = densify(top_k(x, k))
    exact = float(np.linalg.norm(kept - x) / np.linalg.norm(x))
    assert top == pytest.approx((exact, exact**2))  # deterministic: the bias is the whole error
    unscaled = bias_and_error(lambda v, rng: densify(random_k(v, k, rng)), x, 2000)
    assert unscaled[0] == pytest.approx(1 - k / x.size, abs=0.03)  # E[d] = (k/n) x
    scaled = bias_and_error(lambda v, rng: densify(random_k(v, k, rng)) * (x.size / k), x, 2000)
    assert scaled[0] < 0.1 and scaled[1] == pytest.approx(x.size / k - 1, rel=0.1)
    quantized = bias_and_error(lambda v, rng: unqsgd(*qsgd(v, 4, rng), 4), x, 2000)
    assert quantized[0] < 0.05 and quantized[1] <= min(x.size / 16, np.sqrt(x.size) / 4)
