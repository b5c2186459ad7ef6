"""Lab 16's check passes the reference and valid alternatives, and fails the wrong answers, on every rank."""

from __future__ import annotations

import faulthandler
import time

import pytest
from ddlab.checks import CheckFailed, check_split_mesh
from ddlab.mesh import DIMS, coordinates, split_mesh, validate_sizes
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
split_mesh = unguarded(split_mesh)

SHORT = 3.0


def expect_failure(fn, *words: str) -> str:
    """check_split_mesh on fn must fail on every rank, naming every word."""
    with pytest.raises(CheckFailed) as info:
        check_split_mesh(fn, timeout=SHORT)
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


# Valid alternatives ------------------------------------------------------------------
def by_cartesian_grid(comm, sizes):
    """Create_cart over (pipeline, data, context, tensor), its coordinates, one Sub per dimension."""
    validate_sizes(sizes, comm.Get_size())
    grid = comm.Create_cart([sizes[name] for name in DIMS], reorder=False)
    coords = dict(zip(DIMS, (int(c) for c in grid.Get_coords(grid.Get_rank()))))
    comms = {name: grid.Sub([other == name for other in DIMS]) for name in DIMS}
    grid.Free()
    return coords, comms


def by_subtracting_the_coordinate(comm, sizes):
    """Colour: the rank with this dimension's coordinate set to 0; key: the rank itself."""
    if (
        sizes.keys() != set(DIMS)
        or comm.Get_size() != sizes["pipeline"] * sizes["data"] * sizes["context"] * sizes["tensor"]
    ):
        raise ValueError("sizes must multiply to the number of ranks")
    rank = comm.Get_rank()
    coords, stride, strides = {}, 1, {}
    for name in reversed(DIMS):
        coords[name] = rank // stride % sizes[name]
        strides[name] = stride
        stride *= sizes[name]
    comms = {name: comm.Split(rank - coords[name] * strides[name], rank) for name in DIMS}
    return coords, comms


def test_the_reference_and_valid_alternatives_pass(comm) -> None:
    check_split_mesh(split_mesh, timeout=SHORT)
    check_split_mesh(by_cartesian_grid, timeout=SHORT)
    check_split_mesh(by_subtracting_the_coordinate, timeout=SHORT)


# Wrong answers ---------------------------------------------------------------------------
def coordinates_data_fastest(comm, sizes):
    """Coordinates in the wrong order: data varies fastest instead of tensor."""
    validate_sizes(sizes, comm.Get_size())
    order = ("pipeline", "tensor", "context", "data")
    rank, coords = comm.Get_rank(), {}
    for name in reversed(order):
        rank, coords[name] = divmod(rank, sizes[name])
    comms = {}
    for name in DIMS:
        colour = sum(coords[o] * 10**i for i, o in enumerate(order) if o != name)
        comms[name] = comm.Split(colour, coords[name])
    return coords, comms


def colour_is_the_coordinate(comm, sizes):
    """Split colours wrong: colour by this dimension's own coordinate (the ranks sharing it, not the others)."""
    validate_sizes(sizes, comm.Get_size())
    coords = coordinates(comm.Get_rank(), sizes)
    return coords, {name: comm.Split(coords[name], comm.Get_rank()) for name in DIMS}


def key_reversed(comm, sizes):
    """The right groups, ranked backwards."""
    validate_sizes(sizes, comm.Get_size())
    coords = coordinates(comm.Get_rank(), sizes)
    comms = {}
    for name in DIMS:
        colour = sum(coords[o] * 10 ** DIMS.index(o) for o in DIMS if o != name)
        comms[name] = comm.Split(colour, -coords[name])
    return coords, comms


def never_refuses(comm, sizes):
    """No check of the sizes: a mesh whose product is not the rank count goes through."""
    coords = coordinates(comm.Get_rank(), sizes)
    comms = {}
    for name in DIMS:
        colour = sum(coords[o] * 10 ** DIMS.index(o) for o in DIMS if o != name)
        comms[name] = comm.Split(colour, coords[name])
    return coords, comms


def world_for_a_full_dimension(comm, sizes):
    """A dimension holding every rank answered with the communicator passed in."""
    coords, comms = split_mesh(comm, sizes)
    for name in DIMS:
        if sizes[name] == comm.Get_size() > 1:
            comms[name].Free()
            comms[name] = comm
    return coords, comms


def rank_zero_skips_a_split(comm, sizes):
    """Rank 0 never makes the tensor communicator: the others would wait for it forever."""
    coords, comms = split_mesh(comm, sizes)
    if comm.Get_rank() != 0:
        comms["extra"] = comm.Split(0, 0)
    return coords, comms


def splits_the_world(comm, sizes):
    """The right colours and keys, but MPI.COMM_WORLD split instead of comm: on fewer ranks it would block forever."""
    validate_sizes(sizes, comm.Get_size())
    coords = coordinates(comm.Get_rank(), sizes)
    comms = {}
    for name in DIMS:
        colour = sum(coords[o] * 10 ** DIMS.index(o) for o in DIMS if o != name)
        comms[name] = MPI.COMM_WORLD.Split(colour, coords[name])
    return coords, comms


def test_a_split_of_the_world_fails_naming_it_instead_of_hanging(comm) -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a hang ends the process, with tracebacks
    try:
        expect_failure(splits_the_world, "not made from the communicator passed in", "MPI.COMM_WORLD")
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_the_wrong_answers_fail(comm) -> None:
    if comm.Get_size() >= 4:  # on 1, 2 or 3 ranks only one dimension is above 1: any order numbers the ranks alike
        expect_failure(coordinates_data_fastest, "coords are")
    expect_failure(colour_is_the_coordinate, "holds ranks")
    if comm.Get_size() > 1:
        expect_failure(key_reversed, "holds ranks", "ranked by it")
        expect_failure(world_for_a_full_dimension, "the communicator passed in")
        start = time.monotonic()
        expect_failure(rank_zero_skips_a_split, "Split to be called on every rank")
        assert time.monotonic() - start < 4 * SHORT
    expect_failure(never_refuses, "raise ValueError")


def test_a_stub_raises_not_implemented(comm) -> None:
    def stub(comm, sizes):
        raise NotImplementedError("exercise 16.1: split_mesh")

    with pytest.raises(NotImplementedError, match="16.1"):
        check_split_mesh(stub, timeout=SHORT)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("split_mesh", "ddlab.mesh.split_mesh", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
