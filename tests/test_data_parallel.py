"""ddlab.data_parallel and ddlab.models.mlp in one process (multi-rank tests: tests/mpi/)."""

from __future__ import annotations

import math

import pytest
import torch
from ddlab import data_parallel as dp
from ddlab.data import StressStrainCurves
from ddlab.models import count_parameters, make_mlp
from ddlab.runtime.trace import Tracer
from mpi4py import MPI

SELF = MPI.COMM_SELF


def test_the_mlp_has_about_150k_parameters_and_a_seeded_init():
    assert count_parameters(make_mlp()) == 148_482
    assert all(torch.equal(a, b) for a, b in zip(make_mlp(seed=3).parameters(), make_mlp(seed=3).parameters()))
    assert not torch.equal(next(make_mlp(seed=3).parameters()), next(make_mlp(seed=4).parameters()))
    state = torch.random.get_rng_state()
    make_mlp(seed=9)
    assert torch.equal(state, torch.random.get_rng_state())  # the global generator is left alone


def test_buckets_go_last_layer_first_and_respect_the_cap():
    params = list(make_mlp().parameters())
    sizes = [p.numel() * 4 for p in params]  # float32
    assert [len(g) for g in dp.plan_buckets(params, None)] == [8]
    assert dp.plan_buckets(params, 25.0) == [list(reversed(params))]
    singles = dp.plan_buckets(params, 0)
    assert [g[0] is p for g, p in zip(singles, reversed(params))] == [True] * 8
    cap = 0.1
    for group in dp.plan_buckets(params, cap):
        nbytes = sum(p.numel() * 4 for p in group)
        assert nbytes <= cap * 2**20 or len(group) == 1
    assert sum(sizes) == sum(b.nbytes for b in dp.make_buckets(params, cap))


def test_buckets_split_by_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    assert [len(g) for g in dp.plan_buckets(list(model.parameters()), None)] == [2, 2]


def test_a_negative_cap_says_what_is_allowed():
    with pytest.raises(ValueError, match="None: no cap"):
        dp.plan_buckets(list(make_mlp().parameters()), -1)


def test_allreduce_choices_resolve_to_lab_03_functions():
    from ddlab import allreduce

    assert dp.resolve_allreduce(None) is allreduce.allreduce_mpi
    assert dp.resolve_allreduce("ring") is allreduce.allreduce_ring
    with pytest.raises(ValueError, match="ring"):
        dp.resolve_allreduce("rign")
    with pytest.raises(TypeError):
        dp.resolve_allreduce(3)


def test_one_process_data_parallel_is_plain_training():
    data = StressStrainCurves(n=64, dtype=torch.float64)
    plain, wrapped = make_mlp(dtype=torch.float64), make_mlp(dtype=torch.float64)
    for target in (plain, dp.DataParallel(wrapped, SELF, bucket_cap_mb=0.1)):
        optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
        history = dp.train(target, optimizer, data, SELF, epochs=2, batch_size=16, progress=False)
        assert history.steps == 8 and len(history.losses) == 8 and len(history.epoch_times) == 2
    assert all(torch.allclose(a, b, rtol=0, atol=1e-14) for a, b in zip(plain.parameters(), wrapped.parameters()))


def test_training_learns_the_task():
    data, test = StressStrainCurves(n=4096), StressStrainCurves(n=1024, seed=7)
    model = make_mlp()
    before = dp.evaluate(model, test, SELF)["score"]
    dp.train(model, torch.optim.Adam(model.parameters(), lr=1e-3), data, SELF, epochs=2, batch_size=32, progress=False)
    after = dp.evaluate(model, test, SELF)
    assert before < 0.1 < 0.6 < after["score"] and len(after["r2"]) == 2


def test_learning_rate_schedule_and_max_steps():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    original = optimizer.step

    def step():
        seen.append(optimizer.param_groups[0]["lr"])
        original()

    optimizer.step = step
    dp.train(
        model,
        optimizer,
        StressStrainCurves(n=100),
        SELF,
        epochs=2,
        batch_size=10,
        max_steps=3,
        lr_at=lambda s: (s + 1) / 10,
        progress=False,
    )
    assert seen == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25, 0.3])


def test_phases_are_timed():
    tracer = Tracer()
    model = dp.DataParallel(make_mlp(), SELF, tracer=tracer)
    dp.train(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        StressStrainCurves(n=64),
        SELF,
        batch_size=16,
        tracer=tracer,
        progress=False,
    )
    assert set(tracer.totals()) == set(dp.PHASES)
    assert len([s for s in tracer.spans if s.name == "backward"]) == 4


def test_progress_bar_is_off_when_asked_and_on_other_ranks(monkeypatch):
    monkeypatch.setenv("DDLAB_PROGRESS", "0")
    assert dp.progress_bar(5, SELF).disable
    monkeypatch.setenv("DDLAB_PROGRESS", "1")
    assert not dp.progress_bar(5, SELF).disable
    assert dp.progress_bar(5, SELF, enabled=False).disable


def test_checkpoint_round_trip_on_one_process(tmp_path):
    model = make_mlp(seed=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dp.train(model, optimizer, StressStrainCurves(n=32), SELF, batch_size=8, progress=False)
    dp.save_checkpoint(tmp_path / "c.pt", SELF, model, optimizer, epoch=1, note="x")
    other = make_mlp(seed=2)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=1e-3)
    assert dp.load_checkpoint(tmp_path / "c.pt", SELF, other, other_optimizer) == {"epoch": 1, "note": "x"}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert other_optimizer.state_dict()["state"][0]["step"] == 4
    assert not (tmp_path / "c.pt.partial").exists()


def test_a_missing_checkpoint_says_which_file(tmp_path):
    with pytest.raises(OSError, match="nothing.pt"):
        dp.load_checkpoint(tmp_path / "nothing.pt", SELF, make_mlp())


def test_replicas_differ_is_zero_on_one_process():
    assert dp.replicas_differ(make_mlp(), SELF) == 0.0
    assert math.isfinite(dp.replicas_differ(make_mlp(), SELF))
    assert isinstance(dp.threads_per_rank(), int)


def test_an_unknown_progress_mode_says_which_exist():
    with pytest.raises(ValueError, match="'test' or 'thread'"):
        dp.DataParallel(make_mlp(), SELF, progress="magic")
