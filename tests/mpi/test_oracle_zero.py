"""Lab 16's oracle on ZeRO over the data ranks (4x1x1 or 3x1x1, stages 1-3, float32 and float64; 2x1x2): every rank's
peak in the ledger, as `ddlab.oracle.transformer_local.zero_memory` walks a step of lab 13's engine, to the byte.

The width (10) is not a multiple of 4 or 3, so the blocks' flat buffers are padded to equal shards.
"""

from __future__ import annotations

import pytest
import torch
from ddlab.mesh import train_on_mesh
from ddlab.models.gpt import GPTConfig, make_gpt
from ddlab.oracle.transformer_local import MeshCase, rank_memory_local
from mpi4py import MPI

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=10, tied=False)
BATCH = 12  # 3 or 4 sequences per data rank


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_every_ranks_peak_is_predicted_to_the_byte(comm: MPI.Comm, zero: int, dtype: torch.dtype) -> None:
    size = comm.Get_size()
    run = train_on_mesh(comm, make_gpt(CONFIG, dtype=dtype), batch_at, 2, data=size, zero=zero)
    case = MeshCase(size, 1, 1, BATCH, CONFIG.block_size, element_bytes=torch.finfo(dtype).bits // 8, zero=zero)
    predicted = [sum(rank_memory_local(CONFIG, case, rank).values()) for rank in range(size)]
    assert predicted == run.peak_bytes, f"{run.label} {dtype}"


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_beside_a_pipeline_is_predicted_to_the_byte(comm: MPI.Comm, zero: int) -> None:
    """2x1x2: two stages, 1F1B with two micro-batches (the first stage keeps both in flight), ZeRO on each stage."""
    if comm.Get_size() != 4:
        pytest.skip("2 data x 2 pipeline ranks need 4 ranks")
    run = train_on_mesh(comm, make_gpt(CONFIG, dtype=torch.float64), batch_at, 2, 2, 1, 2, micro_batches=2, zero=zero)
    case = MeshCase(2, 1, 2, BATCH, CONFIG.block_size, micro_batches=2, element_bytes=8, zero=zero)
    assert [sum(rank_memory_local(CONFIG, case, rank).values()) for rank in range(4)] == run.peak_bytes
