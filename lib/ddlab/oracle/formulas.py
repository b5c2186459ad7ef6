"""The closed forms at the heart of the oracle, for data and spatial parallelism (lab 09's exercises).

Plain numbers in, plain numbers out, so they can be written and checked on paper.
Times in seconds, memory in bytes; alpha and beta are Hockney's link constants.

Exercise 9.1 signature: `data_parallel_time(compute, gradient_bytes, p, alpha, beta) -> dict`
with keys "compute" and "communication": `compute` is the seconds one device takes for the
forward and backward of the whole batch; each of p ranks does 1/p of it, then the ranks
allreduce `gradient_bytes` with the ring: 2(p-1) alpha + 2(p-1)/p n beta (0 on one rank).

Exercise 9.2 signature: `data_parallel_memory(parameter_bytes, activation_bytes, p,
optimizer_copies) -> dict` with keys "parameters", "gradients", "optimizer", "activations":
every rank holds the whole model, a gradient of the same size and `optimizer_copies` copies
of optimizer state (1 for SGD with momentum, 2 for Adam); `activation_bytes` is what the
whole batch saves for backward, and each rank holds 1/p of the samples.

Exercise 9.3 signature: `spatial_time(compute, halo_bytes, gradient_bytes, p, alpha, beta)
-> dict` with keys "compute" and "communication": the image is cut into p slabs of rows, each
rank computes 1/p; `halo_bytes[i]` is the bytes of the halo convolution i needs from one
neighbour (the whole batch), convolution 0 being the first layer, on the data. As lab 08's
`exchange_rows` does, a rank exchanges with both its neighbours at once: an exchange costs
one message time, alpha + n beta. Every convolution exchanges forward, and again backward
(the halo's gradient) except the first: the data wants no gradient. At the end the ranks
allreduce the gradients (ring). Accepted too, as the text allows: the busiest rank's two
messages one after the other (`at_once=False`: twice the exchange where a rank has two
neighbours, for links that cannot carry both at once).

Exercise 9.5 signature: `hybrid_time(compute, halo_bytes, gradient_bytes, d, s, intra, inter,
per_node) -> dict` with keys "compute" and "communication": data x spatial, d groups of s
slabs, each group on 1/d of the batch; intra and inter are (alpha, beta) of the links inside
a node of `per_node` devices and between nodes. The slabs of a group sit in one node (s <=
per_node, else ValueError): halo exchanges as in 9.3 on the group's 1/d of the halo bytes,
over the intra link; the group's ring allreduce of the gradients (intra); then a ring over
the d groups: inside a node while d s <= per_node, else over the inter link, whose bandwidth
the s rings of a node share (beta times s). Accepted too, as 9.3 accepts it: the halos of the
busiest slab one after the other (`at_once=False`).

Exercise 9.4 signature: `spatial_memory(parameter_bytes, activation_bytes, halo_bytes, p,
rank, optimizer_copies) -> dict` with keys "parameters", "gradients", "optimizer",
"activations", "buffers": as data parallelism for the model; activations 1/p of the whole
image's; buffers: the halo rows rank keeps, halo_bytes[i] from each neighbour it has.
"""

from __future__ import annotations

from typing import Sequence

from ..allreduce.cost import Link, terms
from ..runtime.reference import reference


def ring_allreduce_seconds(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """2(p-1) alpha + 2(p-1)/p n beta: the ring's reduce-scatter then allgather (lab 03's model); 0 on one rank."""
    return float(terms("ring", int(p), float(nbytes)).seconds(Link(float(alpha), float(beta))))


def neighbours(rank: int, p: int) -> int:
    """How many slabs border slab `rank` of p: 2 inside, 1 at an edge, 0 alone."""
    return int(rank > 0) + int(rank < p - 1)


@reference("data_parallel_time")
def data_parallel_time(compute: float, gradient_bytes: float, p: int, alpha: float, beta: float) -> dict[str, float]:
    return {"compute": compute / p, "communication": ring_allreduce_seconds(gradient_bytes, p, alpha, beta)}


@reference("data_parallel_memory")
def data_parallel_memory(
    parameter_bytes: float, activation_bytes: float, p: int, optimizer_copies: int
) -> dict[str, float]:
    return {
        "parameters": parameter_bytes,
        "gradients": parameter_bytes,
        "optimizer": optimizer_copies * parameter_bytes,
        "activations": activation_bytes / p,
    }


def halo_seconds(halo_bytes: Sequence[float], p: int, alpha: float, beta: float, at_once: bool = True) -> float:
    """Halo exchanges of a step on p slabs: forward per convolution, backward but for the first (on the data)."""
    if p <= 1:
        return 0.0
    messages = 1 if at_once else max(neighbours(rank, p) for rank in range(p))
    return sum((1 if i == 0 else 2) * messages * (alpha + n * beta) for i, n in enumerate(halo_bytes))


@reference("spatial_time")
def spatial_time(
    compute: float,
    halo_bytes: Sequence[float],
    gradient_bytes: float,
    p: int,
    alpha: float,
    beta: float,
    at_once: bool = True,
) -> dict[str, float]:
    halos = halo_seconds(halo_bytes, p, alpha, beta, at_once)
    return {"compute": compute / p, "communication": halos + ring_allreduce_seconds(gradient_bytes, p, alpha, beta)}


@reference("hybrid_time")
def hybrid_time(
    compute: float,
    halo_bytes: Sequence[float],
    gradient_bytes: float,
    d: int,
    s: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    per_node: int,
    at_once: bool = True,
) -> dict[str, float]:
    if s > per_node:
        raise ValueError(f"{s} slabs do not fit in a node of {per_node} devices: choose s <= per_node")
    halos = halo_seconds([n / d for n in halo_bytes], s, *intra, at_once=at_once)
    inside = ring_allreduce_seconds(gradient_bytes, s, *intra)
    alpha, beta = (inter[0], inter[1] * s) if d * s > per_node else intra
    across = ring_allreduce_seconds(gradient_bytes, d, alpha, beta)
    return {"compute": compute / (d * s), "communication": halos + inside + across}


@reference("spatial_memory")
def spatial_memory(
    parameter_bytes: float,
    activation_bytes: float,
    halo_bytes: Sequence[float],
    p: int,
    rank: int,
    optimizer_copies: int,
) -> dict[str, float]:
    memory = data_parallel_memory(parameter_bytes, activation_bytes, p, optimizer_copies)
    return {**memory, "buffers": neighbours(rank, p) * sum(halo_bytes)}
