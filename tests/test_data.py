"""ddlab.data: the synthetic stress-strain data set and the sharded sampler (one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import checks
from ddlab.data import (
    ShardedSampler,
    StressStrainCurves,
    curves,
    epoch_permutation,
    eval_shard,
    physical_targets,
    shard_indices,
)
from ddlab.runtime.reference import unguarded

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
shard_indices = unguarded(shard_indices)


def test_samples_depend_only_on_seed_and_index():
    a, b = StressStrainCurves(n=1000, seed=3), StressStrainCurves(n=10**8, seed=3)
    xa, ya = a[[5, 999, 0]]
    xb, yb = b[[5, 999, 0]]
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a[[999]][0][0], xa[1])  # a sample does not depend on its batch
    assert not torch.equal(StressStrainCurves(n=1000, seed=4)[[5]][0], xa[:1])


def test_shapes_dtypes_and_ranges():
    data = StressStrainCurves(n=500, dtype=torch.float64)
    x, y = data[np.arange(500)]
    assert x.shape == (500, curves.N_FEATURES) and y.shape == (500, 2)
    assert x.dtype == y.dtype == torch.float64
    assert y.min() >= -1 and y.max() <= 1
    strain, stress, flag = data.curves(np.arange(500))
    assert set(np.unique(flag)) <= {0.0, 1.0}
    assert np.all(stress[flag == 0] == 0)  # broken specimens carry no load
    assert np.all(np.diff(strain, axis=1) > 0)
    assert 0 < x[:, :200].max() <= 1.0 + 1e-9


def test_curves_follow_the_hardening_law_without_noise():
    data = StressStrainCurves(n=10, noise=0.0)
    p = data.parameters([3])
    strain, stress, flag = data.curves([3])
    plastic = strain > p["yield"] / p["young"]
    intact = (flag == 1) & plastic
    # Swift's law is above the yield strength and increasing while intact.
    assert np.all(stress[intact] >= p["yield"][0] - 1e-9)
    assert np.all(np.diff(stress[intact]) >= 0)


def test_targets_scale_back_to_physical_units():
    data = StressStrainCurves(n=20)
    p = data.parameters(np.arange(20))
    back = physical_targets(data.targets(np.arange(20)))
    assert np.allclose(back[:, 0], p["yield"]) and np.allclose(back[:, 1], p["exponent"])


def test_noise_is_about_standard_normal():
    z = curves._normal(0, np.arange(200_000), 1)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01


def test_bad_indices_say_what_is_allowed():
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        StressStrainCurves(n=10)[[10]]
    with pytest.raises(ValueError):
        StressStrainCurves(n=0)


@pytest.mark.parametrize("n, size", [(12, 4), (10, 4), (3, 5), (101, 7), (1, 1)])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_shards_are_disjoint_equal_and_cover_the_epoch(n, size, remainder):
    shards = [ShardedSampler(n, r, size, seed=1, remainder=remainder).indices(2) for r in range(size)]
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1
    joined = np.concatenate(shards)
    if remainder == "pad":
        assert lengths == {-(-n // size)} and set(joined) == set(range(n))
        assert len(joined) - len(set(joined)) == -(-n // size) * size - n
    else:
        assert lengths == {n // size} and len(set(joined)) == len(joined) == n // size * size


def test_strided_shards_put_together_are_the_global_batch():
    n, size, b = 96, 4, 3
    order = epoch_permutation(n, 5, seed=2)
    shards = [shard_indices(n, r, size, 5, seed=2) for r in range(size)]
    for k in range(n // (size * b)):
        together = sorted(np.concatenate([s[k * b : (k + 1) * b] for s in shards]))
        assert together == sorted(order[k * size * b : (k + 1) * size * b])


def test_epochs_reshuffle_and_batches_are_even():
    sampler = ShardedSampler(50, 1, 4, seed=0)
    assert not np.array_equal(sampler.indices(0), sampler.indices(1))
    batches = list(sampler.batches(4, epoch=0))
    assert len(batches) == sampler.num_batches(4) == 4 and [len(b) for b in batches] == [4, 4, 4, 1]
    assert len(list(sampler.batches(4, 0, drop_last=True))) == 3


def test_eval_shards_are_contiguous_blocks():
    assert [list(eval_shard(10, r, 4)) for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


# The check of exercise 4.1 -----------------------------------------------------------


def test_shard_check_passes_the_reference_and_another_generator():
    checks.check_shard_indices(shard_indices)

    def torch_order(n, rank, size, epoch, seed=0):  # another generator and padding written out: also right
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).numpy()
        pad = -(-n // size) * size - n
        padded = np.concatenate([order] + [order] * (pad // max(n, 1)) + [order[: pad % max(n, 1)]])
        return padded[rank::size]

    checks.check_shard_indices(torch_order)


def blocks(n, rank, size, epoch, seed=0):  # contiguous blocks, not every size-th entry
    order = np.resize(epoch_permutation(n, epoch, seed), -(-n // size) * size)
    length = len(order) // size
    return order[rank * length : (rank + 1) * length]


def random_padding(n, rank, size, epoch, seed=0):  # pads with random samples, not the order's first ones
    order = epoch_permutation(n, epoch, seed)
    pad = -(-n // size) * size - n
    extra = np.random.default_rng([seed, epoch, 1]).choice(n, pad, replace=False) if n >= pad else order[:0]
    return np.concatenate([order, extra])[rank::size]


def unpadded(n, rank, size, epoch, seed=0):
    return epoch_permutation(n, epoch, seed)[rank::size]


def dropped(n, rank, size, epoch, seed=0):
    return shard_indices(n, rank, size, epoch, seed, remainder="drop")


def unshuffled(n, rank, size, epoch, seed=0):
    return shard_indices(n, rank, size, epoch, seed, shuffle=False)


def same_every_epoch(n, rank, size, epoch, seed=0):
    return shard_indices(n, rank, size, 0, seed)


def unseeded(n, rank, size, epoch, seed=0):
    return shard_indices(n, rank, size, epoch, seed=np.random.randint(1 << 30))


def ignores_seed(n, rank, size, epoch, seed=0):
    return shard_indices(n, rank, size, epoch, 0)


def as_list(n, rank, size, epoch, seed=0):
    return list(shard_indices(n, rank, size, epoch, seed))


@pytest.mark.parametrize(
    "wrong, words",
    [
        (unpadded, "same number of steps"),
        (dropped, "pad by repeating"),
        (unshuffled, "epoch 0 and epoch 1"),
        (same_every_epoch, "epoch 0 and epoch 1"),
        (unseeded, "different shards"),
        (ignores_seed, "seeds 0 and 1"),
        (as_list, "NumPy array"),
        (blocks, "every size-th entry"),
        (random_padding, "padded with its own first entries"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_shard_check_fails_on_wrong_shards(wrong, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_shard_indices(wrong)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("shard_indices", "ddlab.data.shard_indices", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
