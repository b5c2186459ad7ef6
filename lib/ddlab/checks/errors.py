"""The one error every check raises (kept apart so importing it does not start MPI)."""


class CheckFailed(AssertionError):
    """A check found a wrong answer; the message says which rank and what."""
