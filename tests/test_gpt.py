"""Lab 14's GPT and text corpus in one process: the corpus, the seeded dropout, and training that learns."""

from __future__ import annotations

import pytest
import torch
from ddlab.data.text import VOCAB_SIZE, BatchSampler, decode, make_corpus
from ddlab.models.gpt import GPTConfig, dropout_mask, evaluate, make_gpt, seeded_dropout, train_gpt


def test_corpus_split_is_seeded_by_topic_and_decodes():
    a, b, c = make_corpus(seed=0), make_corpus(seed=0), make_corpus(seed=1)
    assert a.val_topics == b.val_topics and a.val_topics != c.val_topics
    assert not set(a.val_topics) & set(a.train_topics)
    assert 0.03 < a.val.numel() / (a.train.numel() + a.val.numel()) < 0.3
    assert int(a.train.max()) < VOCAB_SIZE and a.train.dtype == torch.int64
    assert "the" in decode(a.train[:2000])


def test_batches_depend_on_seed_and_step_only_and_targets_are_shifted():
    tokens = make_corpus().train
    sampler = BatchSampler(tokens, batch=3, block=10, seed=5)
    x, y = sampler.batch_at(7)
    assert x.shape == y.shape == (3, 10)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, BatchSampler(tokens, 3, 10, seed=5).batch_at(7)[0])
    assert not torch.equal(x, sampler.batch_at(8)[0])
    with pytest.raises(ValueError, match="smaller block"):
        BatchSampler(tokens[:5], 1, 10)


def test_seeded_dropout_slices_the_whole_mask_and_is_off_without_seed():
    x = torch.ones(2, 6, 4, dtype=torch.float64)
    whole = seeded_dropout(x, 0.5, seed=3, site=2)
    part = seeded_dropout(x[:, 2:4], 0.5, seed=3, site=2, whole=(2, 6, 4), part=(slice(None), slice(2, 4)))
    assert torch.equal(part, whole[:, 2:4])
    assert set(whole.unique().tolist()) == {0.0, 2.0}
    assert not torch.equal(dropout_mask((2, 6, 4), 0.5, 3, 2), dropout_mask((2, 6, 4), 0.5, 3, 1))
    assert seeded_dropout(x, 0.5, None, 2) is x


def test_training_with_dropout_needs_a_seed_and_is_reproducible():
    config = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1)
    model = make_gpt(config, seed=1, dtype=torch.float64)
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="seed="):
        model(idx, idx)
    assert torch.equal(model(idx, seed=4)[0], model(idx, seed=4)[0])
    assert not torch.equal(model(idx, seed=4)[0], model(idx, seed=5)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx, seed=9)[0])


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_shapes_parameters_and_initial_loss(tied):
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16, tied=tied)
    model = make_gpt(config)
    h, layers = 16, 2
    per_block = 12 * h * h + 13 * h  # qkv, proj, fc, proj weights and biases; two LayerNorms
    want = 256 * h * (1 if tied else 2) + 16 * h + layers * per_block + 2 * h
    assert sum(p.numel() for p in model.parameters()) == want
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 256)
    assert abs(float(loss.detach()) - torch.log(torch.tensor(256.0)).item()) < 0.1  # near uniform at the start
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_a_small_gpt_learns_the_corpus():
    torch.manual_seed(0)
    corpus = make_corpus()
    config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    model = make_gpt(config, seed=0)
    train = BatchSampler(corpus.train, 16, config.block_size, seed=1)
    val = BatchSampler(corpus.val, 16, config.block_size, seed=2)
    before = evaluate(model, val.batch_at, 4)
    losses = train_gpt(model, train.batch_at, 150, lr=1e-2)
    after = evaluate(model, val.batch_at, 4)
    assert before > 5.3 and after < 3.3, f"validation loss {before:.2f} -> {after:.2f} after 150 steps"
    assert sum(losses[-10:]) / 10 < losses[0] - 2
