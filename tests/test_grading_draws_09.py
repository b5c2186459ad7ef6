"""The grader's draw for lab 09's formula checks (9.1 to 9.5), in one process as the lab's kernel runs them.

Under DDLAB_GRADE_SEED the checks take their 40 cases from the notebook's recipe on drawn values (P up to 1024,
other byte counts, halos, nodes and groups). The library's formulas pass without a seed and under every seed;
the fitted answers below pass the notebook's check and fail the grader's, naming the drawn case and the seed.
"""

from __future__ import annotations

import pytest
from ddlab.checks import (
    CheckFailed,
    check_data_parallel_memory,
    check_data_parallel_time,
    check_hybrid_time,
    check_spatial_memory,
    check_spatial_time,
)
from ddlab.checks._draw import Draw
from ddlab.checks.oracle import _cases
from ddlab.oracle import formulas
from ddlab.runtime.reference import unguarded

CHECKS = [
    (check_data_parallel_time, unguarded(formulas.data_parallel_time)),
    (check_data_parallel_memory, unguarded(formulas.data_parallel_memory)),
    (check_spatial_time, unguarded(formulas.spatial_time)),
    (check_spatial_memory, unguarded(formulas.spatial_memory)),
    (check_hybrid_time, unguarded(formulas.hybrid_time)),
]


@pytest.mark.parametrize("check, reference", CHECKS, ids=lambda v: getattr(v, "__name__", ""))
def test_the_library_s_formula_passes_without_a_seed_and_under_every_seed(passes_on_every_seed, check, reference):
    lines = passes_on_every_seed(lambda: check(unguarded(reference)))
    assert lines[0].endswith("(P from 1 to 9)"), lines


def test_the_draw_keeps_the_recipe_draws_other_cases_and_the_same_each_time(grading_seeds):
    for name in ("data_parallel_time", "spatial_memory", "hybrid_time"):
        notebook = _cases(name)
        drawn = [_cases(name, Draw(value, name)) for value in grading_seeds]
        assert repr(_cases(name, Draw(grading_seeds[0], name))) == repr(drawn[0]), "the same seed draws the same cases"
        assert len({repr(cases) for cases in [notebook, *drawn]}) == 4, "each seed its own cases, none the notebook's"
        assert all(len(case) == len(notebook[0]) for cases in drawn for case in cases)
    hybrid = _cases("hybrid_time", Draw(grading_seeds[1], "hybrid_time"))
    assert any(s > per_node for *_, s, _, _, per_node in hybrid), "cases where 9.5 must raise stay in"
    assert any(s <= per_node and d * s > per_node for *_, d, s, _, _, per_node in hybrid), "rings that leave the node"


RING_FACTORS = {1: 0.0, 2: 1.0, 3: 4 / 3, 4: 3 / 2, 5: 8 / 5, 8: 7 / 4, 9: 16 / 9}  # 2(P-1)/P, the notebook's P


def ring_factors_of_the_notebook(compute, gradient_bytes, p, alpha, beta):
    """9.1 with 2(P-1)/P read from a table of the rank counts the notebook's check runs."""
    return {"compute": compute / p, "communication": 2 * (p - 1) * alpha + RING_FACTORS[p] * gradient_bytes * beta}


def refuses_twice_a_node(compute, halo_bytes, gradient_bytes, d, s, intra, inter, per_node):
    """9.5 that raises only where the notebook's cases do, at s = 2 per_node, and answers s > per_node otherwise."""
    if s >= 2 * per_node:
        raise ValueError(f"{s} slabs do not fit in a node of {per_node}")
    return unguarded(formulas.hybrid_time)(compute, halo_bytes, gradient_bytes, d, s, intra, inter, max(s, per_node))


def four_convolutions(halo_bytes):
    """The halos of the notebook's networks, which have 1 to 4 convolutions: the first four, padded with 0."""
    first, second, third, fourth = [*halo_bytes, 0.0, 0.0, 0.0][:4]
    return first, second, third, fourth


def spatial_time_of_four_convolutions(compute, halo_bytes, gradient_bytes, p, alpha, beta):
    """9.3 written out for at most the 4 convolutions the notebook's cases have."""
    h0, h1, h2, h3 = four_convolutions(halo_bytes)
    halos = 0.0 if p == 1 else alpha + h0 * beta + sum(2 * (alpha + h * beta) for h in (h1, h2, h3) if h)
    ring = 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * gradient_bytes * beta
    return {"compute": compute / p, "communication": halos + ring}


def spatial_memory_of_four_convolutions(parameter_bytes, activation_bytes, halo_bytes, p, rank, optimizer_copies):
    """9.4 with the halo rows of at most the 4 convolutions the notebook's cases have."""
    memory = unguarded(formulas.data_parallel_memory)(parameter_bytes, activation_bytes, p, optimizer_copies)
    return {**memory, "buffers": ((rank > 0) + (rank < p - 1)) * sum(four_convolutions(halo_bytes))}


def more_than_four_convolutions(name: str):
    return lambda draw: any(
        len(case[{"spatial_time": 1, "spatial_memory": 2}[name]]) > 4 for case in _cases(name, draw)
    )


def between_one_and_two_nodes(draw: Draw) -> bool:
    return any(per_node < s < 2 * per_node for *_, s, _, _, per_node in _cases("hybrid_time", draw))


FITTED = [  # (check, the fitted answer, what the seed must draw, words the failure names besides the seed)
    (
        check_data_parallel_time,
        ring_factors_of_the_notebook,
        lambda draw: max(_cases("data_parallel_time", draw), key=lambda c: c[2])[2] > 9,
        ["data_parallel_time(", "raised KeyError"],
    ),
    (
        check_spatial_time,
        spatial_time_of_four_convolutions,
        more_than_four_convolutions("spatial_time"),
        ["spatial_time(", "expected"],
    ),
    (
        check_spatial_memory,
        spatial_memory_of_four_convolutions,
        more_than_four_convolutions("spatial_memory"),
        ["spatial_memory(", "['buffers']", "expected"],
    ),
    (
        check_hybrid_time,
        refuses_twice_a_node,
        between_one_and_two_nodes,
        ["hybrid_time(", "the text asks for a ValueError here"],
    ),
]


@pytest.mark.parametrize("check, fitted, needs, words", FITTED, ids=lambda v: getattr(v, "__name__", ""))
def test_an_answer_fitted_to_the_notebook_passes_its_check_and_fails_the_grader_s_draw(
    seed, seed_with, check, fitted, needs, words
):
    check(fitted)  # the notebook's own cases: it passes
    name = check.__name__.removeprefix("check_")
    value = seed_with(needs, name, among=range(1000))
    seed(value)
    with pytest.raises(CheckFailed) as failed:
        check(fitted)
    message = str(failed.value)
    for word in [*words, f"(the grader's draw, seed {value})"]:
        assert word in message, message
