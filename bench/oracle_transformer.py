"""Lab 16's transformer oracle at scale: Narayanan et al.'s Table 1 predicted, and the planner's layouts.

For each of the ten GPT runs of Narayanan et al. (SC 2021, Table 1: 1.7 B parameters on 32 A100s to 1008 B on 3072) it
prints the published layout, their measured teraFLOP/s per GPU, the oracle's prediction on the A100 platform of
published figures (`ddlab.oracle.a100_cluster`), the accuracy 1 - |pred - meas| / meas (ParaDL's measure, Kahira et
al., HPDC 2021), then the planner's fastest layout under the 80 GB budget (every mesh d x t x p x c, ZeRO 0-3,
micro-batches 1-8, the three recomputations, sequence parallelism or not), its predicted throughput (counted as
Narayanan et al. count it, with the recomputation's FLOPs, so the two compare) and why it is faster, and the fastest
mesh with the paper's own options; then the mean accuracy, and how much the table moves with the one assumed figure
(the message latency alpha) set to 0. Then the runs of 2024-26 (`ddlab.oracle.published.MODERN`: Llama 3 models on
H100 and B200 nodes, each row's source cited) predicted on the platforms of their datasheets at the default
efficiency, never fitted to them: published and predicted tokens per second per GPU, and memory where published, with
the accuracies and their mean; each row's FLOPs per token beside the count its source publishes; the same layouts as
each release of Megatron-Bridge's summary published them (25.09 to 26.08), beside the one figure the oracle predicts
for each; torchtitan's rows again on their own machine, its efficiencies set from the same file's Table 1, and that
table's memory, which the calibration does not use; what torchtitan's memory column measures (the caching allocator's
reserved peak) beside what the oracle counts, its loss replayed; lab 16's two searches (every mesh, ZeRO stage,
recomputation and pipeline schedule), timed. One process; no MPI. Each target ends in a line "verdict: ..." with the
figure beside it; the searches' 10 s needs a quiet machine. About 15 s with --no-plan (quiet), 5-15 minutes with the
planner.

    .venv/bin/python bench/oracle_transformer.py [--rows 10] [--no-plan] [--efficiency 0.43]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10, help="how many rows of Table 1 (from the smallest)")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner (about 20 s a row)")
    parser.add_argument("--efficiency", type=float, default=None, help="share of the peaks (default: the oracle's)")
    args = parser.parse_args()

    from ddlab.oracle import a100_cluster, plan_transformer, reproduce
    from ddlab.oracle.published import accuracy
    from ddlab.oracle.transformer_planner import explain, search

    platform = a100_cluster()
    rows = reproduce(platform)[: args.rows]
    print(f"{platform.name}: {platform.flops / 1e12:.1f} TFLOP/s achieved per GPU, {platform.memory / 1e9:.0f} GB")
    print(f"{'model':11} {'GPUs':>5} {'published layout':30} {'meas':>5} {'pred':>6} {'acc':>6}  {'peak GB':>7}")
    for run, pred, acc in rows:
        print(
            f"{run.gpt.name:11} {run.layout.devices:5d} {run.layout.label:30} {run.measured_tflops:5.0f} "
            f"{pred.model_flops_per_device() / 1e12:6.1f} {acc:6.3f}  {pred.peak / 1e9:7.1f}"
        )
    mean = statistics.mean(acc for _, _, acc in rows)
    print(f"mean accuracy {mean:.3f} (target >= 0.85), worst {min(acc for _, _, acc in rows):.3f}")
    print(f"verdict: Table 1's mean accuracy {mean:.3f} against >= 0.92: {_met(mean >= 0.92)}")

    no_alpha = replace(platform, intra=replace(platform.intra, alpha=0.0), inter=replace(platform.inter, alpha=0.0))
    moved = [
        abs(acc - accuracy(p.model_flops_per_device() / 1e12, r.measured_tflops))
        for (r, p, _), (_, _, acc) in zip(reproduce(no_alpha), rows)
    ]
    print(f"with alpha = 0 instead of 5 us, accuracy moves by at most {max(moved):.4f}")
    modern(args.efficiency)
    model_flops()
    releases(args.efficiency)
    titan_calibrated()
    reserved_replayed()
    lab_searches()

    if args.no_plan:
        return
    print("\nthe planner's fastest layout under 80 GB (throughput counted with the recomputation's FLOPs):")
    for run, published, _ in rows:
        start = time.perf_counter()
        plan = plan_transformer(run.gpt, run.layout.devices, run.layout.batch, platform)
        best = plan.best
        assert best is not None
        print(
            f"{run.gpt.name:11} {best.layout.label:44} {best.model_flops_per_device() / 1e12:6.1f} TFLOP/s "
            f"(published layout {published.model_flops_per_device() / 1e12:.1f}), {len(plan.ranked)} fit, "
            f"{len(plan.rejected)} rejected ({time.perf_counter() - start:.0f} s)"
        )
        print(f"{'':11} why: {explain(best, published)}")
        same = search(run.gpt, run.layout.devices, run.layout, platform)[0][0]  # the paper's options, any mesh
        print(
            f"{'':11} with the paper's options (full recomputation, no ZeRO, no SP, b = 1): {same.layout.label}, "
            f"{same.model_flops_per_device() / 1e12:.1f} TFLOP/s; {explain(same, published)}"
        )
        layouts = [p.layout for p in plan.ranked]
        rank = f"ranks {layouts.index(run.layout) + 1} of" if run.layout in layouts else "is not among"
        print(f"{'':11} the published layout {rank} {len(plan.ranked)} (plain 1F1B); rejected: {plan.reasons()}")


def lab_searches() -> None:
    """Lab 16's two searches of a modern model on H100s (fp8, flash attention, FSDP overlap), timed."""
    from ddlab.oracle import Layout, plan_transformer
    from ddlab.oracle.published import H100_SXM, LLAMA3_70B, MIXTRAL_8X22B, gpu_platform

    h100, recipe = gpu_platform(H100_SXM), Layout(precision="fp8", kernel="flash", overlap=True)
    moe = MIXTRAL_8X22B
    print("\nlab 16's searches on H100s (the answer must come within 10 s):")
    for gpt, devices, batch, zero, micro in ((LLAMA3_70B, 64, 128, (1, 3), (1, 2)), (moe, 256, 512, (1,), (1,))):
        start, cpu = time.perf_counter(), time.process_time()
        plan = plan_transformer(gpt, devices, batch, h100, base=recipe, zero_stages=zero, micro_batches=micro)
        took, cpu = time.perf_counter() - start, time.process_time() - cpu
        best = plan.best
        assert best is not None
        print(
            f"  {gpt.name:12} on {devices} GPUs: {best.layout.label}, {best.peak / 2**30:.1f} GiB per GPU, {took:.1f} s "
            f"({cpu:.1f} s of CPU: the wall time on an idle core)"
        )
        print(f"verdict: {gpt.name} on {devices} GPUs answered in {took:.1f} s against < 10 s: {_met(took < 10)}")


def modern(efficiency: float | None) -> None:
    """The runs of 2024-26: published and predicted tokens/s per GPU (and memory), accuracies, their mean."""
    from ddlab.oracle.published import EFFICIENCY, validate_modern

    rows = validate_modern(EFFICIENCY if efficiency is None else efficiency)
    share = EFFICIENCY if efficiency is None else efficiency
    print(
        f"\nruns of 2024-26 at {share:.0%} of the datasheets' peaks, on H100s and B200s the attention at its kernel's "
        "measured rates (H100: Shah et al., FlashAttention-3, 2024, Figures 5-6; B200: NVIDIA/cudnn-frontend's SDPA "
        "benchmark):"
    )
    print(
        f"{'model':14} {'seq':>6} {'GPUs':>5} {'hardware':10} {'layout':72} {'tok/s pub':>9} {'pred':>7} {'acc':>6}  "
        "peak pred / HBM, memory published (reserved)"
    )
    for run, pred, acc, mem in rows:
        memory = "" if mem is None else f", {run.memory / 2**30:.1f} GiB pub, acc {mem:.3f}"
        print(
            f"{run.gpt.name:14} {run.gpt.seq:6d} {run.layout.devices:5d} {run.hardware.name.split()[0]:10} "
            f"{run.layout.label:72} {run.tokens_per_gpu:9.0f} {pred.tokens_per_device():7.0f} {acc:6.3f}  "
            f"{pred.peak / 2**30:5.1f} / {run.hardware.memory / 2**30:5.1f} GiB{memory}"
        )
    print(
        f"mean accuracy {statistics.mean(acc for _, _, acc, _ in rows):.3f} (tokens/s per GPU), worst "
        f"{min(acc for _, _, acc, _ in rows):.3f}; memory {statistics.mean(m for *_, m in rows if m is not None):.3f}"
    )
    for source in sorted({run.source for run, *_ in rows}):
        print(f"  source: {source}")
    close = sum(acc >= 0.85 for _, _, acc, _ in rows)
    print(
        f"verdict: tokens/s per GPU within 15% on {close} of {len(rows)} rows against all: {_met(close == len(rows))}"
    )
    memory = [mem for *_, mem in rows if mem is not None]
    near = sum(mem >= 0.9 for mem in memory)
    print(f"verdict: memory within 10% on {near} of {len(memory)} published against all: {_met(near == len(memory))}")
    fits = sum(pred.peak <= run.hardware.memory for run, pred, *_ in rows)
    print(
        f"verdict: every published layout ran, so fits its GPU; predicted to fit on {fits} of {len(rows)}: "
        f"{_met(fits == len(rows))}"
    )


def model_flops() -> None:
    """The oracle's FLOPs per token beside the count each source publishes (its model FLOP/s over its tokens/s):
    whether the model is stated right, apart from the rate the machine reached."""
    from ddlab.oracle.published import MODERN, accuracy, model_flops_per_token

    rows = [run for run in MODERN if run.tflops is not None]
    print("\nFLOPs per token, the oracle's count (causal attention) beside the published model FLOP/s / tokens/s:")
    worst = 1.0
    for run in rows:
        ours, published = model_flops_per_token(run.gpt), run.published_flops_per_token()
        assert published is not None
        worst = min(worst, accuracy(ours, published))
        print(
            f"  {run.gpt.name:16} {run.hardware.name.split()[0]:5} {ours / 1e9:8.2f} {published / 1e9:8.2f} GFLOP "
            f"({ours / published:.4f}); it ran at {run.tflops / 1e12:5.0f} TFLOP/s, "
            f"{run.tflops / run.hardware.fp8:.1%} of the float8 peak"
        )
    print(
        f"verdict: FLOPs per token within 1% of the published count on every row (worst {worst:.4f}): "
        f"{_met(worst >= 0.99)}"
    )


def releases(efficiency: float | None) -> None:
    """Each layout of Megatron-Bridge's summary as its releases published it (25.09 to 26.08; not validation rows),
    beside the one figure the oracle predicts for it: how far the published rate of one layout moved."""
    from ddlab.oracle.published import EFFICIENCY, RELEASES_SOURCE, accuracy, across_releases
    from ddlab.oracle.transformer import moe_visits

    rows = [
        (runs, prediction.tokens_per_device(), prediction)
        for runs, prediction in across_releases(EFFICIENCY if efficiency is None else efficiency)
    ]
    print(f"\nthe same layouts in every release of the summary ({RELEASES_SOURCE}; not validation rows):")
    print(
        f"{'model':16} {'hardware':8} {'GPUs':>5} {'batch':>5} {'layout':56} {'pred':>6}  "
        "published (accuracy), fastest / slowest"
    )
    for runs, pred, _ in rows:
        published = ", ".join(f"{release} {rate:.0f} ({accuracy(pred, rate):.2f})" for release, rate in runs.published)
        print(
            f"{runs.gpt.name:16} {runs.hardware.name.split()[0]:8} {runs.layout.devices:5d} {runs.layout.batch:5d} "
            f"{runs.layout.label[:56]:56} "
            f"{pred:6.0f}  {published}; {runs.spread():.2f}x"
        )
    kinds = {"dense": [r for r in rows if not r[0].gpt.experts], "MoE": [r for r in rows if r[0].gpt.experts]}
    accuracies = {
        kind: [accuracy(pred, rate) for runs, pred, _ in group for _, rate in runs.published]
        for kind, group in kinds.items()
    }
    for kind, group in kinds.items():
        print(
            f"  {kind} layouts: the releases' rates differ by up to {max(runs.spread() for runs, *_ in group):.2f}x; "
            f"the prediction within 15% of {sum(a >= 0.85 for a in accuracies[kind])} of their "
            f"{len(accuracies[kind])} rates (worst accuracy {min(accuracies[kind]):.2f})"
        )
    print(
        "  the published step minus the predicted one, in ms per MoE layer and micro-batch of the busiest rank "
        "(in brackets: were the all-to-alls hidden under the compute as far as it lasts):"
    )
    for runs, _, prediction in kinds["MoE"]:
        lay, tokens = runs.layout, runs.layout.batch * runs.gpt.seq / runs.layout.devices
        visits = moe_visits(runs.gpt, lay)
        hidden = min(prediction.seconds["expert"], prediction.seconds["compute"])
        gaps = ", ".join(
            f"{release} {(gap := (tokens / rate - prediction.time) / visits * 1e3):+.1f} "
            f"({gap + hidden / visits * 1e3:+.1f})"
            for release, rate in runs.published
        )
        print(f"    {runs.gpt.name:16} {runs.hardware.name.split()[0]:5} {lay.label.split(', fused')[0]:44} {gaps}")
    # a figure within 15% of two rates needs 0.85 x the faster <= it <= 1.15 x the slower
    apart = [runs for runs, *_ in rows if runs.spread() > 1.15 / 0.85]
    print(
        f"  layouts whose releases no one prediction can meet within 15% (fastest / slowest > 1.15 / 0.85): "
        f"{len(apart)} of {len(rows)}, {sum(bool(r.gpt.experts) for r in apart)} of them mixtures of experts"
    )
    close = sum(a >= 0.85 for a in accuracies["dense"])
    print(
        f"verdict: the dense layouts within 15% of every release's rate, {close} of {len(accuracies['dense'])}: "
        f"{_met(close == len(accuracies['dense']))}"
    )


def titan_calibrated() -> None:
    """torchtitan's rows on their own machine: its two efficiencies set from the same file's Table 1 (not a
    validation row), then its other tables predicted: what a datasheet cannot say, and what calibration does not fix;
    and Table 1's memory, which the calibration did not use."""
    from ddlab.oracle.published import (
        H100_96GB,
        LLAMA3_8B,
        MODERN,
        TITAN_TABLE1_MEMORY,
        accuracy,
        calibrate_titan,
        gpu_platform,
        titan_table1_layout,
    )
    from ddlab.oracle.transformer import predict

    bf16, fp8 = calibrate_titan()
    platform = gpu_platform(H100_96GB, bf16, fp8_efficiency=fp8)
    print(
        f"\ntorchtitan's machine (500 W H100s, no datasheet) set by its own Table 1 (8K tokens, bf16 and float8): "
        f"{bf16:.1%} of the SXM's bfloat16 peak, {fp8:.1%} of its float8 peak; its Tables 2-4 then predicted:"
    )
    accuracies = []
    for run in (run for run in MODERN if run.hardware is H100_96GB):
        tokens = predict(run.gpt, run.layout, platform).tokens_per_device()
        accuracies.append(accuracy(tokens, run.tokens_per_gpu))
        print(
            f"  {run.gpt.name:11} {run.gpt.seq:6d} tokens, {run.layout.label:76} published {run.tokens_per_gpu:5.0f}, "
            f"predicted {tokens:5.0f} tokens/s per GPU ({tokens / run.tokens_per_gpu:.2f}x), "
            f"accuracy {accuracies[-1]:.3f}"
        )
    close = sum(acc >= 0.85 for acc in accuracies)
    print(f"  within 15% on {close} of {len(accuracies)} on the machine its Table 1 sets")
    print("  Table 1's peak memory, published beside the rates the calibration used (the memory was not used):")
    for precision, gib in TITAN_TABLE1_MEMORY.items():
        peak = predict(LLAMA3_8B, titan_table1_layout(precision), platform).peak / 2**30
        print(f"    {precision}: predicted {peak:.1f} GiB, published {gib:.1f} GiB, accuracy {accuracy(peak, gib):.3f}")


def reserved_replayed() -> None:
    """What torchtitan's memory column measures: torch's `max_memory_reserved`, the segments its caching allocator
    holds, where the oracle counts the tensors held at the peak (`max_memory_allocated`). torchtitan's two losses
    (bfloat16 logits, their float32 copy, torch's cross entropy, under `loss_parallel` or not) traced on this CPU and
    replayed through the caching allocator's rules (`ddlab.oracle.allocator`), bytes per logit."""
    from ddlab.oracle.allocator import loss_peaks
    from ddlab.oracle.published import validate_modern
    from ddlab.oracle.transformer import busiest

    print("\ntorchtitan publishes the reserved peak; the oracle counts the allocated one. Its losses, replayed:")
    for loss in ("eager", "parallel"):
        allocated, reserved = loss_peaks(loss=loss)
        print(
            f"  {loss:8}: {allocated:5.2f} bytes per logit allocated at the peak, {reserved:5.2f} reserved (the 16-bit "
            "logits' block, freed before the backward asks for float32 blocks it cannot hold)"
        )
    for run, pred, _, _ in validate_modern():
        if run.memory is None:
            continue
        lay, gpt = run.layout, busiest(run.gpt, run.layout)
        logits = lay.micro_batch * gpt.seq // lay.context * gpt.vocab / lay.tensor
        print(
            f"  {gpt.name:11} {gpt.seq:6d} tokens on {lay.devices:3d} GPUs, {lay.loss:8} loss: the 16-bit logits "
            f"{2 * logits / 2**30:4.1f} GiB; published reserved - predicted allocated "
            f"{(run.memory - pred.peak) / 2**30:5.1f} GiB"
        )
    print(
        "  a later step may place other tensors in that block (the optimizer's state, made after the first loss), "
        "and what else the cache holds depends on the order of every allocation (bench/reserved_memory.py replays "
        "small models of the whole step): the oracle predicts the allocated peak only"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


if __name__ == "__main__":
    main()
