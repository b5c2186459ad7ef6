"""One failure-aware wait: every wait has a deadline, and gives up when another rank fails.

A `Watch` belongs to one rank's side of a communicator. `poll(done, what)` calls
`done()` until it is true, backing off between tries, and raises `Stalled` after
`timeout` seconds or `PeerFailed` as soon as another rank reports a failure with
`fail_all` (the notices travel on a private duplicate of the communicator, never
mixed with the caller's messages). `ddlab.runtime.counting.CountingComm` and
`ddlab.model_parallel.messages.Mailbox` both wait through one.

`watched(request, what)` covers the requests a student's code holds. It returns a
generalized MPI request that a helper thread completes when the real one does, or
at the deadline (cancelling the real one), so `req.Wait()`, `MPI.Request.Waitall`,
`Test` and `Testall` all return in time; the failure is kept in `failure` for the
check to report.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from mpi4py import MPI

from .reference import library_thread

SPINS = 50  # tries without sleeping: a message about to arrive costs no sleep
LONGEST_PAUSE = 2e-4  # seconds: the back-off stops here, so a waiting rank still reacts fast


class Stalled(RuntimeError):
    """A blocking call waited longer than the timeout: most likely a deadlock."""


class PeerFailed(RuntimeError):
    """Another rank failed, so the message this rank waits for will never come."""


class MessageFailed(RuntimeError):
    """MPI could not complete a watched request (most often a message larger than its receive buffer)."""


def pauses() -> Any:
    """The one back-off: SPINS tries at once, then sleeps doubling from 10 us to LONGEST_PAUSE."""
    for _ in range(SPINS):
        yield 0.0
    pause = 1e-5
    while True:
        yield pause
        pause = min(2 * pause, LONGEST_PAUSE)


class WatchedRequest(MPI.Request):
    """What a watched Isend/Irecv returns: an MPI request (Wait, Test, Waitall work) that cannot hang.

    `wait`/`test` (the object API) also hand back the received object.
    """

    entry: _Entry

    def wait(self, status: MPI.Status | None = None) -> Any:
        self.Wait(status)
        return self.entry.result

    def test(self, status: MPI.Status | None = None) -> tuple[bool, Any]:
        done = self.Test(status)
        return done, (self.entry.result if done else None)


@dataclass
class _Entry:
    real: MPI.Request
    done: MPI.Grequest | None
    what: str
    deadline: float
    pickled: bool
    status: MPI.Status = field(default_factory=MPI.Status)
    result: Any = None
    cancelled: bool = False  # the holder called Cancel
    collective: bool = False  # a collective's request, which MPI cannot cancel


#: Collective requests given up at their deadline. MPI cannot cancel them and may still write
#: into their buffers when the other ranks catch up, so the requests (which hold the buffers)
#: are kept for the life of the process rather than freed.
_ABANDONED: list[MPI.Request] = []


class Watch:
    """Deadlines and failure notices for one rank of `comm` (a collective to create: it duplicates comm)."""

    def __init__(self, comm: MPI.Comm, timeout: float):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = timeout
        self.alarm = comm.Dup()  # carries failure notices, never the caller's data
        self.alarms_sent: Counter[int] = Counter()
        self.alarms_received: Counter[int] = Counter()
        self.failure: tuple[type[RuntimeError], str] | None = None
        self._notice_lock = threading.Lock()
        self._alarm_requests: list[MPI.Request] = []
        self._entries: list[_Entry] = []
        self._entries_lock = threading.Lock()
        self._helper: threading.Thread | None = None
        self._stop = threading.Event()

    # Waiting ----------------------------------------------------------------------
    def poll(self, done: Callable[[], bool], what: str, between: Callable[[], Any] | None = None) -> float:
        """Call done() until true (between() after each miss); raise Stalled or PeerFailed instead of hanging.

        Returns the CPU seconds of the last call, the one that completed (and moved the data).
        done() also turns true when it tests a watched request that was given up (its deadline, a
        peer's failure): that request moved no data, so the failure recorded first is raised instead.
        """
        deadline = time.monotonic() + self.timeout
        for pause in pauses():
            start = time.thread_time()
            if done():
                self._raise_failure()
                return time.thread_time() - start
            self.check(what)
            if time.monotonic() > deadline:
                raise Stalled(self._stalled(what))
            if pause:
                time.sleep(pause)
            if between is not None:
                between()
        raise AssertionError("unreachable")

    def check(self, what: str) -> None:
        """Raise PeerFailed (or the failure already met) if this wait can no longer succeed."""
        self._take_notice(what)
        self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise the failure this watch has met, if any (a watched request gives up only after recording it)."""
        if self.failure is not None:
            kind, message = self.failure
            raise kind(message)

    def _stalled(self, what: str) -> str:
        return (
            f"rank {self.rank} waited {self.timeout:.0f} s for {what} and it never completed: is the "
            "matching call missing on the other rank, or are both ranks waiting for each other (a deadlock)?"
        )

    def _take_notice(self, what: str) -> None:
        """Receive one failure notice if there is one, and remember it as this watch's failure."""
        with self._notice_lock:
            notice = MPI.Status()
            if not self.alarm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, notice):
                return
            source = notice.Get_source()
            reason = self.alarm.recv(source=source)
            self.alarms_received[source] += 1
            if self.failure is None:
                self.failure = (PeerFailed, f"rank {self.rank} gave up on {what}: rank {source} failed ({reason})")

    # Failures ---------------------------------------------------------------------
    def fail_all(self, reason: str) -> None:
        """Tell every other rank that this one failed, so none waits for it forever."""
        for peer in range(self.size):
            if peer != self.rank:
                self._alarm_requests.append(self.alarm.isend(reason, peer))
                self.alarms_sent[peer] += 1

    def settle(self) -> None:
        """After a failure, on all ranks: receive every notice still meant for this rank, and start afresh.

        A collective. Waits started afterwards succeed again.
        """
        with self._notice_lock:
            sent = self.alarm.allgather(dict(self.alarms_sent))
            for source in range(self.size):
                for _ in range(sent[source].get(self.rank, 0) - self.alarms_received[source]):
                    self.alarm.recv(source=source)
                    self.alarms_received[source] += 1
            MPI.Request.Waitall(self._alarm_requests)
            self._alarm_requests.clear()
            self.failure = None

    def free(self) -> None:
        """Stop the helper and release the notice communicator (a collective)."""
        self._stop.set()
        if self._helper is not None:
            self._helper.join()
        self.alarm.Free()

    # Requests a caller holds -----------------------------------------------------
    def watched(self, real: MPI.Request, what: str, pickled: bool = False, collective: bool = False) -> WatchedRequest:
        """A request that completes when `real` does, or at the deadline (real cancelled, failure kept).

        A collective's request cannot be cancelled: at the deadline it is left behind."""
        entry = _Entry(real, None, what, time.monotonic() + self.timeout, pickled, collective=collective)
        entry.done = MPI.Grequest.Start(_query, _nothing, _cancel, args=(entry,))
        request = WatchedRequest(entry.done)
        request.entry = entry
        with self._entries_lock:
            self._entries.append(entry)
        if self._helper is None:
            self._helper = threading.Thread(target=self._complete_requests, name="ddlab-watch", daemon=True)
            library_thread(self._helper)
            self._helper.start()
        return request

    def _complete_requests(self) -> None:
        """The helper thread: the only one to touch the real requests."""
        waits = pauses()
        while not self._stop.is_set():
            with self._entries_lock:
                entries = list(self._entries)
            finished = [entry for entry in entries if self._settled(entry)]
            with self._entries_lock:
                self._entries = [entry for entry in self._entries if entry not in finished]
            if finished:
                waits = pauses()
            pause = next(waits)
            if not entries:
                time.sleep(1e-3)
            elif pause:
                time.sleep(pause)

    def _settled(self, entry: _Entry) -> bool:
        """Complete entry if its real request is done, or give it up past its deadline or a failure."""
        try:
            if entry.pickled:
                done, entry.result = entry.real.test(entry.status)
            else:
                done = entry.real.Test(entry.status)
        except MPI.Exception as err:  # MPI completed it with an error: the holder's wait returns, the check reports it
            if self.failure is None:
                self.failure = (MessageFailed, _message_failed(self.rank, entry.what, err))
            done = True
        if not done:
            self._take_notice(entry.what)
            if self.failure is None and time.monotonic() > entry.deadline:
                self.failure = (Stalled, self._stalled(entry.what))
            if self.failure is None and not entry.cancelled:
                return False
            if entry.collective:  # left behind, but kept: MPI may still write into its buffers
                _ABANDONED.append(entry.real)
            else:
                entry.real.Cancel()  # a receive is cancelled for sure; a send may not be, and is left
            entry.status.Set_cancelled(True)
        assert entry.done is not None
        entry.done.Complete()
        return True


def _message_failed(rank: int, what: str, err: MPI.Exception) -> str:
    text = f"rank {rank}: MPI could not complete {what}: {err.Get_error_string()}"
    if err.Get_error_class() == MPI.ERR_TRUNCATE:
        text += (
            " (the message was larger than the receive buffer: does the sender send the same dtype and"
            " shape, with the buffer API? A lowercase send pickles its object and cannot be received into"
            " an array)"
        )
    return text


def _query(status: MPI.Status, entry: _Entry) -> None:
    if entry.collective:  # a collective's status carries no source, tag or count
        status.Set_elements(MPI.BYTE, 0)
        status.Set_cancelled(False)
        return
    status.Set_source(entry.status.Get_source())
    status.Set_tag(entry.status.Get_tag())
    status.Set_elements(MPI.BYTE, entry.status.Get_count(MPI.BYTE))
    status.Set_cancelled(entry.status.Is_cancelled())


def _cancel(completed: bool, entry: _Entry) -> None:
    entry.cancelled = True


def _nothing(*args: Any) -> None:
    return None
