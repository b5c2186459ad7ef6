"""Zero-bubble schedules on real ranks: every schedule's gradients equal one process's (float64, 1e-10).

The stages are float64 chains (linear, tanh, linear), one per virtual stage: one per rank on a
chain (1F1B with the whole backward, ZB-H1, ZB-H2), two per rank in a V (ZB-V) or interleaved (lab 16's
schedule). m runs over p, 2p, 4p and p + 1 (not a multiple of p): every schedule but the interleaved
one takes any m. The ledger's numbers (bytes
of saved tensors) are exact; timings are never asserted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ddlab.pipeline import micro_batch_loss
from ddlab.pipeline.zero_bubble import (
    backward_input,
    backward_weight,
    forward_recorded,
    one_f_one_b_whole,
    placed,
    run_split,
    split_peak,
    split_peak_bytes,
    zb_h1,
    zb_h2,
    zb_v,
)
from ddlab.pipeline.zero_bubble_runs import SCHEDULES as RUNS
from ddlab.pipeline.zero_bubble_runs import held_bytes, interleaved_whole, stages
from ddlab.runtime.memory import Ledger
from mpi4py import MPI
from torch import nn

WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
WIDTH, ROWS = 3, 2


def _stages(n: int) -> list[nn.Module]:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return [nn.Sequential(nn.Linear(WIDTH, 5), nn.Tanh(), nn.Linear(5, WIDTH)).double() for _ in range(n)]


def _data(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=gen) for _ in range(m)]
    return inputs, [torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=gen) for _ in range(m)]


def _one_process(stages: list[nn.Module], inputs, targets) -> tuple[list[list[torch.Tensor]], float]:
    chain = copy.deepcopy(nn.Sequential(*stages))
    loss = micro_batch_loss(chain(torch.cat(inputs)), torch.cat(targets))
    loss.backward()
    return [[q.grad for q in stage.parameters()] for stage in chain], loss.item()


SCHEDULES = [
    ("1f1b", one_f_one_b_whole, "chain"),
    ("zb-h1", zb_h1, "chain"),
    ("zb-h2", zb_h2, "chain"),
    ("zb-v", zb_v, "V"),
    ("interleaved", interleaved_whole, "interleaved"),
]


#: every schedule with m = p, 2p, 4p, and p + 1 where it allows it (not the interleaved one: groups of p)
CASES = [(*s, f) for s in SCHEDULES for f in ("p", "2p", "4p", "p+1") if not (s[2] == "interleaved" and f == "p+1")]


@pytest.mark.parametrize("name, schedule, shape, factor", CASES, ids=[f"{c[0]}-m={c[3]}" for c in CASES])
def test_gradients_equal_one_process(name, schedule, shape, factor):
    m = {"p": P, "2p": 2 * P, "4p": 4 * P, "p+1": P + 1}[factor]
    n = P if shape == "chain" else 2 * P
    stages = _stages(n)
    inputs, targets = _data(m)
    want, want_loss = _one_process(stages, inputs, targets)
    mine = [RANK] if shape == "chain" else [placed(shape, P, RANK, 0), placed(shape, P, RANK, 1)]
    chunks = [copy.deepcopy(stages[q]) for q in mine]
    losses = run_split(WORLD, chunks, schedule(P, m, RANK), inputs, targets, shape=shape)
    errors = [
        max(float((got.grad - exp).abs().max()) for got, exp in zip(chunk.parameters(), want[q]))
        for chunk, q in zip(chunks, mine)
    ]
    errors = WORLD.allgather(max(errors))
    owner_of_loss = 0 if shape == "V" else P - 1
    losses = WORLD.bcast(losses, root=owner_of_loss)
    assert max(errors) < 1e-10, f"{name}, m={m}: gradient error per rank {errors}"
    assert len(losses) == m and sum(losses) == pytest.approx(want_loss, rel=1e-10)


def test_split_backward_equals_whole_backward_and_w_keeps_what_it_needs():
    stage = _stages(1)[0]
    whole = copy.deepcopy(stage)
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    ledger = Ledger()
    ledger.ignore(stage)  # the weights autograd saves are parameters, not activations
    with ledger.activations():
        y, records = forward_recorded(stage, x)
    saved = ledger.used["activations"]
    grad_x, pending = backward_input(y, grad_y, x, records)
    del y, records
    assert ledger.used["activations"] == 0, "B frees the graph"
    assert all(q.grad is None for q in stage.parameters()), "B computes no weight gradient"
    for _, a, g in pending:
        ledger.hold(a)
        ledger.hold(g)
    kept = ledger.used["activations"]
    backward_weight(pending)
    x2 = x.detach().clone().requires_grad_()
    whole(x2).backward(grad_y)
    assert float((grad_x - x2.grad).abs().max()) < 1e-12
    for got, exp in zip(stage.parameters(), whole.parameters()):
        assert float((got.grad - exp.grad).abs().max()) < 1e-12
    # forward saved x (2x3) and tanh's output (2x5); W keeps both inputs and both output gradients
    assert saved == 8 * ROWS * (WIDTH + 5)
    assert kept == 8 * ROWS * (WIDTH + 5 + 5 + WIDTH)


def test_zb_h1_keeps_1f1b_peak_micro_batches():
    for m in (P, 2 * P, 4 * P, P + 1):
        assert max(split_peak(zb_h1(P, m, s)) for s in range(P)) == max(
            split_peak(one_f_one_b_whole(P, m, s)) for s in range(P)
        )


@pytest.mark.parametrize("block", ["tanh", "post_norm"])
def test_the_ledger_s_peak_is_the_op_list_s_and_w_frees_what_it_kept(block):
    """Each rank's ledger peak is exactly its op list's count of micro-batches waiting for B (M_B each) and
    for W (M_W each): what W keeps is freed when W runs, not at the next B. With a post-norm block
    (M_W <= M_B, as Qi et al.'s Table 1 has for a transformer layer) ZB-H1's peak is 1F1B's; with the
    tanh block W keeps twice what F saved, and the last stage's p late W's pay it."""
    m_b, m_w = held_bytes(block, WIDTH, 5, ROWS, torch.float64)
    m = 2 * P
    inputs, targets = _data(m)
    peaks = {}
    for name in ("1F1B", "ZB-H1", "ZB-H2", "ZB-V"):
        schedule, shape = RUNS[name]
        n = P if shape == "chain" else 2 * P
        models = stages(n, WIDTH, 5, torch.float64, block)
        chunks = [copy.deepcopy(models[placed(shape, P, RANK, c)]) for c in range(n // P)]
        ledger = Ledger()
        ops = schedule(P, m, RANK)
        run_split(WORLD, chunks, ops, inputs, targets, shape=shape, ledger=ledger)
        assert ledger.used["activations"] == 0, f"{name}: activations left after the step"
        assert ledger.peak["activations"] == split_peak_bytes(ops, m_b, m_w), f"{name}, rank {RANK}"
        peaks[name] = max(WORLD.allgather(ledger.peak["activations"]))
    if block == "post_norm":
        assert m_w <= m_b and peaks["ZB-H1"] == peaks["1F1B"]
    else:
        assert m_w == 2 * m_b and peaks["ZB-H1"] == 2 * peaks["1F1B"]


@pytest.mark.parametrize("schedule", ["ZBV", "interleaved"])
def test_torch_s_zero_bubble_schedule_gives_ddlab_s_gradients(schedule):
    """torch.distributed.pipelining's ScheduleZBVZeroBubble (the V, beside ddlab's zb_v) and
    ScheduleInterleavedZeroBubble (beside lab 16's interleaved schedule) over gloo: the same losses and
    gradients as ddlab's run of the same stages, and as one process's (float64)."""
    import os

    import torch.distributed.pipelining as pipelining
    from ddlab.data_parallel import close_gloo
    from ddlab.pipeline.torch_zero_bubble import TORCH_SCHEDULES, TorchZeroBubble

    name, shape = TORCH_SCHEDULES[schedule]
    if not hasattr(pipelining, name):
        if os.environ.get("CI") == "true":
            pytest.fail(f"this torch ({torch.__version__}) has no torch.distributed.pipelining.{name}")
        pytest.skip(f"this torch ({torch.__version__}) has no torch.distributed.pipelining.{name}")
    m = 2 * P
    models = _stages(2 * P)
    inputs, targets = _data(m)
    want, want_loss = _one_process(models, inputs, targets)
    ours = [copy.deepcopy(models[placed(shape, P, RANK, c)]) for c in range(2)]
    ops = zb_v(P, m, RANK) if shape == "V" else interleaved_whole(P, m, RANK)
    our_losses = run_split(WORLD, ours, ops, inputs, targets, shape=shape)
    try:
        theirs = TorchZeroBubble(WORLD, models, m, schedule)
        their_losses = theirs.step(inputs, targets)
    finally:
        close_gloo()
    errors = [
        max(float((a.grad - b.grad).abs().max()) for a, b in zip(mine.parameters(), other.parameters()))
        for mine, other in zip(theirs.chunks, ours)
    ]
    to_one = [
        max(float((a.grad - b).abs().max()) for a, b in zip(chunk.parameters(), want[q]))
        for chunk, q in zip(theirs.chunks, theirs.indices)
    ]
    errors, to_one = WORLD.allgather(max(errors)), WORLD.allgather(max(to_one))
    assert max(errors) < 1e-10 and max(to_one) < 1e-10, f"{schedule}: vs ddlab {errors}, vs one process {to_one}"
    assert their_losses == pytest.approx(our_losses, rel=1e-12)
    if their_losses:
        assert sum(their_losses) == pytest.approx(want_loss, rel=1e-10)


def test_zb_v_on_a_mesh_of_pipeline_2_and_data_2_gives_one_process_s_gradients():
    """Lab 16's mesh, pipeline 2 x data 2: each replica's pipeline runs ZB-V (4 virtual stages in a V) on
    its half of 10 micro-batches (5 each, not a multiple of its 2 stages); the gradients summed over the
    data dimension equal one process's on the whole batch (float64)."""
    if P != 4:
        pytest.skip("pipeline 2 x data 2 needs 4 ranks")
    from ddlab.mesh import Mesh
    from ddlab.pipeline.zero_bubble import run_split_data_parallel

    mesh = Mesh.build(WORLD, data=2, pipeline=2)
    stage = mesh.coords["pipeline"]
    models = _stages(4)
    inputs, targets = _data(10)
    want, want_loss = _one_process(models, inputs, targets)
    mine = [copy.deepcopy(models[placed("V", 2, stage, c)]) for c in range(2)]
    try:
        losses = run_split_data_parallel(mesh.pipeline, mesh.data, mine, zb_v, inputs, targets)
        everyone = WORLD.allgather(losses)
    finally:
        mesh.free()
    errors = [
        max(float((a.grad - b).abs().max()) for a, b in zip(chunk.parameters(), want[placed("V", 2, stage, c)]))
        for c, chunk in enumerate(mine)
    ]
    assert max(WORLD.allgather(max(errors))) < 1e-10
    assert sorted(len(x) for x in everyone) == [0, 0, 5, 5]
    assert sum(sum(x) for x in everyone) == pytest.approx(want_loss, rel=1e-10)
