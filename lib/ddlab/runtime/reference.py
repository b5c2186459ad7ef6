"""The library's own answers to the exercises, marked, so that a check can refuse an answer that runs one.

Every function (or class) of ddlab that implements an exercise's mechanism is decorated with
`@reference("exercise")`, where "exercise" is its check's name without `check_` (for example
`@reference("allreduce_ring")` on `ddlab.allreduce.allreduce_ring`). Every check runs inside
`answering("exercise")` (`ddlab.checks` wraps them all). While it does, a reference marked for
that exercise refuses to run (raises `ReferenceCalled`) when the student's code is what reached
it: directly, through an alias or subclass, or through any helper of the library. The check's own
calls of the reference (to compute what to expect) run as usual, and so does a reference marked
for another exercise (a building block the lab allows, such as lab 03's allreduce in lab 04).

Who reached it is read off the call stack: going outward from the reference, the first frame that
belongs neither to the library (ddlab outside `ddlab.checks`, the standard library, installed
packages) nor to a check is the student's code. A stack that ends before either (the reference is
the target of a thread) belongs to whoever started the thread: the library marks its threads
(`library_thread`), any other thread is the answer's, whatever its name. An answer that *is* a
reference (an alias, a subclass, an autograd Function whose forward or backward is one, a partial
of one) is called by the check itself, so the checks also look at what they are given (`marked`).
A refusal is remembered, so an answer that catches the error fails all the same.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import sysconfig
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar, cast

T = TypeVar("T")

#: How a refusal ends: what to do instead (the lab's text lists the building blocks it allows).
WRITE_IT = "write this exercise's mechanism yourself; the text before the exercise lists what you may call"

_DDLAB = str(Path(__file__).resolve().parents[1])
_CHECKS = str(Path(_DDLAB) / "checks")
_LIBRARIES = tuple(
    {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(key))}
)

#: The library's own threads (runtime.waiting's helper, DataParallel's allreduce thread), marked by library_thread.
_library_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: Where an answer that is a class keeps the code a check runs (autograd Functions, modules, callables).
_RUN_BY_CHECKS = ("forward", "backward", "apply", "__call__", "__init__")

_lock = threading.Lock()
#: exercise being checked now -> the references of it that the student's code called (qualified names)
_answering: dict[str, list[str]] = {}


class ReferenceCalled(RuntimeError):
    """A student's answer ran the library's own implementation of the exercise it answers."""


def refusal(name: str) -> str:
    """The message of a refusal of the reference `name`."""
    return f"your answer called {name}, the library's own answer to this exercise: {WRITE_IT}"


def _unguarded_call(raw: Callable[..., Any]) -> Callable[..., Any]:
    """`raw`, called so that the references it reaches run as for a check (see `unguarded`)."""

    @functools.wraps(raw)
    def run_unguarded(*args: Any, **kwargs: Any) -> Any:
        return raw(*args, **kwargs)

    return run_unguarded


_UNGUARDED = _unguarded_call(print).__code__  # the code of every run_unguarded


def _reached_by_student(frame: FrameType | None) -> bool:
    """Whether, going outward from `frame`, student code comes before a check (see the module's doc)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_CHECKS) or frame.f_code is _UNGUARDED:
            return False
        if not (path.startswith(_DDLAB) or path.startswith(_LIBRARIES) or path.startswith("<frozen")):
            return True
        frame = frame.f_back
    thread = threading.current_thread()  # no frame decided: the bottom of a thread, started by whom?
    return thread is not threading.main_thread() and thread not in _library_threads


def library_thread(thread: threading.Thread | None = None) -> None:
    """Mark `thread` (default: the calling one) as the library's, so that a reference at its bottom is the library's
    call, not the answer's: before a Thread's start, or as a ThreadPoolExecutor's initializer."""
    _library_threads.add(thread or threading.current_thread())


def _refuse(name: str, exercises: tuple[str, ...]) -> None:
    if not _answering:  # the common case: no check running
        return
    with _lock:
        hit = [e for e in exercises if e in _answering]
    if hit and _reached_by_student(sys._getframe(2)):
        with _lock:
            for exercise in hit:
                _answering[exercise].append(name)
        raise ReferenceCalled(refusal(name))


def reference(*exercises: str) -> Callable[[T], T]:
    """Mark a function or class as the library's answer to `exercises` (check names without `check_`).

    A class is marked by its constructor: building one is running the reference. (A class whose
    instances are never built, such as a torch.autograd.Function, marks its methods instead.)"""
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


def unguarded(obj: T) -> T:
    """A reference without its mark, for the library's own tests of the checks (a valid answer, or the
    base of a wrong one, that the refusal would otherwise stop before the check looks at it).

    A function gives the function it wraps, run as a check runs it (the references it reaches in
    turn run too); a class, a subclass whose constructor, forward and backward are the unmarked ones,
    run the same way. An answer that digs the reference out like this is not one the refusal can
    see: it is there to be read, by the instructor."""
    if not isinstance(obj, type):
        function: Callable[..., Any] = getattr(obj, "__wrapped__", cast(Callable[..., Any], obj))
        return cast(T, _unguarded_call(function))
    plain: dict[str, Any] = {"__reference_of__": (), "__module__": obj.__module__, "__qualname__": obj.__qualname__}
    for attribute in _RUN_BY_CHECKS:
        home: Mapping[str, Any] = next((vars(c) for c in obj.__mro__ if attribute in vars(c)), {})
        found = home.get(attribute)
        inner = found.__func__ if isinstance(found, staticmethod) else found
        marked_here = attribute == "__init__" and "__reference_of__" in home
        if hasattr(inner, "__wrapped__") and (references_of(inner) or marked_here):
            raw = _unguarded_call(getattr(inner, "__wrapped__"))  # noqa: B009 (inner is typed Optional)
            plain[attribute] = staticmethod(raw) if isinstance(found, staticmethod) else raw
    plain_class: T = type(obj)(obj.__name__, (obj,), plain)
    return plain_class


def references_of(obj: Any) -> tuple[str, ...]:
    """The exercises `obj` is marked as the library's answer to (empty if unmarked)."""
    return tuple(getattr(obj, "__reference_of__", ()))


def marked(answers: Iterable[Any], exercise: str) -> str | None:
    """The qualified name of a reference of `exercise` that one of `answers` is (or holds), else None.

    Sees through aliases (the object itself), subclasses (the mark is inherited), classes whose
    forward, backward, apply or __call__ is a reference, bound methods and functools.partial."""
    for answer in answers:
        seen: list[Any] = [answer]
        for inner in ("func", "__func__", "__wrapped__"):
            if (found := getattr(answer, inner, None)) is not None:
                seen.append(found)
        if isinstance(answer, type):
            seen += [getattr(answer, attribute, None) for attribute in _RUN_BY_CHECKS]
        for candidate in seen:
            if exercise in references_of(candidate):
                if isinstance(candidate, type):  # the class of the mark, not the answer's subclass of it
                    candidate = next(c for c in candidate.__mro__ if exercise in vars(c).get("__reference_of__", ()))
                return f"{candidate.__module__}.{candidate.__qualname__}"
    return None


@contextlib.contextmanager
def answering(exercise: str) -> Iterator[list[str]]:
    """Check an answer to `exercise`: inside, a reference marked for it refuses the student's code.

    Yields the list of references the student's code called (filled as it runs), for the check
    to fail on even when the answer caught the refusal."""
    with _lock:
        outer = exercise in _answering
        called = _answering.setdefault(exercise, [])
    try:
        yield called
    finally:
        if not outer:
            with _lock:
                _answering.pop(exercise, None)
