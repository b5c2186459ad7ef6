"""Lab 15's ring attention and zig-zag checks on 1..P ranks: valid answers pass, the issue's wrong ones fail.

Wrong: a causal mask with the positions of the wrong chunk (this rank's own, not the block's
owner's); a ring that receives the next block before sending the one it holds (every rank waits,
none sends: it must fail at the check's deadline, not hang); a ring that sends the positions too
(bytes); one that calls Allgather (refused); one that changes its inputs.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from ddlab.checks import CheckFailed, check_ring_attention, check_ring_attention_backward, check_ulysses, check_zigzag
from ddlab.checks import context_parallel as context_parallel_checks
from ddlab.context_parallel import (
    attend_block,
    attend_block_backward,
    empty_partial,
    finish,
    merge_partials,
    reference_attention,
    ring_attention_backward,
    ulysses_attention,
)
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
merge_partials = unguarded(merge_partials)
ring_attention_backward = unguarded(ring_attention_backward)
ulysses_attention = unguarded(ulysses_attention)

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


def split_reference(x, size, rank, dtype=None):
    """Valid: the late chunk read as the first `chunk` rows from its start (dtype given: a wrong answer that
    pads into a buffer of that dtype whatever x's)."""
    length = x.shape[-2]
    chunk = -(-length // (2 * size))
    padded = np.zeros((*x.shape[:-2], 2 * size * chunk, x.shape[-1]), dtype=dtype or x.dtype)
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


def test_zigzag_check_fails_a_split_into_float64_whatever_the_dtype(comm):
    with pytest.raises(CheckFailed, match="float32"):
        check_zigzag(lambda x, size, rank: split_reference(x, size, rank, np.float64), unsplit_reference)


def test_zigzag_check_on_ranks(comm, capsys):
    check_zigzag(split_reference, unsplit_reference)
    assert ("passed" in capsys.readouterr().out) == (comm.Get_rank() == 0)
    with pytest.raises(CheckFailed, match="unsplit"):
        check_zigzag(split_reference, unsplit_in_rank_order)


def split_by_index(x, size, rank):
    """Valid: np.pad to the padded length, then index arrays with leading axes, which return a non-contiguous
    array (the check must hand the ring contiguous copies, not fail in MPI)."""
    length = x.shape[-2]
    chunk = -(-length // (2 * size))
    pad = [(0, 0)] * x.ndim
    pad[-2] = (0, 2 * size * chunk - length)
    late = 2 * size - 1 - rank
    rows = np.r_[rank * chunk : (rank + 1) * chunk, late * chunk : (late + 1) * chunk]
    return np.pad(x, pad)[..., rows, :]


def test_zigzag_check_accepts_a_non_contiguous_split(comm, deadline):
    assert not split_by_index(np.ones((2, 13, 3)), 2, 1).flags.c_contiguous  # what the test is about
    with deadline(120):  # it once failed in MPI on two ranks while the others waited for them forever
        check_zigzag(split_by_index, unsplit_reference)


def split_failing_on_the_upper_ranks(x, size, rank):
    """Wrong: raises on the upper half of the world's ranks only (the others would go on to the ring)."""
    if MPI.COMM_WORLD.Get_rank() >= max(1, MPI.COMM_WORLD.Get_size() // 2):
        raise RuntimeError("this rank's split broke")
    return split_reference(x, size, rank)


def split_stuck_on_the_last_rank(x, size, rank):
    """Wrong: never returns on the world's last rank."""
    while MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1 and MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(0.01)
    return split_reference(x, size, rank)


def test_zigzag_check_fails_a_split_that_breaks_on_some_ranks_on_every_rank(comm, deadline, monkeypatch):
    monkeypatch.setattr(context_parallel_checks, "CALL_DEADLINE", 1.0)
    if comm.Get_size() == 1:
        pytest.skip("needs ranks that differ")
    for answer, says in ((split_failing_on_the_upper_ranks, "RuntimeError"), (split_stuck_on_the_last_rank, "1 s")):
        start = time.monotonic()
        with deadline(60), pytest.raises(CheckFailed, match=says):
            check_zigzag(answer, unsplit_reference)
        assert time.monotonic() - start < 30  # the check's deadline, not the test's, ended it
        comm.Barrier()  # every rank got here: none is left waiting in the check's collectives


# --- the backward ring (exercise 15.3) and Ulysses (exercise 15.5) ---------------------------------------------


def backward_by(shift, last_hop=True, fixed_dtype=None, extra=False, always_causal=False):
    """A backward ring whose blocks move by shift(comm, send, tag) -> received; the variations are wrong answers:
    last_hop=False stops the gradients one hop short of home, fixed_dtype receives into buffers of that dtype,
    extra=True sends the key/value block on the last step too, always_causal masks whatever `causal` says."""

    def answer(comm, q, k, v, out, lse, grad_out, positions, causal):
        causal = causal or always_causal
        rank, size = comm.Get_rank(), comm.Get_size()
        delta = np.sum(grad_out * out, axis=-1)
        held, grads, dq = np.stack([k, v]), np.zeros((2, *k.shape), dtype=k.dtype), np.zeros_like(q)
        for step in range(size):
            source = (rank - step) % size
            share = attend_block_backward(
                q, held[0], held[1], grad_out, lse, delta, positions[rank], positions[source], causal
            )
            dq += share[0]
            grads = grads + np.stack(share[1:])
            if size > 1 and (last_hop or step < size - 1):
                grads = shift(comm, grads, 2, fixed_dtype)
            if size > 1 and (step < size - 1 or extra):
                held = shift(comm, held, 1, fixed_dtype)
        return dq, grads[0], grads[1]

    return answer


def by_isend_irecv(comm, send, tag, dtype=None):
    rank, size = comm.Get_rank(), comm.Get_size()
    incoming = np.empty(send.shape, dtype=dtype or send.dtype)
    MPI.Request.Waitall([comm.Irecv(incoming, (rank - 1) % size, tag), comm.Isend(send, (rank + 1) % size, tag)])
    return incoming


def by_irecv_any_tag(comm, send, tag, dtype=None):
    """Valid: the receive takes MPI's default tag (ANY_TAG), the send its own."""
    rank, size = comm.Get_rank(), comm.Get_size()
    incoming = np.empty(send.shape, dtype=dtype or send.dtype)
    MPI.Request.Waitall([comm.Irecv(incoming, source=(rank - 1) % size), comm.Isend(send, (rank + 1) % size, tag)])
    return incoming


def by_recv_any_tag(comm, send, tag, dtype=None):
    """Valid: a blocking receive with the default tag, after a non-blocking send."""
    rank, size = comm.Get_rank(), comm.Get_size()
    incoming = np.empty(send.shape, dtype=dtype or send.dtype)
    request = comm.Isend(send, (rank + 1) % size, tag)
    comm.Recv(incoming, source=(rank - 1) % size)
    request.Wait()
    return incoming


def by_allgather(comm, send, tag, dtype=None):
    """Wrong: every block gathered by a collective, the previous rank's kept."""
    rank, size = comm.Get_rank(), comm.Get_size()
    everyone = np.empty((size, *send.shape), dtype=dtype or send.dtype)
    comm.Allgather(send, everyone)
    return everyone[(rank - 1) % size].copy()


def by_sendrecv(comm, send, tag, dtype=None):
    rank, size = comm.Get_rank(), comm.Get_size()
    incoming = np.empty(send.shape, dtype=dtype or send.dtype)
    comm.Sendrecv(send, (rank + 1) % size, tag, incoming, (rank - 1) % size, tag)
    return incoming


def backward_scaling_grad_in_place(comm, q, k, v, out, lse, grad_out, positions, causal):
    """Scales grad_out by 1 in place first... by multiplying it by 2 and dividing back: the caller's array is touched."""
    grad_out *= 2.0
    result = ring_attention_backward(comm, q, k, v, out, lse, grad_out / 2.0, positions, causal)
    grad_out /= 3.0
    return result


def backward_on_the_world(comm, q, k, v, out, lse, grad_out, positions, causal):
    return backward_by(by_isend_irecv)(MPI.COMM_WORLD, q, k, v, out, lse, grad_out, positions, causal)


def backward_without_the_flag(comm, q, k, v, out, lse, grad_out, positions):
    """The exercise as it was before the causal flag: eight arguments, always causal."""
    return ring_attention_backward(comm, q, k, v, out, lse, grad_out, positions)


@pytest.mark.parametrize(
    "answer",
    [
        ring_attention_backward,
        backward_by(by_isend_irecv),
        backward_by(by_sendrecv),
        backward_by(by_irecv_any_tag),
        backward_by(by_recv_any_tag),
    ],
)
def test_backward_check_accepts_isend_irecv_and_sendrecv(comm, deadline, answer):
    with deadline(120):
        check_ring_attention_backward(answer)


@pytest.mark.parametrize(
    "answer, says",
    [
        (backward_by(by_isend_irecv, last_hop=False), "dk|dv|bytes"),
        (backward_by(by_sendrecv, fixed_dtype=np.float64), "float32"),
        (backward_by(by_isend_irecv, extra=True), "bytes"),
        (backward_scaling_grad_in_place, "changed"),
        (backward_on_the_world, "communicator it was given"),
        (backward_by(by_isend_irecv, always_causal=True), "not causal.*d[qkv] is wrong"),
        (backward_without_the_flag, "TypeError"),
        (backward_by(by_allgather), "collective|Allgather"),
    ],
)
def test_backward_check_fails_wrong_answers(comm, deadline, answer, says):
    if comm.Get_size() == 1 and says in ("dk|dv|bytes", "bytes", "communicator it was given", "collective|Allgather"):
        pytest.skip("one rank sends nothing: no hop to miss, no block too many, no other communicator")
    with deadline(120), pytest.raises(CheckFailed, match=says):
        check_ring_attention_backward(answer, timeout=3.0)


def test_backward_check_fails_its_stub(comm):
    def stub(comm, q, k, v, out, lse, grad_out, positions, causal):
        raise NotImplementedError("exercise 15.3")

    with pytest.raises(NotImplementedError):
        check_ring_attention_backward(stub)


def ulysses_by(reorder=False, fixed_dtype=None, twice=False):
    """Ulysses with one Alltoall per tensor each way; variations: reorder puts the gathered rows in the order of
    the sources reversed (wrong positions), fixed_dtype receives into a buffer of that dtype, twice sends q twice."""

    def answer(comm, q, k, v, positions):
        size = comm.Get_size()
        heads, rows, d = q.shape

        def to_heads(x):
            out = np.ascontiguousarray(x.reshape(size, heads // size, rows, d))
            inc = np.empty(out.shape, dtype=fixed_dtype or out.dtype)
            comm.Alltoall(out, inc)
            blocks = list(inc)[::-1] if reorder else list(inc)
            return np.concatenate(blocks, axis=-2)

        if twice:
            to_heads(q)
        whole = positions.reshape(-1)
        o, _ = reference_attention(to_heads(q), to_heads(k), to_heads(v), whole, whole)
        back = np.ascontiguousarray(np.stack(np.split(o, size, axis=-2)))
        inc = np.empty_like(back)
        comm.Alltoall(back, inc)
        return inc.reshape(heads, rows, d)

    return answer


@pytest.mark.parametrize("answer", [ulysses_attention, ulysses_by()])
def test_ulysses_check_accepts(comm, deadline, answer):
    with deadline(120):
        check_ulysses(answer)


@pytest.mark.parametrize(
    "answer, says",
    [(ulysses_by(fixed_dtype=np.float64), "float32|dtype|disagree"), (ulysses_by(twice=True), "four Alltoalls")],
)
def test_ulysses_check_fails_wrong_answers(comm, deadline, answer, says):
    with deadline(120), pytest.raises(CheckFailed, match=says):
        check_ulysses(answer, timeout=3.0)


def test_ulysses_check_fails_rows_gathered_out_of_rank_order(comm, deadline):
    if comm.Get_size() == 1:
        pytest.skip("one rank: one block, no order to get wrong")
    with deadline(120), pytest.raises(CheckFailed, match="output"):
        check_ulysses(ulysses_by(reorder=True), timeout=3.0)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("merge_partials", "ddlab.context_parallel.merge_partials", ()),
        ("ring_attention", "ddlab.context_parallel.ring_attention", ()),
        ("ring_attention_backward", "ddlab.context_parallel.ring_attention_backward", ()),
        ("zigzag", "ddlab.context_parallel.zigzag_positions", (unsplit_reference,)),
        ("ulysses", "ddlab.context_parallel.ulysses_attention", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
