"""ddlab.precision on one process: float8 casts saturate, scale per block, follow a delayed history; the recipes
train, and what each keeps is the oracle's to the byte, beside the gaps lab 18 names; bad input is refused with
what to do."""

from __future__ import annotations

import pytest
import torch
from ddlab import precision
from ddlab.data.text import BatchSampler, make_corpus
from ddlab.models.gpt import GPTConfig, make_gpt
from ddlab.oracle import transformer as oracle
from ddlab.precision import footprint


@pytest.mark.parametrize("dtype", precision.FORMATS)
def test_a_cast_with_a_smaller_amax_saturates_instead_of_overflowing(dtype):
    x = torch.tensor([[1.0, -4.0, 2.0]])
    q, scale = precision.quantize_float8(x, dtype, (1, 3), amax=torch.tensor([[2.0]]))
    back = precision.dequantize(q, scale, (1, 3))
    assert torch.isfinite(back).all() and float(back[0, 1]) == pytest.approx(-2.0)
    assert float(scale) == pytest.approx(2.0 / precision.fmax(dtype))


def test_block_scales_keep_small_blocks_that_one_scale_flushes_to_zero():
    x = torch.cat([torch.full((4, 4), 1e-4), torch.full((4, 4), 300.0)], dim=1)
    one_q, one_scale = precision.quantize_float8(x, torch.float8_e4m3fn, (4, 8))
    q, scale = precision.quantize_float8(x, torch.float8_e4m3fn, (4, 4))
    assert scale.shape == (1, 2) and one_scale.shape == (1, 1)
    assert (precision.dequantize(one_q, one_scale, (4, 8))[:, :4] == 0).all()
    assert precision.cast_error(x[:, :4], q[:, :4], scale[:, :1], (4, 4)) < 0.07
    assert torch.equal(x[:, :4], torch.full((4, 4), 1e-4)), "the cast changed x"


def test_an_all_zero_block_has_scale_one_and_the_delayed_history_takes_the_largest():
    x = torch.zeros(2, 6)
    x[:, 3:] = 5.0
    _, scale = precision.quantize_float8(x, torch.float8_e5m2, (2, 3))
    assert float(scale[0, 0]) == 1.0
    history = precision.AmaxHistory((2, 6), length=2)
    history.record(x * 3)
    history.record(x)
    assert float(history.amax(x)) == 15.0
    history.record(x)  # the 3x step falls out of a history of 2
    assert float(history.amax(x)) == 5.0


def test_bad_input_is_refused_saying_what_to_use():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        precision.quantize_float8(torch.ones(2, 2), torch.float16, (1, 2))
    with pytest.raises(ValueError, match="grid"):
        precision.quantize_float8(torch.ones(2, 2), torch.float8_e4m3fn, (1, 2), amax=torch.ones(1, 1))
    with pytest.raises(ValueError, match="interval"):
        precision.LossScale(scale=1.0, factor=1.0)
    with pytest.raises(ValueError, match="recipe"):
        precision.train_recipe("float4", make_gpt(GPTConfig(n_layer=1, n_embd=16, n_head=2)), lambda s: None, 1)


def test_every_recipe_trains_the_gpt_a_few_steps():
    torch.set_num_threads(1)
    config = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
    train = BatchSampler(make_corpus(seed=0).train, 8, config.block_size, seed=1)
    model = make_gpt(config, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    for recipe in precision.RECIPES:
        run = precision.train_recipe(recipe, model, train.batch_at, 10, initial_scale=2.0**17)
        assert len(run["losses"]) == 10 and all(torch.isfinite(torch.tensor(run["losses"])))
        assert max(run["losses"][-3:]) < run["losses"][0] - 0.5, (recipe, run["losses"])
        if recipe == "float16":
            assert run["skipped"] >= 1, (
                "2^17 times the loss (about 5.5) overflows float16: the first step must be skipped"
            )
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "train_recipe changed its model"


def test_each_recipes_bytes_are_the_oracles_and_the_gaps_are_what_lab_18_says():
    """The ledger against the oracle, to the byte: per parameter equal (AdamW's 4-byte step count per tensor
    apart); per token of a block the oracle's bytes plus the LayerNorms' statistics (4 elements), and for emulated
    float8 the float32 casts of the linear layers' weights (12 h^2 per block); the whole forward also the token
    ids, positions and targets (int64), the final LayerNorm's input, statistics and output, the loss, and the
    logits' softmax in the compute type where the oracle counts the loss's peak, a float32 (or wider) copy of the
    logits beside the 16-bit ones."""
    torch.set_num_threads(1)
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)
    x, y = BatchSampler(make_corpus(seed=0).train, 4, config.block_size, seed=1).batch_at(0)
    model = make_gpt(config, seed=0)
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    h, s, vocab, layers, tokens = config.n_embd, config.block_size, config.vocab_size, config.n_layer, x.numel()
    for recipe in precision.RECIPES:
        got = footprint.measured_bytes(recipe, model, x, y)
        want = footprint.predicted_bytes(recipe, config, len(x))
        e = footprint.PRECISIONS[recipe].activations
        for part in ("weights", "gradients", "masters"):
            assert got[part] == want[part], (recipe, part)
        assert got["states"] == want["states"] + 4 * tensors / n, recipe
        casts = 12 * h * h * 4 if recipe.startswith("float8") else 0
        assert got["block"] == want["block"] + 4 * e + casts / tokens, recipe
        assert got["per element"] == got["block"] * tokens / footprint.block_elements(config, len(x)), recipe
        assert want["per element"] == e
        loss = max(4, e) + (e if e < 4 else 0)  # the oracle's loss: a float32 copy beside 16-bit logits (LOSSES)
        outside = tokens * (16 + (2 * h + 2) * e + (e - loss) * vocab) + 8 * s + e
        assert got["activations"] == want["activations"] + layers * (4 * e * tokens + casts) + outside, recipe
    fp8 = footprint.predicted_bytes(oracle.RECIPES["fp8"], config, len(x))
    assert [fp8[p] for p in footprint.PARTS] == [2, 2, 4, 8]
    with pytest.raises(ValueError, match="recipe"):
        footprint.measured_bytes("float4", model, x, y)
