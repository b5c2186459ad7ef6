"""The device mesh: P ranks as a grid of named dimensions, each with its own sub-communicator (lab 16).

A mesh of P = pipeline x data x context x tensor ranks numbers its ranks row-major over the
dimensions in `DIMS` order, tensor fastest:

    rank = ((pipeline_coord * data + data_coord) * context + context_coord) * tensor + tensor_coord

so a tensor group is consecutive ranks (inside a node, where the links are fastest) and the
pipeline stages are the outermost blocks (across nodes): the placement of Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021
(section 3.3: tensor parallelism inside a server, pipeline parallelism across servers, data
parallelism over the rest).

A dimension's communicator holds the ranks whose coordinates differ only in that dimension,
ranked by that coordinate: the ranks a tensor-parallel layer, a pipeline message, a
gradient average or a ring attention talk to.

With context parallelism the ranks holding the same weights are those of one data x context
plane: `Mesh.replicas`, made by one more Split, averages the gradients (each context rank's
come from its positions of the sequences only).

Exercise 16.1 signature: `split_mesh(comm, sizes) -> (coords, comms)`: `sizes` a dict giving
every name of `DIMS` a positive int whose product is comm's size (else ValueError saying so);
returns `coords`, this rank's coordinate per name (dict of int, from the rank order above),
and `comms`, per name a new communicator (the caller frees it) of the ranks that differ from
this one only in that dimension, in which this rank's rank is its coordinate. A collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from mpi4py import MPI

from ..runtime.reference import reference

#: The mesh's dimensions, slowest-varying first: the rank order of the mesh (tensor fastest).
DIMS = ("pipeline", "data", "context", "tensor")

Sizes = dict[str, int]
SplitMesh = Callable[[MPI.Comm, Sizes], tuple[dict[str, int], dict[str, MPI.Comm]]]


def validate_sizes(sizes: Sizes, world: int) -> None:
    """Raise ValueError unless sizes names exactly DIMS, each a positive int, multiplying to world."""
    if set(sizes) != set(DIMS):
        raise ValueError(f"give a size to each of {DIMS} (1 for a dimension not used), got {sorted(sizes)}")
    bad = {name: n for name, n in sizes.items() if not isinstance(n, int) or isinstance(n, bool) or n < 1}
    if bad:
        raise ValueError(f"every dimension's size must be a positive int, got {bad}")
    product = math.prod(sizes.values())
    if product != world:
        shown = " x ".join(f"{sizes[name]} {name}" for name in DIMS)
        raise ValueError(
            f"the mesh's sizes multiply to {product} ({shown}) but the communicator has {world} ranks: "
            "choose sizes whose product is the number of ranks"
        )


def coordinates(rank: int, sizes: Sizes) -> dict[str, int]:
    """A rank's coordinate in each dimension (row-major over DIMS, tensor fastest)."""
    coords = {}
    for name in reversed(DIMS):
        rank, coords[name] = divmod(rank, sizes[name])
    return {name: coords[name] for name in DIMS}


@reference("split_mesh")
def split_mesh(comm: MPI.Comm, sizes: Sizes) -> tuple[dict[str, int], dict[str, MPI.Comm]]:
    """Exercise 16.1's reference: this rank's coordinates, and one sub-communicator per dimension (by Split)."""
    validate_sizes(sizes, comm.Get_size())
    coords = coordinates(comm.Get_rank(), sizes)
    comms = {}
    for name in DIMS:
        # the ranks sharing every other coordinate form one group: colour = those coordinates as one number
        others = [other for other in DIMS if other != name]
        colour = 0
        for other in others:
            colour = colour * sizes[other] + coords[other]
        comms[name] = comm.Split(colour, coords[name])
    return coords, comms


@dataclass
class Mesh:
    """This rank's place in a mesh: the sizes, its coordinates and each dimension's communicator.

    `Mesh.build(comm, data=2, tensor=2)` (sizes not given are 1); `mesh.tensor` is the tensor
    communicator, and likewise `data`, `pipeline`, `context`, and `replicas` (data x context);
    `free()` frees them (a collective).
    """

    sizes: Sizes
    coords: dict[str, int]
    comms: dict[str, MPI.Comm]
    replica_comm: MPI.Comm | None = None  # the data x context plane, made when context > 1

    @classmethod
    def build(
        cls,
        comm: MPI.Comm,
        data: int = 1,
        tensor: int = 1,
        pipeline: int = 1,
        context: int = 1,
        split: SplitMesh = split_mesh,
    ) -> Mesh:
        """The mesh of comm's ranks with these sizes (their product must be comm's size). A collective.

        split: the function that makes the coordinates and communicators (exercise 16.1's signature)."""
        sizes = {"pipeline": pipeline, "data": data, "context": context, "tensor": tensor}
        validate_sizes(sizes, comm.Get_size())
        coords, comms = split(comm, sizes)
        plane = None
        if context > 1:  # the ranks that differ only in data and context: same pipeline stage, same tensor rank
            plane = comm.Split(
                coords["pipeline"] * tensor + coords["tensor"], coords["data"] * context + coords["context"]
            )
        return cls(sizes, coords, comms, plane)

    @property
    def data(self) -> MPI.Comm:
        return self.comms["data"]

    @property
    def tensor(self) -> MPI.Comm:
        return self.comms["tensor"]

    @property
    def pipeline(self) -> MPI.Comm:
        return self.comms["pipeline"]

    @property
    def context(self) -> MPI.Comm:
        return self.comms["context"]

    @property
    def replicas(self) -> MPI.Comm:
        """The ranks holding the same weights: data x context (ranked data-major), the data communicator if context is 1."""
        return self.data if self.replica_comm is None else self.replica_comm

    @property
    def label(self) -> str:
        """'2x1x2' : data x tensor x pipeline (and x context when it is used)."""
        dims = ["data", "tensor", "pipeline"] + (["context"] if self.sizes["context"] > 1 else [])
        return "x".join(str(self.sizes[name]) for name in dims)

    def free(self) -> None:
        for sub in self.comms.values():
            sub.Free()
        if self.replica_comm is not None:
            self.replica_comm.Free()


def layouts(world: int, dims: tuple[str, ...] = ("data", "tensor", "pipeline")) -> list[Sizes]:
    """Every way of writing world as a product of positive sizes over dims (the others 1), in a fixed order."""
    if world < 1:
        raise ValueError(f"a mesh needs at least one rank, got {world}")
    if not set(dims) <= set(DIMS):
        raise ValueError(f"dimensions must be among {DIMS}, got {dims}")
    found: list[Sizes] = []

    def place(index: int, left: int, chosen: dict[str, int]) -> None:
        if index == len(dims) - 1:
            found.append({**dict.fromkeys(DIMS, 1), **chosen, dims[index]: left})
            return
        for n in range(left, 0, -1):
            if left % n == 0:
                place(index + 1, left // n, {**chosen, dims[index]: n})

    place(0, world, {})
    return found
