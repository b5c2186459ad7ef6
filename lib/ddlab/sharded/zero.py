"""ZeRO stages 1, 2 and 3 (FSDP) on flat units, from a reduce-scatter and an allgather.

    model = Sharded(make_mlp(), comm, stage=3, prefetch=1)
    optimizer = model.attach(torch.optim.Adam(model.shards(), lr=1e-3))
    loss_fn(model(x), y).backward()      # each rank's shard of the averaged gradient is in shard.grad
    optimizer.step()                     # each rank updates its own shard only

Data parallelism keeps parameters, gradients and optimizer state on every rank: for
Adam in mixed precision 2 + 2 + 12 = 16 bytes per parameter (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020).
Here the model's parameters are grouped into units (by default each child module
that has parameters, in forward order), each unit a flat buffer cut into P shards
(`flat.py`). Rank r keeps the master copy of shard r of every unit, and the
optimizer sees only those shards (`shards()`), so its state is sharded in every stage:

- stage 1: every rank keeps all parameters and the full gradient; at the end of
  backward each unit's gradient is reduce-scattered (a rank needs only its shard's
  sum to update its shard); after the step, the parameters are allgathered.
- stage 2: as 1, but a unit's gradient is reduce-scattered as soon as the unit's
  backward has produced all of it, and the full gradient is freed then.
- stage 3 (FSDP, Zhao et al., VLDB 2023): a unit's parameters exist only while it
  computes: allgathered just before its forward, freed right after (the buffer's
  storage shrinks to nothing, so the tensors autograd saved no longer hold memory),
  allgathered again when backward reaches the unit (a hook on its outputs' gradient),
  freed when its gradient is complete and reduce-scattered.

Bytes sent per step, for Ψ parameters: stages 1 and 2 move one reduce-scatter and one
allgather, (P-1)/P Ψ each, as a ring allreduce; stage 3 two allgathers and one
reduce-scatter, 1.5 times that.

With "mpi" the collectives are MPI's non-blocking ones (`Iallgather`,
`Ireduce_scatter_block`, on a duplicate of `comm`), started in the same order on
every rank, so they overlap computing: reduce-scatters run while backward goes on
(stages 2 and 3, at most REDUCES_IN_FLIGHT at once), the allgathers after a step while
the next forward starts (stages 1 and 2), and with `prefetch=k` (stage 3) the
allgathers of the next k units, forward and backward, while the current one computes:
at most k units are gathered ahead. MPI moves a request on only inside an MPI call, so
every hook tests those in flight; a rank that must wait tests with a back-off that
sleeps instead of spinning (no helper thread: on a shared core, a thread spinning in
`Wait` takes the time of the rank computing). The collectives are pluggable
(`collectives.py`): "mpi", "ring" (lab 03's halves), or a pair of functions, which run
to their end when started (correct, no overlap). A `tracer` records the time each
rank waits for them ("allgather wait", "reduce-scatter wait").

Mixed precision (Micikevicius et al., "Mixed Precision Training", ICLR 2018): master
shards and optimizer state stay in the parameters' dtype (float32), the units are
allgathered and compute in `param_dtype` (bfloat16, float16), gradients are
reduce-scattered in `reduce_dtype` (float32). float16 needs loss scaling
(`precision.DynamicLossScale`). `checkpoint=True` recomputes each unit's forward in
backward instead of keeping its activations (Chen et al., "Training Deep Nets with
Sublinear Memory Cost", 2016).

Gradient accumulation over micro-batches: by default every backward reduce-scatters each
unit's gradient and the shards' gradients add up (`shard.grad +=`), so the full gradient never
outlives its unit (stages 2-3) but the bytes of one reduce-scatter are sent per micro-batch.
A backward run inside `with model.no_sync():` reduces nothing: each parameter's full gradient
stays and accumulates locally (ZeRO-1's gradient memory), and the next backward outside the
block reduce-scatters the sum once (one reduce-scatter's bytes per step).

A `ddlab.runtime.memory.Ledger` passed as `ledger` is charged with what the engine keeps:
parameters (full units: always in stages 1-2, while gathered in 3), gradients (the
parameters' own while they exist, the buffer being reduced, the shards' gradients) and
optimizer state (master shards here, the optimizer's state through the ledger's hook).
With a budget, a rank that runs out of it must not stop alone: the other ranks would wait
for collectives it never starts, and a communicator freed with requests in flight crashes
MPI. So the ledger defers the error (`Ledger.defer`) through each phase (forward,
backward, the optimizer's step); every rank finishes the phase's collectives, then all
agree (one allgather) and raise the same `AgreedOutOfMemory`, naming the rank and its budget.

Exercise 13.5 signature: `zero3_unit(unit, comm) -> shard`, stage 3's core for one unit (an `nn.Module`,
alike on every rank), in the parameters' dtype: the parameters made views of one flat buffer zero-padded to P
equal shards of s = ceil(N/P) items, this rank's slice copied into a new `nn.Parameter` (returned), the
buffer's storage shrunk to nothing; the unit's hooks gather every rank's current shard into it before its
forward and again before its backward, free it after its forward, and once its last gradient has arrived
reduce-scatter the flat zero-padded gradient over `comm`, set `shard.grad` to this rank's piece of the mean
(a new tensor), set the parameters' `.grad` to None and free it. `Sharded(stage=3)` and `FlatSpace` are the
library's answers to it.
"""

from __future__ import annotations

import ctypes
import functools
from collections import deque
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
import torch.utils.checkpoint
from mpi4py import MPI
from torch import nn

from ..data_parallel.sync import broadcast_parameters
from ..runtime.counting import underlying
from ..runtime.memory import AgreedOutOfMemory, Ledger, OutOfMemory
from ..runtime.reference import reference
from ..runtime.trace import Tracer
from .collectives import Collectives, CollectivesChoice, InFlight
from .flat import FlatSpace

STAGES = (1, 2, 3)
#: Reduce-scatters in flight at once: each overlaps the backward of the units before it, and
#: the bound keeps their float32 buffers to two units' worth instead of the whole model's.
REDUCES_IN_FLIGHT = 2


def raw(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as a NumPy array (bfloat16 as its int16 bits), for MPI.

    Made from the address, not `tensor.numpy()`, which would pin the storage's size and
    forbid freeing a unit by shrinking it."""
    dtype = np.dtype(np.int16) if tensor.dtype == torch.bfloat16 else torch.empty((), dtype=tensor.dtype).numpy().dtype
    nbytes = tensor.numel() * tensor.element_size()
    return np.frombuffer(memoryview((ctypes.c_byte * nbytes).from_address(tensor.data_ptr())), dtype=dtype)


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


class Unit:
    """One unit's flat space: the full buffer its parameters view, this rank's master shard, what is in flight."""

    def __init__(self, index: int, module: nn.Module, names: list[str], size: int, rank: int, param_dtype: torch.dtype):
        self.index, self.module, self.names = index, module, names
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.space = FlatSpace.of(self.params, size)
        flat = self.space.flatten([p.detach() for p in self.params], self.params[0].dtype)
        self.master = nn.Parameter(self.space.shard(flat, rank).clone())
        self.full = flat.to(param_dtype)
        for p, view in zip(self.params, self.space.views(self.full)):
            p.data = view
        self.gathered = True
        self.gathering: InFlight | None = None  # its allgather, into `full`
        self.sending: torch.Tensor | None = None  # the shard being allgathered, alive until it lands
        self.reducing: tuple[InFlight, int] | None = None  # its reduce-scatter, and the bytes of the buffer sent
        self.pending = 0  # parameters whose gradient this backward has still to produce
        self.reduced = False  # its reduce-scatter has started in this backward
        self.grad_charged = False

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()


@reference("sharded_optimizer", "zero2_hooks", "zero3_unit")
class Sharded(nn.Module):
    """`module` trained by ZeRO stage 1, 2 or 3 over the ranks of `comm`; see the module's docstring.

    units: the submodules that form units, in the order forward uses them (default: the
    children of `module` that have parameters); every parameter must be in one.
    collectives: "mpi", "ring" or (reduce_scatter, allgather) functions.
    prefetch: stage 3, units gathered ahead. param_dtype, reduce_dtype: mixed precision
    (default: the parameters' dtype). checkpoint: recompute each unit in backward.
    broadcast: start from rank 0's parameters. ledger: charged with model state.
    tracer: records the waits for collectives.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: MPI.Comm,
        stage: int = 3,
        units: list[nn.Module] | None = None,
        collectives: CollectivesChoice = "mpi",
        prefetch: int = 0,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        checkpoint: bool = False,
        broadcast: bool = True,
        ledger: Ledger | None = None,
        tracer: Tracer | None = None,
    ):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if prefetch < 0:
            raise ValueError(f"prefetch is a number of units gathered ahead (>= 0), got {prefetch}")
        self.module, self.stage, self.prefetch, self.ledger = module, stage, prefetch, ledger
        self._collectives = Collectives(collectives)
        self.tracer = tracer or Tracer(enabled=False)
        # Its own communicator: collectives in flight never mix with the caller's messages. Made first: on a
        # CountingComm every rank meets at the Dup under the deadline, so a rank that never builds the engine
        # (or builds it over other ranks) fails there instead of leaving the others in the broadcast.
        self.comm = comm.Dup()
        if broadcast:
            broadcast_parameters(module, underlying(comm))  # a CountingComm's real one: not step traffic
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        dtypes = {p.dtype for p in module.parameters()}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"the parameters must share one floating dtype (the master dtype), got {dtypes}")
        self.master_dtype = next(iter(dtypes))
        self.param_dtype = param_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.master_dtype
        if self.reduce_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"reduce_dtype must be float32 or float64 (sums need range), got {self.reduce_dtype}")
        self.units = self._make_units(units)
        self._in_backward = False
        self._sync = True  # False inside no_sync(): backward keeps the full gradients, reduces nothing
        self._reducing: deque[Unit] = deque()  # units whose reduce-scatter is in flight, oldest first
        self._grad_charged: set[int] = set()
        self._hooks: list[Any] = []
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit)))
            self._hooks.append(unit.module.register_forward_hook(functools.partial(self._after_forward, unit)))
            for p in unit.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_gradient, unit)))
            if checkpoint:
                inner = unit.module.forward
                unit.module.forward = functools.partial(torch.utils.checkpoint.checkpoint, inner, use_reentrant=False)
            if ledger is not None:
                ledger.charge("optimizer", unit.master.numel() * unit.master.element_size(), "master shard")
                if stage == 3:
                    self._free(unit, charged=False)
                else:
                    ledger.charge("parameters", unit.full_bytes, f"unit {unit.index}")
                    ledger.ignore(unit.module)
            elif stage == 3:
                self._free(unit, charged=False)

    def _make_units(self, modules: list[nn.Module] | None) -> list[Unit]:
        if modules is None:
            modules = [child for child in self.module.children() if any(True for _ in child.parameters())]
        names = {id(p): name for name, p in self.module.named_parameters()}
        seen: set[int] = set()
        units = []
        for index, module in enumerate(modules):
            mine = [p for p in module.parameters() if p.requires_grad]
            if not mine or any(id(p) in seen or id(p) not in names for p in mine):
                raise ValueError(
                    f"unit {index} ({type(module).__name__}) must be a submodule of the model with "
                    "parameters of its own, none shared with another unit"
                )
            seen.update(id(p) for p in mine)
            units.append(Unit(index, module, [names[id(p)] for p in mine], self.size, self.rank, self.param_dtype))
        left = [name for name, p in self.module.named_parameters() if p.requires_grad and id(p) not in seen]
        if left:
            raise ValueError(f"parameters {left} are in no unit: pass units= covering every parameter")
        return units

    # Public -------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.param_dtype != self.master_dtype:
            args = tuple(
                a.to(self.param_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
            )
        if not self._budgeted:
            return self.module(*args, **kwargs)
        assert self.ledger is not None
        self.ledger.defer()
        try:
            output = self.module(*args, **kwargs)
        finally:
            overdrawn = self.ledger.settle()
        self._agree(overdrawn, "the forward pass")
        return output

    def shards(self) -> list[nn.Parameter]:
        """This rank's master shards, one per unit: what the optimizer updates."""
        return [unit.master for unit in self.units]

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make `optimizer` (built on `shards()`) allgather the parameters after each step; returns it."""
        given = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if given != {id(s) for s in self.shards()}:
            raise ValueError(
                "build the optimizer on model.shards() (this rank's master shards), not on the model's parameters"
            )
        if self.ledger is not None:
            optimizer.register_step_pre_hook(self._before_step)
            self.ledger.watch(nn.Module(), optimizer)  # charges the optimizer's state after each step
        optimizer.register_step_post_hook(self._after_step)  # after the ledger's: agrees on its charge
        return optimizer

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Backwards run inside accumulate the full gradient locally; the next one outside reduces the sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def synchronize(self) -> None:
        """Wait for every collective in flight (the parameters gathered after a step, in stages 1-2)."""
        for unit in self.units:
            if unit.gathering is not None:
                self._finish_gather(unit)
        while self._reducing:
            self._finish_reduce(self._reducing.popleft())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, by name, gathered from the master shards (a collective; new tensors)."""
        self.synchronize()
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            mine = unit.master.detach().numpy()
            flat = torch.from_numpy(self._collectives.allgather(self.comm, mine, unit.space.bounds))
            out.update(zip(unit.names, (view.clone() for view in unit.space.views(flat))))
        return out

    def close(self) -> None:
        """Complete the collectives in flight, remove the hooks, free the duplicate communicator (a collective)."""
        self.synchronize()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for unit in self.units:
            unit.module.__dict__.pop("forward", None)
        self.comm.Free()

    # Running out of memory, together ---------------------------------------------
    @property
    def _budgeted(self) -> bool:
        return self.ledger is not None  # on every rank or none: all ranks agree, budget or not

    def _agree(self, overdrawn: OutOfMemory | None, phase: str) -> None:
        """All ranks: raise AgreedOutOfMemory if any rank's ledger passed its budget in this phase.

        Called where every rank has started the phase's collectives, so none waits for another. The
        agreement is bookkeeping, not the algorithm's traffic: a counting communicator neither counts nor
        refuses it (it runs on the communicator underneath)."""
        control = underlying(self.comm)
        failed = control.allreduce(overdrawn is not None, op=MPI.LOR)
        if failed:
            messages = control.allgather(None if overdrawn is None else str(overdrawn))
            failures = {rank: text for rank, text in enumerate(messages) if text is not None}
            raise AgreedOutOfMemory(failures, phase, self.size)

    # Collectives ----------------------------------------------------------------
    def _progress(self) -> None:
        """Let MPI move on the collectives in flight (it does only inside MPI calls)."""
        for unit in self.units:
            if unit.gathering is not None:
                unit.gathering.done()
        for unit in self._reducing:
            if unit.reducing is not None:
                unit.reducing[0].done()

    def _start_gather(self, unit: Unit) -> None:
        """Start allgathering the unit's shards into its full buffer (its storage back first, if freed)."""
        if unit.gathered or unit.gathering is not None:
            return
        if self.stage == 3 and self.ledger is not None:
            self.ledger.charge("parameters", unit.full_bytes, f"gathered unit {unit.index}")
        storage = unit.full.untyped_storage()
        if storage.nbytes() < unit.full_bytes:
            storage.resize_(unit.full_bytes)
        unit.sending = unit.master.detach().to(self.param_dtype)
        unit.gathering = self._collectives.start_allgather(
            self.comm, raw(unit.sending), unit.space.bounds, raw(unit.full)
        )

    def _finish_gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        self._start_gather(unit)
        assert unit.gathering is not None
        with self.tracer.span("allgather wait"):
            unit.gathering.wait()
        unit.gathering, unit.sending, unit.gathered = None, None, True
        if self.ledger is not None:
            self.ledger.ignore(unit.module)  # autograd's saved views of it are parameters, not activations

    def _free(self, unit: Unit, charged: bool = True) -> None:
        if not unit.gathered:
            return
        if self.ledger is not None:
            self.ledger.unignore(unit.module)  # the storage's address may be reused by an activation
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False
        if charged and self.ledger is not None:
            self.ledger.release("parameters", unit.full_bytes)

    def _start_reduce(self, unit: Unit) -> None:
        grads = [p.grad for p in unit.params]
        flat = unit.space.flatten(grads, self.reduce_dtype)
        if self.stage == 1:  # ZeRO-1 keeps the full gradient; zeroed, so the next backward accumulates afresh
            for p in unit.params:
                if p.grad is not None:
                    p.grad.zero_()
        else:
            for p in unit.params:
                if p.grad is not None and self.ledger is not None:
                    self.ledger.release("gradients", p.grad.numel() * p.grad.element_size())
                    self._grad_charged.discard(id(p))
                p.grad = None
        if self.ledger is not None:
            self.ledger.charge("gradients", flat.numel() * flat.element_size(), f"unit {unit.index} being reduced")
        started = self._collectives.start_reduce_scatter(self.comm, flat.numpy(), unit.space.bounds)
        unit.reducing = (started, flat.numel() * flat.element_size())
        unit.reduced = True
        self._reducing.append(unit)
        while len(self._reducing) > REDUCES_IN_FLIGHT:
            self._finish_reduce(self._reducing.popleft())
        if self.stage == 3:
            self._free(unit)

    def _finish_reduce(self, unit: Unit) -> None:
        assert unit.reducing is not None
        (started, nbytes), unit.reducing = unit.reducing, None
        with self.tracer.span("reduce-scatter wait"):
            summed = started.wait()
        shard = torch.from_numpy(summed).to(self.master_dtype).div_(self.size)
        if self.ledger is not None:
            self.ledger.release("gradients", nbytes)
            if unit.master.grad is None and not unit.grad_charged:
                self.ledger.charge("gradients", shard.numel() * shard.element_size(), "a gradient shard")
                unit.grad_charged = True
        if unit.master.grad is None:
            unit.master.grad = shard
        else:
            unit.master.grad += shard

    # Called by torch ------------------------------------------------------------
    def _before_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        self._progress()
        self._finish_gather(unit)
        if self.stage == 3:
            for ahead in self.units[unit.index + 1 : unit.index + 1 + self.prefetch]:
                self._start_gather(ahead)

    def _after_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        self._progress()
        if self.stage != 3:
            return
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._before_backward, unit))
        self._free(unit)

    def _before_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._begin_backward()
        self._progress()
        self._finish_gather(unit)
        for ahead in self.units[max(0, unit.index - self.prefetch) : unit.index][::-1]:
            self._start_gather(ahead)

    def _on_gradient(self, unit: Unit, param: torch.Tensor) -> None:
        self._begin_backward()
        if self.ledger is not None and id(param) not in self._grad_charged:
            self._grad_charged.add(id(param))
            assert param.grad is not None
            self.ledger.charge(
                "gradients",
                param.grad.numel() * param.grad.element_size(),
                f"the gradient of {tuple(param.shape)} parameters",
            )
        unit.pending -= 1
        self._progress()
        if unit.pending == 0 and self.stage >= 2:
            if self._sync:
                self._start_reduce(unit)
            elif self.stage == 3:
                self._free(unit)  # its gradient stays, accumulating; its parameters need not

    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        if self._budgeted:
            assert self.ledger is not None
            self.ledger.defer()
        for unit in self.units:
            unit.pending, unit.reduced = len(unit.params), False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Reduce what backward left (stage 1: everything; else units with unused parameters), wait for all.
        Inside no_sync, reduce nothing."""
        try:
            for unit in reversed(self.units):
                if not self._sync:  # no_sync: nothing reduced; stage 3 frees what backward left gathered
                    if self.stage == 3:
                        if unit.gathering is not None:
                            self._finish_gather(unit)  # a prefetch still in flight lands before it is freed
                        self._free(unit)
                elif not unit.reduced and (self.stage == 1 or unit.pending > 0):
                    if unit.gathering is not None:
                        self._finish_gather(unit)  # a prefetch still in flight lands (and is freed) first
                    self._start_reduce(unit)
            while self._reducing:
                self._finish_reduce(self._reducing.popleft())
        finally:
            self._in_backward = False
        if self._budgeted:
            assert self.ledger is not None
            self._agree(self.ledger.settle(), "the backward pass")

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._budgeted:
            assert self.ledger is not None
            self.ledger.defer()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.refresh()
        if self._budgeted:
            assert self.ledger is not None
            self._agree(self.ledger.settle(), "the optimizer's step")

    def refresh(self) -> None:
        """The master shards changed (a step, a loaded checkpoint): start allgathering the units (stages 1-2).

        Stage 3 gathers before each use anyway. Forward waits for each unit's allgather."""
        if self.stage == 3:
            return
        for unit in self.units:
            unit.gathered = False
            self._start_gather(unit)
