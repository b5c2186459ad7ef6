"""The lab 07 pipeline against its theory: bubble, activation memory, stage balance.

One MPI job of 4 ranks pipelines the lab's UNet (4 levels, 4 channels, 128x128 images,
micro-batches of one image) and prints:

- for M = 1, 2, 4, 8, 16 micro-batches and both schedules, the measured bubble on the
  busy clock (median over rounds) and |bubble - (K-1)/(M+K-1)|, with the bubble
  expected from the run's own stage times and the slowest stage over the mean, in the
  less even direction (forward or backward), beside it;
- the share of a lone micro-batch's work done off the critical path (M = 1) and the
  theory with that overlap, which is why a balanced pipeline measures below (K-1)/(M+K-1);
- GPipe / 1F1B peak activation memory per rank, against M / min(K-s, M);
- max/mean stage time of the naive and the balanced (dynamic programming, then
  calibrated) split, 1F1B with 8 micro-batches, and their throughput ratio;
- a control: the same schedules on K identical stages (a plain stack of equal 3x3
  convolutions, built from the UNet's own layers), which (K-1)/(M+K-1) assumes. What
  still separates the bubble from the theory there is the machine, not the split.

The schedules take turns within every round (and so do the two splits), each round
starting with the other one, so that other work on the machine hits them alike.

    .venv/bin/python bench/pipeline.py [--rounds 5]

With `--interleaved` (lab 16) it measures instead the bubble against M for plain 1F1B and the
interleaved schedule (v = 2 chunks per rank, Narayanan et al., SC 2021, section 2.2.2) on p ranks
(`--ranks`, default 2: one per core) of a chain of equal linear layers, beside (p-1)/m and
(p-1)/(v m) of the ideal time and (p-1)/(m+p-1), (p-1)/(v m+p-1) of the step. The bubble is measured
as lab 07 measures it, on the busy clock (`run_interleaved(..., clock=Timeline)`: idle is a rank
waiting for a message its sender had not yet sent, in CPU time), beside the schedule replayed with the
step's own op times per rank (what uneven ranks give), and, on the wall clock, the idle share of the
same spans and 1 - ideal / step (the ideal each rank's own ops back to back, measured in the same round).

    .venv/bin/python bench/pipeline.py --interleaved [--ranks 2] [--rounds 5]

With `--zero-bubble` (lab 17) it measures on 4 ranks, for m = 4, 8, 12, 16 (`--ms`), the bubble of 1F1B,
the interleaved schedule, ZB-H1, ZB-H2 and ZB-V (Qi et al., ICLR 2024, sections 2.1-2.2; Qi et al. 2024,
"Pipeline Parallelism with Controllable Memory") on post-norm blocks (linear, GELU, linear, a layer
norm without weights; medians of `--rounds` runs, the schedules taking turns), beside each schedule's
replay and formula from the run's own F, B and W times, and each schedule's peak activation memory from
the ledger over 1F1B's (and per rank, in units of M_B; interleaved and ZB-V hold two blocks a rank, twice
the layers). Then the tanh block's (linear, tanh, linear) ZB-H1 peak, whose W keeps twice what F saved,
and torch's ScheduleZBVZeroBubble beside ddlab's zb_v on the same stages over gloo: wall time per step
and the results. A verdict line (PASS or FAIL, the measured figure beside the target) per target: at
m = 8 ZB-H1's bubble over 1F1B's within 0.1 of the formulas', its peak within 5% of 1F1B's, torch's
results equal to ddlab's. The full run (5 rounds, 4 values of m) takes about 6 minutes on a quiet
2-core machine (an estimate: `--rounds 1 --ms 4 8` took 100 s at a load average of 16); it prints its
own time at the end. Run it on a quiet machine.

    .venv/bin/python bench/pipeline.py --zero-bubble [--rounds 5] [--ms 4 8 12 16] [--size 64 256 32]

It relaunches itself under mpiexec (ddlab.runtime.mpi.bench_main).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch import nn

TIMEOUT = 1800
MS = (1, 2, 4, 8, 16)


class ConvStack(nn.Module):
    """K identical stages in the UNet's form: an input convolution, `k * per_stage` equal 3x3
    convolutions, a head, no skips; `bounds` cuts it after every `per_stage` convolutions
    (the first stage also runs the input convolution, the last the head and the loss)."""

    def __init__(self, width: int, per_stage: int, k: int, in_channels: int = 3, classes: int = 3):
        from ddlab.models.unet import Conv, Head

        super().__init__()
        self.depth, self.in_channels = 0, in_channels
        body = [Conv(width, width) for _ in range(k * per_stage)]
        self.layers = nn.ModuleList([Conv(in_channels, width), *body, Head(width, classes)])
        self.bounds = [0] + [1 + per_stage * s for s in range(1, k)] + [len(self.layers)]


def bubble_table(k: int, bubbles: dict, expected: dict, imbalance: dict) -> None:
    """Print, per M and schedule, the median bubble, |bubble - (K-1)/(M+K-1)|, expected and max/mean,
    and the largest |diff| for M >= 4 against the 0.05 target."""
    from ddlab.pipeline import theory_bubble

    print(
        f"{'M':>3} {'theory':>7} | {'GPipe':>6} {'|diff|':>6} {'expected':>8} {'max/mean':>8} | "
        f"{'1F1B':>6} {'|diff|':>6} {'expected':>8} {'max/mean':>8}"
    )
    worst = 0.0
    for m in sorted({m for _, m in bubbles}):
        cells = []
        for name in ("gpipe", "one_f_one_b"):
            got = statistics.median(bubbles[name, m])
            diff = abs(got - theory_bubble(k, m))
            if m >= 4:
                worst = max(worst, diff)
            cells.append(
                f"{got:6.3f} {diff:6.3f} {statistics.median(expected[name, m]):8.3f} "
                f"{statistics.median(imbalance[name, m]):8.2f}"
            )
        print(f"{m:3d} {theory_bubble(k, m):7.3f} | " + " | ".join(cells))
    print(f"largest |bubble - theory| for M >= 4: {worst:.3f} (target <= 0.05: {'met' if worst <= 0.05 else 'missed'})")


def child(rounds: int) -> None:
    from ddlab.data.images import make_segmentation
    from ddlab.model_parallel import naive_split
    from ddlab.models.unet import UNet
    from ddlab.pipeline import (
        Calibration,
        calibrate,
        expected_bubble,
        gpipe,
        hidden_share,
        measure_pipeline,
        measured_stage_times,
        one_f_one_b,
        theory_bubble,
    )
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, k = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = UNet(width=4, depth=4)
    images, masks = make_segmentation(16, 128, seed=0)
    times = measured_stage_times(comm, model, images[:1], masks[:1])
    calibration = calibrate(comm, model, images[:8], masks[:8], times, m=8)
    splits = {"naive": naive_split(len(model.layers), k), "balanced": calibration.best}
    schedules = (gpipe, one_f_one_b)

    control = ConvStack(width=16, per_stage=4, k=k)
    control_images, control_masks = make_segmentation(16, 32, seed=0)
    tables = {which: ({}, {}, {}) for which in ("unet", "control")}  # bubbles, expected, max/mean
    peaks: dict[tuple[str, int], list[int]] = {}
    hidden: list[float] = []
    stage_times = {name: [] for name in splits}
    makespans = {name: [] for name in splits}
    for round_ in range(rounds):
        order = schedules if round_ % 2 == 0 else schedules[::-1]
        for m in MS:
            for schedule in order:
                for which, net, bounds, x, y in (
                    ("unet", model, splits["balanced"], images, masks),
                    ("control", control, control.bounds, control_images, control_masks),
                ):
                    run = measure_pipeline(comm, net, bounds, schedule, m, x[:m], y[:m], repeats=1)
                    for table, value in zip(
                        tables[which],
                        (run.bubble, expected_bubble(run, schedule), Calibration.imbalance(run.directions)),
                    ):
                        table.setdefault((schedule.__name__, m), []).append(value)
                    if which == "unet":
                        peaks[schedule.__name__, m] = run.peak_activations
                        if m == 1:
                            hidden.append(hidden_share(run))
        for name in list(splits) if round_ % 2 == 0 else list(splits)[::-1]:
            run = measure_pipeline(comm, model, splits[name], one_f_one_b, 8, images[:8], masks[:8], repeats=1)
            stage_times[name].append(run.stage_times)
            makespans[name].append(run.makespan)
    if rank != 0:
        return

    print(f"{k} ranks, UNet(width=4, depth=4), 128x128 images, micro-batches of 1, {rounds} rounds")
    print(
        f"splits: naive {splits['naive']}, balanced {splits['balanced']} "
        f"(calibration rounds: {[round(calibration.imbalance(m), 2) for _, _, m in calibration.rounds]})"
    )
    print("\nbubble on the busy clock (median over rounds); theory (K-1)/(M+K-1); expected: the schedule")
    print("replayed with the run's own stage times; max/mean: slowest stage over the mean in that run,")
    print("in the less even direction (forward or backward)")
    bubble_table(k, *tables["unet"])
    h = statistics.median(hidden)
    print(f"\nM = 1: {h:.3f} of the stages' work ran off the critical path (median over both schedules and rounds);")
    print("theory with that overlap: " + ", ".join(f"M={m} {theory_bubble(k, m, h):.3f}" for m in MS))

    print("\npeak activations, GPipe / 1F1B per rank, against M / min(K-s, M)")
    for m in MS:
        g, f = peaks["gpipe", m], peaks["one_f_one_b", m]
        ratios = [a / b for a, b in zip(g, f)]
        want = [m / min(k - s, m) for s in range(k)]
        print(f"M={m:2d}: measured {[round(r, 2) for r in ratios]}  expected {[round(w, 2) for w in want]}")
    ok = all(max(peaks["one_f_one_b", m]) <= max(peaks["gpipe", m]) * k / m * 1.1 for m in MS if m >= 2 * k)
    print(f"1F1B peak <= GPipe peak x K/M + 10% for M >= 2K (largest rank): {'met' if ok else 'missed'}")

    print("\nstage balance, 1F1B with M=8 (per stage: median over rounds of its busy time)")
    ratio = {}
    for name, per_round in stage_times.items():
        per_stage = [statistics.median(t) for t in zip(*per_round)]
        ratio[name] = max(per_stage) / (sum(per_stage) / k)
        print(
            f"{name:9} {splits[name]}: ms per micro-batch {[round(t / 8 * 1e3, 2) for t in per_stage]}, "
            f"max/mean {ratio[name]:.3f}"
        )
    speed = statistics.median(makespans["naive"]) / statistics.median(makespans["balanced"])
    print(
        f"balanced max/mean <= 1.15: {'met' if ratio['balanced'] <= 1.15 else 'missed'}; "
        f"throughput balanced / naive = {speed:.2f}"
    )

    print(
        f"\ncontrol: {k} identical stages ({control.bounds}: an input convolution, {len(control.layers) - 2} "
        "equal 16->16 3x3 convolutions, a head), 32x32 images;"
    )
    print("the split cannot be uneven here, so what remains is the machine's")
    bubble_table(k, *tables["control"])


INTERLEAVED_WIDTH, INTERLEAVED_ROWS, LAYERS_PER_CHUNK, CHUNKS = 512, 256, 2, 2


def interleaved_child(rounds: int) -> None:
    """Bubble against M, 1F1B (one chunk of v x LAYERS_PER_CHUNK layers per rank) and interleaved (v chunks).

    Three measures of one step, each a share of the step: the idle share on the busy clock (CPU time,
    messages carrying the sender's time, as lab 07 measures), the idle share on the wall clock from the
    same run's spans, and 1 - ideal / step on the wall clock."""
    import time

    from ddlab.model_parallel import Timeline, kind_totals, utilisation
    from ddlab.pipeline import bubble, interleaved_1f1b, interleaved_bubble, run_interleaved
    from ddlab.pipeline.schedules import replay
    from ddlab.runtime.trace import gather_spans
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, p, v = comm.Get_rank(), comm.Get_size(), CHUNKS
    torch.set_num_threads(1)
    torch.manual_seed(0)

    def layer() -> nn.Module:
        return nn.Sequential(nn.Linear(INTERLEAVED_WIDTH, INTERLEAVED_WIDTH), nn.Tanh())

    virtual = [nn.Sequential(*(layer() for _ in range(LAYERS_PER_CHUNK))) for _ in range(v * p)]
    # 1F1B: rank r holds virtual stages r v .. r v + v - 1 as one chunk; interleaved: stages r, p + r, ...
    plain = [nn.Sequential(*virtual[rank * v : (rank + 1) * v])]
    chunked = [virtual[j * p + rank] for j in range(v)]

    def loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((y - target) ** 2).sum()

    def step(chunks: list[nn.Module], chunk_count: int, m: int, ideal: float) -> tuple[float, ...]:
        """(busy-clock bubble, expected, wall-clock bubble from the spans, 1 - ideal / step, max/mean) of one step.

        expected: the schedule replayed with this step's own op times, each rank's busy time per op split
        between forward and backward as its compute was (uneven ranks included, jitter left out); max/mean:
        the slowest rank's busy time per op over the mean. The inputs require grad, so that rank 0's first
        layer computes its input's gradient as every other layer does: the ranks are equal, as the formulas
        assume (without it rank 0's backward is the shorter, and in 1F1B's steady state, which leaves no
        slack, the other rank's extra time per micro-batch is idle on rank 0: a bubble growing with M)."""
        inputs = [torch.randn(INTERLEAVED_ROWS, INTERLEAVED_WIDTH, requires_grad=True) for _ in range(m)]
        schedules = [interleaved_1f1b(p, m, r, chunk_count) for r in range(p)]
        clock = Timeline(rank)
        comm.Barrier()
        start = time.perf_counter()
        run_interleaved(comm, chunks, schedules[rank], inputs, inputs, loss, clock=clock)
        wall = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        busy_spans, wall_spans = gather_spans(clock.busy, comm), gather_spans(clock.wall, comm)
        per_op = [utilisation([spans])["busy"][0] / (chunk_count * m) for spans in busy_spans]
        totals = [kind_totals(spans) for spans in busy_spans]
        share = [t["forward"] / (t["forward"] + t["backward"]) for t in totals]
        forward = [t * f for t, f in zip(per_op, share)]
        backward = [t * (1 - f) for t, f in zip(per_op, share)]
        expected = bubble(replay(schedules, forward, backward, chunk_count))
        imbalance = max(per_op) / (sum(per_op) / p)
        return (
            utilisation(busy_spans)["bubble"],
            expected,
            utilisation(wall_spans)["bubble"],
            1 - ideal / wall,
            imbalance,
        )

    def alone(m: int) -> float:
        """This rank's forwards and backwards of m micro-batches, back to back, no messages; all ranks at once."""
        x = torch.randn(INTERLEAVED_ROWS, INTERLEAVED_WIDTH, requires_grad=True)
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(m):
            plain[0](x).sum().backward()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    ms = [m for m in (p, 2 * p, 4 * p, 8 * p) if m <= 16] or [p]
    found: dict[tuple[int, int], list[tuple[float, ...]]] = {}
    step(plain, 1, ms[0], alone(ms[0])), step(chunked, v, ms[0], 0.0)  # warm-up, not counted
    for round_ in range(rounds):
        for m in ms:
            ideal = alone(m)
            order = ((plain, 1), (chunked, v))
            for chunks, count in order if round_ % 2 == 0 else order[::-1]:
                found.setdefault((m, count), []).append(step(chunks, count, m, ideal))
    if rank != 0:
        return
    print(f"p = {p} ranks, v = {v} chunks, {LAYERS_PER_CHUNK * v} layers per rank, median of {rounds} rounds")
    print("bubble as a share of the step. busy: idle on the busy clock (CPU time; a message carries its sender's")
    print("  time: the step as it would run with a core per rank); expected: the schedule replayed with the")
    print("  step's own op times per rank (what is left of busy - expected is jitter: ops that ran slower")
    print("  than their rank's mean, on a machine shared); formula: (p-1)/(m+p-1), (p-1)/(v m+p-1);")
    print("  waits: idle on the wall clock, from the same spans; 1-i/s: 1 - ideal / step, wall clock, the")
    print("  ideal each rank's ops back to back, measured in the same round")
    head = f"{'busy':>6} {'expect':>6} {'formula':>7} {'waits':>6} {'1-i/s':>6}"
    print(f"{'':3} | {'1F1B':^35} | {'interleaved, v = ' + str(v):^35}")
    print(f"{'M':>3} | {head} | {head}")
    medians = {key: [statistics.median(x) for x in zip(*values)] for key, values in found.items()}
    for m in ms:
        cells = []
        for count in (1, v):
            busy, expected, waits, share, _ = medians[(m, count)]
            cells.append(
                f"{busy:6.3f} {expected:6.3f} {interleaved_bubble(p, m, count):7.3f} {waits:6.3f} {share:6.3f}"
            )
        print(f"{m:3} | " + " | ".join(cells))
    print("\nthe same on the busy clock as a share of the ideal compute, b / (1 - b), against (p-1)/m and (p-1)/(v m);")
    print("max/mean: the slowest rank's busy time per op over the mean")
    head = f"{'busy':>6} {'expect':>6} {'formula':>7} {'ratio':>5} {'max/mean':>8}"
    print(f"{'':3} | {'1F1B':^36} | {'interleaved':^36} | {'interleaved / 1F1B':^18}")
    print(f"{'M':>3} | {head} | {head} | {'busy':>6} {'1/v':>5}")
    for m in ms:
        cells, ideal = [], []
        for count in (1, v):
            busy, expected = (b / (1 - b) for b in medians[(m, count)][:2])
            want = (p - 1) / (count * m)
            cells.append(f"{busy:6.3f} {expected:6.3f} {want:7.3f} {busy / want:5.2f} {medians[(m, count)][4]:8.3f}")
            ideal.append(busy)
        print(f"{m:3} | " + " | ".join(cells) + f" | {ideal[1] / ideal[0]:6.2f} {1 / v:5.2f}")


ZB_MS = (4, 8, 12, 16)


def verdict(target: str, ok: bool, measured: str) -> None:
    """One line per target: PASS or FAIL, the target, and what was measured beside it."""
    print(f"verdict {'PASS' if ok else 'FAIL'}: {target}: {measured}")


def zero_bubble_child(rounds: int, ms: tuple[int, ...], size: tuple[int, int, int] = (64, 256, 32)) -> None:
    from ddlab.pipeline.torch_pipelining import alternate_wall_times
    from ddlab.pipeline.torch_zero_bubble import TorchZeroBubble
    from ddlab.pipeline.zero_bubble import placed, run_split, zb_v
    from ddlab.pipeline.zero_bubble_runs import SCHEDULES, closed_form, held_bytes, measure_split, predicted, stages
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    width, hidden, rows = size
    started = time.perf_counter()
    names = list(SCHEDULES)
    found: dict[tuple[str, int], list] = {}
    for m in ms:
        for turn in range(rounds):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                found.setdefault((name, m), []).append(
                    measure_split(comm, name, m, width, hidden, rows, repeats=1, block="post_norm")
                )
    tanh = {
        name: measure_split(comm, name, 8, width, hidden, rows, repeats=1, block="tanh") for name in ("1F1B", "ZB-H1")
    }
    # torch's ZB-V beside ddlab's, same stages (two a rank in a V), same micro-batches
    m = 8
    models = stages(2 * p, width, hidden, block="post_norm")
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    targets = [torch.randn(rows, width, generator=gen) for _ in range(m)]
    ours = [copy.deepcopy(models[placed("V", p, rank, c)]) for c in range(2)]
    theirs = TorchZeroBubble(comm, models, m, "ZBV")
    ops = zb_v(p, m, rank)
    results: dict[str, list[float]] = {}

    def ddlab_step() -> None:
        for chunk in ours:
            chunk.zero_grad(set_to_none=True)
        results["ddlab"] = run_split(comm, ours, ops, inputs, targets, shape="V")

    def torch_step() -> None:
        for chunk in theirs.chunks:
            chunk.zero_grad(set_to_none=True)
        results["torch"] = theirs.step(inputs, targets)

    times = alternate_wall_times(comm, {"ddlab ZB-V": ddlab_step, "torch ZBV": torch_step}, repeats=rounds + 1)
    scale = max(float(q.grad.abs().max()) for chunk in ours for q in chunk.parameters())
    grad_gap = max(
        float((a.grad - b.grad).abs().max())
        for x, y in zip(ours, theirs.chunks)
        for a, b in zip(x.parameters(), y.parameters())
    )
    grad_gap = comm.allreduce(grad_gap, op=MPI.MAX) / comm.allreduce(scale, op=MPI.MAX)
    loss_gap = max((abs(a - b) / abs(a) for a, b in zip(results["ddlab"], results["torch"])), default=0.0)
    loss_gap = comm.allreduce(loss_gap, op=MPI.MAX)
    if rank != 0:
        return
    m_b, m_w = held_bytes("post_norm", width, hidden, rows)
    t_b, t_w = held_bytes("tanh", width, hidden, rows)
    print(
        f"p = {p}; stages: linear {width} -> {hidden}, GELU, linear {hidden} -> {width}, layer norm (no weights); "
        f"{rows} rows, float32"
    )
    print(f"M_B = {m_b} bytes held from F to B, M_W = {m_w} from B to W (ledger; M_W / M_B = {m_w / m_b:.3f})")
    print("bubble (idle share of the step, busy clock; median of rounds) | replayed with the run's F, B, W | formula")
    print("peak: largest rank's peak activation bytes over 1F1B's (ledger); per rank in units of M_B")
    ratios = {}
    for m in ms:
        print(f"\nm = {m}")
        base = statistics.median(max(r.peaks) for r in found[("1F1B", m)])
        split = tuple(statistics.median(r.times[k] for r in found[("ZB-H1", m)]) for k in range(3))
        f, b, w = (1e3 * t for t in split)
        print(f"  F, B, W = {f:.3f}, {b:.3f}, {w:.3f} ms (ZB-H1's runs, median)")
        for name in names:
            runs = found[(name, m)]
            measured = statistics.median(r.bubble for r in runs)
            replayed = statistics.median(predicted(r) for r in runs)
            forms = [closed_form(r, split if r.times[2] == 0.0 else None) for r in runs]
            formula = None if forms[0] is None else statistics.median(f for f in forms if f is not None)
            peak = statistics.median(max(r.peaks) for r in runs) / base
            per_rank = " ".join(f"{x / m_b:.2f}" for x in runs[0].peaks)
            ratios[(name, m)] = (measured, formula, peak)
            shown = "     -" if formula is None else f"{formula:6.3f}"
            print(f"  {name:12} {measured:6.3f} | {replayed:6.3f} | {shown} | peak {peak:5.2f}x  ({per_rank})")
    print()
    if 8 in ms:
        (h1, h1f, h1_peak), (base_b, base_f, _) = ratios[("ZB-H1", 8)], ratios[("1F1B", 8)]
        gap = abs(h1 / base_b - h1f / base_f)
        verdict(
            "m = 8: ZB-H1's bubble over 1F1B's within 0.1 of the formulas' from the run's own F, B, W",
            gap <= 0.1,
            f"measured {h1 / base_b:.3f}, formulas {h1f / base_f:.3f}, difference {gap:.3f}",
        )
        verdict(
            "m = 8: ZB-H1's peak activation memory within 5% of 1F1B's (post-norm block, M_W <= M_B)",
            abs(h1_peak - 1) <= 0.05,
            f"{h1_peak:.3f}x",
        )
    tanh_ratio = max(tanh["ZB-H1"].peaks) / max(tanh["1F1B"].peaks)
    print(
        f"(tanh block, linear, tanh, linear: M_W / M_B = {t_w / t_b:.2f}, ZB-H1's peak {tanh_ratio:.2f}x 1F1B's, "
        f"per rank {' '.join(f'{x / t_b:.0f}' for x in tanh['ZB-H1'].peaks)} M_B against 1F1B's "
        f"{' '.join(f'{x / t_b:.0f}' for x in tanh['1F1B'].peaks)}: the last stage holds p micro-batches "
        "waiting for W, each M_W = 2 M_B)"
    )
    ours_t, theirs_t = statistics.median(times["ddlab ZB-V"]), statistics.median(times["torch ZBV"])
    print(
        f"torch ScheduleZBVZeroBubble beside ddlab's zb_v, m = 8, wall seconds per step (median of {rounds + 1}): "
        f"ddlab {ours_t * 1e3:.1f} ms, torch {theirs_t * 1e3:.1f} ms (torch / ddlab {theirs_t / ours_t:.2f})"
    )
    verdict(
        "torch's ZBV and ddlab's ZB-V give the same results (float32: losses and gradients within 1e-5 relative)",
        grad_gap <= 1e-5 and loss_gap <= 1e-5,
        f"largest gradient difference {grad_gap:.1e} of the largest gradient, loss {loss_gap:.1e}",
    )
    print(f"ran {time.perf_counter() - started:.0f} s")


def main() -> int:
    from ddlab.runtime.mpi import bench_main

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interleaved", action="store_true", help="bubble against M, 1F1B and interleaved")
    parser.add_argument("--zero-bubble", action="store_true", help="lab 17: 1F1B, interleaved, ZB-H1, ZB-H2, ZB-V")
    parser.add_argument("--ms", type=int, nargs="+", default=list(ZB_MS), help="with --zero-bubble: micro-batch counts")
    parser.add_argument(
        "--size",
        type=int,
        nargs=3,
        default=[64, 256, 32],
        metavar=("WIDTH", "HIDDEN", "ROWS"),
        help="with --zero-bubble: a block's width and hidden width, a micro-batch's rows (larger: W nearer F and B)",
    )
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=None, help="rank counts (default 4; 2 with --interleaved)"
    )
    args, _ = parser.parse_known_args()
    if args.interleaved and args.ranks is None:
        parser.set_defaults(ranks=[2])

    def run(a: argparse.Namespace) -> None:
        if a.zero_bubble:
            zero_bubble_child(a.rounds, tuple(a.ms), tuple(a.size))
        elif a.interleaved:
            interleaved_child(a.rounds)
        else:
            child(a.rounds)

    return bench_main(parser, run, TIMEOUT)


if __name__ == "__main__":
    sys.exit(main())
