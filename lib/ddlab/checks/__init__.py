"""Student-facing checks: run on every engine right after an exercise.

Each `check_<exercise>(fn)` is called on all ranks at once (in a %%px cell), runs
the student's function on sub-communicators of every size up to the world's,
compares with the reference, counts messages and bytes, and raises the same
AssertionError on every rank, saying what was wrong and where.

Checks load on first use, so a lab imports only its own (and lab 01 does not pay
for torch, which the data-parallel checks import).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from ..runtime.reference import ReferenceCalled, answering, marked, refusal
from .errors import CheckFailed

# name -> the module of this package that defines it
_WHERE = {
    "CheckFailed": "errors",
    "check_block_range": "cluster",
    "check_collect": "point_to_point",
    "check_exchange": "point_to_point",
    "check_fit_alpha_beta": "point_to_point",
    "check_ping_pong": "point_to_point",
    "check_bcast_linear": "collectives",
    "check_bcast_tree": "collectives",
    "check_reduce_linear": "collectives",
    "check_reduce_tree": "collectives",
    "check_allreduce_rabenseifner": "allreduce",
    "check_allreduce_recursive_doubling": "allreduce",
    "check_allreduce_ring": "allreduce",
    "check_average_gradients": "data_parallel",
    "check_broadcast_parameters": "data_parallel",
    "check_shard_indices": "data_parallel",
    "check_train_step": "data_parallel",
    "check_overlapped_averaging": "data_parallel",
    "check_trains_with_allreduce": "data_parallel",
    "check_balanced_split": "model_parallel",
    "check_recv_tensor": "model_parallel",
    "check_send_tensor": "model_parallel",
    "check_allreduce_bucketed": "scaling",
    "check_lr_factor": "scaling",
    "check_scaling_efficiency": "scaling",
    "check_gpipe": "pipeline",
    "check_one_f_one_b": "pipeline",
    "check_run_schedule": "pipeline",
    "check_pipedream_partition": "pipeline",
    "check_filter_parallel_conv": "intra_layer",
    "check_halo_exchange": "intra_layer",
    "check_slab_bounds": "intra_layer",
    "check_spatial_max_pool": "intra_layer",
    "check_hierarchical_allreduce": "compression",
    "check_qsgd": "compression",
    "check_sparse_allreduce": "compression",
    "check_top_k_with_feedback": "compression",
    "check_async_worker": "parameter_server",
    "check_gossip_step": "parameter_server",
    "check_ssp_gate": "parameter_server",
    "check_ssp_server": "parameter_server",
    "check_exchange_plan": "shuffling",
    "check_exchange_samples": "shuffling",
    "check_redistribute": "shuffling",
    "check_data_parallel_time": "oracle",
    "check_data_parallel_memory": "oracle",
    "check_spatial_time": "oracle",
    "check_spatial_memory": "oracle",
    "check_hybrid_time": "oracle",
    "check_conjugates": "tensor_parallel",
    "check_parallel_linear": "tensor_parallel",
    "check_vocab_parallel_cross_entropy": "tensor_parallel",
    "check_parallelize": "tensor_parallel",
    "check_sequence_parallel_block": "tensor_parallel",
    "check_reduce_scatter": "sharded",
    "check_allgather": "sharded",
    "check_reshard": "sharded",
    "check_sharded_optimizer": "sharded",
    "check_zero2_hooks": "sharded",
    "check_zero3_unit": "sharded",
    "check_hybrid_reduce_scatter": "sharded_hybrid",
    "check_memory_per_rank": "oracle_transformer",
    "check_step_time": "oracle_transformer",
    "check_layout_search": "oracle_transformer",
    "check_block_counts": "oracle_transformer",
    "check_merge_partials": "context_parallel",
    "check_ring_attention": "context_parallel",
    "check_ring_attention_backward": "context_parallel",
    "check_ulysses": "context_parallel",
    "check_zigzag": "context_parallel",
    "check_dispatch": "experts",
    "check_combine": "experts",
    "check_route": "experts",
    "check_split_mesh": "mesh",
    "check_mesh_trainer": "mesh",
    "check_interleaved": "mesh",
    "check_split_backward": "zero_bubble",
    "check_zb_h1": "zero_bubble",
    "check_run_zero_bubble": "zero_bubble",
    "check_zb_v": "zero_bubble",
    "check_loss_scale_step": "precision",
    "check_quantize_float8": "precision",
    "check_float8_allgather": "precision",
    "check_reduce_scatter_rounded": "precision",
    "check_detect": "resilience",
    "check_recover": "resilience",
    "check_train_resilient": "resilience",
    "check_rebuild_shards": "resilience",
    "check_simulate_goodput": "resilience",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"ddlab.checks has no {name!r}; the checks are: {', '.join(sorted(_WHERE))}")
    found = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    return found if not name.startswith("check_") else _refusing_the_reference(found, name.removeprefix("check_"))


def _refusing_the_reference(check: Callable[..., None], exercise: str) -> Callable[..., None]:
    """`check`, run so that the student's code cannot run the library's own answer to `exercise`.

    The one place the course refuses it (see ddlab.runtime.reference): an answer that is a reference
    marked for the exercise fails at once; one that runs it fails with its name, even if it caught
    the refusal."""

    @functools.wraps(check)
    def checked(*args: Any, **kwargs: Any) -> None:
        if (name := marked([*args, *kwargs.values()], exercise)) is not None:  # the same on every rank
            raise CheckFailed(refusal(name))
        with answering(exercise) as called:
            try:
                check(*args, **kwargs)
            except ReferenceCalled as err:
                raise CheckFailed(str(err)) from None
            except CheckFailed:  # the check's own message, when the answer caught the refusal and went wrong
                if called:
                    raise CheckFailed(refusal(called[0])) from None
                raise
        if called:
            raise CheckFailed(refusal(called[0]))

    return checked


def __dir__() -> list[str]:
    return sorted(__all__)
