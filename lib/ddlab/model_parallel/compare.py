"""Layouts of one UNet side by side: the messages a training step sends (skips apart) and each rank's peak memory.

A message's tag names the edge it belongs to (`PiecePlan.tag`), so the
mailboxes' counts per tag give the skip connections' messages and bytes apart
from the activation's. Memory is the exact `Ledger` peak of every rank
(`try_split`, no budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from ..data.images import make_segmentation
from ..models.unet import UNet
from .fit import Fit, try_split
from .messages import Mailbox
from .stage import train_step
from .ushape import Piece, PiecePlan, PieceStage


@dataclass
class StepTraffic:
    """What one training step sends over all ranks (forward activations and backward gradients)."""

    messages: int
    nbytes: int
    skip_messages: int
    skip_bytes: int


def posted(mailbox: Mailbox) -> dict[int, tuple[int, int]]:
    """Messages and bytes the mailbox posted, per tag."""
    return {tag: (count, mailbox.bytes_by_tag[tag]) for tag, count in mailbox.sent_by_tag.items()}


def step_traffic(per_rank: list[dict[int, tuple[int, int]]], plan: PiecePlan) -> StepTraffic:
    """Every rank's posted messages (`posted`, one single-micro-batch step), skip connections counted apart."""
    counts = [
        (plan.edges[tag % len(plan.edges)].name, messages, nbytes)
        for tags in per_rank
        for tag, (messages, nbytes) in tags.items()
    ]
    skips = [c for c in counts if c[0] != "x"]
    return StepTraffic(
        sum(c[1] for c in counts), sum(c[2] for c in counts), sum(c[1] for c in skips), sum(c[2] for c in skips)
    )


def compare_layouts(
    comm: MPI.Comm, model: UNet, layouts: dict[str, list[Piece]], side: int, batch: int = 2, steps: int = 2
) -> dict[str, tuple[Fit, StepTraffic]]:
    """Per layout: one counted training step, then `steps` measured ones (`try_split`, no budget) at this side.

    The same result on every rank. A collective over comm.
    """
    images, masks = make_segmentation(batch, side, seed=0, dtype=next(model.parameters()).dtype)
    results = {}
    for name, pieces in layouts.items():
        stage = PieceStage(model, pieces, comm, tuple(images.shape[1:]))
        train_step(stage, images, masks)
        traffic = step_traffic(comm.allgather(posted(stage.mailbox)), stage.plan)
        stage.mailbox.free()
        results[name] = (try_split(comm, model, pieces, side, name, budget=None, batch=batch, steps=steps), traffic)
    return results


def layout_table(results: dict[str, tuple[Fit, StepTraffic]]) -> str:
    """A text table: per layout, messages and MiB per step (all, and skips), ms per sample, peak MiB per rank."""
    lines = [
        f"{'layout':10} {'messages':>8} {'MiB':>6} {'skip msgs':>9} {'skip MiB':>8} {'ms/sample':>9}  peak MiB per rank"
    ]
    for name, (fit, t) in results.items():
        ms = "" if fit.seconds_per_sample is None else f"{fit.seconds_per_sample * 1e3:9.0f}"
        peaks = " / ".join(f"{p / 2**20:.1f}" for p in fit.peak_per_rank)
        lines.append(
            f"{name:10} {t.messages:8d} {t.nbytes / 2**20:6.2f} {t.skip_messages:9d} "
            f"{t.skip_bytes / 2**20:8.2f} {ms:>9}  {peaks}"
        )
    return "\n".join(lines)
