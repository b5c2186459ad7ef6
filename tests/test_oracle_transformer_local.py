"""Lab 16's oracle on this machine: per-layout predictions from the platform and the model, memory as the ledger counts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ddlab.allreduce.cost import Link
from ddlab.mesh import layouts, train_on_mesh
from ddlab.models.gpt import GPTConfig, make_gpt
from ddlab.oracle.platform import Curves, Platform
from ddlab.oracle.transformer import step_time
from ddlab.oracle.transformer_local import (
    GPT,
    MeshCase,
    calibrate,
    case_of,
    exchanges,
    mesh_time,
    predict_mesh,
    rank_memory_local,
)
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


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="multiple of 4"):
        MeshCase(2, 1, 1, 6, 8, micro_batches=2)
    with pytest.raises(ValueError, match="tied=False"):
        predict_mesh(replace(CONFIG, tied=True), MeshCase(1, 1, 1, BATCH, 8), _platform())
    with pytest.raises(ValueError, match="context = 1"):
        case_of({"data": 1, "tensor": 1, "pipeline": 1, "context": 4}, BATCH, 8)
    with pytest.raises(ValueError, match="float32"):
        MeshCase(1, 1, 1, BATCH, 8, element_bytes=2)
