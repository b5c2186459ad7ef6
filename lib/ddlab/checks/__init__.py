"""Student-facing checks: run on every engine right after an exercise.

Each `check_<exercise>(fn)` is called on all ranks at once (in a %%px cell), runs
the student's function on sub-communicators of every size up to the world's,
compares with the reference, counts messages and bytes, and raises the same
AssertionError on every rank, saying what was wrong and where.
"""

from ._core import CheckFailed
from .cluster import check_block_range
