"""Lab 09's checks fail wrong formulas with a useful message and pass a valid alternative (one process)."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.checks import (
    CheckFailed,
    check_data_parallel_memory,
    check_data_parallel_time,
    check_hybrid_time,
    check_spatial_memory,
    check_spatial_time,
)
from ddlab.oracle import formulas as marked
from ddlab.runtime.reference import unguarded


class formulas:  # noqa: N801 (read as the module it stands for)
    """The library's formulas without their mark: the checks refuse them to an answer (see
    test_the_checks_refuse_the_library_s_own_formulas); these tests use them as valid answers and in wrong ones."""

    data_parallel_time = staticmethod(unguarded(marked.data_parallel_time))
    data_parallel_memory = staticmethod(unguarded(marked.data_parallel_memory))
    spatial_time = staticmethod(unguarded(marked.spatial_time))
    spatial_memory = staticmethod(unguarded(marked.spatial_memory))
    hybrid_time = staticmethod(unguarded(marked.hybrid_time))


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


def numpy_memory(params, acts, halos, p, rank, copies):  # valid: NumPy integers and NumPy sums
    sides = np.int64(rank > 0) + np.int64(rank < p - 1)
    return {
        **{
            k: np.int64(v)
            for k, v in formulas.data_parallel_memory(params, acts, p, copies).items()
            if k != "activations"
        },
        "activations": np.float64(acts) / p,
        "buffers": sides * np.sum(np.asarray(halos, dtype=np.float64)),
    }


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
    return {
        "compute": compute / p,
        "communication": sum(alpha + h * beta for h in halos) * (p > 1) + ring(nbytes, p, alpha, beta),
    }


def first_backward_too(compute, halos, nbytes, p, alpha, beta):  # charges a backward halo on the data
    return {
        "compute": compute / p,
        "communication": sum(2 * (alpha + h * beta) for h in halos) * (p > 1) + ring(nbytes, p, alpha, beta),
    }


def serialised(compute, halos, nbytes, p, alpha, beta):  # valid: the text allows the two messages in turn
    busiest = min(2, p - 1)
    halo = sum((1 if i == 0 else 2) * busiest * (alpha + h * beta) for i, h in enumerate(halos))
    return {"compute": compute / p, "communication": halo + ring(nbytes, p, alpha, beta)}


def at_once_loop(compute, halos, nbytes, p, alpha, beta):  # valid: exchanges listed one by one, NumPy sums
    exchanges = [] if p == 1 else [alpha + halos[0] * beta]
    for h in list(halos)[1:]:
        exchanges += [alpha + h * beta] * (2 if p > 1 else 0)
    return {"compute": np.float64(compute) / p, "communication": np.sum(exchanges) + ring(nbytes, p, alpha, beta)}


def sorts_in_place(compute, halos, nbytes, p, alpha, beta):  # right value, but sorts the caller's list
    if isinstance(halos, list):
        halos.sort()
    return formulas.spatial_time(compute, halos, nbytes, p, alpha, beta)


def spins(compute, halos, nbytes, p, alpha, beta):  # a loop that never ends on one rank's count
    while p > 4:
        pass
    return formulas.spatial_time(compute, halos, nbytes, p, alpha, beta)


def hybrid(
    compute,
    halos,
    nbytes,
    d,
    s,
    intra,
    inter,
    per_node,
    share=True,
    split=True,
    crosses=True,
    first=1,
    in_turn=1,
    refuse=True,
):
    """The hybrid written out, with switches for the plausible mistakes (and refuse=False: no ValueError)."""
    if s > per_node and refuse:
        raise ValueError("the slabs do not fit in a node")
    (a, b), (a2, b2) = intra, inter
    halo = 0.0
    if s > 1:
        for i, h in enumerate(halos):
            halo += (first if i == 0 else 2) * (in_turn if s > 2 else 1) * (a + (h / d if split else h) * b)
    if d * s > per_node or not crosses:
        a2, b2 = a2, b2 * (s if share else 1)
    else:
        a2, b2 = a, b
    comm = halo + ring(nbytes, s, a, b) + ring(nbytes, d, a2, b2)
    return {"compute": compute / (d * s), "communication": comm}


def floor_memory(params, acts, p, copies):  # valid: whole bytes per rank
    return {**formulas.data_parallel_memory(params, acts, p, copies), "activations": acts // p}


def ceil_spatial_memory(params, acts, halos, p, rank, copies):  # valid: whole bytes, rounded up
    return {**formulas.spatial_memory(params, acts, halos, p, rank, copies), "activations": -(-acts // p)}


def valid_hybrid(compute, halos, nbytes, d, s, intra, inter, per_node):  # valid: via the 9.3 formula
    if s > per_node:
        raise ValueError(f"{s} slabs, {per_node} devices a node")
    inside = formulas.spatial_time(compute / d, [h / d for h in halos], nbytes, s, *intra)
    leaves = d * s > per_node
    alpha, beta = (inter[0], inter[1] * s) if leaves else (intra[0], intra[1])
    across = formulas.data_parallel_time(0.0, nbytes, d, alpha, beta)["communication"]
    return {"compute": inside["compute"], "communication": inside["communication"] + across}


@pytest.mark.parametrize(
    "check, wrong, words",
    [
        (check_data_parallel_time, no_share, "communication"),
        (check_data_parallel_time, no_split, "compute"),
        (check_data_parallel_memory, whole_activations, "activations"),
        (check_data_parallel_memory, sharded_weights, "parameters"),
        (check_spatial_memory, both_sides, "buffers"),
        (check_spatial_time, halo_once, "communication"),
        (check_spatial_time, first_backward_too, "communication"),
        (check_spatial_time, sorts_in_place, "changed its inputs"),
        (check_hybrid_time, lambda *a: hybrid(*a, share=False), "communication"),
        (check_hybrid_time, lambda *a: hybrid(*a, split=False), "communication"),
        (check_hybrid_time, lambda *a: hybrid(*a, first=2), "communication"),
        (check_hybrid_time, lambda *a: hybrid(*a, crosses=False), "communication"),
        (check_hybrid_time, lambda c, *a: {**hybrid(c, *a), "compute": c / a[2]}, "compute"),
        (check_hybrid_time, lambda *a: hybrid(*a, refuse=False), "asks for a ValueError"),
        (check_hybrid_time, lambda *a: hybrid(*a[:7], 1), "asks for an answer"),
        (check_hybrid_time, lambda *a: hybrid(*a, in_turn=3), "communication"),
        (check_data_parallel_memory, lambda *a: {**floor_memory(*a), "activations": a[1] // a[2] - 2}, "activations"),
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
        (check_spatial_time, serialised),
        (check_spatial_time, at_once_loop),
        (check_hybrid_time, formulas.hybrid_time),
        (check_hybrid_time, hybrid),
        (check_hybrid_time, valid_hybrid),
        (check_hybrid_time, lambda *a: hybrid(*a, in_turn=2)),
        (check_data_parallel_memory, floor_memory),
        (check_spatial_memory, ceil_spatial_memory),
        (check_spatial_memory, valid_memory),
        (check_spatial_memory, numpy_memory),
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


def test_a_formula_that_never_returns_fails_within_the_deadline(monkeypatch):
    import ddlab.checks.oracle as checks

    monkeypatch.setattr(checks, "DEADLINE", 0.5)
    with pytest.raises(CheckFailed, match="did not return within"):
        check_spatial_time(spins)


def test_cases_exercise_numpy_inputs_and_every_argument():
    import ddlab.checks.oracle as checks

    cases = checks._cases("hybrid_time")
    assert any(isinstance(c[1], np.ndarray) for c in cases) and any(isinstance(c[1], tuple) for c in cases)
    assert {c[3] for c in cases} >= {1, 2, 3, 4, 8} and {c[4] for c in cases} >= {1, 2, 4}
    assert {c[7] for c in cases} == {2, 4, 8}
    assert any(c[3] * c[4] > c[7] for c in cases) and any(1 < c[3] * c[4] <= c[7] for c in cases)


def test_hybrid_refuses_slabs_wider_than_a_node():
    with pytest.raises(ValueError, match="s <= per_node"):
        formulas.hybrid_time(1.0, [1.0], 1.0, 2, 8, (1e-6, 1e-9), (1e-5, 1e-9), 4)


def test_a_hybrid_failure_locates_the_cases_without_the_recipe():
    with pytest.raises(CheckFailed) as failure:
        check_hybrid_time(lambda *a: hybrid(*a, share=False))
    message = str(failure.value)
    assert "only cases with d s > per_node (the groups' rings leave the node) differ" in message
    assert "beta times s" not in message and "1/d" not in message and "rank 0" not in message


def test_a_near_miss_prints_its_ratio_to_more_than_one_digit():
    with pytest.raises(CheckFailed, match=r"ratio 1\.00\d+, \+0\.\d+%"):
        check_spatial_time(lambda *a: {**formulas.spatial_time(*a), "compute": a[0] / a[3] * 1.001})


@pytest.mark.parametrize(
    "exercise", ["data_parallel_time", "data_parallel_memory", "spatial_time", "spatial_memory", "hybrid_time"]
)
def test_the_checks_refuse_the_library_s_own_formulas(refuses_the_reference, exercise):
    refuses_the_reference(exercise, f"ddlab.oracle.formulas.{exercise}")
