"""Why a GPU's reserved memory exceeds its allocated peak: PyTorch's CUDA caching allocator, replayed on a trace.

torch on a GPU does not return a freed tensor's memory to the device: its caching allocator keeps the block and hands
it to a later request it fits. A request that no cached block fits gets a new segment from the device, so the memory
torch reserves (`torch.cuda.max_memory_reserved`, what torchtitan's benchmark tables publish) can exceed the peak of
the memory its tensors hold at once (`max_memory_allocated`, what `transformer.rank_memory` counts).

`trace` records, on this CPU process, every allocation and free a step makes (torch's profiler, which sees the
allocator under every op, DTensor's included), and `replay` runs that sequence through the rules of the caching
allocator (c10/cuda/CUDACachingAllocator.cpp, its defaults: no `max_split_size`, no expandable segments, one
stream):

- a request is rounded up to a multiple of 512 bytes; up to 1 MiB it is "small", larger "large", each pool apart;
- it takes the smallest free block of its pool that fits (the lowest address among equals), split when the rest is
  at least 512 bytes (small) or more than 1 MiB (large);
- failing that, a new segment: 2 MiB for a small request, 20 MiB for a large one under 10 MiB, else the request
  rounded up to 2 MiB;
- a freed block merges with the free blocks beside it in its segment; segments are never given back (the allocator
  does so only when the device runs out, which a replay does not model).

`loss_peaks` replays torchtitan's losses, the block where the two peaks part the most: torch frees the 16-bit
logits before the backward asks for float32 blocks they cannot hold, so that block stays reserved beside the
loss's peak (in a whole step, what else lands in it depends on every other allocation: bench/reserved_memory.py).
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MIN_BLOCK = 512
SMALL = 1 << 20  # the largest small request
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for large requests under MIN_LARGE
MIN_LARGE = 10 << 20
ROUND_LARGE = 2 << 20

#: One event of a trace: (address, bytes), the bytes negative for a free.
Event = tuple[int, int]


def trace(step: Callable[[], object]) -> list[Event]:
    """The allocations and frees `step` makes on this process's CPU allocator, in order (torch's profiler with
    `profile_memory`)."""
    from torch._C._profiler import _ExtraFields_Allocation
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _silent_stderr():  # the profiler's own start and stop lines
        prof.start()
    try:
        step()
    finally:
        with _silent_stderr():
            prof.stop()
    events: list[tuple[int, int, int]] = []
    results = None if prof.profiler is None else prof.profiler.kineto_results
    if results is None:
        raise RuntimeError("torch's profiler kept no events: is another profiler running?")
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    return [(ptr, size) for _, ptr, size in sorted(events)]


@contextmanager
def _silent_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null (the profiler's native logging writes there, not to `sys.stderr`)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _rounded(size: int) -> int:
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def _segment(size: int) -> int:
    if size <= SMALL:
        return SMALL_SEGMENT
    if size < MIN_LARGE:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class CachingAllocator:
    """The caching allocator's state: its segments' blocks, its free blocks by pool, and its peaks (bytes)."""

    free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    blocks: list[dict[int, int]] = field(default_factory=list)  # per segment: offset -> size
    taken: dict[int, tuple[bool, int, int, int]] = field(default_factory=dict)  # address -> (small, segment, ...)
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0

    def malloc(self, address: int, request: int) -> None:
        size = _rounded(request)
        small = size <= SMALL
        pool = self.free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))  # the smallest free block that fits, lowest address first
        if i < len(pool):
            block, segment, offset = pool.pop(i)
        else:
            block, segment, offset = _segment(size), len(self.blocks), 0
            self.blocks.append({0: block})
            self.reserved += block
        rest = block - size
        if rest >= MIN_BLOCK if small else rest > SMALL:
            self.blocks[segment][offset], self.blocks[segment][offset + size] = size, rest
            bisect.insort(pool, (rest, segment, offset + size))
        else:
            size = block
        self.taken[address] = (small, segment, offset, size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def release(self, address: int) -> None:
        small, segment, offset, size = self.taken.pop(address)
        self.allocated -= size
        pool, blocks = self.free[small], self.blocks[segment]
        after = offset + size
        if after in blocks and (blocks[after], segment, after) in pool:
            pool.remove((blocks[after], segment, after))
            size += blocks.pop(after)
        before = max((o for o in blocks if o < offset), default=None)
        if before is not None and before + blocks[before] == offset and (blocks[before], segment, before) in pool:
            pool.remove((blocks[before], segment, before))
            del blocks[offset]
            offset, size = before, size + blocks[before]
        blocks[offset] = size
        bisect.insort(pool, (size, segment, offset))


def replay(events: list[Event], watch: Callable[[CachingAllocator, int, int], None] | None = None) -> CachingAllocator:
    """The caching allocator after `events` (frees of memory allocated before the trace began are skipped);
    `watch(allocator, address, size)` sees it after each event it applied."""
    allocator = CachingAllocator()
    for address, size in events:
        if size > 0:
            allocator.malloc(address, size)
        elif address in allocator.taken:
            allocator.release(address)
        else:
            continue
        if watch is not None:
            watch(allocator, address, size)
    return allocator


def loss_peaks(
    tokens: int = 2048, width: int = 8, vocab: int = 8192, loss: Literal["eager", "parallel"] = "eager"
) -> tuple[float, float]:
    """Bytes per logit that torchtitan's loss holds at its allocated peak and reserves, replayed: bfloat16 logits,
    their float32 copy, torch's cross entropy, the logits deleted before the backward as its train step does.
    `loss` "eager" is torch's cross entropy; "parallel" runs it under `loss_parallel` on logits sharded over the
    vocabulary (a DTensor, as torchtitan's tensor-parallel output layer leaves them) on a one-rank mesh.

    A first step runs untraced, so the input's and the head's gradients exist before the trace, as after any step."""
    import torch
    import torch.nn.functional as F

    if min(tokens, width, vocab) < 1:
        raise ValueError(f"tokens, width and vocab must be positive, not {tokens}, {width}, {vocab}")
    if loss not in ("eager", "parallel"):
        raise ValueError(f"loss {loss!r}: choose eager (torch's cross entropy) or parallel (under loss_parallel)")
    x = torch.randn(tokens, width, dtype=torch.bfloat16)
    w = torch.randn(vocab, width, dtype=torch.bfloat16)
    labels = torch.randint(vocab, (tokens,))
    with _one_rank_mesh() if loss == "parallel" else nullcontext() as mesh:
        if mesh is not None:
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            x, w = distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w, mesh, [Shard(0)])
            labels = distribute_tensor(labels, mesh, [Replicate()])
        x.requires_grad_()
        w.requires_grad_()

        def step() -> None:
            pred = x @ w.t()
            with _loss_parallel() if mesh is not None else nullcontext():
                value = F.cross_entropy(pred.float(), labels)
                del pred
                value.backward()

        step()
        allocator = replay(trace(step))
    return allocator.peak_allocated / (tokens * vocab), allocator.peak_reserved / (tokens * vocab)


def _loss_parallel() -> AbstractContextManager[None]:
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


@contextmanager
def _one_rank_mesh() -> Iterator[DeviceMesh]:
    """A device mesh of this process alone: gloo over an in-memory store, its sockets on the loopback interface
    whatever GLOO_SOCKET_IFNAME says (nothing listens on the network; gloo keeps its loopback listener after the
    group is destroyed on the way out)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..runtime.loopback import gloo_on_loopback

    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process, and the loss_parallel replay starts its own "
            "one-rank group: destroy the running one first (dist.destroy_process_group()), or replay loss='eager'"
        )
    with gloo_on_loopback():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()
