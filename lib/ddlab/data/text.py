"""A byte-level text corpus made locally, a seeded train/validation split, and a batch sampler (lab 14).

The text is the Python Language Reference's topic pages that `pydoc` shows for
`help("if")` and the like: the module `pydoc_data.topics`, generated from the Python
documentation and shipped with every CPython installation, so nothing is downloaded.
The Python documentation is distributed under the PSF License Version 2
(https://docs.python.org/3/license.html). About 460 KB of English prose and code in
some eighty topics.

Tokens are the text's UTF-8 bytes (a vocabulary of 256, every byte its own token), so
there is no tokenizer to build and any text encodes. The split is by topic: a seeded
draw puts about a tenth of the topics in the validation set, so the model is validated
on pages it never trained on, not on other windows of the same pages.

`BatchSampler.batch(step)` draws `batch` windows of `block + 1` bytes at positions that
depend only on (seed, step): every rank computes the same global batch without a
message, and a data-parallel rank takes its share of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

VOCAB_SIZE = 256


def topics() -> dict[str, str]:
    """The Python Language Reference's topic texts, by topic name (shipped with CPython)."""
    from pydoc_data.topics import topics as texts

    return dict(sorted(texts.items()))


@dataclass(frozen=True)
class TextCorpus:
    """Training and validation bytes as int64 token tensors, and which topics went where."""

    train: torch.Tensor
    val: torch.Tensor
    train_topics: tuple[str, ...]
    val_topics: tuple[str, ...]


def _encode(texts: list[str]) -> torch.Tensor:
    data = "\n\n".join(texts).encode("utf-8")
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))


def make_corpus(seed: int = 0, val_fraction: float = 0.1) -> TextCorpus:
    """The corpus split by topic: a seeded draw of round(val_fraction * topics) topics for validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
    texts = topics()
    names = list(texts)
    n_val = max(1, round(val_fraction * len(names)))
    chosen = set(np.random.default_rng(seed).choice(len(names), size=n_val, replace=False).tolist())
    val = [n for i, n in enumerate(names) if i in chosen]
    train = [n for i, n in enumerate(names) if i not in chosen]
    return TextCorpus(_encode([texts[n] for n in train]), _encode([texts[n] for n in val]), tuple(train), tuple(val))


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Bytes back to text (invalid UTF-8 sequences, e.g. a cut multi-byte character, shown as U+FFFD)."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


class BatchSampler:
    """Random windows of a token tensor: inputs (batch, block) and targets shifted by one byte."""

    def __init__(self, tokens: torch.Tensor, batch: int, block: int, seed: int = 0):
        if batch < 1 or block < 1:
            raise ValueError(f"batch and block must be positive, got batch={batch}, block={block}")
        if tokens.numel() <= block + 1:
            raise ValueError(f"a window of {block + 1} tokens does not fit in {tokens.numel()}: use a smaller block")
        self.tokens, self.batch, self.block, self.seed = tokens, batch, block, seed

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step's (inputs, targets), each (batch, block) int64: the same for a given (seed, step) everywhere."""
        starts = np.random.default_rng([self.seed, step]).integers(
            0, self.tokens.numel() - self.block - 1, size=self.batch
        )
        windows = torch.stack([self.tokens[s : s + self.block + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
