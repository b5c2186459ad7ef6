"""Lab 16's oracle on this machine: per-layout predictions from the platform and the model, memory as the ledger counts."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from ddlab.allreduce.cost import Link
from ddlab.context_parallel import ring_attention_heads
from ddlab.mesh import DIMS, layouts, train_on_mesh
from ddlab.models.gpt import Block, GPTConfig, make_gpt
from ddlab.oracle.platform import Curves, Platform
from ddlab.oracle.transformer import step_time
from ddlab.oracle.transformer_local import (
    GPT,
    MeshCase,
    activation_elements,
    calibrate,
    case_of,
    exchanges,
    layer_elements,
    mesh_time,
    predict_mesh,
    rank_memory_local,
    rank_parameters,
    ring_arithmetic,
    ring_arithmetic_seconds,
    ring_block_flops,
    ring_exchanges,
    ring_time,
    zero_units,
)
from ddlab.runtime.memory import Ledger
from ddlab.tensor_parallel import ParallelBlock
from mpi4py import MPI

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=4, n_embd=16, tied=False)
BATCH = 8


def _platform(flops: float = 1e9, sync: float = 1e-4, per_layer: float = 1e-3) -> Platform:
    link = Link(alpha=2e-5, beta=1e-9)
    return Platform(
        name="test",
        devices_per_node=4,
        flops=flops,
        memory=2**30,
        intra=link,
        inter=link,
        curves=Curves(),
        contention=(1.0, 1.3, 1.6, 2.0),
        sync=sync,
        overheads={"gpt layer": per_layer},
    )


def _batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, each batch a tensor of its own (the ledger counts the storage the targets live in)."""
    tokens = torch.randint(
        CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_memory_prediction_is_the_ledgers_count_on_one_process(dtype):
    run = train_on_mesh(MPI.COMM_SELF, make_gpt(CONFIG, dtype=dtype), _batch_at, 2)
    case = MeshCase(1, 1, 1, BATCH, CONFIG.block_size, element_bytes=torch.finfo(dtype).bits // 8)
    predicted = predict_mesh(CONFIG, case, _platform()).peaks()
    assert predicted == [pytest.approx(run.peak_bytes[0], rel=1e-9)]


def test_parameters_of_the_stages_add_up_to_the_model():
    model = make_gpt(CONFIG)
    whole = 4 * sum(p.numel() for p in model.parameters())
    stages = case_of({"data": 1, "tensor": 1, "pipeline": 4, "context": 1}, BATCH, CONFIG.block_size, 2)
    assert sum(rank_memory_local(CONFIG, stages, r)["parameters"] for r in range(4)) == whole
    # tensor parallel: the split weights add up, the LayerNorms, proj biases and position embedding are on every rank
    split = case_of({"data": 1, "tensor": 4, "pipeline": 1, "context": 1}, BATCH, CONFIG.block_size)
    h, layers = CONFIG.n_embd, CONFIG.n_layer
    whole_on_each = layers * (4 * h + 2 * h) + 2 * h + CONFIG.block_size * h
    assert sum(rank_memory_local(CONFIG, split, r)["parameters"] for r in range(4)) == whole + 3 * 4 * whole_on_each


def test_stages_keep_the_micro_batches_1f1b_has_in_flight():
    case = MeshCase(1, 1, 4, BATCH, CONFIG.block_size, micro_batches=4)  # 1 layer per stage; min(4 - s, 4) in flight
    second, third = rank_memory_local(CONFIG, case, 1), rank_memory_local(CONFIG, case, 2)
    assert second["activations"] == pytest.approx(3 / 2 * third["activations"])
    assert second["parameters"] == third["parameters"]


def test_time_follows_the_platform():
    case = case_of(layouts(4)[0], BATCH, CONFIG.block_size)
    base = mesh_time(CONFIG, case, _platform())
    faster = mesh_time(CONFIG, case, _platform(flops=2e9, per_layer=0.0))
    slower = mesh_time(CONFIG, case, _platform(flops=2e9, per_layer=0.0, sync=1e-3))
    assert faster["compute"] < base["compute"]
    assert slower["sync"] == pytest.approx(10 * faster["sync"])
    assert faster["data"] == base["data"] > 0  # the gradient allreduce over the 4 data ranks
    # the communication parts are step_time's, of the oracle's own Layout
    parts = step_time(GPT.from_config(CONFIG), case.layout(), _platform())
    assert {k: base[k] for k in ("tensor", "context", "pipeline", "data")} == {
        k: parts[k] for k in ("tensor", "context", "pipeline", "data")
    }


def test_every_layout_is_predicted_with_its_own_parts():
    platform = _platform()
    predictions = {}
    for sizes in layouts(4):
        case = case_of(sizes, BATCH, CONFIG.block_size, micro_batches=2 if sizes["pipeline"] > 1 else 1)
        predictions[case.label] = predict_mesh(CONFIG, case, platform)
    assert predictions["1x4x1"].seconds["tensor"] > 0 == predictions["4x1x1"].seconds["tensor"]
    assert predictions["1x1x4"].seconds["bubble"] > 0 == predictions["2x2x1"].seconds["bubble"]
    # a tensor-parallel rank runs every layer for 1/4 of the FLOPs, as a data-parallel rank does
    assert predictions["1x4x1"].seconds["compute"] == predictions["4x1x1"].seconds["compute"]
    assert predictions["1x1x4"].seconds["compute"] < predictions["4x1x1"].seconds["compute"]
    assert exchanges(CONFIG, case_of(layouts(4)[3], BATCH, CONFIG.block_size)) == 4 * CONFIG.n_layer + 4
    assert all(len(p.memory) == 4 for p in predictions.values())


def test_accuracy_is_paradls_and_the_worst_ranks():
    prediction = predict_mesh(CONFIG, MeshCase(1, 1, 1, BATCH, CONFIG.block_size), _platform())
    assert prediction.time_accuracy(prediction.time * 2) == pytest.approx(0.5)
    peak = prediction.peaks()[0]
    assert prediction.memory_accuracy([int(peak * 1.25)]) == pytest.approx(0.8, rel=1e-6)
    with pytest.raises(ValueError, match="measured ranks"):
        prediction.memory_accuracy([1, 2])


def test_calibration_on_one_process_measures_a_rate():
    platform = calibrate(MPI.COMM_SELF, _platform(), CONFIG, lambda: make_gpt(CONFIG), _batch_at, BATCH, 8, 1, 1)
    assert platform.flops > 0 and platform.contention == (1.0,)
    assert platform.overheads["gpt layer"] >= 0.0
    assert platform.overheads["ring block"] >= 0.0 and platform.overheads["ring flop"] > 0.0


def test_ring_attention_s_own_arithmetic_is_priced_on_context_layouts():
    """A context rank runs c blocks of lab 15's NumPy code per layer and micro-batch in place of the
    attention the GPT's rate prices; without context, or without that calibration, nothing changes."""
    block, per_flop = 2e-4, 1e-9
    platform = replace(_platform(), overheads={"gpt layer": 1e-3, "ring block": block, "ring flop": per_flop})
    case = MeshCase(1, 2, 1, BATCH, CONFIG.block_size, context=2)  # 2 heads per rank, 4 rows per block
    blocks = CONFIG.n_layer * 2 * (block + ring_block_flops(BATCH, 2, 4, 4) * per_flop)
    torch_share = 12 * BATCH * CONFIG.n_layer * CONFIG.block_size**2 * CONFIG.n_embd / 4 / platform.flops
    assert ring_arithmetic(CONFIG, case, platform) == pytest.approx(blocks - torch_share)
    assert ring_arithmetic(CONFIG, replace(case, context=1, data=2), platform) == 0.0
    assert ring_arithmetic(CONFIG, case, _platform()) == 0.0
    uncalibrated = mesh_time(CONFIG, case, _platform())["compute"]
    extra = (blocks - torch_share) * platform.slowdown(4)
    assert mesh_time(CONFIG, case, platform)["compute"] == pytest.approx(uncalibrated + extra)
    assert ring_arithmetic_seconds(2, 2, 4, 4, 2, repeats=1) > 0.0


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="multiple of 4"):
        MeshCase(2, 1, 1, 6, 8, micro_batches=2)
    with pytest.raises(ValueError, match="tied=False"):
        predict_mesh(replace(CONFIG, tied=True), MeshCase(1, 1, 1, BATCH, 8), _platform())
    with pytest.raises(ValueError, match="2 x 3 zig-zag chunks: use a multiple of 6"):
        case_of({"data": 1, "tensor": 1, "pipeline": 1, "context": 3}, BATCH, 8)
    with pytest.raises(ValueError, match="float32"):
        MeshCase(1, 1, 1, BATCH, 8, element_bytes=2)
    with pytest.raises(ValueError, match="ZeRO stage 1, 2, 3"):
        MeshCase(4, 1, 1, BATCH, 8, zero=4)


@pytest.mark.parametrize("context", [1, 2, 4])
def test_a_block_keeps_what_the_oracle_counts_with_local_or_ring_attention(context):
    """A block's saved tensors, as the ledger counts them, to the byte: local attention keeps its s x s softmax,
    ring attention (here a ring of one rank holding a context rank's s/c rows) its output and log-sum-exp."""
    config = replace(CONFIG, block_size=16)
    case = MeshCase(1, 1, 1, 2, config.block_size, element_bytes=8, context=context)
    torch.manual_seed(0)
    block = Block(config, 0).double()
    attend = None if context == 1 else functools.partial(ring_attention_heads, MPI.COMM_SELF)
    split = ParallelBlock(block, MPI.COMM_SELF, attend=attend)
    ledger = Ledger()
    ledger.ignore(split)
    x = torch.randn(2, config.block_size // context, config.n_embd, dtype=torch.float64, requires_grad=True)
    with ledger.activations():
        y = split(x)
    assert ledger.used["activations"] == 8 * layer_elements(config, case)
    y.sum().backward()  # every saved tensor released
    assert ledger.used["activations"] == 0


def test_context_ranks_split_the_work_and_send_the_ring_blocks():
    platform = _platform()
    config = replace(CONFIG, block_size=16)
    plain = case_of({"data": 1, "tensor": 1, "pipeline": 1, "context": 1}, BATCH, 16)
    ring = case_of({"data": 1, "tensor": 1, "pipeline": 1, "context": 4}, BATCH, 16)
    assert ring.label == "1x1x1x4" and ring.ranks == 4 and ring.layout().context == 4
    mine, alone = mesh_time(config, ring, platform), mesh_time(config, plain, platform)
    assert alone["context"] == 0 and mine["tensor"] == mine["pipeline"] == 0
    # per layer: 3 forward and 3 + 4 backward blocks of 2 b (s/4) h float32 elements, priced as ping-pong
    block = 2 * BATCH * 4 * config.n_embd * 4
    assert mine["context"] == pytest.approx(config.n_layer * 10 * platform.comm("p2p", block, 2))
    assert mine["data"] > 0  # the 4 context ranks' gradients are averaged
    assert ring_exchanges(config, plain) == 0 and ring_exchanges(config, ring) == config.n_layer * (3 + 4 + 4)
    assert exchanges(config, ring) == ring_exchanges(config, ring) + 1
    assert ring_time(config, plain, platform) == 0
    # the rank's s/c rows: no s x s matrix, so 4 context ranks each keep less than a quarter of one's activations
    acts = [rank_memory_local(config, ring, r)["activations"] for r in range(4)]
    assert len(set(acts)) == 1 and acts[0] < rank_memory_local(config, plain, 0)["activations"] / 4
    assert len(predict_mesh(config, ring, platform).memory) == 4
    assert all(case_of(s, BATCH, 16).ranks == 4 for s in layouts(4, DIMS))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_memory_is_the_ledgers_count_on_one_process(zero):
    """float64 here; tests/mpi/test_oracle_zero.py checks both precisions on 4 and 3 data ranks (padded shards)."""
    run = train_on_mesh(MPI.COMM_SELF, make_gpt(CONFIG, dtype=torch.float64), _batch_at, 2, zero=zero)
    case = MeshCase(1, 1, 1, BATCH, CONFIG.block_size, element_bytes=8, zero=zero)
    assert predict_mesh(CONFIG, case, _platform()).peaks() == run.peak_bytes


def test_zero_units_are_the_stages_parameters_and_saved_tensors():
    for case in (MeshCase(4, 1, 1, BATCH, 8, zero=3), MeshCase(1, 2, 2, BATCH, 8, micro_batches=2, zero=1)):
        for stage in range(case.pipeline):
            for tensor_rank in range(case.tensor):
                units = zero_units(CONFIG, case, stage, tensor_rank)
                saved = activation_elements(CONFIG, case, stage, tensor_rank)
                assert sum(u.saved + u.loss for u in units) == pytest.approx(
                    saved["floats"] * case.element_bytes + saved["other bytes"]
                )
                assert (sum(u.elements for u in units), sum(u.tensors for u in units)) == rank_parameters(
                    CONFIG, case, stage, tensor_rank
                )


def test_zero_splits_the_model_state_over_the_data_ranks():
    # Rajbhandari et al. (SC 2020): optimizer state split from stage 1, gradients from 2, parameters in 3
    plain = rank_memory_local(CONFIG, MeshCase(4, 1, 1, BATCH, 8), 0)
    zero = {z: rank_memory_local(CONFIG, MeshCase(4, 1, 1, BATCH, 8, zero=z), 0) for z in (1, 2, 3)}
    assert zero[1]["optimizer"] == zero[2]["optimizer"] == zero[3]["optimizer"] < plain["optimizer"]
    assert zero[3]["parameters"] < zero[2]["parameters"] == zero[1]["parameters"] == plain["parameters"]
    assert zero[2]["gradients"] < plain["gradients"] < zero[1]["gradients"]  # ZeRO-1: every gradient and its shard
    shards = sum(-(-u.elements // 4) for u in zero_units(CONFIG, MeshCase(4, 1, 1, BATCH, 8, zero=1), 0, 0))
    assert zero[1]["optimizer"] == 4 * 3 * shards + 4 * (CONFIG.n_layer + 2)  # master, two moments, a step count


def test_zero_time_is_its_collectives_unit_by_unit():
    platform = _platform()
    case = case_of(layouts(4)[0], BATCH, CONFIG.block_size)
    units = zero_units(CONFIG, replace(case, zero=1), 0, 0)
    padded = [4 * -(-u.elements // 4) * 4 for u in units]
    times = {z: mesh_time(CONFIG, replace(case, zero=z), platform) for z in (0, 1, 2, 3)}
    gather = [platform.comm("allgather", n, 4) for n in padded]
    scatter = [platform.comm("reduce_scatter", n, 4) for n in padded]
    # stages 1-2: the allgathers after the update finish behind train_on_mesh's barrier, off the timed step
    assert times[1]["data"] == times[2]["data"] == pytest.approx(sum(scatter))
    assert times[3]["data"] == pytest.approx(2 * sum(gather) + sum(scatter))
    assert all(times[z]["compute"] == times[0]["compute"] for z in (1, 2, 3))
    assert exchanges(CONFIG, replace(case, zero=1)) == len(units)
    assert exchanges(CONFIG, replace(case, zero=3)) == 3 * len(units) == 3 * (CONFIG.n_layer + 2)
    assert times[3]["sync"] == pytest.approx(3 * times[1]["sync"])
    two = replace(case, batch=2 * BATCH, micro_batches=2, zero=3)  # every micro-batch gathers and reduces again
    assert mesh_time(CONFIG, two, platform)["data"] == pytest.approx(2 * times[3]["data"])


def test_zero_is_predicted_with_context_1_only():
    with pytest.raises(ValueError, match="ZeRO is predicted with context = 1 only"):
        MeshCase(2, 1, 1, BATCH, 8, context=2, zero=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_interleaved_chunks_on_one_process_are_the_ledgers_count(dtype):
    """v = 2 chunks on one pipeline rank (every message to itself): the walk of the schedule's op list
    holds both chunks of every micro-batch, as the ledger counts."""
    run = train_on_mesh(MPI.COMM_SELF, make_gpt(CONFIG, dtype=dtype), _batch_at, 2, micro_batches=2, virtual=2)
    case = MeshCase(1, 1, 1, BATCH, CONFIG.block_size, 2, torch.finfo(dtype).bits // 8, virtual=2)
    assert run.label == "1x1x1 v2" == case.label
    assert predict_mesh(CONFIG, case, _platform()).peaks() == [pytest.approx(run.peak_bytes[0], rel=1e-9)]


def test_the_interleaved_schedule_is_priced_with_its_bubble_messages_and_warm_up():
    platform, p, m = _platform(), 2, 4
    plain = case_of({"data": 1, "tensor": 1, "pipeline": p}, BATCH, CONFIG.block_size, m)
    inter = case_of({"data": 1, "tensor": 1, "pipeline": p}, BATCH, CONFIG.block_size, m, virtual=2)
    one, two = mesh_time(CONFIG, plain, platform), mesh_time(CONFIG, inter, platform)
    assert two["bubble"] == pytest.approx((p - 1) / (2 * m) * two["compute"])  # (p - 1)/(v m) of the compute
    assert one["bubble"] == pytest.approx((p - 1) / m * one["compute"])
    assert two["pipeline"] == pytest.approx(2 * one["pipeline"])  # v times the point-to-point messages
    assert exchanges(CONFIG, inter) == exchanges(CONFIG, plain) + 2 * m
    # rank 0's warm-up runs 2 (p - 1) + (v - 1) p = 4 forwards (chunk 0 of micro-batches 0, 1, chunk 1 of 0, 1),
    # then F(chunk 0, 2), B(chunk 1, 0), F(chunk 0, 3): 5 chunks of 1 block in flight, 4 of them chunk 0's with
    # the token ids (8 + 1 bytes per token, 8 per position); 1F1B keeps 2 micro-batches of 2 blocks and the ids
    block, tokens = layer_elements(CONFIG, inter) * 4, BATCH // m * CONFIG.block_size
    ids = 9 * tokens + 8 * CONFIG.block_size
    assert rank_memory_local(CONFIG, inter, 0)["activations"] == pytest.approx(5 * block + 4 * ids)
    assert rank_memory_local(CONFIG, plain, 0)["activations"] == pytest.approx(2 * (2 * block + ids))
    assert predict_mesh(CONFIG, inter, platform).case.label == "1x1x2 v2"


def test_interleaved_sizes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="groups of p = 2: use a multiple of 2, got 3"):
        MeshCase(1, 1, 2, 12, 8, micro_batches=3, virtual=2)
    with pytest.raises(ValueError, match="1 with ZeRO"):
        MeshCase(2, 1, 2, 8, 8, micro_batches=2, zero=1, virtual=2)
    with pytest.raises(ValueError, match="4 blocks do not split into 4 chunks x 2 pipeline stages"):
        predict_mesh(CONFIG, MeshCase(1, 1, 2, 8, 8, micro_batches=2, virtual=4), _platform())
