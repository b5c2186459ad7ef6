"""The library's own answers to the exercises, marked, so that a check can refuse an answer that runs one.

Every function (or class) of ddlab that implements an exercise's mechanism is decorated with
`@reference("exercise")`, where "exercise" is its check's name without `check_` (for example
`@reference("allreduce_ring")` on `ddlab.allreduce.allreduce_ring`). A check runs the student's
answer inside `answering("exercise")`; while it does, a call to a reference marked for that
exercise raises `ReferenceCalled`, and is remembered, so an answer that catches the error fails
all the same when the answer returns. A reference marked for another exercise (a building block
the lab allows, such as lab 03's allreduce inside lab 04's averaging) runs as usual.

The mark costs one set lookup per call; nothing is refused outside a check.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

#: How the refusal ends: what to do instead (the lab's text lists the building blocks it allows).
WRITE_IT = "write this exercise's mechanism yourself; the text before the exercise lists what you may call"

_lock = threading.Lock()
#: exercise being answered now -> the references of it that the answer called (qualified names)
_answering: dict[str, list[str]] = {}


class ReferenceCalled(RuntimeError):
    """An answer ran the library's own implementation of the exercise it answers."""


def _refuse(name: str, exercises: tuple[str, ...]) -> None:
    with _lock:
        hit = [e for e in exercises if e in _answering]
        for exercise in hit:
            _answering[exercise].append(name)
    if hit:
        raise ReferenceCalled(f"your answer called {name}, the library's own answer to this exercise: {WRITE_IT}")


def reference(*exercises: str) -> Callable[[T], T]:
    """Mark a function or class as the library's answer to `exercises` (check names without `check_`).

    A class is marked by its constructor: building one is running the reference."""
    if not exercises:
        raise ValueError("reference() needs the exercise(s) it answers, e.g. @reference('allreduce_ring')")

    def mark(obj: T) -> T:
        name = f"{obj.__module__}.{obj.__qualname__}"  # type: ignore[attr-defined]
        if isinstance(obj, type):
            init = obj.__init__  # type: ignore[misc]

            @functools.wraps(init)
            def guarded_init(self: Any, *args: Any, **kwargs: Any) -> None:
                _refuse(name, exercises)
                init(self, *args, **kwargs)

            obj.__init__ = guarded_init  # type: ignore[misc]
            obj.__reference_of__ = exercises  # type: ignore[attr-defined]
            return obj
        func: Callable[..., Any] = obj  # type: ignore[assignment]

        @functools.wraps(func)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            _refuse(name, exercises)
            return func(*args, **kwargs)

        guarded.__reference_of__ = exercises  # type: ignore[attr-defined]
        return guarded  # type: ignore[return-value]

    return mark


def references_of(obj: Any) -> tuple[str, ...]:
    """The exercises `obj` is marked as the library's answer to (empty if unmarked)."""
    return tuple(getattr(obj, "__reference_of__", ()))


@contextlib.contextmanager
def answering(exercise: str) -> Iterator[None]:
    """Run a student's answer to `exercise`: a reference marked for it refuses to run, and if one was
    called (even if the answer caught the refusal), ReferenceCalled is raised when the block ends."""
    with _lock:
        outer = exercise in _answering
        _answering.setdefault(exercise, [])
    try:
        yield
    finally:
        with _lock:
            called = _answering.get(exercise, []) if not outer else []
            if not outer:
                _answering.pop(exercise, None)
    if called:
        raise ReferenceCalled(f"your answer called {called[0]}, the library's own answer to this exercise: {WRITE_IT}")
