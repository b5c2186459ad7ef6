"""The one error every check raises (kept apart so importing it does not start MPI)."""


class CheckFailed(AssertionError):
    """A check found a wrong answer; the message says which rank and what."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows, on each engine under %%px: the message alone.

        The frames would be the check's own code, one copy per engine; the message names the
        rank, what was wrong and what to do."""
        return [f"{type(self).__name__}: {self}"]
