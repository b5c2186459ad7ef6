"""The U-shaped (horizontal) split of a UNet: encoder level i and decoder level i on the same rank.

Cutting the list of layers in order (`naive_split`, `balanced_split`) puts the
encoder's first levels on the first ranks and the decoder's last levels on the
last ones, so a skip connection whose two ends land on different ranks becomes
a message, and the outermost one crosses from rank 0 to rank K-1. The U-shaped
split folds the network at its bottleneck instead: rank r < K-1 holds encoder
level r and decoder level r (rank 0 also the head), rank K-1 the deeper levels
and the bottleneck. The activation goes down the encoder 0 -> 1 -> ... -> K-1
and back up the decoder K-1 -> ... -> 0, so each rank runs two *pieces* per
forward (the last one, one), and no skip connection ever leaves its rank.

A layout is a list of `Piece`s in layer order, each run by one rank; `PiecePlan`
finds the tensors crossing between pieces of different ranks, and `PieceStage`
is one rank's share, with the interface of `Stage` (so `train_step`, `attempt`
and `gradient_error` work on it): the same `Mailbox` and send/receive autograd
functions, one `torch.autograd.backward` per micro-batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ..models.unet import UNet, layer_names
from ..runtime.comm import Comm
from ..runtime.counting import underlying
from ..runtime.memory import Ledger
from .autograd import RecvTensor, SendTensor, recv, send
from .messages import Mailbox
from .splits import Edge, trace_shapes
from .timeline import Timeline


@dataclass(frozen=True)
class Piece:
    """Consecutive layers of the model, run by one rank."""

    owner: int
    layers: range


def u_split(model: UNet, k: int) -> list[Piece]:
    """The U-shaped layout over k ranks: rank r < k-1 runs encoder level r and decoder level r.

    Rank k-1 runs the levels below (k-1 <= depth) and the bottleneck; rank 0 also the head.
    """
    if not 1 <= k <= model.depth + 1:
        raise ValueError(f"a UNet of depth {model.depth} folds over 1 to {model.depth + 1} ranks, not {k}")
    n = len(model.layers)
    down = {layer.saves: i for i, layer in enumerate(model.layers) if layer.saves}
    up = {layer.uses: i for i, layer in enumerate(model.layers) if layer.uses}
    enter = [0] + [down[f"skip{r}"] + 1 for r in range(k - 1)]  # first layer of encoder level r
    leave = [n] + [up[f"skip{r}"] for r in range(k - 1)]  # one past decoder level r's last layer
    encoder = [Piece(r, range(enter[r], enter[r + 1])) for r in range(k - 1)]
    decoder = [Piece(r, range(leave[r + 1], leave[r])) for r in reversed(range(k - 1))]
    return [*encoder, Piece(k - 1, range(enter[k - 1], leave[k - 1])), *decoder]


def layer_order_pieces(bounds: list[int]) -> list[Piece]:
    """A layer-order split (bounds) as pieces: stage s, one piece, on rank s."""
    return [Piece(s, range(a, b)) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))]


@dataclass(frozen=True)
class PieceEdge(Edge):
    """A tensor crossing from piece `src_piece` (on rank src) to piece `dst_piece` (on rank dst)."""

    src_piece: int = 0
    dst_piece: int = 0


class PiecePlan:
    """Pieces in layer order: which layers each rank runs, and the tensors crossing between ranks."""

    def __init__(self, model: UNet, pieces: list[Piece], image_shape: tuple[int, ...]):
        n = len(model.layers)
        if [i for p in pieces for i in p.layers] != list(range(n)):
            raise ValueError(f"pieces must cover layers 0 to {n - 1} once each, in order: {pieces}")
        self.pieces, self.k = list(pieces), max(p.owner for p in pieces) + 1
        if {p.owner for p in pieces} != set(range(self.k)):
            raise ValueError(f"every rank 0 to {self.k - 1} must run a piece: {pieces}")
        outputs, skip_shapes = trace_shapes(model, image_shape)
        piece_of = [q for q, p in enumerate(pieces) for _ in p.layers]
        found = [
            ("x", q, q + 1, outputs[pieces[q].layers[-1]])
            for q in range(len(pieces) - 1)
            if pieces[q].owner != pieces[q + 1].owner
        ]
        made = {layer.saves: i for i, layer in enumerate(model.layers) if layer.saves}
        for j, layer in enumerate(model.layers):
            if layer.uses and self.owner(piece_of[made[layer.uses]]) != self.owner(piece_of[j]):
                found.append((layer.uses, piece_of[made[layer.uses]], piece_of[j], skip_shapes[layer.uses]))
        self.edges = [
            PieceEdge(name, self.owner(a), self.owner(b), shape, i, a, b)
            for i, (name, a, b, shape) in enumerate(sorted(found, key=lambda e: (e[1], e[2], e[0])))
        ]

    def owner(self, piece: int) -> int:
        return self.pieces[piece].owner

    def own_pieces(self, rank: int) -> list[int]:
        return [q for q, p in enumerate(self.pieces) if p.owner == rank]

    def layers(self, rank: int) -> list[int]:
        """The layers rank runs, in order."""
        return [i for q in self.own_pieces(rank) for i in self.pieces[q].layers]

    def inputs(self, piece: int) -> list[PieceEdge]:
        """Edges arriving at piece: the activation first, then skips."""
        return sorted((e for e in self.edges if e.dst_piece == piece), key=lambda e: (e.name != "x", e.index))

    def outputs(self, piece: int) -> list[PieceEdge]:
        return [e for e in self.edges if e.src_piece == piece]

    def tag(self, edge: Edge, mb: int) -> int:
        """The MPI tag of edge's message for micro-batch mb (the same forward and backward)."""
        return mb * len(self.edges) + edge.index

    def describe(self) -> str:
        """One line per piece: its rank, its layers and what it sends where."""
        lines = []
        for q, p in enumerate(self.pieces):
            sends = ", ".join(f"{e.name}->{e.dst}" for e in self.outputs(q)) or "nothing"
            lines.append(f"piece {q} on rank {p.owner}: layers {p.layers.start}-{p.layers.stop - 1}, sends {sends}")
        return "\n".join(lines)


class PieceStage:
    """Rank r of comm runs its pieces of `model` laid out as `pieces`, for images of `image_shape`.

    Like `Stage` (same constructor options, same forward/backward), but a rank may
    run several pieces per forward; skips made and used on the rank stay on it.
    Creating it is a collective over comm.
    """

    def __init__(
        self,
        model: UNet,
        pieces: list[Piece],
        comm: Comm,
        image_shape: tuple[int, ...],
        *,
        ledger: Ledger | None = None,
        clock: Timeline | None = None,
        timeout: float = 60.0,
        send_function: type = SendTensor,
        recv_function: type = RecvTensor,
    ):
        self.index, size = underlying(comm).Get_rank(), underlying(comm).Get_size()
        self.plan = PiecePlan(model, pieces, image_shape)
        if self.plan.k != size:
            raise ValueError(f"the pieces run on {self.plan.k} ranks but the communicator has {size}")
        mine = self.plan.layers(self.index)
        self.layers = copy.deepcopy(nn.ModuleList(model.layers[i] for i in mine))
        self._layer = dict(zip(mine, self.layers))
        names = layer_names(model)
        self._layer_name = {i: f"layer {i} ({names[i]})" for i in mine}
        self.ledger = ledger or Ledger(stage=f"rank {self.index}")
        self.mailbox = Mailbox(comm, timeout, clock)
        self.clock = self.mailbox.clock
        self.send_function, self.recv_function = send_function, recv_function
        self._roots: dict[int, list[torch.Tensor]] = {}
        self.losses: dict[int, float] = {}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.layers.parameters())

    def forward(self, mb: int, images: torch.Tensor, masks: torch.Tensor, scale: float) -> None:
        """Forward of micro-batch mb through this rank's pieces, in layer order (images used by piece 0)."""
        if mb in self._roots:
            raise RuntimeError(f"rank {self.index}: micro-batch {mb} is already in flight (forward twice?)")
        roots: list[torch.Tensor] = []
        skips: dict[str, torch.Tensor] = {}  # made on this rank for its later pieces, or received
        x = images
        with self.clock.span("forward", mb), self.ledger.activations():
            for q in self.plan.own_pieces(self.index):
                for edge in self.plan.inputs(q):
                    tensor = recv(
                        self.mailbox,
                        edge.src,
                        self.plan.tag(edge, mb),
                        (images.shape[0], *edge.shape),
                        images.dtype,
                        self.recv_function,
                    )
                    self.ledger.hold(tensor, f"the {edge.name} from rank {edge.src}")
                    if edge.name == "x":
                        x = tensor
                    else:
                        skips[edge.name] = tensor
                for i in self.plan.pieces[q].layers:
                    with self.ledger.running(self._layer_name[i]):
                        x = self._layer[i](x, skips)
                    self.mailbox.progress()
                if q == len(self.plan.pieces) - 1:
                    with self.ledger.running("the loss"):
                        loss = nn.functional.cross_entropy(x, masks, reduction="sum") * scale
                    self.losses[mb] = loss.item()
                    roots.append(loss)
                roots += [
                    send(
                        x if e.name == "x" else skips.pop(e.name),
                        self.mailbox,
                        e.dst,
                        self.plan.tag(e, mb),
                        self.send_function,
                    )
                    for e in self.plan.outputs(q)
                ]
        self._roots[mb] = roots

    def backward(self, mb: int) -> None:
        """Backward of micro-batch mb: one autograd pass over what the rank's pieces sent (and the loss).

        Autograd runs the nodes made last first, so a rank's decoder piece
        finishes its backward, sending its gradients down, before its encoder
        piece waits for the gradient coming back up.
        """
        if mb not in self._roots:
            raise RuntimeError(f"rank {self.index}: backward of micro-batch {mb}, whose forward has not run")
        with self.clock.span("backward", mb), self.ledger.activations():
            torch.autograd.backward(self._roots.pop(mb))
