"""Lab 09's checks fail wrong formulas with a useful message and pass a valid alternative (one process)."""

from __future__ import annotations

import pytest
from ddlab.checks import (
    CheckFailed,
    check_data_parallel_memory,
    check_data_parallel_time,
    check_spatial_memory,
    check_spatial_time,
)
from ddlab.oracle import formulas


def ring(nbytes, p, alpha, beta):
    return 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def no_share(compute, nbytes, p, alpha, beta):  # forgets the 2(P-1)/P factor
    return {"compute": compute / p, "communication": 0.0 if p == 1 else 2 * (p - 1) * alpha + nbytes * beta}


def no_split(compute, nbytes, p, alpha, beta):  # every rank computes the whole batch
    return {"compute": compute, "communication": ring(nbytes, p, alpha, beta)}


def loops(compute, nbytes, p, alpha, beta):  # valid: the ring step by step
    steps = [alpha + nbytes / p * beta for _ in range(2 * (p - 1))]
    return {"communication": sum(steps), "compute": compute / p}


def whole_activations(params, acts, p, copies):  # activations not divided over the ranks
    return {"parameters": params, "gradients": params, "optimizer": copies * params, "activations": acts}


def sharded_weights(params, acts, p, copies):  # ZeRO's sharding is not data parallelism here
    return {
        "parameters": params / p,
        "gradients": params / p,
        "optimizer": copies * params / p,
        "activations": acts / p,
    }


def both_sides(params, acts, halos, p, rank, copies):  # halo on both sides of the edge ranks too
    out = formulas.data_parallel_memory(params, acts, p, copies)
    return {**out, "buffers": (2 if p > 1 else 0) * sum(halos)}


def valid_memory(params, acts, halos, p, rank, copies):  # valid: count the neighbours explicitly
    sides = len([r for r in (rank - 1, rank + 1) if 0 <= r < p])
    return {
        "buffers": sum(h * sides for h in halos),
        "activations": acts / p,
        "optimizer": params * copies,
        "gradients": params,
        "parameters": params,
    }


def halo_once(compute, halos, nbytes, p, alpha, beta):  # only the forward exchange
    busiest = min(2, p - 1)
    return {
        "compute": compute / p,
        "communication": sum(busiest * (alpha + h * beta) for h in halos) + ring(nbytes, p, alpha, beta),
    }


def one_neighbour(compute, halos, nbytes, p, alpha, beta):  # every rank as if it had one neighbour
    return {
        "compute": compute / p,
        "communication": sum(2 * (alpha + h * beta) for h in halos) * (p > 1) + ring(nbytes, p, alpha, beta),
    }


@pytest.mark.parametrize(
    "check, wrong, words",
    [
        (check_data_parallel_time, no_share, "communication"),
        (check_data_parallel_time, no_split, "compute"),
        (check_data_parallel_memory, whole_activations, "activations"),
        (check_data_parallel_memory, sharded_weights, "parameters"),
        (check_spatial_memory, both_sides, "buffers"),
        (check_spatial_time, halo_once, "communication"),
        (check_spatial_time, one_neighbour, "communication"),
        (check_data_parallel_time, lambda *a: (1.0, 2.0), "dict"),
        (check_spatial_memory, lambda *a: {"parameters": 1}, "keys"),
    ],
)
def test_wrong_formulas_fail(check, wrong, words):
    with pytest.raises(CheckFailed, match=words):
        check(wrong)


@pytest.mark.parametrize(
    "check, valid",
    [
        (check_data_parallel_time, loops),
        (check_data_parallel_time, formulas.data_parallel_time),
        (check_data_parallel_memory, formulas.data_parallel_memory),
        (check_spatial_time, formulas.spatial_time),
        (check_spatial_memory, valid_memory),
    ],
)
def test_valid_formulas_pass(check, valid, capsys):
    check(valid)
    assert capsys.readouterr().out.startswith("passed:")


def test_stub_error_passes_through():
    def stub(*args):
        raise NotImplementedError("Exercise 9.1: write data_parallel_time")

    with pytest.raises(NotImplementedError):
        check_data_parallel_time(stub)
