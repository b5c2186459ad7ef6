"""Lab 15's ring attention and zig-zag checks on 1..P ranks: valid answers pass, the issue's wrong ones fail.

Wrong: a causal mask with the positions of the wrong chunk (this rank's own, not the block's
owner's); a ring that receives the next block before sending the one it holds (every rank waits,
none sends: it must fail at the check's deadline, not hang); a ring that sends the positions too
(bytes); one that calls Allgather (refused); one that changes its inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.checks import CheckFailed, check_ring_attention, check_zigzag
from ddlab.context_parallel import attend_block, empty_partial, finish, merge_partials

TAG = 15


def ring_reference(comm, q, k, v, positions):
    """The notebook's answer: one message of K and V per step, compute overlapped with it."""
    rank, size = comm.Get_rank(), comm.Get_size()
    held = np.stack([k, v])
    partial = empty_partial(q, v.shape[-1])
    for step in range(size):
        source = (rank - step) % size
        if step < size - 1:
            incoming = np.empty_like(held)
            requests = [comm.Irecv(incoming, (rank - 1) % size, TAG), comm.Isend(held, (rank + 1) % size, TAG)]
        partial = merge_partials(partial, attend_block(q, held[0], held[1], positions[rank], positions[source]))
        if step < size - 1:
            for request in requests:
                request.Wait()
            held = incoming
    return finish(partial)


def ring_two_messages_blocking(comm, q, k, v, positions):
    """Valid, written differently: K and V in two Sendrecv calls per step (no overlap), merged at the end."""
    rank, size = comm.Get_rank(), comm.Get_size()
    blocks = []
    key, value = k.copy(), v.copy()
    for step in range(size):
        blocks.append(attend_block(q, key, value, positions[rank], positions[(rank - step) % size]))
        if step < size - 1:
            new_key, new_value = np.empty_like(key), np.empty_like(value)
            comm.Sendrecv(key, (rank + 1) % size, TAG, new_key, (rank - 1) % size, TAG)
            comm.Sendrecv(value, (rank + 1) % size, TAG + 1, new_value, (rank - 1) % size, TAG + 1)
            key, value = new_key, new_value
    total = blocks[0]
    for block in blocks[1:]:
        total = merge_partials(total, block)
    return finish(total)


def ring_mask_of_wrong_chunk(comm, q, k, v, positions):
    """Wrong (the issue's): the causal mask uses this rank's positions for every key block."""
    rank = comm.Get_rank()
    return ring_reference(comm, q, k, v, np.stack([positions[rank]] * len(positions)))


def ring_receives_before_sending(comm, q, k, v, positions):
    """Wrong (the issue's): each step receives the next block, then sends it on before using the one held:
    every rank waits in Recv, none has sent: a deadlock the check must end at its deadline."""
    rank, size = comm.Get_rank(), comm.Get_size()
    held = np.stack([k, v])
    partial = empty_partial(q, v.shape[-1])
    for step in range(size):
        partial = merge_partials(
            partial, attend_block(q, held[0], held[1], positions[rank], positions[(rank - step) % size])
        )
        if step < size - 1:
            incoming = np.empty_like(held)
            comm.Recv(incoming, (rank - 1) % size, TAG)
            comm.Send(incoming, (rank + 1) % size, TAG)
            held = incoming
    return finish(partial)


def ring_sends_positions(comm, q, k, v, positions):
    """Wrong in bytes: passes the positions along with each block."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for _ in range(size - 1):
        incoming = np.empty_like(positions[rank])
        comm.Sendrecv(positions[rank].copy(), (rank + 1) % size, TAG + 2, incoming, (rank - 1) % size, TAG + 2)
    return ring_reference(comm, q, k, v, positions)


def ring_by_allgather(comm, q, k, v, positions):
    """Wrong: gathers every block with MPI's collective."""
    keys = np.empty((comm.Get_size(), *k.shape))
    comm.Allgather(k, keys)
    return ring_reference(comm, q, k, v, positions)


def ring_overwrites_keys(comm, q, k, v, positions):
    """Wrong: right values, but k used as scratch afterwards (the caller still needs it for backward)."""
    result = ring_reference(comm, q, k, v, positions)
    k[...] = 0.0
    return result


@pytest.mark.parametrize("answer", [ring_reference, ring_two_messages_blocking])
def test_ring_check_accepts(comm, answer, capsys):
    check_ring_attention(answer)
    out = capsys.readouterr().out
    assert ("passed" in out) == (comm.Get_rank() == 0)


@pytest.mark.parametrize(
    "answer,message",
    [
        (ring_mask_of_wrong_chunk, "out is wrong"),
        (ring_receives_before_sending, "never completed"),
        (ring_sends_positions, "bytes, the ring sends"),
        (ring_by_allgather, "Allgather"),
        (ring_overwrites_keys, "was changed"),
    ],
)
def test_ring_check_fails(comm, answer, message):
    if comm.Get_size() == 1 and answer is not ring_overwrites_keys:
        pytest.skip("one rank sends no message and sees one chunk: these answers are right there")
    with pytest.raises(CheckFailed, match=message):
        check_ring_attention(answer, timeout=3.0)  # only the deadlock waits it out


def split_reference(x, size, rank):
    """Valid: the late chunk read as the first `chunk` rows from its start."""
    length = x.shape[-2]
    chunk = -(-length // (2 * size))
    padded = np.zeros((*x.shape[:-2], 2 * size * chunk, x.shape[-1]))
    padded[..., :length, :] = x
    late = 2 * size - 1 - rank
    return np.concatenate(
        [padded[..., rank * chunk : (rank + 1) * chunk, :], padded[..., late * chunk :, :][..., :chunk, :]], -2
    )


def unsplit_reference(parts, length):
    """Valid: early chunks in rank order, then late chunks in reverse rank order."""
    chunk = parts[0].shape[-2] // 2
    chunks = [p[..., :chunk, :] for p in parts] + [p[..., chunk:, :] for p in reversed(parts)]
    return np.concatenate(chunks, axis=-2)[..., :length, :]


def unsplit_in_rank_order(parts, length):
    """Wrong: puts the parts back one after another, as if the split were contiguous."""
    return np.concatenate(parts, axis=-2)[..., :length, :]


def test_zigzag_check_on_ranks(comm, capsys):
    check_zigzag(split_reference, unsplit_reference)
    assert ("passed" in capsys.readouterr().out) == (comm.Get_rank() == 0)
    with pytest.raises(CheckFailed, match="unsplit"):
        check_zigzag(split_reference, unsplit_in_rank_order)
