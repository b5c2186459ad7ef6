"""Per-rank memory accounting under a budget, so that running out of memory is real on CPU.

A GPU fails with "CUDA out of memory" when a rank asks for more bytes than it has;
a laptop's RAM would rather swap. A `Ledger` gives each rank a byte budget and counts
what training keeps alive, in four parts (the split of Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", 2020):

- parameters, charged when a module is watched;
- gradients, charged when autograd first accumulates a parameter's gradient;
- optimizer state, charged after each optimizer step by what the step added;
- activations: what autograd saves for the backward pass (seen through
  saved-tensor hooks, each storage counted once however often it is saved) and
  tensors that arrived by message, for as long as they are alive.

The charge that would pass the budget raises `OutOfMemory`, naming the stage and
the bytes asked for. Between `defer()` and `settle()` it is recorded instead (and
charged): an engine whose ranks share collectives finishes the phase on every rank,
then all agree on the failure (`ddlab.sharded` does, raising `AgreedOutOfMemory`). Short-lived temporaries (a layer's output before the next layer
saves it, gradients of activations during backward) are not counted: the saved
tensors are the bulk that decides whether training fits.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, cast

import torch

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


class OutOfMemory(MemoryError):
    """A stage asked for more bytes than its rank's budget holds."""

    def __init__(self, stage: str, asked: int, category: str, what: str, used: dict[str, int], budget: int):
        self.stage, self.asked, self.category, self.used, self.budget = stage, asked, category, dict(used), budget
        parts = ", ".join(f"{name} {mib(n)}" for name, n in used.items())
        super().__init__(
            f"{stage}: out of memory asking for {asked} bytes ({mib(asked)}) of {category}"
            f"{' for ' + what if what else ''}; {mib(sum(used.values()))} of the {mib(budget)} "
            f"budget in use ({parts}). Use a smaller image or batch, or split the model over more ranks."
        )


class AgreedOutOfMemory(OutOfMemory):
    """Raised alike on every rank of a group when some of its ranks ran out of memory in a phase they share."""

    def __init__(self, failures: dict[int, str], phase: str, size: int):
        self.failures, self.phase = dict(failures), phase
        first = min(failures)
        others = sorted(set(failures) - {first})
        also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
        MemoryError.__init__(
            self,
            f"out of memory on rank {first} of {size}{also} in {phase}: {failures[first]} Every rank stopped "
            "here together, with no collective left in flight: close the model and try again with a smaller "
            "model or batch, a higher ZeRO stage, more ranks, or a larger budget.",
        )


def mib(nbytes: float) -> str:
    """Bytes as mebibytes, e.g. '12.3 MiB'."""
    return f"{nbytes / 2**20:.1f} MiB"


def tensor_bytes(tensors: object) -> int:
    """Bytes of all tensors in a (nested) list, tuple or dict."""
    if isinstance(tensors, torch.Tensor):
        return tensors.untyped_storage().nbytes()
    if isinstance(tensors, dict):
        return sum(tensor_bytes(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return sum(tensor_bytes(v) for v in tensors)
    return 0


class _Release:
    """Drops one reference to a counted storage, once, however often it is called."""

    __slots__ = ("ledger", "key", "done")

    def __init__(self, ledger: Ledger, key: int):
        self.ledger, self.key, self.done = ledger, key, False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.ledger._drop(self.key)


class _Saved:
    """What a pack hook returns: the tensor; its charge is released when autograd drops it."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release: _Release):
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


class Ledger:
    """One rank's memory account: current and peak bytes per category, against a budget.

    `budget=None` only measures. Use `watch(module, optimizer)` once, run forward
    passes inside `with ledger.activations():`, and call `hold(t)` for tensors that
    arrive by message.
    """

    def __init__(self, budget: int | None = None, stage: str = "stage 0"):
        if budget is not None and budget <= 0:
            raise ValueError(f"the budget must be a positive number of bytes (or None), got {budget}")
        self.budget, self.stage = budget, stage
        self.where = ""  # what runs now (e.g. "layer 3 (Conv)"), named in OutOfMemory messages
        self.used = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, references]
        self._parameter_storages: set[int] = set()  # saved views of parameters are not activations
        self._grads_charged: set[int] = set()
        self._optimizer_bytes: dict[int, int] = {}
        self._handles: list = []
        self.deferring = False
        self.overdrawn: OutOfMemory | None = None  # the first charge past the budget while deferring

    @property
    def total(self) -> int:
        return sum(self.used.values())

    def charge(self, category: str, nbytes: int, what: str = "") -> None:
        """Add nbytes to a category, or raise OutOfMemory if the budget would be passed."""
        if self.budget is not None and self.total + nbytes > self.budget:
            where = f"{what} in {self.where}" if self.where and what else what or self.where
            error = OutOfMemory(self.stage, nbytes, category, where, self.used, self.budget)
            if not self.deferring:
                raise error
            self.overdrawn = self.overdrawn or error
        self.used[category] += nbytes
        self.peak[category] = max(self.peak[category], self.used[category])
        self.peak_total = max(self.peak_total, self.total)

    def defer(self) -> None:
        """From now until `settle`, a charge past the budget is kept in `overdrawn` (and charged), not raised."""
        self.deferring = True

    def settle(self) -> OutOfMemory | None:
        """Stop deferring; return the first charge that passed the budget since `defer` (None if none)."""
        overdrawn, self.overdrawn, self.deferring = self.overdrawn, None, False
        return overdrawn

    def release(self, category: str, nbytes: int) -> None:
        self.used[category] -= nbytes

    def reset_peak(self) -> None:
        """Start measuring peaks again from what is in use now."""
        self.peak = dict(self.used)
        self.peak_total = self.total

    # Parameters, gradients, optimizer state ------------------------------------
    def watch(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Charge module's parameters now, their gradients when created, the optimizer's state after steps."""
        self.ignore(module)
        for param in module.parameters():
            self.charge("parameters", tensor_bytes(param), f"{tuple(param.shape)} parameters")
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._on_step))

    def ignore(self, module: torch.nn.Module) -> None:
        """Never count module's parameters (or views of them) as activations, without charging them."""
        self._parameter_storages.update(p.untyped_storage().data_ptr() for p in module.parameters())

    def unignore(self, module: torch.nn.Module) -> None:
        """Undo `ignore` before module's parameter storages are freed: tensors later allocated at their
        addresses are activations again (else the allocator's reuse of an address would hide them)."""
        self._parameter_storages.difference_update(p.untyped_storage().data_ptr() for p in module.parameters())

    def _on_grad(self, param: torch.Tensor) -> None:
        if id(param) not in self._grads_charged:
            self._grads_charged.add(id(param))
            self.charge("gradients", tensor_bytes(param.grad), f"the gradient of {tuple(param.shape)} parameters")

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        now = tensor_bytes(list(optimizer.state.values()))
        before = self._optimizer_bytes.get(id(optimizer), 0)
        if now > before:
            self.charge("optimizer", now - before, f"{type(optimizer).__name__} state")
        else:
            self.release("optimizer", before - now)
        self._optimizer_bytes[id(optimizer)] = now

    def close(self) -> None:
        """Remove the hooks `watch` installed (the counts stay readable)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # Activations ----------------------------------------------------------------
    def _hold_storage(self, tensor: torch.Tensor, what: str) -> _Release | None:
        """Count tensor's storage once; return a callable that drops this reference."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._parameter_storages or isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "meta":
            return None
        entry = self._live.get(key)
        if entry is None:
            self.charge("activations", storage.nbytes(), what)
            self._live[key] = entry = [storage.nbytes(), 0]
        entry[1] += 1
        return _Release(self, key)

    def _drop(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.release("activations", entry[0])

    def _pack(self, tensor: torch.Tensor) -> object:
        release = self._hold_storage(tensor, f"a saved {tuple(tensor.shape)} tensor")
        return tensor if release is None else _Saved(tensor, release)

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else cast(torch.Tensor, saved)

    @contextlib.contextmanager
    def activations(self) -> Iterator[None]:
        """Within the block, what autograd saves for backward is charged until autograd frees it."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @contextlib.contextmanager
    def running(self, where: str) -> Iterator[None]:
        """Within the block, allocations are charged to `where` (e.g. "layer 3 (Conv)") in OutOfMemory messages."""
        previous, self.where = self.where, where
        try:
            yield
        finally:
            self.where = previous

    def hold(self, tensor: torch.Tensor, what: str = "a received tensor") -> None:
        """Charge tensor (e.g. one that arrived by message) as activations until it is garbage collected."""
        release = self._hold_storage(tensor, f"{what} {tuple(tensor.shape)}")
        if release is not None:
            weakref.finalize(tensor, release)

    def report(self) -> dict[str, int]:
        """Peak bytes per category and in total ('peak'), and the budget (0 if none)."""
        return {**self.peak, "peak": self.peak_total, "budget": self.budget or 0}
