"""One rank's stage of a UNet split over the ranks of a communicator.

Stage s holds its layers and runs, for each micro-batch, a forward that receives
what other stages send it (the activation from stage s-1, skip connections from
earlier stages), runs its layers and sends on what later stages need; and a
backward that is a single `torch.autograd.backward` over what it sent (and the
loss, on the last stage): the send/receive autograd functions carry the gradients.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models.unet import UNet, layer_names
from ..runtime.comm import Comm
from ..runtime.counting import PeerFailed, underlying
from ..runtime.memory import Ledger
from .autograd import RecvTensor, SendTensor, recv, send
from .messages import Mailbox
from .splits import StagePlan
from .timeline import Timeline

if TYPE_CHECKING:
    from .ushape import PieceStage


class Stage:
    """Rank r of comm runs stage r of `model` cut at `bounds`, for images of `image_shape` (C, H, W).

    The stage keeps its own copy of its layers. `ledger` charges its memory (a
    measuring-only ledger by default); `clock` records its timeline; `recompute`
    keeps only the stage's inputs in forward and runs the forward again in backward
    (`torch.utils.checkpoint`). Creating a stage is a collective over comm.
    """

    def __init__(
        self,
        model: UNet,
        bounds: list[int],
        comm: Comm,
        image_shape: tuple[int, ...],
        *,
        ledger: Ledger | None = None,
        clock: Timeline | None = None,
        recompute: bool = False,
        timeout: float = 60.0,
        send_function: type = SendTensor,
        recv_function: type = RecvTensor,
    ):
        self.index, size = underlying(comm).Get_rank(), underlying(comm).Get_size()
        self.plan = StagePlan(model, bounds, image_shape)
        if self.plan.k != size:
            raise ValueError(
                f"bounds {bounds} make {self.plan.k} stages but the communicator has {size} ranks: one stage per rank"
            )
        self.layers = copy.deepcopy(nn.ModuleList(model.layers[i] for i in self.plan.layers(self.index)))
        names = layer_names(model)
        self.layer_names = [f"layer {i} ({names[i]})" for i in self.plan.layers(self.index)]
        self.first, self.last = self.index == 0, self.index == self.plan.k - 1
        self.inputs, self.outputs = self.plan.inputs(self.index), self.plan.outputs(self.index)
        self.ledger = ledger or Ledger(stage=f"stage {self.index}")
        self.mailbox = Mailbox(comm, timeout, clock)
        self.clock = self.mailbox.clock
        self.recompute = recompute
        self.send_function, self.recv_function = send_function, recv_function
        self._roots: dict[int, list[torch.Tensor]] = {}
        self.losses: dict[int, float] = {}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.layers.parameters())

    def in_flight(self) -> list[int]:
        """Micro-batches whose forward is done and backward not yet."""
        return sorted(self._roots)

    def forward(self, mb: int, images: torch.Tensor, masks: torch.Tensor, scale: float) -> None:
        """Forward of micro-batch mb (images used on the first stage, masks on the last).

        The last stage's loss is the summed cross-entropy times `scale`
        (1 / pixels in the whole batch, so micro-batch gradients add up to the batch's).
        """
        if mb in self._roots:
            raise RuntimeError(f"stage {self.index}: micro-batch {mb} is already in flight (forward twice?)")
        with self.clock.span("forward", mb), self.ledger.activations():
            x, made = self._layers(*self._receive(mb, images))
            roots = [self._loss(mb, x, masks, scale)] if self.last else []
            roots += self._send(mb, x, made)
        self._roots[mb] = roots

    def backward(self, mb: int) -> None:
        """Backward of micro-batch mb: receives the gradients of what it sent, sends those of what it received."""
        if mb not in self._roots:
            raise RuntimeError(f"stage {self.index}: backward of micro-batch {mb}, whose forward has not run")
        with self.clock.span("backward", mb), self.ledger.activations():
            torch.autograd.backward(self._roots.pop(mb))

    # The steps of forward ------------------------------------------------------
    def _receive(self, mb: int, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The stage's input (the images, on the first stage) and the skips other stages send for mb.

        Received tensors are charged to the ledger while alive.
        """
        received = {}
        for edge in self.inputs:
            shape = (images.shape[0], *edge.shape)
            tensor = recv(self.mailbox, edge.src, self.plan.tag(edge, mb), shape, images.dtype, self.recv_function)
            self.ledger.hold(tensor, f"the {edge.name} from stage {edge.src}")
            received[edge.name] = tensor
        x = images if self.first else received.pop("x")
        return x, received

    def _layers(self, x: torch.Tensor, skips: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the stage's layers (checkpointed if recompute); the output, and the skips to send on by name."""
        out_names = [e.name for e in self.outputs if e.name != "x"]
        if self.recompute:
            x = x if x.requires_grad else x.detach().requires_grad_()  # reentrant checkpoint needs one
            run = functools.partial(self._run_checkpointed, list(skips), out_names)
            outs = checkpoint(run, x, *skips.values(), use_reentrant=True)
        else:
            outs = self._run(x, skips, out_names)
        return outs[0], dict(zip(out_names, outs[1:]))

    def _run(self, x: torch.Tensor, skips: dict[str, torch.Tensor], out_names: list[str]) -> tuple:
        """Run the stage's layers; skips holds the received ones, which layers pop once used."""
        for layer, name in zip(self.layers, self.layer_names):
            with self.ledger.running(name):
                x = layer(x, skips)
            self.mailbox.progress()
        return (x, *(skips[name] for name in out_names))

    def _run_checkpointed(
        self, skip_names: list[str], out_names: list[str], x: torch.Tensor, *skip_tensors: torch.Tensor
    ) -> tuple:
        return self._run(x, dict(zip(skip_names, skip_tensors)), out_names)

    def _loss(self, mb: int, out: torch.Tensor, masks: torch.Tensor, scale: float) -> torch.Tensor:
        """The last stage's loss for micro-batch mb (noted in self.losses)."""
        with self.ledger.running("the loss"):
            loss = nn.functional.cross_entropy(out, masks, reduction="sum") * scale
        self.losses[mb] = loss.item()
        return loss

    def _send(self, mb: int, x: torch.Tensor, made: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Post the output and the skips later stages need; the placeholders backward starts from."""
        return [
            send(
                x if edge.name == "x" else made[edge.name],
                self.mailbox,
                edge.dst,
                self.plan.tag(edge, mb),
                self.send_function,
            )
            for edge in self.outputs
        ]


def train_step(
    stage: Stage | PieceStage, images: torch.Tensor, masks: torch.Tensor, optimizer: torch.optim.Optimizer | None = None
) -> float | None:
    """One step on the whole batch, no pipelining: forward, backward, (optimizer step).

    Returns the loss on the last stage, None on the others.
    """
    stage.forward(0, images, masks, 1.0 / masks.numel())
    stage.backward(0)
    stage.mailbox.flush()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return stage.losses.pop(0, None)


def attempt(stage: Stage | PieceStage, fn: Callable[[], Any]) -> tuple[Any, list[str | None]]:
    """Run fn on every rank; if any rank fails, all stop cleanly. Returns (result, error per rank).

    A rank whose fn raises tells the others, which stop waiting for it (their
    errors are None: they did nothing wrong); then every rank clears the messages
    left in flight, so the stage can run again. A collective over the stage's ranks.
    """
    result, problem = None, None
    try:
        result = fn()
    except PeerFailed:
        pass
    except Exception as err:  # report it to every rank, whatever it was
        problem = f"{type(err).__name__}: {err}"
        stage.mailbox.fail(problem)
    problems = stage.mailbox.raw.allgather(problem)
    if any(problems):
        stage.mailbox.recover()
        stage._roots.clear()
        stage.losses.clear()
    return result, problems


def reference_gradients(model: UNet, images: torch.Tensor, masks: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per layer, the gradients of its parameters for this batch in one process (model is copied)."""
    single = copy.deepcopy(model)
    single.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(single(images), masks).backward()
    return [[p.grad.clone() for p in layer.parameters() if p.grad is not None] for layer in single.layers]


def gradient_error(stage: Stage | PieceStage, reference: list[list[torch.Tensor]]) -> float:
    """Largest |stage gradient - reference| over this stage's parameters (inf if one is missing)."""
    worst = 0.0
    for layer, grads in zip(stage.layers, (reference[i] for i in stage.plan.layers(stage.index))):
        for param, want in zip(layer.parameters(), grads):
            if param.grad is None:
                return float("inf")
            worst = max(worst, float((param.grad - want).abs().max()))
    return worst
