"""Per-rank timers and event traces: where each rank spends its time, and when.

A `Tracer` records named spans (start, end) on tracks of one rank:

    tracer = Tracer(rank=comm.Get_rank())
    tracer.align(comm)                      # a common time origin for all ranks
    with tracer.span("forward"):
        ...
    tracer.totals()                         # {"forward": seconds, ...}

Spans on one track may nest; `totals(exclusive=True)` then counts each second once,
in the innermost span (a "backward" span holding an "allreduce" wait is split into
backward compute and communication). Spans on other tracks (for example an
allreduce in flight while backward runs) are not nested in anything.

`gather_spans` collects every rank's spans, `chrome_trace` turns them into the
Chrome trace-event format, which Perfetto (https://ui.perfetto.dev) and
chrome://tracing open: one process row per rank, one thread row per track.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, overload

if TYPE_CHECKING:
    from mpi4py import MPI

#: The track spans go to unless told otherwise.
MAIN = "main"


@dataclass(frozen=True)
class Span:
    """One timed interval of one rank, in seconds since the tracer's origin.

    name says what the rank did ("forward", "allreduce"); number, which one of them
    (the micro-batch of a pipeline's forward, the bucket of an allreduce in flight).
    """

    name: str
    start: float
    end: float
    track: str = MAIN
    rank: int = 0
    number: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """'forward 3': the name, and the number if there is one."""
        return self.name if self.number is None else f"{self.name} {self.number}"


class Tracer:
    """Records spans of one rank; cheap enough to leave on inside a training step."""

    def __init__(self, rank: int = 0, enabled: bool = True):
        self.rank = rank
        self.enabled = enabled
        self.origin = time.perf_counter()
        self.spans: list[Span] = []

    def now(self) -> float:
        """Seconds since the origin."""
        return time.perf_counter() - self.origin

    def align(self, comm: MPI.Comm) -> None:
        """Forget recorded spans and restart the clock on every rank right after a barrier.

        Ranks leave a barrier within microseconds of each other, so their origins agree
        that well, even on different nodes whose clocks do not.
        """
        comm.Barrier()
        self.origin = time.perf_counter()
        self.spans.clear()

    def reset(self) -> None:
        """Forget recorded spans (the origin stays)."""
        self.spans.clear()

    def add(self, name: str, start: float, end: float, track: str = MAIN, number: int | None = None) -> None:
        """Record a span measured elsewhere (times from `now()`)."""
        if self.enabled:
            self.spans.append(Span(name, start, end, track, self.rank, number))

    @contextlib.contextmanager
    def span(self, name: str, track: str = MAIN) -> Iterator[None]:
        """Time the body of a `with` block."""
        if not self.enabled:
            yield
            return
        start = self.now()
        try:
            yield
        finally:
            self.spans.append(Span(name, start, self.now(), track, self.rank))

    def totals(self, exclusive: bool = True, track: str | None = MAIN) -> dict[str, float]:
        """Seconds per span name; exclusive: minus the time of spans nested inside (same track)."""
        return totals(self.spans, exclusive=exclusive, track=track)


def totals(spans: list[Span], exclusive: bool = True, track: str | None = MAIN) -> dict[str, float]:
    """Seconds per span name over `spans` of one track (all tracks if track is None)."""
    out: dict[str, float] = defaultdict(float)
    by_track: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        if track is None or span.track == track:
            by_track[span.track].append(span)
    for track_spans in by_track.values():
        for span, self_time in _self_times(track_spans) if exclusive else ((s, s.duration) for s in track_spans):
            out[span.name] += self_time
    return dict(out)


def _self_times(spans: list[Span]) -> list[tuple[Span, float]]:
    """Each span with its duration minus that of its direct children (properly nested spans)."""
    ordered = sorted(spans, key=lambda s: (s.start, -s.end))
    stack: list[list[Any]] = []  # [span, time taken by children]
    done = []
    for span in ordered:
        while stack and span.start >= stack[-1][0].end:
            parent, children = stack.pop()
            done.append((parent, parent.duration - children))
        if stack:
            stack[-1][1] += span.duration
        stack.append([span, 0.0])
    done.extend((span, span.duration - children) for span, children in reversed(stack))
    return done


@overload
def gather_spans(tracer: Tracer, comm: MPI.Comm, root: None = None) -> list[list[Span]]: ...


@overload
def gather_spans(tracer: Tracer, comm: MPI.Comm, root: int) -> list[list[Span]] | None: ...


def gather_spans(tracer: Tracer, comm: MPI.Comm, root: int | None = None) -> list[list[Span]] | None:
    """All ranks' spans, one list per rank: on every rank, or only on `root` (None elsewhere)."""
    if root is None:
        return comm.allgather(tracer.spans)
    return comm.gather(tracer.spans, root=root)


def breakdown(spans_by_rank: list[list[Span]], names: list[str], track: str = MAIN) -> list[dict[str, float]]:
    """Per rank, exclusive seconds for each of `names` (0.0 when a rank has none)."""
    out = []
    for spans in spans_by_rank:
        per_name = totals(spans, exclusive=True, track=track)
        out.append({name: per_name.get(name, 0.0) for name in names})
    return out


def chrome_trace(spans_by_rank: list[list[Span]], label: str = "rank") -> dict:
    """The Chrome trace-event JSON object: complete ("X") events in microseconds.

    Each rank is a process ("rank 0", ...), each track a thread, in order of first use.
    """
    events: list[dict] = []
    for rank, spans in enumerate(spans_by_rank):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"{label} {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        tracks = list(dict.fromkeys(span.track for span in spans))
        for tid, track in enumerate(tracks):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        tid_of = {track: tid for tid, track in enumerate(tracks)}
        for span in spans:
            events.append(
                {
                    "ph": "X",
                    "name": span.label,
                    "cat": span.track,
                    "pid": rank,
                    "tid": tid_of[span.track],
                    "ts": round(span.start * 1e6, 3),
                    "dur": round(max(span.duration, 0.0) * 1e6, 3),
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, spans_by_rank: list[list[Span]], label: str = "rank") -> Path:
    """Write the trace of all ranks to `path` (open it at https://ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans_by_rank, label)))
    return path
