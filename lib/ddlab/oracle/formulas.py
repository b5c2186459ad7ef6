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
neighbour (the whole batch). In the forward and again in the backward pass of every
convolution, the busiest rank sends one message of halo_bytes[i] to each of its neighbours,
one after the other (alpha + n beta each); at the end the ranks allreduce the gradients (ring).

Exercise 9.4 signature: `spatial_memory(parameter_bytes, activation_bytes, halo_bytes, p,
rank, optimizer_copies) -> dict` with keys "parameters", "gradients", "optimizer",
"activations", "buffers": as data parallelism for the model; activations 1/p of the whole
image's; buffers: the halo rows rank keeps, halo_bytes[i] from each neighbour it has.
"""

from __future__ import annotations

from typing import Sequence

from ..allreduce.cost import Link, terms


def ring_allreduce_seconds(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """2(p-1) alpha + 2(p-1)/p n beta: the ring's reduce-scatter then allgather (lab 03's model); 0 on one rank."""
    return float(terms("ring", p, nbytes).seconds(Link(alpha, beta)))


def neighbours(rank: int, p: int) -> int:
    """How many slabs border slab `rank` of p: 2 inside, 1 at an edge, 0 alone."""
    return int(rank > 0) + int(rank < p - 1)


def data_parallel_time(compute: float, gradient_bytes: float, p: int, alpha: float, beta: float) -> dict[str, float]:
    return {"compute": compute / p, "communication": ring_allreduce_seconds(gradient_bytes, p, alpha, beta)}


def data_parallel_memory(
    parameter_bytes: float, activation_bytes: float, p: int, optimizer_copies: int
) -> dict[str, float]:
    return {
        "parameters": parameter_bytes,
        "gradients": parameter_bytes,
        "optimizer": optimizer_copies * parameter_bytes,
        "activations": activation_bytes / p,
    }


def spatial_time(
    compute: float, halo_bytes: Sequence[float], gradient_bytes: float, p: int, alpha: float, beta: float
) -> dict[str, float]:
    busiest = max(neighbours(rank, p) for rank in range(p))
    halos = sum(2 * busiest * (alpha + n * beta) for n in halo_bytes)  # forward and backward
    return {"compute": compute / p, "communication": halos + ring_allreduce_seconds(gradient_bytes, p, alpha, beta)}


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
