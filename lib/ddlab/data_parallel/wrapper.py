"""DataParallel: a model replica whose backward pass ends with averaged gradients.

    model = DataParallel(make_mlp(), comm)        # broadcasts rank 0's parameters
    loss = loss_fn(model(x), y)
    loss.backward()                               # gradients are averaged over ranks here
    optimizer.step()

How, step by step (the design of PyTorch DDP, Li et al., VLDB 2020, in Python):
1. Gradients are grouped into buckets (`buckets.py`), last layer first.
2. A hook on each parameter fires when backward has accumulated its gradient. When
   every gradient of a bucket is there, its allreduce starts on the bucket's flat
   buffer (which the gradients are views of, after a first copy), while backward goes on computing the earlier layers.
   With the MPI library's allreduce that is a non-blocking `Iallreduce`. Most MPI
   libraries move it along only while the program is inside an MPI call, so later
   hooks call `Test` on it (progress="test"); or a helper thread sits in `Wait`
   (progress="thread", which needs MPI_THREAD_MULTIPLE), so MPI progresses while
   torch computes (both release Python's GIL). Any other allreduce function (lab
   03's, yours) is called in the hook and blocks until done: correct, no overlap.
3. Buckets start strictly in order 0, 1, 2, ... on every rank, so all ranks issue
   their collectives in the same order, as MPI requires.
4. At the end of backward (a callback queued on autograd's engine) the remaining
   buckets start, every allreduce is waited for and divided by the number of ranks,
   in place: `.grad` are views of the buffers.

`overlap=False` starts all buckets only at the end of backward, to measure what
overlap buys. `no_sync()` skips communication for gradient accumulation.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch
from mpi4py import MPI
from torch import nn

from ..runtime.reference import library_thread, reference
from ..runtime.trace import Tracer
from .buckets import DEFAULT_CAP_MB, Bucket, InFlight, RequestInFlight, make_buckets
from .sync import AllreduceChoice, broadcast_parameters, resolve_allreduce

#: Tracer track of allreduces in flight (from start to observed completion).
IN_FLIGHT = "allreduce in flight"


@reference("train_step", "overlapped_averaging")
class DataParallel(nn.Module):
    """Wraps `module` so that backward averages its gradients over the ranks of `comm`.

    allreduce: None or "mpi" (MPI's Iallreduce, overlapped), a name of lab 03's
    algorithms, or a function f(comm, x) -> sums. bucket_cap_mb: 25 as DDP; 0 gives
    one bucket per tensor, None one for everything. overlap, progress: see above.
    tracer: records the waits ("allreduce") and each bucket in flight.
    broadcast: start from rank 0's parameters and buffers.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: MPI.Comm,
        allreduce: AllreduceChoice = None,
        bucket_cap_mb: float | None = DEFAULT_CAP_MB,
        overlap: bool = True,
        progress: str = "test",
        tracer: Tracer | None = None,
        broadcast: bool = True,
    ):
        super().__init__()
        if progress not in ("test", "thread"):
            raise ValueError(f"progress must be 'test' or 'thread', got {progress!r}")
        if progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ValueError(
                "progress='thread' needs MPI initialised with MPI_THREAD_MULTIPLE "
                "(mpi4py's default); use progress='test'"
            )
        self.module = module
        self.comm = comm
        self.size = comm.Get_size()
        self.overlap = overlap
        self._helper = (
            ThreadPoolExecutor(1, thread_name_prefix="ddlab-allreduce", initializer=library_thread)
            if progress == "thread"
            else None
        )
        self.tracer = tracer or Tracer(comm.Get_rank(), enabled=False)
        # None and "mpi" take the non-blocking path: Iallreduce, overlapped with backward.
        self._function = None if allreduce in (None, "mpi") else resolve_allreduce(allreduce)
        if broadcast:
            broadcast_parameters(module, comm)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[Bucket] = make_buckets(params, bucket_cap_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._in_backward = False
        self._next = 0  # the next bucket to start
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate local gradients (no communication)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def remove_hooks(self) -> None:
        """Detach from the module (its gradients are then no longer averaged), stop the helper thread."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._helper is not None:
            self._helper.shutdown()

    # Called by autograd -------------------------------------------------------
    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._in_backward:
            self._begin_backward()
        if not self.overlap:
            return
        bucket = self._bucket_of[id(param)]
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])
        self._poll()

    def _begin_backward(self) -> None:
        self._in_backward = True
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next = 0
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """After the last gradient: start what is left, wait for everything, average the gradients."""
        try:
            while self._next < len(self.buckets):
                self._start(self.buckets[self._next])
            with self.tracer.span("allreduce"):
                for bucket in self.buckets:
                    self._finish(bucket)
        finally:
            self._in_backward = False

    # Communication --------------------------------------------------------------
    def _start(self, bucket: Bucket) -> None:
        """Gather the bucket's gradients into its buffer and start (or run) its allreduce."""
        self._next += 1
        bucket.gather_gradients()
        started = self.tracer.now()
        if self._function is None:
            request = self.comm.Iallreduce(MPI.IN_PLACE, bucket.buffer, op=MPI.SUM)
            in_flight: InFlight = (
                RequestInFlight(request, self.tracer.now)
                if self._helper is None
                else self._helper.submit(self._wait, request)
            )
            bucket.start(in_flight, started)
            return
        bucket.start(None, started)
        with self.tracer.span("allreduce"):
            total = self._function(self.comm, bucket.buffer.copy())
            bucket.buffer[...] = total
        self._traced(bucket, self.tracer.now())

    def _wait(self, request: MPI.Request) -> float:
        """In the helper thread: wait for the allreduce; return when it completed."""
        request.Wait()
        return self.tracer.now()

    def _traced(self, bucket: Bucket, end: float | None) -> None:
        if end is not None:
            self.tracer.add("bucket", bucket.started, end, IN_FLIGHT, number=bucket.index)

    def _poll(self) -> None:
        """Let MPI progress the allreduces in flight; note those that have completed."""
        for bucket in self.buckets[: self._next]:
            self._traced(bucket, bucket.poll())

    def _finish(self, bucket: Bucket) -> None:
        """Wait for the bucket's allreduce, then average its gradients (views of the buffer) in place."""
        self._traced(bucket, bucket.finish())
        with torch.no_grad():
            bucket.tensor.div_(self.size)
