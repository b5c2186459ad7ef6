"""The caching allocator's replay (`ddlab.oracle.allocator`): its rules on hand-made traces, then a real loss's."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from ddlab.oracle.allocator import CachingAllocator, loss_peaks, replay
from ddlab.oracle.transformer import LOSSES
from ddlab.runtime.loopback import gloo_on_loopback

MiB = 1 << 20


def test_a_request_without_a_free_block_that_fits_gets_a_segment_of_its_class():
    allocator = replay([(1, 100), (2, 5 * MiB), (3, 11 * MiB + 1)])
    assert allocator.reserved == 2 * MiB + 20 * MiB  # a small buffer; a large one, whose rest holds the 11 MiB
    assert allocator.allocated == 512 + 5 * MiB + 11 * MiB + 512  # 512 bytes at least, and in steps of 512
    allocator.malloc(4, 13 * MiB + 1)
    assert allocator.reserved == 2 * MiB + 20 * MiB + 14 * MiB  # no free block fits: the request, to 2 MiB


def test_a_freed_block_serves_the_smallest_request_it_fits_and_is_split():
    allocator = replay([(1, 40 * MiB), (2, 30 * MiB), (1, -40 * MiB), (2, -30 * MiB), (3, 24 * MiB), (4, 16 * MiB)])
    assert allocator.reserved == 70 * MiB  # no segment more: 24 MiB from the 30's block, 16 from the 40's
    _, first, _, _ = allocator.taken[3]
    _, second, _, _ = allocator.taken[4]
    assert (first, second) == (1, 0)  # best fit: the 30 MiB segment for 24 MiB, then the 40 MiB one for 16
    assert replay([(1, 40 * MiB), (1, -40 * MiB), (2, 64 * MiB)]).reserved == 104 * MiB  # too small: a new segment


def test_a_watcher_sees_the_allocator_after_each_event_it_applied():
    seen = []
    replay(
        [(9, -MiB), (1, 4 * MiB), (2, MiB), (1, -4 * MiB)],  # 9 was allocated before the trace; 2 is a small block
        lambda allocator, address, size: seen.append((address, size, allocator.allocated, allocator.reserved)),
    )
    assert seen == [(1, 4 * MiB, 4 * MiB, 20 * MiB), (2, MiB, 5 * MiB, 22 * MiB), (1, -4 * MiB, MiB, 22 * MiB)]


def test_freed_neighbours_merge_and_a_segment_is_never_given_back():
    allocator = CachingAllocator()
    for address, size in ((1, 20 * MiB), (1, -20 * MiB), (2, 8 * MiB), (3, 8 * MiB), (2, -8 * MiB), (3, -8 * MiB)):
        allocator.malloc(address, size) if size > 0 else allocator.release(address)
    assert allocator.free[False] == [(20 * MiB, 0, 0)]  # the two halves and the rest, one block again
    assert (allocator.reserved, allocator.allocated) == (20 * MiB, 0)
    allocator.malloc(4, 20 * MiB)
    assert allocator.reserved == 20 * MiB


@pytest.mark.parametrize("loss", ["eager", "parallel"])
def test_torchs_losses_reserve_their_16_bit_logits_beside_their_peak(loss):
    """bfloat16 logits, their float32 copy and torch's cross entropy (under `loss_parallel` too, on logits sharded
    over the vocabulary), as torchtitan's step runs them: the replay's allocated peak is the oracle's count of the
    loss (`LOSSES`: three float32 copies, four under loss_parallel), and the 16-bit logits' block, freed before the
    backward asks for a float32 block it cannot hold, stays reserved beside it."""
    allocated, reserved = loss_peaks(loss=loss)
    wide, narrow = LOSSES[loss]
    assert allocated == pytest.approx(4 * wide + 2 * narrow, rel=0.01)
    assert reserved == pytest.approx(4 * wide + 2 * narrow + 2, rel=0.01)


def test_the_loss_replay_refuses_an_empty_shape_an_unknown_loss_and_a_running_group():
    with pytest.raises(ValueError, match="must be positive"):
        loss_peaks(tokens=0)
    with pytest.raises(ValueError, match="choose eager"):
        loss_peaks(loss="fused")
    with gloo_on_loopback():  # nothing listens beyond loopback
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            with pytest.raises(RuntimeError, match="already initialised.*destroy the running one first"):
                loss_peaks(loss="parallel")
        finally:
            dist.destroy_process_group()


def test_the_parallel_replay_talks_over_loopback_whatever_gloo_was_told(monkeypatch):
    """The one-rank group never needs another host: it runs on the loopback interface even where
    GLOO_SOCKET_IFNAME names another (here one that does not exist, which gloo would refuse), and the variable is
    as it was afterwards."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ddlab-no-such-interface")
    assert loss_peaks(tokens=64, vocab=256, loss="parallel")[0] > 0
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ddlab-no-such-interface"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    loss_peaks(tokens=64, vocab=256, loss="parallel")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
