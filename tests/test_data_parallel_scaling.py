"""ddlab.scaling in one process, and the checks of lab 05's exercises that need no MPI."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ddlab import checks, scaling
from mpi4py import MPI


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


def lab_efficiency(times, weak=False):  # the lab's answer, written out (the library's own is refused)
    return {p: times[1] / t if weak else times[1] / (p * t) for p, t in times.items()}


def lab_lr_factor(step, k, rule="linear", warmup_steps=0):
    target = {"none": 1.0, "linear": float(k), "sqrt": k**0.5}[rule]
    return 1.0 + (target - 1.0) * step / warmup_steps if step < warmup_steps else target


def test_efficiency_check_passes_the_reference():
    checks.check_scaling_efficiency(lab_efficiency)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda times, weak=False: {p: times[1] / (p * t) for p, t in times.items()}, "weak=True"),
        (lambda times, weak=False: {p: times[1] / t for p, t in times.items()}, "weak=False"),
        (lambda times, weak=False: [times[1] / t for t in times.values()], "expected a dict"),
        (lambda times, weak=False: {p: t / times[1] for p, t in times.items()}, "efficiency at P=2"),
    ],
)
def test_efficiency_check_fails_on_wrong_formulas(wrong, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_scaling_efficiency(wrong)


def test_lr_check_passes_the_reference():
    checks.check_lr_factor(lab_lr_factor)
    checks.check_lr_factor(lambda *args: np.float64(lab_lr_factor(*args)))  # a NumPy float is a float


@pytest.mark.parametrize(
    "wrong, words",
    [
        (lambda step, k, rule="linear", warmup_steps=0: lab_lr_factor(step, k, rule, 0), "ramping up"),
        (
            lambda step, k, rule="linear", warmup_steps=0: lab_lr_factor(
                step, k * k if rule == "sqrt" else k, rule, warmup_steps
            ),
            "sqrt",
        ),
        (
            lambda step, k, rule="linear", warmup_steps=0: lab_lr_factor(
                step, k, "none" if rule == "linear" else rule, warmup_steps
            ),
            "rule='linear'",
        ),
    ],
)
def test_lr_check_fails_on_wrong_rules(wrong, words):
    with pytest.raises(checks.CheckFailed, match=words):
        checks.check_lr_factor(wrong)


@pytest.mark.parametrize(
    "check, reference",
    [(checks.check_scaling_efficiency, scaling.efficiency), (checks.check_lr_factor, scaling.lr_factor)],
    ids=["scaling_efficiency", "lr_factor"],
)
def test_the_checks_refuse_the_library_s_own_answer(check, reference):
    with pytest.raises(checks.CheckFailed, match="the library's own answer"):
        check(lambda *args, **kwargs: reference(*args, **kwargs))


# Equal wall-clock, synchronisations per epoch, MPI against gloo ---------------------


def test_a_time_budget_stops_training_after_the_step_that_spends_it():
    import torch
    from ddlab.data import StressStrainCurves
    from ddlab.data_parallel import train
    from ddlab.models import make_mlp

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    history = train(
        model,
        optimizer,
        StressStrainCurves(256),
        MPI.COMM_SELF,
        epochs=50,
        batch_size=8,
        time_budget=0.0,
        progress=False,
    )
    assert history.steps == 1 and len(history.epoch_times) == 1
    full = train(
        model,
        optimizer,
        StressStrainCurves(256),
        MPI.COMM_SELF,
        epochs=2,
        batch_size=64,
        time_budget=1e9,
        progress=False,
    )
    assert full.steps == 8 and len(full.epoch_times) == 2


@pytest.mark.parametrize(
    "n, batch, ranks, want",
    [(1024, 32, 1, 32), (1024, 32, 4, 32), (1000, 64, 4, 16), (1024, 1024, 4, 1), (100, 12, 3, 9)],
)
def test_syncs_per_epoch_counts_the_batches_of_a_padded_shard(n, batch, ranks, want):
    from ddlab.scaling import syncs_per_epoch

    assert syncs_per_epoch(n, batch, ranks) == want


def test_train_for_time_counts_one_allreduce_per_step_and_scores_as_it_goes():
    from ddlab.scaling import syncs_per_epoch, time_to_score, train_for_time

    run = train_for_time(MPI.COMM_SELF, 0.5, 128, lr=0.01, n=512, test=128)
    assert run["times"][0] == 0.0 and run["times"][-1] >= 0.5 and len(run["scores"]) == len(run["times"])
    assert run["times"] == sorted(run["times"])
    per_epoch = syncs_per_epoch(512, 128, 1)
    # how many epochs the budget holds depends on the machine's speed; what is counted does not
    assert run["allreduces_total"] == run["steps"] >= 1 and run["epoch_time"] > 0
    assert run["allreduces"] == [per_epoch] * (run["steps"] // per_epoch), "one allreduce per step, epoch by epoch"
    assert time_to_score(run["times"], run["scores"], -1e9) == 0.0
    assert time_to_score(run["times"], run["scores"], 2.0) is None  # R^2 never passes 1


def test_a_global_batch_the_ranks_cannot_share_is_refused():
    from ddlab.scaling import train_for_time

    class TwoRanks:
        def Get_size(self):
            return 2

    with pytest.raises(ValueError, match="multiple of the ranks"):
        train_for_time(TwoRanks(), 0.1, 3)
    with pytest.raises(ValueError, match="positive number of seconds"):
        train_for_time(TwoRanks(), 0, 4)


def test_allreduce_vs_gloo_on_one_process():
    from ddlab.data_parallel import close_gloo
    from ddlab.scaling import allreduce_vs_gloo

    try:
        times = allreduce_vs_gloo(MPI.COMM_SELF, [16, 4096], repeats=2)
    finally:
        close_gloo()
    assert set(times) == {"MPI Allreduce", "gloo all_reduce"}
    assert all(len(v) == 2 and min(v) > 0 for v in times.values())
