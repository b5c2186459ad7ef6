"""Lab 00's check of block_range: the lab's answer and a valid alternative pass, wrong blocks fail by name."""

from __future__ import annotations

import pytest
from ddlab import checks
from ddlab.runtime.blocks import block_range


def lab_answer(n: int, rank: int, size: int) -> range:  # the lab's: the first n % size ranks take one more
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def by_offsets(n: int, rank: int, size: int) -> range:  # another right answer: starts from a cumulative sum
    sizes = [n // size + (r < n % size) for r in range(size)]
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def as_list(n: int, rank: int, size: int) -> list[int]:
    return list(lab_answer(n, rank, size))


def extra_at_the_end(n: int, rank: int, size: int) -> range:  # the last ranks take the larger blocks
    reverse = lab_answer(n, size - 1 - rank, size)
    return range(n - reverse.stop, n - reverse.start)


def floor_blocks(n: int, rank: int, size: int) -> range:  # the remainder is lost
    return range(rank * (n // size), (rank + 1) * (n // size))


def test_block_range_check_passes_the_lab_answer_and_another(capsys):
    checks.check_block_range(lab_answer)
    checks.check_block_range(by_offsets)
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize(
    "wrong, words",
    [
        (as_list, "got a list, expected a range"),
        (extra_at_the_end, "the first n % size"),
        (floor_blocks, "rank 0 got indices"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_block_range_check_fails_wrong_answers(wrong, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_block_range(wrong)


def test_block_range_check_refuses_the_library_s_own():
    for answer in (block_range, lambda n, rank, size: block_range(n, rank, size)):  # as it is, and called
        with pytest.raises(checks.CheckFailed, match="the library's own answer"):
            checks.check_block_range(answer)
