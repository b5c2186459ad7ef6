"""ddlab.scaling in one process, and the checks of lab 05's exercises that need no MPI."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from ddlab import checks, scaling


def test_speedup_and_efficiency():
    assert scaling.speedup(10.0, 4.0) == 2.5
    assert scaling.efficiency(10.0, 4.0, 4) == 0.625
    assert scaling.efficiency(10.0, 12.5, 4, weak=True) == 0.8


def test_fused_ratio_is_1_for_one_piece_and_k_when_latency_dominates():
    assert scaling.fused_ratio(1, 1e6, 1e-5, 1e-9) == 1.0
    assert scaling.fused_ratio(8, 0.0, 1e-5, 1e-9) == pytest.approx(8.0)
    assert scaling.fused_ratio(8, 1e12, 1e-5, 1e-9) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("rule, target", [("none", 1.0), ("linear", 16.0), ("sqrt", 4.0)])
def test_lr_rules_with_and_without_warmup(rule, target):
    assert scaling.lr_factor(0, 16, rule) == target
    assert scaling.lr_factor(0, 16, rule, warmup_steps=10) == 1.0
    assert scaling.lr_factor(5, 16, rule, warmup_steps=10) == pytest.approx(1 + (target - 1) / 2)
    assert scaling.lr_factor(10, 16, rule, warmup_steps=10) == target


def test_an_unknown_rule_says_which_exist():
    with pytest.raises(ValueError, match="sqrt"):
        scaling.lr_factor(0, 2, "quadratic")


def test_measure_training_on_one_process():
    result = scaling.measure_training(16, steps=3, warmup=1, n=256, comm=MPI.COMM_SELF)
    assert result["size"] == 1 and result["step_time"] > 0
    assert set(result["phases"]) == {"data", "forward", "backward", "allreduce", "optimizer"}
    assert sum(result["phases"].values()) <= result["step_time"] * 1.05
    assert {s.name for s in result["spans"]} >= {"forward", "backward"}


def test_time_pieces_and_fit_on_one_process():
    times = scaling.time_pieces(MPI.COMM_SELF, 1000, [1, 4], repeats=2)
    assert set(times) == {1, 4} and all(t > 0 for t in times.values())
    alpha, beta = scaling.fit_allreduce(MPI.COMM_SELF, sizes=[64, 4096, 2**18], repeats=2)
    assert math.isfinite(alpha) and math.isfinite(beta)


# The checks of exercises 5.1 and 5.3 -------------------------------------------------

def reference_efficiency(times, weak=False):
    return {p: scaling.efficiency(times[1], t, p, weak) for p, t in times.items()}


def test_efficiency_check_passes_the_reference():
    checks.check_scaling_efficiency(reference_efficiency)


@pytest.mark.parametrize("wrong, words", [
    (lambda times, weak=False: {p: times[1] / (p * t) for p, t in times.items()}, "weak=True"),
    (lambda times, weak=False: {p: times[1] / t for p, t in times.items()}, "weak=False"),
    (lambda times, weak=False: [times[1] / t for t in times.values()], "expected a dict"),
    (lambda times, weak=False: {p: t / times[1] for p, t in times.items()}, "efficiency at P=2"),
])
def test_efficiency_check_fails_on_wrong_formulas(wrong, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_scaling_efficiency(wrong)


def test_lr_check_passes_the_reference():
    checks.check_lr_factor(scaling.lr_factor)
    checks.check_lr_factor(lambda *args: np.float64(scaling.lr_factor(*args)))  # a NumPy float is a float


@pytest.mark.parametrize("wrong, words", [
    (lambda step, k, rule="linear", warmup_steps=0: scaling.lr_factor(step, k, rule, 0), "ramping up"),
    (lambda step, k, rule="linear", warmup_steps=0: scaling.lr_factor(step, k * k if rule == "sqrt" else k, rule,
                                                                       warmup_steps), "sqrt"),
    (lambda step, k, rule="linear", warmup_steps=0: scaling.lr_factor(step, k, "none" if rule == "linear" else rule,
                                                                       warmup_steps), "rule='linear'"),
])
def test_lr_check_fails_on_wrong_rules(wrong, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_lr_factor(wrong)
