"""ddlab.data_parallel on several ranks: the same parameters as one process, and as torch DDP.

Every rank runs every test; results are compared across ranks with collectives and
asserted on every rank, so a failure never leaves a rank waiting.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import data_parallel as dp
from ddlab.data import StressStrainCurves
from ddlab.models import make_mlp
from ddlab.runtime.trace import Tracer
from mpi4py import MPI

TOLERANCE = 1e-10
PER_RANK = 8


def worst_everywhere(comm: MPI.Comm, value: float) -> float:
    return comm.allreduce(value, op=MPI.MAX)


def relative(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max(
        float((a - b).abs().max() / b.abs().max())
        for a, b in zip(model.state_dict().values(), reference.state_dict().values())
    )


def data_for(comm: MPI.Comm, steps: int = 5) -> StressStrainCurves:
    return StressStrainCurves(n=comm.Get_size() * PER_RANK * steps, seed=2, dtype=torch.float64)


def trained(
    comm: MPI.Comm, data: StressStrainCurves, batch_size: int, epochs: int = 2, wrap: str | None = "ddlab", **options
) -> torch.nn.Module:
    model = make_mlp(seed=1, dtype=torch.float64)
    if wrap == "ddlab":
        wrapped = dp.DataParallel(model, comm, **options)
    elif wrap == "ddp":
        wrapped = dp.torch_ddp(model)
    else:
        wrapped = model
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    dp.train(wrapped, optimizer, data, comm, epochs=epochs, batch_size=batch_size, progress=False)
    return model


@pytest.fixture(scope="module")
def one_process() -> torch.nn.Module:
    """The reference: one process (MPI.COMM_SELF) with the global batch P*b."""
    comm = MPI.COMM_WORLD
    return trained(MPI.COMM_SELF, data_for(comm), comm.Get_size() * PER_RANK, wrap=None)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"overlap": False},
        {"bucket_cap_mb": 0},
        {"bucket_cap_mb": 0.1},
        {"bucket_cap_mb": None},
        {"allreduce": "ring"},
        {"allreduce": "rabenseifner", "bucket_cap_mb": 0.1},
        {"progress": "thread", "bucket_cap_mb": 0.1},
        {"progress": "thread", "overlap": False},
    ],
    ids=str,
)
def test_ranks_match_one_process_with_the_global_batch(comm, one_process, options):
    model = trained(comm, data_for(comm), PER_RANK, **options)
    assert worst_everywhere(comm, relative(model, one_process)) < TOLERANCE


class CountingIallreduce:
    """A communicator that counts Iallreduce calls and forwards everything."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.calls = comm, 0

    def Iallreduce(self, *args, **kwargs):
        self.calls += 1
        return self.comm.Iallreduce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.comm, name)


def test_accumulation_communicates_once_per_step_and_matches_the_global_batch(comm, one_process):
    model = make_mlp(seed=1, dtype=torch.float64)
    counting = CountingIallreduce(comm)
    wrapped = dp.DataParallel(model, counting)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    history = dp.train(
        wrapped, optimizer, data_for(comm), comm, epochs=2, batch_size=PER_RANK // 2, accumulate=2, progress=False
    )
    assert worst_everywhere(comm, relative(model, one_process)) < TOLERANCE
    assert counting.calls == history.steps * len(wrapped.buckets)


def test_no_sync_leaves_gradients_local(comm):
    model = make_mlp(seed=1, dtype=torch.float64)
    wrapped = dp.DataParallel(model, comm)
    x, y = data_for(comm)[np.arange(4) + 4 * comm.Get_rank()]
    with wrapped.no_sync():
        dp.squared_error(wrapped(x), y).mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    reference = make_mlp(seed=1, dtype=torch.float64)
    dp.squared_error(reference(x), y).mean().backward()
    assert (
        worst_everywhere(comm, max(float((a - b.grad).abs().max()) for a, b in zip(local, reference.parameters())))
        == 0.0
    )


def test_parameters_and_buffers_are_broadcast_from_rank_0(comm):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).double()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.fill_(comm.Get_rank() + 1.5)
    dp.DataParallel(model, comm)
    values = {float(t.flatten()[0]) for t in model.state_dict().values() if t.is_floating_point()}
    assert comm.allgather(values) == [{1.5}] * comm.Get_size()


@pytest.mark.parametrize("progress", ["test", "thread"])
def test_buckets_start_during_backward_with_overlap(comm, progress):
    """With overlap, the first bucket's allreduce starts before backward has ended."""
    tracer = Tracer(comm.Get_rank())
    model = dp.DataParallel(make_mlp(seed=1), comm, bucket_cap_mb=0.05, tracer=tracer, progress=progress)
    x, y = StressStrainCurves(n=64)[np.arange(64)]
    with tracer.span("backward"):
        dp.squared_error(model(x), y).mean().backward()
    backward = next(s for s in tracer.spans if s.name == "backward")
    starts = sorted(s.start for s in tracer.spans if s.track == dp.wrapper.IN_FLIGHT)
    assert len(model.buckets) > 2
    assert comm.allreduce(int(len(starts) == len(model.buckets) and starts[0] < backward.end - 1e-6), op=MPI.MIN) == 1


def test_torch_ddp_reaches_the_same_parameters(comm, one_process):
    dp.init_gloo(comm)
    try:
        model = trained(comm, data_for(comm), PER_RANK, wrap="ddp")
    finally:
        dp.close_gloo()
    assert worst_everywhere(comm, relative(model, one_process)) < TOLERANCE


def test_checkpoint_written_by_rank_0_resumes_on_all_ranks(comm, tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("ckpt") / "model.pt") if comm.Get_rank() == 0 else None)
    data = data_for(comm)

    def fresh():
        model = dp.DataParallel(make_mlp(seed=1, dtype=torch.float64), comm)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    straight, optimizer = fresh()
    dp.train(straight, optimizer, data, comm, epochs=2, batch_size=PER_RANK, progress=False)
    first, optimizer = fresh()
    dp.train(first, optimizer, data, comm, epochs=1, batch_size=PER_RANK, progress=False)
    dp.save_checkpoint(path, comm, first, optimizer, epoch=1)
    resumed, optimizer = fresh()  # new replicas, new optimizer state
    state = dp.load_checkpoint(path, comm, resumed, optimizer)
    dp.train(resumed, optimizer, data, comm, epochs=2, start_epoch=state["epoch"], batch_size=PER_RANK, progress=False)
    assert state == {"epoch": 1}
    assert worst_everywhere(comm, relative(resumed.module, straight.module)) < TOLERANCE


def test_evaluate_agrees_with_one_process(comm):
    model = make_mlp(seed=1, dtype=torch.float64)
    data = StressStrainCurves(n=101, seed=9, dtype=torch.float64)  # 101: blocks of unequal length
    together, alone = dp.evaluate(model, data, comm), dp.evaluate(model, data, MPI.COMM_SELF)
    assert abs(together["mse"] - alone["mse"]) <= 1e-12 * alone["mse"]
    assert np.allclose(together["r2"], alone["r2"], rtol=1e-12)


def test_student_style_allreduce_function_is_called_per_bucket(comm):
    calls = []

    def allreduce(c, x):
        calls.append(x.size)
        out = np.empty_like(x)
        c.Allreduce(x, out)
        return out

    model = dp.DataParallel(make_mlp(seed=1), comm, allreduce=allreduce, bucket_cap_mb=0.1)
    x, y = StressStrainCurves(n=8)[np.arange(8)]
    dp.squared_error(model(x), y).mean().backward()
    assert calls == [b.buffer.size for b in model.buckets]


def test_a_plain_model_with_after_backward_averaging_matches_one_process(comm, one_process):
    model = make_mlp(seed=1, dtype=torch.float64)
    dp.broadcast_parameters(model, comm)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dp.train(
        model,
        optimizer,
        data_for(comm),
        comm,
        epochs=2,
        batch_size=PER_RANK,
        progress=False,
        after_backward=lambda: dp.average_gradients(model, comm, "ring"),
    )
    assert worst_everywhere(comm, relative(model, one_process)) < TOLERANCE
