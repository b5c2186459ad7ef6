"""A communicator that counts: messages and bytes per rank, and rounds on the critical path.

Checks hand a `CountingComm` to a student's collective instead of the real
communicator. It forwards point-to-point calls to MPI, records each one, and
refuses the MPI library's own collectives, so a hand-written broadcast cannot
quietly call `Bcast`, and the point-to-point calls it cannot count (persistent and
buffered sends), naming what to use instead. A matched probe (`Mprobe`, `Improbe`) is counted:
the message it returns receives through the same timeout and log as `Recv`. `traffic(...)` then gathers what every rank did.

Rounds model the alpha term: a message's round is one more than the latest round
its sender has seen, counting both the messages it received and the ones it sent
before (a rank sends one message at a time). A linear broadcast on P ranks takes
P-1 rounds, a binomial tree ceil(log2 P).

A check may allow named collectives (`allow=("Alltoallv",)`) for exercises that are
about calling one: the call is forwarded, its buffer arguments validated first (so a
count or displacement past the end of a buffer is an error, not a crash), and its
bytes logged as one send per destination and one receive per source, tag
COLLECTIVE_TAG. Alltoallv, Alltoall (lab 15's counts), Allgather and Allgatherv are supported (the gathers log
their sends only: this rank's buffer once to every other rank), Reduce_scatter (lab 13's
MPI choice: logs its sends only, each other rank's chunk of this rank's buffer to it), Allreduce (lab 08's
filter and channel parallel convolutions: named in `Traffic.calls`, bytes not logged), and
Bcast, which allows the object form `bcast` too (lab 04's parameter broadcast; named in
`Traffic.calls`). The object forms `allgather` and `allreduce`, allowed by name, are for small
values such as lab 08's channel counts: one holding an array or tensor is refused, naming the
buffer form; their pickles are logged as sends, tag COLLECTIVE_TAG. Each runs as its non-blocking twin under the timeout. Iallreduce (lab 04's
overlapped buckets) returns a watched request, so waiting on it cannot hang either.

`Split` returns a CountingComm of the sub-communicator that logs into the same
traffic, peers named by their rank in the communicator the check made, so a
hierarchical collective's messages inside and between groups are all counted;
`Traffic.unfreed` counts the communicators made (Split, Dup) and not yet `Free`d.

Blocking calls never hang a check: they wait through a `ddlab.runtime.waiting.Watch`,
giving up after `timeout` seconds with a message naming the message waited for,
and at once when another rank reports a failure through `fail_all`. The requests
Isend/Irecv return are watched too, so `Wait`/`Waitall` on them cannot hang; `unwaited()`
names those the student's code never completed (a dropped request is an error too).
"""

from __future__ import annotations

import functools
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import numpy as np
from mpi4py import MPI

from .comm import Comm
from .waiting import PeerFailed, Stalled, Watch, WatchedRequest

#: The MPI collectives, by base name: their non-blocking (I...) and persistent (..._init)
#: forms and the lower-case object API are collectives too.
COLLECTIVES = {
    "barrier",
    "bcast",
    "reduce",
    "allreduce",
    "gather",
    "gatherv",
    "scatter",
    "scatterv",
    "allgather",
    "allgatherv",
    "alltoall",
    "alltoallv",
    "alltoallw",
    "reduce_scatter",
    "reduce_scatter_block",
    "scan",
    "exscan",
}

#: Point-to-point calls the counting communicator does not count, and what to use instead.
UNCOUNTED = {
    **dict.fromkeys(
        ("Send_init", "Ssend_init", "Bsend_init", "Rsend_init", "Psend_init"), "Isend (a new request each time)"
    ),
    **dict.fromkeys(("Recv_init", "Precv_init"), "Irecv (a new request each time)"),
    **dict.fromkeys(("Bsend", "Rsend", "bsend"), "Send (or Isend and Wait)"),
    **dict.fromkeys(("Ibsend", "Irsend", "ibsend"), "Isend"),
    **dict.fromkeys(("Isendrecv", "Isendrecv_replace"), "Isend and Irecv"),
    "Attach_buffer": "Send or Isend (no buffer to attach)",
    # communicators whose messages the check could not follow
    **dict.fromkeys(("Clone", "Idup", "Dup_with_info", "Idup_with_info"), "Dup"),
    **dict.fromkeys(
        (
            "Create",
            "Create_group",
            "Split_type",
            "Create_cart",
            "Create_graph",
            "Create_dist_graph",
            "Create_dist_graph_adjacent",
            "Create_intercomm",
        ),
        "Split (by color and key)",
    ),
}


def is_collective(name: str) -> bool:
    """True for the name of an MPI collective in any form: Bcast, Ibcast, Bcast_init, bcast."""
    base = name.lower().removesuffix("_init")
    return base in COLLECTIVES or (base.startswith("i") and base[1:] in COLLECTIVES)


#: Tag of the events an allowed collective logs: below every C int, so no send or receive can carry it
#: (a receive's MPI.ANY_TAG, the default, is -1 and is logged as given).
COLLECTIVE_TAG = -(2**31) - 1
ALLOWABLE = (
    "Alltoall",
    "Alltoallv",
    "Allreduce",
    "Iallreduce",
    "Allgather",
    "Allgatherv",
    "Reduce_scatter",
    "Bcast",
    "allgather",
    "allreduce",
)


class ForbiddenCollective(RuntimeError):
    """A hand-written collective called the MPI library's own collectives."""


class UncountedCall(RuntimeError):
    """A student's code called a point-to-point operation the counting communicator cannot count."""


class MismatchedCollective(RuntimeError):
    """The ranks reached different collective calls at the same point (e.g. Split on one, Dup on another)."""


#: The communicator constructors the counting communicator offers; the ranks check they call the same one.
CONSTRUCTORS = ("Split", "Dup")


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
    calls: list[str] = field(default_factory=list)  # allowed collectives, in the order called
    unfreed: int = 0  # communicators this rank made through Split or Dup and has not freed
    unreceived: list[tuple[int, int]] = field(default_factory=list)  # (source, tag) of messages that reached
    # this rank and no receive took: found (and received) by the check harness's run_counted once the run ends

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
    def messages_received(self) -> int:
        return len(self.recvs)

    @property
    def bytes_sent(self) -> int:
        return sum(e.nbytes for e in self.sends)

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


def _vector_blocks(spec: Any, size: int, what: str) -> list[int]:
    """Bytes per rank of an mpi4py vector buffer spec, e.g. [array, (counts, displs)] or
    [array, counts, displs, datatype]; ValueError if a block lies outside the array."""
    if not isinstance(spec, (list, tuple)) or len(spec) < 2:
        raise ValueError(
            f"Alltoallv: give the {what} buffer as [array, (counts, displacements)] "
            "or [array, counts, displacements, datatype]"
        )
    data, rest = np.asarray(spec[0]), list(spec[1:])
    datatype = rest.pop() if rest and isinstance(rest[-1], MPI.Datatype) else None
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)) and len(rest[0]) == 2 and np.ndim(rest[0][0]) == 1:
        rest = list(rest[0])
    counts = np.asarray(rest[0], dtype=np.int64)
    displs = (
        np.asarray(rest[1], dtype=np.int64)
        if len(rest) > 1 and rest[1] is not None
        else np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    )
    if counts.shape != (size,) or displs.shape != (size,):
        raise ValueError(
            f"Alltoallv: the {what} counts and displacements need one entry per rank ({size}), "
            f"got {counts.size} and {displs.size}"
        )
    unit = datatype.Get_extent()[1] if datatype is not None else data.itemsize
    ends = (displs + counts) * unit
    bad = np.flatnonzero((counts < 0) | (displs < 0) | (ends > data.nbytes))
    if bad.size:
        r = int(bad[0])
        raise ValueError(
            f"Alltoallv: the {what} block for rank {r} (displacement {displs[r]}, count {counts[r]}) "
            f"lies outside the {what} buffer of {data.nbytes // unit} elements"
        )
    return (counts * unit).tolist()


def _peer(source: int) -> str:
    return "any rank" if source == MPI.ANY_SOURCE else f"rank {source}"


def _tag(tag: int) -> str:
    return "any" if tag == MPI.ANY_TAG else str(tag)


class CountingComm:
    """Wraps an mpi4py communicator; forwards point-to-point calls and records them."""

    def __init__(
        self,
        comm: MPI.Comm,
        timeout: float = 20.0,
        allow: tuple[str, ...] = (),
        stagger: float = 0.0,
        parent: CountingComm | None = None,
        on_send: Callable[[int, int], None] | None = None,
    ):
        """`stagger`: seconds a rank's first send waits per rank above it, so that messages
        to one receiver arrive in reverse rank order (a check's way to force the bad order).
        `parent`: the counting communicator this one was split from (see Split).
        `on_send(peer, tag)`: called as each send is made, before it (a check's look at the state then)."""
        unknown = set(allow) - set(ALLOWABLE)
        if unknown:
            raise ValueError(f"CountingComm can allow only {ALLOWABLE}, not {sorted(unknown)}")
        self.comm = comm
        self.timeout = timeout
        self.allow = tuple(allow)
        self._first_send_wait = stagger * (comm.Get_size() - 1 - comm.Get_rank())
        self._probing_since: float | None = None  # start of this rank's current run of Iprobe misses
        self.on_send: Callable[[int, int], None] | None = parent.on_send if parent is not None else on_send
        if parent is None:
            self.traffic, self.watch, self.members = Traffic(comm.Get_rank()), Watch(comm, timeout), None
            self.requests: list[WatchedRequest] = []
        else:  # a sub-communicator: the parent's log, watch and requests, peers translated to the parent's ranks
            self.traffic, self.watch, self.requests = parent.traffic, parent.watch, parent.requests
            self.members = comm.allgather(parent.traffic.rank)

    def free(self) -> None:
        """Release the watch's notice communicator (a collective call)."""
        self.watch.free()

    def fail_all(self, reason: str) -> None:
        """Tell every other rank that this one failed, so none waits for it forever."""
        self.watch.fail_all(reason)

    def _wait(self, requests: list[MPI.Request], statuses: list[MPI.Status], what: str, cancel: bool = True) -> None:
        """Wait for requests, but not past the timeout nor past another rank's failure.

        cancel=False for collectives' requests, which MPI cannot cancel.
        """
        try:
            self.watch.poll(lambda: MPI.Request.Testall(requests, statuses), what)
        except (Stalled, PeerFailed):
            for request in requests if cancel else ():
                if request != MPI.REQUEST_NULL:
                    request.Cancel()
            raise

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

    def agree(self, value: int, what: str) -> list[int]:
        """Every rank's value, gathered on the notice communicator under the timeout: a check's way to
        stop before a rank starts another collective the others have not matched. A sub-communicator
        (`Split`, `Dup`) gathers on its own ranks: the notice communicator spans the parent's."""
        return [int(v) for v in self._share(np.array([value], dtype=np.int64), what).ravel()]

    def _share(self, mine: np.ndarray, what: str) -> np.ndarray:
        """Every rank's int64 array `mine` (one shape on all), stacked in rank order, gathered under the
        timeout on the notice communicator, or on a sub-communicator's own ranks (that one spans the parent's)."""
        everyone = np.empty((self.size, *mine.shape), dtype=np.int64)
        on = self.watch.alarm if self.members is None else self.comm
        self._wait([on.Iallgather(mine, everyone)], [MPI.Status()], what, cancel=False)
        return everyone

    def _same_call(self, name: str) -> None:
        """Meet every rank under the timeout; raise MismatchedCollective unless each is calling `name` too."""
        codes = self.agree(CONSTRUCTORS.index(name), f"{name} to be called on every rank")
        if len(set(codes)) > 1:
            calls = ", ".join(f"rank {rank} {CONSTRUCTORS[code]}" for rank, code in enumerate(codes))
            raise MismatchedCollective(
                f"the ranks called different collectives at the same point ({calls}): every "
                "rank must make the same collective calls, in the same order"
            )

    def unwaited(self) -> str | None:
        """What the student's code left without a Wait/Test that completed it (a request never waited), or None."""
        left = [
            request.entry.what.removesuffix(" to complete").removesuffix(" to be received")
            for request in self.requests
            if request != MPI.REQUEST_NULL
        ]
        if not left:
            return None
        return (
            f"{', '.join(left)} returned a request that was never waited for: call Wait (or Waitall on all of "
            "them) on every request before returning, so the message is complete and its buffer free"
        )

    def _handed(self, request: WatchedRequest) -> WatchedRequest:
        """A request handed to the student's code, remembered so that unwaited() can name it."""
        self.requests.append(request)
        return request

    def wait(self, requests: list[MPI.Request], what: str) -> None:
        """Wait for requests (e.g. from Isend/Irecv), with the timeout and failure notices of blocking calls."""
        self._wait(requests, [MPI.Status() for _ in requests], what)

    def __getattr__(self, name: str) -> Any:
        if is_collective(name) and name not in self.allow:
            uses = (
                f"may call only comm.{', comm.'.join(self.allow)}"
                if self.allow
                else "builds it from point-to-point messages (Send/Recv, Isend/Irecv, Sendrecv) only"
            )
            what = (
                f"mpi4py's pickled object form of {name[0].upper() + name[1:]}"
                if name[0].islower() and name[0].upper() + name[1:] in self.allow
                else "the MPI library's own collective"
            )
            raise ForbiddenCollective(f"comm.{name} is {what}: this exercise {uses}.")
        if name in UNCOUNTED:
            raise UncountedCall(
                f"comm.{name} is not counted by the check's communicator: use comm.{UNCOUNTED[name]} "
                f"instead (the check counts Send/Recv, Isend/Irecv/Issend, Sendrecv, "
                f"Sendrecv_replace, Probe, Mprobe and their lower-case object forms)."
            )
        return getattr(self.comm, name)

    # Allowed collectives --------------------------------------------------------
    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        """MPI's Alltoallv, if allowed: every rank's buffers checked and agreed on first, bytes logged.

        All ranks first share their byte counts (an Iallgather, see `_share`), so that all of them refuse together a call whose counts do not
        match pairwise, or that runs past a buffer, instead of crashing or hanging.
        """
        if "Alltoallv" not in self.allow:
            return self.__getattr__("Alltoallv")
        size, problem = self.size, None
        try:
            mine = [_vector_blocks(sendbuf, size, "send"), _vector_blocks(recvbuf, size, "receive")]
        except ValueError as err:
            problem, mine = str(err), [[-1] * size, [-1] * size]
        everyone = self._share(np.array(mine, dtype=np.int64), "the other ranks to call Alltoallv")
        if problem is not None:
            raise ValueError(problem)
        sends, recvs = everyone[:, 0, :], everyone[:, 1, :]
        if (sends < 0).any():
            raise ValueError(f"Alltoallv: rank {int(np.flatnonzero((sends < 0).any(1))[0])} passed invalid buffers")
        if not np.array_equal(sends, recvs.T):
            s, d = (int(v) for v in np.argwhere(sends != recvs.T)[0])
            raise ValueError(
                f"Alltoallv: rank {s} sends rank {d} {sends[s, d]} bytes but rank {d}'s receive counts "
                f"and displacements make room for {recvs[d, s]} bytes from it (they must match pairwise)"
            )
        for peer in range(size):
            self._log("send", peer, COLLECTIVE_TAG, int(sends[self.rank, peer]))
        self._wait([self.comm.Ialltoallv(sendbuf, recvbuf)], [MPI.Status()], "Alltoallv to complete", cancel=False)
        for peer in range(size):
            self._log("recv", peer, COLLECTIVE_TAG, int(recvs[self.rank, peer]))
        self.traffic.calls.append("Alltoallv")

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        """MPI's Alltoall, if allowed (lab 15's exchange of counts): equal blocks, one per rank, bytes logged.

        As for Alltoallv, all ranks first share their buffers' sizes, so that all of them refuse
        together a call whose blocks differ from rank to rank, instead of crashing or hanging."""
        if "Alltoall" not in self.allow:
            return self.__getattr__("Alltoall")
        send, recv = _nbytes(sendbuf), _nbytes(recvbuf)
        everyone = self._share(np.array([send, recv], dtype=np.int64), "the other ranks to call Alltoall")
        if send % self.size or recv % self.size:
            raise ValueError(f"Alltoall: the buffers ({send} and {recv} bytes) must hold {self.size} equal blocks")
        if len(set(everyone.ravel().tolist())) > 1:
            sizes = ", ".join(f"rank {r} sends {s} and receives {v}" for r, (s, v) in enumerate(everyone.tolist()))
            raise ValueError(
                f"Alltoall: the ranks' buffers disagree ({sizes} bytes): every rank sends and receives "
                f"{self.size} blocks of one size, the same on every rank"
            )
        for peer in range(self.size):
            self._log("send", peer, COLLECTIVE_TAG, send // self.size)
        self._wait([self.comm.Ialltoall(sendbuf, recvbuf)], [MPI.Status()], "Alltoall to complete", cancel=False)
        for peer in range(self.size):
            self._log("recv", peer, COLLECTIVE_TAG, recv // self.size)
        self.traffic.calls.append("Alltoall")

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> None:
        """MPI's Allreduce, if allowed, as its non-blocking twin under the timeout; named in the calls."""
        if "Allreduce" not in self.allow:
            self.__getattr__("Allreduce")  # raises ForbiddenCollective
        self._wait(
            [self.comm.Iallreduce(sendbuf, recvbuf, op)],
            [MPI.Status()],
            "Allreduce to be called on every rank",
            cancel=False,
        )
        self.traffic.calls.append("Allreduce")

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> MPI.Request:
        """MPI's Iallreduce, if allowed: its request watched (waiting on it cannot hang); named in the calls."""
        if "Iallreduce" not in self.allow:
            self.__getattr__("Iallreduce")  # raises ForbiddenCollective
        self.traffic.calls.append("Iallreduce")
        return self.watch.watched(
            self.comm.Iallreduce(sendbuf, recvbuf, op),
            "Iallreduce to be started on every rank and to complete",
            collective=True,
        )

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """MPI's Bcast, if allowed, as its non-blocking twin under the timeout; named in the calls."""
        if "Bcast" not in self.allow:
            self.__getattr__("Bcast")  # raises ForbiddenCollective
        self._wait(
            [self.comm.Ibcast(buf, root)],
            [MPI.Status()],
            f"Bcast from rank {root} to be called on every rank",
            cancel=False,
        )
        self.traffic.calls.append("Bcast")

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """The object broadcast, if Bcast is allowed: the root's pickle, its length first, by Bcast."""
        if "Bcast" not in self.allow:
            self.__getattr__("bcast")  # raises ForbiddenCollective
        data = pickle.dumps(obj) if self.rank == root else b""
        length = np.array([len(data)], dtype=np.int64)
        self.Bcast(length, root)
        payload = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(length[0], np.uint8)
        self.Bcast(payload, root)
        return pickle.loads(payload.tobytes())

    def allgather(self, obj: Any) -> list[Any]:
        """The object allgather, if allowed by name: for small values (counts, shapes), not data."""
        if "allgather" not in self.allow:
            self.__getattr__("allgather")  # raises ForbiddenCollective
        _refuse_arrays(obj, "allgather", "comm.Allgather or comm.Allgatherv")
        self.traffic.calls.append("allgather")
        return self._gather_objects(obj)

    def allreduce(self, obj: Any, op: MPI.Op = MPI.SUM) -> Any:
        """The object allreduce, if allowed by name: for small values (counts, flags), not data."""
        if "allreduce" not in self.allow:
            self.__getattr__("allreduce")  # raises ForbiddenCollective
        _refuse_arrays(obj, "allreduce", "comm.Allreduce")
        self.traffic.calls.append("allreduce")
        return functools.reduce(op, self._gather_objects(obj))

    def _gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order: the pickles' lengths, then the pickles, each under the timeout; bytes logged."""
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        lengths = np.empty(self.size, dtype=np.int64)
        self._wait(
            [self.comm.Iallgather(np.array([len(data)], dtype=np.int64), lengths)],
            [MPI.Status()],
            "the object collective to be called on every rank",
            cancel=False,
        )
        for peer in range(self.size):
            if peer != self.rank:
                self._log("send", peer, COLLECTIVE_TAG, len(data))
        payload = np.empty(int(lengths.sum()), dtype=np.uint8)
        self._wait(
            [self.comm.Iallgatherv(np.frombuffer(data, dtype=np.uint8), [payload, lengths.tolist()])],
            [MPI.Status()],
            "the object collective to complete",
            cancel=False,
        )
        ends = np.cumsum(lengths).tolist()
        return [pickle.loads(payload[end - n : end].tobytes()) for n, end in zip(lengths.tolist(), ends)]

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """MPI's Allgather, if allowed; logs this rank's buffer sent to every other rank."""
        self._gather("Allgather", sendbuf, recvbuf)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        """MPI's Allgatherv, if allowed; logs this rank's buffer sent to every other rank."""
        self._gather("Allgatherv", sendbuf, recvbuf)

    def _gather(self, name: str, sendbuf: Any, recvbuf: Any) -> None:
        if name not in self.allow:
            self.__getattr__(name)  # raises ForbiddenCollective
        for peer in range(self.size):
            if peer != self.rank:
                self._log("send", peer, COLLECTIVE_TAG, _nbytes(sendbuf))
        start = self.comm.Iallgather if name == "Allgather" else self.comm.Iallgatherv
        self._wait([start(sendbuf, recvbuf)], [MPI.Status()], f"{name} to complete", cancel=False)
        self.traffic.calls.append(name)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: list[int], op: MPI.Op = MPI.SUM) -> None:
        """MPI's Reduce_scatter, if allowed; logs each other rank's chunk of sendbuf as sent to it."""
        if "Reduce_scatter" not in self.allow:
            self.__getattr__("Reduce_scatter")  # raises ForbiddenCollective
        itemsize = _nbytes(sendbuf) // max(1, sum(recvcounts))
        for peer, count in enumerate(recvcounts):
            if peer != self.rank:
                self._log("send", peer, COLLECTIVE_TAG, count * itemsize)
        self._wait(
            [self.comm.Ireduce_scatter(sendbuf, recvbuf, recvcounts, op)],
            [MPI.Status()],
            "Reduce_scatter to complete",
            cancel=False,
        )
        self.traffic.calls.append("Reduce_scatter")

    # New communicators -----------------------------------------------------------
    def Split(self, color: int = 0, key: int = 0) -> Any:
        """MPI's Split; the sub-communicator counts into this one's traffic (COMM_NULL stays COMM_NULL).

        Split blocks until every rank calls it, so the ranks first meet under the timeout
        (`_same_call`): a Split that some rank never calls fails instead of hanging.
        """
        self._same_call("Split")
        sub = self.comm.Split(color, key)
        if sub == MPI.COMM_NULL:
            return sub
        self.traffic.unfreed += 1
        return CountingComm(sub, self.timeout, self.allow, parent=self)

    def Dup(self) -> CountingComm:
        """MPI's Dup (as Idup, under the timeout); the copy counts into this one's traffic."""
        self._same_call("Dup")
        dup, request = self.comm.Idup()
        self._wait([request], [MPI.Status()], "Dup to be called on every rank", cancel=False)
        self.traffic.unfreed += 1
        return CountingComm(dup, self.timeout, self.allow, parent=self)

    def Free(self) -> None:
        """MPI's Free; `Traffic.unfreed` counts it off if this communicator came from Split or Dup."""
        self.comm.Free()
        if self.members is not None:
            self.traffic.unfreed -= 1

    def _log(self, kind: str, peer: int, tag: int, nbytes: int) -> None:
        """Record a call (before it is made); a rank's first send waits out its stagger first."""
        if kind == "send" and self._first_send_wait:
            time.sleep(self._first_send_wait)
            self._first_send_wait = 0.0
        if self.members is not None and peer >= 0:
            peer = self.members[peer]
        self.traffic.events.append(Event(kind, int(peer), int(tag), int(nbytes)))
        if kind == "send" and self.on_send is not None:
            self.on_send(int(peer), int(tag))

    # Buffer API ---------------------------------------------------------------
    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self._log("send", dest, tag, _nbytes(buf))
        self._wait(
            [self.comm.Issend(buf, dest, tag)], [MPI.Status()], f"Send to rank {dest} (tag {tag}) to be received"
        )

    Ssend = Send

    def Recv(
        self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: MPI.Status | None = None
    ) -> None:
        status = status if status is not None else MPI.Status()
        self._wait([self.comm.Irecv(buf, source, tag)], [status], f"Recv from {_peer(source)} (tag {_tag(tag)})")
        self._log("recv", status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = MPI.ANY_SOURCE,
        recvtag: int = MPI.ANY_TAG,
        status: MPI.Status | None = None,
    ) -> None:
        status = status if status is not None else MPI.Status()
        self._log("send", dest, sendtag, _nbytes(sendbuf))
        requests = [self.comm.Irecv(recvbuf, source, recvtag), self.comm.Isend(sendbuf, dest, sendtag)]
        self._wait(requests, [status, MPI.Status()], f"Sendrecv with rank {dest} / {_peer(source)}")
        self._log("recv", status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))

    def Sendrecv_replace(
        self,
        buf: Any,
        dest: int,
        sendtag: int = 0,
        source: int = MPI.ANY_SOURCE,
        recvtag: int = MPI.ANY_TAG,
        status: MPI.Status | None = None,
    ) -> None:
        status = status if status is not None else MPI.Status()
        self._log("send", dest, sendtag, _nbytes(buf))
        self._wait(
            [self.comm.Isendrecv_replace(buf, dest, sendtag, source, recvtag)],
            [status],
            f"Sendrecv_replace with rank {dest} / {_peer(source)}",
        )
        self._log("recv", status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:
        self._log("send", dest, tag, _nbytes(buf))
        return self._handed(
            self.watch.watched(self.comm.Isend(buf, dest, tag), f"Isend to rank {dest} (tag {tag}) to complete")
        )

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:
        self._log("send", dest, tag, _nbytes(buf))
        return self._handed(
            self.watch.watched(self.comm.Issend(buf, dest, tag), f"Issend to rank {dest} (tag {tag}) to be received")
        )

    def Irecv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> MPI.Request:
        self._log("recv", source, tag, _nbytes(buf))
        return self._handed(
            self.watch.watched(self.comm.Irecv(buf, source, tag), f"Irecv from {_peer(source)} (tag {_tag(tag)})")
        )

    # Object (pickle) API ------------------------------------------------------
    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        self._log("send", dest, tag, len(payload))
        self._wait(
            [self.comm.issend(obj, dest, tag)], [MPI.Status()], f"send to rank {dest} (tag {tag}) to be received"
        )

    ssend = send

    def recv(
        self, buf: Any = None, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: MPI.Status | None = None
    ) -> Any:
        status = status if status is not None else MPI.Status()
        probe = MPI.Status()
        self.watch.poll(lambda: self.comm.Iprobe(source, tag, probe), f"recv from {_peer(source)} (tag {_tag(tag)})")
        obj = self.comm.recv(buf, probe.Get_source(), probe.Get_tag(), status)
        self._log("recv", status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))
        return obj

    def sendrecv(
        self,
        sendobj: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = MPI.ANY_SOURCE,
        recvtag: int = MPI.ANY_TAG,
        status: MPI.Status | None = None,
    ) -> Any:
        request = self.isend(sendobj, dest, sendtag)
        obj = self.recv(recvbuf, source, recvtag, status)
        self._wait([request], [MPI.Status()], f"sendrecv's send to rank {dest}")
        return obj

    def isend(self, obj: Any, dest: int, tag: int = 0) -> MPI.Request:
        self._log("send", dest, tag, len(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)))
        return self._handed(
            self.watch.watched(
                self.comm.isend(obj, dest, tag), f"isend to rank {dest} (tag {tag}) to complete", pickled=True
            )
        )

    def issend(self, obj: Any, dest: int, tag: int = 0) -> MPI.Request:
        self._log("send", dest, tag, len(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)))
        return self._handed(
            self.watch.watched(
                self.comm.issend(obj, dest, tag), f"issend to rank {dest} (tag {tag}) to be received", pickled=True
            )
        )

    def irecv(self, buf: Any = None, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> MPI.Request:
        self._log("recv", source, tag, 0)
        return self._handed(
            self.watch.watched(
                self.comm.irecv(buf, source, tag), f"irecv from {_peer(source)} (tag {_tag(tag)})", pickled=True
            )
        )

    def Probe(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: MPI.Status | None = None) -> bool:
        """MPI's Probe (waits for a message without receiving it), with the timeout."""
        status = status if status is not None else MPI.Status()
        self.watch.poll(
            lambda: self.comm.Iprobe(source, tag, status), f"Probe for a message from {_peer(source)} (tag {_tag(tag)})"
        )
        return True

    probe = Probe

    def Iprobe(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: MPI.Status | None = None) -> bool:
        """MPI's Iprobe; misses in a row past the timeout (a polling loop no message ends) raise Stalled."""
        return self._probed(
            self.comm.Iprobe(source, tag, status), f"Iprobe for a message from {_peer(source)} (tag {_tag(tag)})"
        )

    def _probed(self, found: bool, what: str) -> bool:
        """found, after a non-blocking probe; a run of misses longer than the timeout raises Stalled."""
        if found:
            self._probing_since = None
            return True
        self.watch.check(what)  # another rank failed: stop polling
        now = time.monotonic()
        self._probing_since = now if self._probing_since is None else self._probing_since
        if now - self._probing_since > self.timeout:
            raise Stalled(
                f"rank {self.rank} polled {what} for {self.timeout:g} s and none came: is the matching "
                "send missing, or is this rank waiting for one message too many?"
            )
        return False

    iprobe = Iprobe

    def Mprobe(
        self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: MPI.Status | None = None
    ) -> CountedMessage:
        """MPI's matched probe, with the timeout: the message it returns is received (and counted) by its Recv."""
        status = status if status is not None else MPI.Status()
        matched: list[MPI.Message] = []

        def match() -> bool:
            message = self.comm.Improbe(source, tag, status)
            matched.extend([message] if message is not None else [])
            return message is not None

        self.watch.poll(match, f"Mprobe for a message from {_peer(source)} (tag {_tag(tag)})")
        return CountedMessage(self, matched[0], status.Get_source(), status.Get_tag())

    mprobe = Mprobe

    def Improbe(
        self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: MPI.Status | None = None
    ) -> CountedMessage | None:
        """MPI's non-blocking matched probe; misses in a row past the timeout raise Stalled (as Iprobe's)."""
        status = status if status is not None else MPI.Status()
        message = self.comm.Improbe(source, tag, status)
        self._probed(message is not None, f"Improbe for a message from {_peer(source)} (tag {_tag(tag)})")
        if message is None:
            return None
        return CountedMessage(self, message, status.Get_source(), status.Get_tag())

    improbe = Improbe


class CountedMessage:
    """A message matched by CountingComm.Mprobe/Improbe: its receives are logged and cannot hang."""

    def __init__(self, counting: CountingComm, message: MPI.Message, source: int, tag: int):
        self.counting, self.message, self.source, self.tag = counting, message, source, tag
        self.what = f"the matched message from rank {source} (tag {tag}) to be received"

    def Recv(self, buf: Any, status: MPI.Status | None = None) -> None:
        status = status if status is not None else MPI.Status()
        # A matched message cannot be cancelled, and its sender has started: wait without cancelling.
        self.counting._wait([self.message.Irecv(buf)], [status], self.what, cancel=False)
        self.counting._log("recv", self.source, self.tag, status.Get_count(MPI.BYTE))

    def Irecv(self, buf: Any) -> MPI.Request:
        self.counting._log("recv", self.source, self.tag, _nbytes(buf))
        return self.counting._handed(self.counting.watch.watched(self.message.Irecv(buf), self.what))

    def recv(self, status: MPI.Status | None = None) -> Any:
        status = status if status is not None else MPI.Status()
        request, received = self.message.irecv(), []

        def done() -> bool:
            complete, obj = request.test(status)
            received.extend([obj] if complete else [])
            return bool(complete)

        self.counting.watch.poll(done, self.what)
        self.counting._log("recv", self.source, self.tag, status.Get_count(MPI.BYTE))
        return received[0]

    def irecv(self) -> MPI.Request:
        self.counting._log("recv", self.source, self.tag, 0)
        return self.counting._handed(self.counting.watch.watched(self.message.irecv(), self.what, pickled=True))


def _refuse_arrays(obj: Any, name: str, buffer_form: str) -> None:
    """Raise ForbiddenCollective if obj holds an array or tensor: the object forms are for small values."""
    if hasattr(obj, "__array__") or isinstance(obj, memoryview):
        raise ForbiddenCollective(
            f"comm.{name} pickled a {type(obj).__name__}: the object forms carry small values (counts, shapes, "
            f"flags); send arrays and tensors with the buffer form, {buffer_form}, which moves their bytes unpickled"
        )
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else ()
    for item in items:
        _refuse_arrays(item, name, buffer_form)


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
        queue
        for (s, d, t), queue in pending.items()
        if queue and d == dest and source in (s, MPI.ANY_SOURCE) and tag in (t, MPI.ANY_TAG)
    ]
    return min(queues, key=lambda queue: queue[0]).pop(0) if queues else None


def underlying(comm: Comm) -> MPI.Comm:
    """The real communicator: comm itself, or the one a CountingComm wraps.

    For bookkeeping that is not the algorithm's own traffic (agreeing on input
    shapes before an allreduce), so it is neither counted nor refused.
    """
    return comm.comm if isinstance(comm, CountingComm) else cast(MPI.Comm, comm)


def gather_traffic(counting: CountingComm) -> list[Traffic]:
    """Every rank's Traffic, on every rank (a collective on the real communicator)."""
    return counting.comm.allgather(counting.traffic)
