"""The grader's draw: the cases a check runs when it is graded, instead of the notebook's.

A notebook's check runs fixed cases the student can read, so an answer fitted to them (a buffer
just big enough for the lengths shown, a table of the three dtypes tried, the world's rank where
the communicator's is meant) would pass. When a grader sets a seed (`ddlab grade --seed S`, or
`DDLAB_GRADE_SEED=S` in nbgrader's environment: the kernel and its engines inherit it), a
converted check asks `grading_draw(comm, name)` for a `Draw` and takes its lengths, dtypes, data
and sub-communicators from it, within the domain the lab states. Every rank seeds the same
generator (the seed is rank 0's, broadcast), so all agree on every case; the same seed draws the
same cases, and a right answer passes whatever the seed. Without a seed there is no draw
(`None`) and each check runs the notebook's cases, as the lab shows them.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, TypeVar

import numpy as np

if TYPE_CHECKING:  # a check run in the kernel alone (block_range) must not start MPI
    from mpi4py import MPI

from .errors import CheckFailed

#: The environment variable that carries the grader's seed to the kernel and its engines.
SEED_VARIABLE = "DDLAB_GRADE_SEED"

T = TypeVar("T")


def _read_seed() -> int | str | None:
    """The seed in this process's environment, None if unset, or what is wrong with it (a string)."""
    text = os.environ.get(SEED_VARIABLE, "").strip()
    if not text:
        return None
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        return (
            f"{SEED_VARIABLE}={text!r} is not a grading seed: set it to a whole number of 0 or more "
            "(ddlab grade --seed S sets it), or unset it to run the notebook's own cases"
        )
    return seed


@dataclass(frozen=True)
class Draw:
    """The grader's cases for one check: every method gives the same answer on every rank for the same keys."""

    seed: int
    check: str

    def rng(self, *keys: object) -> np.random.Generator:
        """A generator for this seed, check and keys (e.g. the number of ranks, a case's index)."""
        salt = [zlib.crc32(str(key).encode()) for key in (self.check, *keys)]
        return np.random.default_rng([self.seed, *salt])

    def integer(self, low: int, high: int, *keys: object) -> int:
        """One whole number in [low, high]."""
        return int(self.rng("integer", *keys).integers(low, high + 1))

    def lengths(self, count: int, low: int, high: int, *keys: object) -> list[int]:
        """`count` different whole numbers in [low, high] (fewer if the range is smaller), in increasing order."""
        span = high - low + 1
        picked = self.rng("lengths", *keys).choice(span, size=min(count, span), replace=False)
        return sorted(int(low + i) for i in picked)

    def choose(self, domain: Sequence[T], count: int, *keys: object) -> list[T]:
        """`count` different items of the domain (all of it if smaller), in the domain's order."""
        picked = self.rng("choose", *keys).choice(len(domain), size=min(count, len(domain)), replace=False)
        return [domain[i] for i in sorted(picked)]

    def data_seed(self, *keys: object) -> int:
        """A seed for a case's input data."""
        return int(self.rng("data", *keys).integers(2**31))

    def ranks(self, size: int, p: int) -> list[int]:
        """`p` of the ranks 0..size-1 in a drawn order: the members of a sub-communicator, its rank i first."""
        return [int(r) for r in self.rng("ranks", size, p).permutation(size)[:p]]

    def __str__(self) -> str:
        return f"the grader's draw, seed {self.seed}"


def grading_draw(comm: MPI.Comm | None, check: str) -> Draw | None:
    """The grader's draw for `check`, or None outside grading. Collective on comm (rank 0's seed, broadcast);
    comm None: this process's own (a check that runs in the notebook's kernel, without MPI)."""
    found = _read_seed() if comm is None or comm.Get_rank() == 0 else None
    if comm is not None:
        found = comm.bcast(found, root=0)
    if isinstance(found, str):
        raise CheckFailed(found)
    return None if found is None else Draw(found, check)


def named(draw: Draw | None) -> str:
    """' (the grader's draw, seed S)' to append to a case's description, or '' outside grading."""
    return "" if draw is None else f" ({draw})"
