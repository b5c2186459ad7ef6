"""A communicator that counts: messages and bytes per rank, and rounds on the critical path.

Checks hand a `CountingComm` to a student's collective instead of the real
communicator. It forwards point-to-point calls to MPI, records each one, and
refuses the MPI library's own collectives, so a hand-written broadcast cannot
quietly call `Bcast`. `traffic(...)` then gathers what every rank did.

Rounds model the alpha term: a message's round is one more than the latest round
its sender has seen, counting both the messages it received and the ones it sent
before (a rank sends one message at a time). A linear broadcast on P ranks takes
P-1 rounds, a binomial tree ceil(log2 P).

Blocking calls never hang a check: they poll, give up after `timeout` seconds
with a message naming the message waited for, and give up at once when another
rank reports a failure through `fail_all`.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

COLLECTIVES = {
    "Bcast", "bcast", "Reduce", "reduce", "Allreduce", "allreduce", "Gather", "gather",
    "Gatherv", "Scatter", "scatter", "Scatterv", "Allgather", "allgather", "Allgatherv",
    "Alltoall", "alltoall", "Alltoallv", "Reduce_scatter", "Reduce_scatter_block",
    "Scan", "Exscan", "Ibcast", "Ireduce", "Iallreduce", "Iallgather", "Ialltoall",
    "Ireduce_scatter", "Ireduce_scatter_block", "Igather", "Iscatter", "Barrier", "barrier",
    "Ibarrier",
}


class ForbiddenCollective(RuntimeError):
    """A hand-written collective called the MPI library's own collectives."""


class Stalled(RuntimeError):
    """A blocking call waited longer than the timeout: most likely a deadlock."""


class PeerFailed(RuntimeError):
    """Another rank failed, so the message this rank waits for will never come."""


@dataclass
class Event:
    kind: str  # "send" or "recv"
    peer: int
    tag: int
    nbytes: int


@dataclass
class Traffic:
    """What one rank sent and received through a CountingComm."""

    rank: int
    events: list[Event] = field(default_factory=list)

    @property
    def sends(self) -> list[Event]:
        return [e for e in self.events if e.kind == "send"]

    @property
    def recvs(self) -> list[Event]:
        return [e for e in self.events if e.kind == "recv"]

    @property
    def messages_sent(self) -> int:
        return len(self.sends)

    @property
    def bytes_sent(self) -> int:
        return sum(e.nbytes for e in self.sends)

    @property
    def messages_received(self) -> int:
        return len(self.recvs)

    @property
    def bytes_received(self) -> int:
        return sum(e.nbytes for e in self.recvs)


def _nbytes(buf: Any) -> int:
    """Bytes in an mpi4py buffer argument: an array, or [array, type] / [array, count, type]."""
    if isinstance(buf, (list, tuple)):
        data = np.asarray(buf[0])
        if len(buf) == 3 and isinstance(buf[1], int):
            return buf[1] * buf[2].Get_size()
        return data.nbytes
    return np.asarray(buf).nbytes


def _peer(source: int) -> str:
    return "any rank" if source == MPI.ANY_SOURCE else f"rank {source}"


def _tag(tag: int) -> str:
    return "any" if tag == MPI.ANY_TAG else str(tag)


class CountingComm:
    """Wraps an mpi4py communicator; forwards point-to-point calls and records them."""

    def __init__(self, comm: MPI.Comm, timeout: float = 20.0, allowed: tuple[str, ...] = ()):
        self.comm = comm
        self.timeout = timeout
        self.allowed = allowed  # collectives forwarded (uncounted) for exercises that use them, not build them
        self.traffic = Traffic(comm.Get_rank())
        self._alarm = comm.Dup()  # carries failure notices, never student data

    def free(self) -> None:
        """Release the private alarm communicator (a collective call)."""
        self._alarm.Free()

    def fail_all(self, reason: str) -> None:
        """Tell every other rank that this one failed, so none waits for it forever."""
        for peer in range(self.size):
            if peer != self.rank:
                self._alarm.isend(reason, peer)

    def _wait(self, requests: list[MPI.Request], statuses: list[MPI.Status], what: str) -> None:
        """Wait for requests, but not past the timeout nor past another rank's failure."""
        try:
            self._poll(lambda: MPI.Request.Testall(requests, statuses), what)
        except (Stalled, PeerFailed):
            for request in requests:
                if request != MPI.REQUEST_NULL:
                    request.Cancel()
            raise

    def _poll(self, done: Callable[[], bool], what: str) -> None:
        """Call done() until it is true; raise Stalled or PeerFailed instead of hanging."""
        deadline, spins = time.monotonic() + self.timeout, 0
        while not done():
            notice = MPI.Status()
            if self._alarm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, notice):
                reason = self._alarm.recv(source=notice.Get_source())
                raise PeerFailed(f"gave up on {what}: rank {notice.Get_source()} failed ({reason})")
            if time.monotonic() > deadline:
                raise Stalled(
                    f"waited {self.timeout:.0f} s for {what} and it never completed: "
                    "is the matching call missing on the other rank, or are both ranks "
                    "waiting for each other (a deadlock)?"
                )
            spins += 1
            if spins > 1000:
                time.sleep(1e-4)  # leave the core to ranks that have work (oversubscribed)

    # Identity -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def Get_rank(self) -> int:
        return self.comm.Get_rank()

    def Get_size(self) -> int:
        return self.comm.Get_size()

    def wait(self, requests: list[MPI.Request], what: str) -> None:
        """Wait for requests (e.g. from Isend/Irecv), with the timeout and failure notices of blocking calls."""
        self._wait(requests, [MPI.Status() for _ in requests], what)

    def __getattr__(self, name: str) -> Any:
        if name in self.allowed and name in COLLECTIVES:
            return self._collective(name)
        if name in COLLECTIVES:
            raise ForbiddenCollective(
                f"comm.{name} is the MPI library's own collective: this exercise builds it "
                "from point-to-point messages (Send/Recv, Isend/Irecv, Sendrecv) only."
            )
        return getattr(self.comm, name)

    def _collective(self, name: str) -> Callable[..., None]:
        """A blocking buffer collective run as its non-blocking twin (Iallreduce...), with the timeout."""
        start = getattr(self.comm, "I" + name[0].lower() + name[1:], None)
        if start is None:
            raise ForbiddenCollective(f"comm.{name} has no non-blocking twin to wait on with a timeout; use a buffer collective")

        def run(*args: Any, **kwargs: Any) -> None:
            request = start(*args, **kwargs)
            self._poll(request.Test, f"{name} to be called on every rank")

        return run

    def _log(self, kind: str, peer: int, tag: int, nbytes: int) -> None:
        self.traffic.events.append(Event(kind, int(peer), int(tag), int(nbytes)))

    # Buffer API ---------------------------------------------------------------
    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self._log("send", dest, tag, _nbytes(buf))
        self._wait([self.comm.Issend(buf, dest, tag)], [MPI.Status()], f"Send to rank {dest} (tag {tag}) to be received")

    Ssend = Send

    def Recv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
             status: MPI.Status | None = None) -> None:
        status = status if status is not None else MPI.Status()
        self._wait([self.comm.Irecv(buf, source, tag)], [status], f"Recv from {_peer(source)} (tag {_tag(tag)})")
        self._log("recv", status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG,
                 status: MPI.Status | None = None) -> None:
        status = status if status is not None else MPI.Status()
        self._log("send", dest, sendtag, _nbytes(sendbuf))
        requests = [self.comm.Irecv(recvbuf, source, recvtag), self.comm.Isend(sendbuf, dest, sendtag)]
        self._wait(requests, [status, MPI.Status()], f"Sendrecv with rank {dest} / {_peer(source)}")
        self._log("recv", status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:
        self._log("send", dest, tag, _nbytes(buf))
        return self.comm.Isend(buf, dest, tag)

    def Irecv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> MPI.Request:
        self._log("recv", source, tag, _nbytes(buf))
        return self.comm.Irecv(buf, source, tag)

    # Object (pickle) API ------------------------------------------------------
    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        self._log("send", dest, tag, len(payload))
        self._wait([self.comm.issend(obj, dest, tag)], [MPI.Status()], f"send to rank {dest} (tag {tag}) to be received")

    def recv(self, buf: Any = None, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
             status: MPI.Status | None = None) -> Any:
        status = status if status is not None else MPI.Status()
        probe = MPI.Status()
        self._poll(lambda: self.comm.Iprobe(source, tag, probe), f"recv from {_peer(source)} (tag {_tag(tag)})")
        obj = self.comm.recv(buf, probe.Get_source(), probe.Get_tag(), status)
        self._log("recv", status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))
        return obj

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG,
                 status: MPI.Status | None = None) -> Any:
        request = self.isend(sendobj, dest, sendtag)
        obj = self.recv(recvbuf, source, recvtag, status)
        self._wait([request], [MPI.Status()], f"sendrecv's send to rank {dest}")
        return obj

    def isend(self, obj: Any, dest: int, tag: int = 0) -> MPI.Request:
        self._log("send", dest, tag, len(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)))
        return self.comm.isend(obj, dest, tag)

    def irecv(self, buf: Any = None, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> MPI.Request:
        self._log("recv", source, tag, 0)
        return self.comm.irecv(buf, source, tag)

    def Probe(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
              status: MPI.Status | None = None) -> bool:
        """MPI's Probe (waits for a message without receiving it), with the timeout."""
        status = status if status is not None else MPI.Status()
        self._poll(lambda: self.comm.Iprobe(source, tag, status), f"Probe for a message from {_peer(source)} (tag {_tag(tag)})")
        return True

    probe = Probe


def rounds(all_traffic: list[Traffic], *, one_receive_at_a_time: bool = False) -> int:
    """Length of the longest chain of messages, each sent after the previous arrived.

    A message's round is one more than the largest round its sender had seen when
    sending it (rounds of messages it received before, and of its own earlier sends).
    Sends and receives are matched in order per (source, dest, tag), as MPI does;
    receives posted with ANY_SOURCE or ANY_TAG match any sender or tag.

    With `one_receive_at_a_time`, a rank also takes its receives one round after
    another, so a linear reduce (P-1 messages into the root) counts P-1 rounds, not 1.
    """
    pending: dict[tuple[int, int, int], list[int]] = {}
    cursor = {t.rank: 0 for t in all_traffic}
    seen = {t.rank: 0 for t in all_traffic}
    events = {t.rank: t.events for t in all_traffic}
    longest, progress = 0, True
    while progress:
        progress = False
        for rank, evs in events.items():
            while cursor[rank] < len(evs):
                e = evs[cursor[rank]]
                if e.kind == "send":
                    seen[rank] += 1
                    pending.setdefault((rank, e.peer, e.tag), []).append(seen[rank])
                    longest = max(longest, seen[rank])
                else:
                    arrived = _take_message(pending, e.peer, rank, e.tag)
                    if arrived is None:
                        break  # its message is not sent yet in this replay: try later
                    seen[rank] = max(seen[rank] + one_receive_at_a_time, arrived)
                    longest = max(longest, seen[rank])
                cursor[rank] += 1
                progress = True
    return longest


def _take_message(pending: dict[tuple[int, int, int], list[int]], source: int, dest: int, tag: int) -> int | None:
    """Pop the round of the message a receive matches (the earliest, for wildcards), or None."""
    queues = [
        queue for (s, d, t), queue in pending.items()
        if queue and d == dest and source in (s, MPI.ANY_SOURCE) and tag in (t, MPI.ANY_TAG)
    ]
    return min(queues, key=lambda queue: queue[0]).pop(0) if queues else None


def underlying(comm: Any) -> MPI.Comm:
    """The real communicator: comm itself, or the one a CountingComm wraps.

    For bookkeeping that is not the algorithm's own traffic (agreeing on input
    shapes before an allreduce), so it is neither counted nor refused.
    """
    return comm.comm if isinstance(comm, CountingComm) else comm


def gather_traffic(counting: CountingComm) -> list[Traffic]:
    """Every rank's Traffic, on every rank (a collective on the real communicator)."""
    return counting.comm.allgather(counting.traffic)
