"""What each rank of a split model does and when, on two clocks: the wall clock and a busy clock.

On a machine with fewer cores than ranks (4 engines on 2 cores), the wall clock
measures the operating system's time slicing as much as the model: a stage that
shares its core with another runs twice as long, and a stage that waits for a
message frees its core for others. The *busy clock* removes that: each rank
advances it by the CPU time it spends computing (`time.thread_time`, which stops
while the rank is descheduled or asleep), and a message carries the sender's busy
time, so a receiver that is ahead jumps to the moment the data was ready and
records the gap as idle. That is Lamport's logical clock (Lamport, "Time, Clocks,
and the Ordering of Events in a Distributed System", 1978) ticking in CPU seconds:
the timeline the same run would have with one core per rank.

Both clocks record flat, non-overlapping pieces named "<kind> <micro-batch>"
(kinds: forward, backward, send, recv, idle, other) into `ddlab.runtime.trace.Tracer`s, so
`ddlab.runtime.trace.gather_spans` and `chrome_trace` work on them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.trace import Span, Tracer

KINDS = ("forward", "backward", "weight", "send", "recv", "idle", "other")
BUSY_KINDS = ("forward", "backward", "weight", "send", "recv")


def polite_barrier(comm: Comm, pause: float = 1e-3) -> None:
    """A barrier that sleeps while it waits, leaving the cores to ranks that compute."""
    request = underlying(comm).Ibarrier()
    while not request.Test():
        time.sleep(pause)


class Timeline:
    """One rank's timeline on the wall clock (`wall`) and the busy clock (`busy`).

    `span(kind, mb)` labels the time spent inside it (nested spans take over
    their part); `wait_begin()` / `wait_end(sent_at)` bracket waiting for a message.
    A disabled timeline records nothing and costs nothing.
    """

    def __init__(self, rank: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.wall, self.busy = Tracer(rank), Tracer(rank)
        self.now = 0.0  # busy clock, seconds
        self._labels: list[tuple[str, int | None]] = []  # (kind, micro-batch) of the spans we are in
        self._wall_mark = self._cpu_mark = 0.0
        self.start()

    def start(self, comm: Comm | None = None) -> None:
        """Forget what was recorded and start both clocks at 0 (after a barrier on comm, if given)."""
        if comm is not None:
            polite_barrier(comm)
        self.wall.reset()
        self.busy.reset()
        self.wall.origin = time.perf_counter()
        self.now = 0.0
        self._wall_mark, self._cpu_mark = time.perf_counter(), time.thread_time()

    def _piece(self, label: tuple[str, int | None], wall_end: float, cpu_end: float) -> None:
        """Record the time since the last mark as `label` (kind, micro-batch) on both clocks."""
        wall_start, cpu_spent = self._wall_mark, max(cpu_end - self._cpu_mark, 0.0)
        kind, mb = label
        if wall_end > wall_start:
            origin = self.wall.origin
            self.wall.add(kind, wall_start - origin, wall_end - origin, number=mb)
        if cpu_spent > 0:
            self.busy.add(kind, self.now, self.now + cpu_spent, number=mb)
            self.now += cpu_spent
        self._wall_mark, self._cpu_mark = wall_end, cpu_end

    def _mark(self) -> None:
        self._piece(self._labels[-1] if self._labels else ("other", None), time.perf_counter(), time.thread_time())

    @contextlib.contextmanager
    def span(self, kind: str, mb: int | None = None) -> Iterator[None]:
        """Label the time spent in the block as kind (of micro-batch mb)."""
        if not self.enabled:
            yield
            return
        self._mark()
        mb = self._micro_batch() if mb is None else mb
        self._labels.append((kind, mb))
        try:
            yield
        finally:
            self._mark()
            self._labels.pop()

    def reading(self) -> float:
        """The busy clock now, CPU time spent inside the current span included."""
        return self.now + max(time.thread_time() - self._cpu_mark, 0.0) if self.enabled else self.now

    def _micro_batch(self) -> int | None:
        """The micro-batch of the innermost labelled span, if any."""
        return self._labels[-1][1] if self._labels else None

    def wait_begin(self) -> None:
        """A receive starts waiting: what came before it is done."""
        if self.enabled:
            self._mark()

    def wait_end(self, sent_at: float | None, receive_cpu: float = 0.0) -> None:
        """The wait is over; the message (if any) was sent at busy time `sent_at`.

        Wall clock: the whole wait was idle. Busy clock: idle until `sent_at` if the
        sender was behind, then `receive_cpu` seconds of recv (the call that moved
        the data); the CPU spent polling meanwhile is an artefact of waiting and
        counts as nothing.
        """
        if not self.enabled:
            return
        wall_end, cpu_end = time.perf_counter(), time.thread_time()
        mb = self._micro_batch()
        if wall_end > self._wall_mark:
            origin = self.wall.origin
            self.wall.add("idle", self._wall_mark - origin, wall_end - origin, number=mb)
        if sent_at is not None and sent_at > self.now:
            self.busy.add("idle", self.now, sent_at, number=mb)
            self.now = sent_at
        if receive_cpu > 0:
            self.busy.add("recv", self.now, self.now + receive_cpu, number=mb)
            self.now += receive_cpu
        self._wall_mark, self._cpu_mark = wall_end, cpu_end


def kind_totals(spans: list[Span]) -> dict[str, float]:
    """Seconds per kind over one rank's flat spans."""
    out = dict.fromkeys(KINDS, 0.0)
    for span in spans:
        out[span.name] = out.get(span.name, 0.0) + span.duration
    return out


def utilisation(spans_by_rank: list[list[Span]]) -> dict[str, Any]:
    """Makespan, busy seconds per rank, and the bubble: the idle share of ranks x makespan.

    Busy is forward, backward, send and recv time; everything else up to the
    makespan (waiting for messages, waiting for the step to end) is idle.
    """
    starts = [s.start for spans in spans_by_rank for s in spans]
    ends = [s.end for spans in spans_by_rank for s in spans]
    makespan = (max(ends) - min(starts)) if starts else 0.0
    busy = [sum(s.duration for s in spans if s.name in BUSY_KINDS) for spans in spans_by_rank]
    bubble = 1 - sum(busy) / (len(spans_by_rank) * makespan) if makespan > 0 else 0.0
    return {"makespan": makespan, "busy": busy, "bubble": bubble}
