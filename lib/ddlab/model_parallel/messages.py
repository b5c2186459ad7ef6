"""Tensor messages between the stages of a split model: sends that never block, receives with a way out.

Stages post activations and gradients with `Isend` and go on computing, so no
ordering of sends can deadlock (stage 0 sending a skip connection to stage 3 must
not wait for stage 3 to be ready). Receives wait with a timeout (`Stalled`) and
give up when another rank reports a failure (`PeerFailed`), for instance running
out of memory. After a failure, `recover()` collects the messages that will never
be used, so the next step starts clean.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from mpi4py import MPI

from ..runtime.comm import Comm
from ..runtime.counting import CountingComm, underlying
from ..runtime.waiting import Watch
from .timeline import Timeline

_STAMP = np.dtype(np.float64).itemsize  # bytes of the busy-clock stamp ahead of the data
_ALIGN = 64  # torch's CPU allocations start at a multiple of 64 bytes


class Mailbox:
    """One rank's tensor messages on `comm` (an MPI communicator or a CountingComm).

    A collective to create (it duplicates the communicator for failure notices, or
    shares a CountingComm's watch). With an enabled `clock`, each message carries the
    sender's busy-clock time.
    """

    def __init__(self, comm: Comm, timeout: float = 60.0, clock: Timeline | None = None):
        self.comm, self.raw = comm, underlying(comm)
        self.rank, self.size = self.raw.Get_rank(), self.raw.Get_size()
        self.timeout = timeout
        self.clock = clock or Timeline(self.rank, enabled=False)
        self.stamped = self.clock.enabled
        self._own_watch = not isinstance(comm, CountingComm)
        self.watch = comm.watch if isinstance(comm, CountingComm) else Watch(self.raw, timeout)
        self._sends: list[tuple[MPI.Request, np.ndarray]] = []
        self._open_recv: MPI.Request | None = None
        self._open_source, self._open_status = -1, MPI.Status()
        self.sent: Counter[int] = Counter()  # messages posted to each peer
        self.received: Counter[int] = Counter()  # messages completed from each peer
        self.sent_by_tag: Counter[int] = Counter()  # messages posted with each tag
        self.bytes_by_tag: Counter[int] = Counter()  # bytes of tensor data posted with each tag

    def free(self) -> None:
        """Release the failure-notice communicator (a collective; pending sends must be done)."""
        self.flush()
        if self._own_watch:
            self.watch.free()

    # Sending ------------------------------------------------------------------
    def post(self, tensor: torch.Tensor, dest: int, tag: int) -> None:
        """Send a copy of tensor to rank dest without waiting for it to be received."""
        with self.clock.span("send"):
            data = tensor.detach().contiguous().numpy().view(np.uint8).reshape(-1)
            if self.stamped:  # stamped once copied: the data is not ready for the receiver before
                buf = np.empty(_STAMP + data.size, np.uint8)
                buf[_STAMP:] = data
                buf[:_STAMP].view(np.float64)[0] = self.clock.reading()
            else:
                buf = data.copy()
            self._sends.append((self.comm.Isend(buf, dest, tag), buf))
            self.sent[dest] += 1
            self.sent_by_tag[tag] += 1
            self.bytes_by_tag[tag] += data.size
            self.progress()

    def progress(self) -> None:
        """Let MPI move pending sends along; forget the ones that are done."""
        if self._sends:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def _all_sent(self) -> bool:
        self.progress()
        return not self._sends

    def flush(self) -> None:
        """Wait until every posted send has been received (with the timeout)."""
        self.clock.wait_begin()
        self.watch.poll(self._all_sent, f"{len(self._sends)} sends to be received")
        self.clock.wait_end(None)

    # Receiving ----------------------------------------------------------------
    def take(self, shape: tuple[int, ...], dtype: torch.dtype, source: int, tag: int) -> torch.Tensor:
        """Receive a tensor of this shape and dtype from rank source (waits, with the timeout)."""
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        header = _STAMP if self.stamped else 0
        # the data at a 64-byte boundary, stamped or not: the kernels a tensor meets may take another path (and round
        # otherwise) for another alignment, so a message's values must not depend on the clock being on
        buf = torch.empty(_ALIGN + nbytes, dtype=torch.uint8).numpy()[_ALIGN - header :]
        what = f"a {tuple(shape)} tensor from rank {source} (tag {tag})"
        self.clock.wait_begin()
        # Probe first: a receive posted for fewer bytes than the message can neither complete nor be
        # cancelled, so a shape too small would hang this rank instead of failing it. (A smaller message
        # is received; the checks count its bytes.)
        status = MPI.Status()
        self.watch.poll(lambda: self.raw.Iprobe(source, tag, status), what, self.progress)
        if status.Get_count(MPI.BYTE) > buf.size:
            arrived = status.Get_count(MPI.BYTE) - header
            raise ValueError(
                f"rank {self.rank} expected {what} of {nbytes} bytes, but the message holds {arrived} bytes: "
                "receive into the shape and dtype of the tensor that was sent (saved at forward), not of "
                "another tensor such as the placeholder's gradient"
            )
        request, received = self.comm.Irecv(buf, source, tag), MPI.Status()
        self._open_recv, self._open_source, self._open_status = request, source, received
        receive_cpu = self.watch.poll(lambda: request.Test(received), what, self.progress)
        self._open_recv = None
        self.received[source] += 1
        self.clock.wait_end(float(buf[:header].view(np.float64)[0]) if header else None, receive_cpu)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(buf[header:]).view(dtype).view(shape)

    # Failures -----------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Tell every other rank that this one failed, so none waits for it forever."""
        self.watch.fail_all(reason)

    def recover(self) -> None:
        """After a failed step, on all ranks: drop every message nobody will use, so the next step starts clean.

        Counts of messages posted and received are exchanged; each rank receives
        (and discards) the ones still meant for it, then waits for its own sends.
        """
        if self._open_recv is not None:
            if self._open_recv != MPI.REQUEST_NULL:  # still open; else the watch gave it up (status cancelled)
                self._open_recv.Cancel()
                self._open_recv.Wait(self._open_status)
            if not self._open_status.Is_cancelled():
                self.received[self._open_source] += 1
            self._open_recv = None
        sent = self.raw.allgather(dict(self.sent))
        for source in range(self.size):
            for _ in range(sent[source].get(self.rank, 0) - self.received[source]):
                status = MPI.Status()
                self.raw.Probe(source, MPI.ANY_TAG, status)
                self.raw.Recv(np.empty(status.Get_count(MPI.BYTE), np.uint8), source, status.Get_tag())
                self.received[source] += 1
        self.watch.settle()
        MPI.Request.Waitall([r for r, _ in self._sends])
        self._sends.clear()
        self.raw.Barrier()
