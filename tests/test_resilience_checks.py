"""Lab 19's checks are fair and firm: they kill ranks for real, pass valid answers and name each wrong one.

Each check starts fault-tolerant jobs of its own (see ddlab.checks.resilience), so these run in one
process. The answers below are written as a student would (defined here, outside ddlab): valid
alternatives pass; wrong ones fail with a message naming the cause, within the deadline given:
waiting forever, retrying a revoked communicator, losing or double-counting a sample, ranks
disagreeing on the step; and the library's own answer, as it is and called (refuses_the_reference).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from ddlab import checks, resilience
from ddlab.checks import CheckFailed
from ddlab.runtime.blocks import block_range
from mpi4py import MPI

SHORT = 5.0  # seconds: the deadline given to the answers that never complete (the others get the default)
HANGS = {"detect_blocking", "recover_retrying", "train_retrying_revoked"}
# recover_once and recover_without_retry may hang or return, by the timing (under ULFM a collective on a communicator
# with a rank that died fails on the ranks next to it, and a survivor waiting for one of those may wait for ever):
# they keep the default deadline, so that their first run, with one death, always ends, and the check names the
# death during the recovery either way.

# ------------------------------------------------------------------ valid answers, written another way


def detect_by_probe(comm, source, timeout):
    """Iprobe in a loop, then Recv what came: another valid detector."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if comm.Iprobe(source=source, tag=MPI.ANY_TAG):
                comm.Recv(np.empty(8), source=source, tag=MPI.ANY_TAG)
                return "arrived"
            comm.Ack_failed()
            if source in _failed_ranks(comm):
                return "dead"
        except MPI.Exception as err:
            if err.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
                return "dead"
            raise
        time.sleep(0.001)
    return "slow"


def detect_after_a_pause(comm, source, timeout):
    """Busy for half a second before it looks: the sender has sent and finished long before. Its message must still
    be there (a rank that left early was once a failed peer to the asker, ULFM's view of an exit)."""
    time.sleep(0.5)
    return detect_by_probe(comm, source, timeout - 0.5)


def _failed_ranks(comm):
    failed = comm.Get_failed()
    return set(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), comm.Get_group()))


def recover_with_agree_loop(comm, done):
    while True:
        comm.Revoke()
        new = comm.Shrink()
        new.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            steps = new.allgather(done)
            ok = 1
        except MPI.Exception:
            steps, ok = [done], 0
            new.Revoke()  # a survivor still waiting in the allgather fails too
        new.Ack_failed()
        try:  # raises, on every survivor alike, for a death not all had acknowledged: a no
            ok = new.Agree(ok)
        except MPI.Exception:
            ok = 0
        if ok:
            return new, min(steps)
        comm = new


def train_with_rollback(comm, problem, steps):
    """Commits each step by Agree; keeps the losses in a dict by step; another valid shape."""
    params, losses, step = problem.initial(), {}, 0
    while step < steps:
        span = block_range(problem.batch, comm.Get_rank(), comm.Get_size())
        ids = problem.batch_ids(step)[span.start : span.stop]
        ok, total = 1, np.zeros(1 + params.size)
        try:
            loss, grad = problem.loss_and_grad(params, ids)
            comm.Allreduce(np.concatenate(([loss], grad)), total)
        except MPI.Exception:
            ok = 0
            comm.Revoke()
        try:
            ok = comm.Agree(ok)
        except MPI.Exception:
            ok = 0
        if not ok:
            comm, step = recover_with_agree_loop(comm, step)
            continue
        params = params - problem.lr * total[1:] / problem.batch
        losses[step] = total[0] / problem.batch
        step += 1
    return [losses[s] for s in range(steps)]


def rebuild_by_allgather(comm, old_rank, old_size, mine, buddy, numel):
    shard = mine.size
    flat = np.zeros(shard * old_size, dtype=mine.dtype)
    for q, own, copy in comm.allgather((old_rank, mine, buddy)):
        flat[q * shard : (q + 1) * shard] = own
        right = (q + 1) % old_size
        flat[right * shard : (right + 1) * shard] = copy
    new = max(1, -(-numel // comm.Get_size()))
    out = np.zeros(new, dtype=mine.dtype)
    piece = flat[comm.Get_rank() * new : min(numel, (comm.Get_rank() + 1) * new)]
    out[: piece.size] = piece
    return out


def goodput_loop(interval, cost, mtbf, restart, work, rng):
    t, saved, fail_at = 0.0, 0.0, rng.exponential(mtbf)
    while saved < work:
        chunk = min(interval, work - saved)
        if t + chunk + cost > fail_at:
            t = fail_at + restart
            fail_at = t + rng.exponential(mtbf)
        else:
            t += chunk + cost
            saved += chunk
    return work / t


def test_valid_answers_pass(capsys) -> None:
    checks.check_detect(detect_by_probe)
    checks.check_recover(recover_with_agree_loop)
    checks.check_train_resilient(train_with_rollback)
    checks.check_rebuild_shards(rebuild_by_allgather)
    checks.check_simulate_goodput(goodput_loop)
    assert capsys.readouterr().out.count("passed:") == 5


def test_a_detector_that_looks_late_still_finds_the_message(capsys) -> None:
    for _ in range(3):  # each run failed about one time in three when a finished rank left at once
        checks.check_detect(detect_after_a_pause)
    assert capsys.readouterr().out.count("passed:") == 3


# ------------------------------------------------------------------ wrong answers, one per class


def detect_blocking(comm, source, timeout):  # waits forever for a peer that sends only later
    try:
        comm.Recv(np.empty(8), source=source)
    except MPI.Exception:
        return "dead"
    return "arrived"


def detect_dead_on_timeout(comm, source, timeout):  # takes silence for death: a slow peer is not dead
    request = comm.Irecv(np.empty(8), source=source)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if request.Test():
                return "arrived"
        except MPI.Exception:
            return "dead"
        time.sleep(0.001)
    request.Cancel()
    request.Wait()
    return "dead"


def detect_leaves_receive_pending(comm, source, timeout):
    request = comm.Irecv(np.empty(8), source=source)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if request.Test():
                return "arrived"
        except MPI.Exception:
            return "dead"
        time.sleep(0.001)
    return "slow"


def recover_own_step(comm, done):  # ranks disagree on the step
    comm.Revoke()
    new = comm.Shrink()
    return new, done


def recover_without_shrink(comm, done):  # goes on with the revoked communicator
    comm.Revoke()
    return comm, done


def recover_retrying(comm, done):  # retries a collective on the broken communicator until it works: forever
    while True:
        try:
            return comm, comm.allreduce(done, op=MPI.MIN)
        except MPI.Exception:
            time.sleep(0.01)


def recover_once(comm, done):  # no Agree, no retry: a death during the recovery escapes
    comm.Revoke()
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    return new, new.allreduce(done, op=MPI.MIN)


def recover_without_retry(comm, done):  # catches the failure, but keeps the communicator that holds the new dead
    comm.Revoke()
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        return new, new.allreduce(done, op=MPI.MIN)
    except MPI.Exception:
        return new, done


def train_fixed_split(comm, problem, steps):  # keeps the split of the first communicator: loses samples
    first = comm.Get_size()
    params, losses, step = problem.initial(), [], 0
    while step < steps:
        rank = comm.Get_rank()
        span = block_range(problem.batch, rank, first)
        ids = problem.batch_ids(step)[span.start : span.stop]
        total = resilience.attempt(comm, _allreduce_step, comm, problem, params, ids)
        if total is None:
            comm, step = resilience.recover(comm, step)
            continue
        params = params - problem.lr * total[1:] / problem.batch
        losses.append(total[0] / problem.batch)
        step += 1
    return losses


def train_dead_share_to_all(comm, problem, steps):  # every survivor takes the dead rank's share: counted twice
    params, losses, step, lost = problem.initial(), [], 0, []
    first, me = comm.Get_size(), comm.Get_rank()
    while step < steps:
        shares = [block_range(problem.batch, r, first) for r in [me, *lost]]
        ids = np.concatenate([problem.batch_ids(step)[span.start : span.stop] for span in shares])
        total = resilience.attempt(comm, _allreduce_step, comm, problem, params, ids)
        if total is None:
            comm, step = resilience.recover(comm, step)
            alive = set(comm.allgather(me))
            lost = [r for r in range(first) if r not in alive]
            continue
        params = params - problem.lr * total[1:] / problem.batch
        losses.append(total[0] / problem.batch)
        step += 1
    return losses


def train_retrying_revoked(comm, problem, steps):  # after a failure, calls Allreduce again on the same communicator
    params, losses = problem.initial(), []
    for step in range(steps):
        span = block_range(problem.batch, comm.Get_rank(), comm.Get_size())
        ids = problem.batch_ids(step)[span.start : span.stop]
        while True:
            try:
                total = _allreduce_step(comm, problem, params, ids)
                break
            except MPI.Exception:
                comm.Revoke()
        params = params - problem.lr * total[1:] / problem.batch
        losses.append(total[0] / problem.batch)
    return losses


def train_without_agree(comm, problem, steps):  # commits a step when its own Allreduce returned: ranks may disagree
    params, losses, step = problem.initial(), [], 0
    while step < steps:
        span = block_range(problem.batch, comm.Get_rank(), comm.Get_size())
        ids = problem.batch_ids(step)[span.start : span.stop]
        try:
            total = _allreduce_step(comm, problem, params, ids)
        except MPI.Exception:
            comm.Revoke()
            comm, step = resilience.recover(comm, step)
            del losses[step:]
            continue
        params = params - problem.lr * total[1:] / problem.batch
        losses.append(total[0] / problem.batch)
        step += 1
    return losses


def train_agree_outside_try(comm, problem, steps):  # `ok = comm.Agree(ok)` as written, its error left to escape
    params, losses, step = problem.initial(), [], 0
    while step < steps:
        span = block_range(problem.batch, comm.Get_rank(), comm.Get_size())
        ids = problem.batch_ids(step)[span.start : span.stop]
        ok, total = 1, None
        try:
            total = _allreduce_step(comm, problem, params, ids)
        except MPI.Exception:
            ok = 0
            comm.Revoke()
        comm.Ack_failed()
        ok = comm.Agree(ok)
        if not ok:
            comm, step = resilience.recover(comm, step)
            continue
        params = params - problem.lr * total[1:] / problem.batch
        losses.append(total[0] / problem.batch)
        step += 1
    return losses


def _allreduce_step(comm, problem, params, ids):
    loss, grad = problem.loss_and_grad(params, ids)
    total = np.empty(1 + params.size)
    comm.Allreduce(np.concatenate(([loss], grad)), total)
    return total


def rebuild_without_buddies(comm, old_rank, old_size, mine, buddy, numel):
    shards = [np.zeros_like(mine) for _ in range(old_size)]
    for q, own in comm.allgather((old_rank, mine)):
        shards[q] = own
    return resilience.reshard(shards, numel, comm.Get_size(), comm.Get_rank())


def goodput_no_restart(interval, cost, mtbf, restart, work, rng):
    return goodput_loop(interval, cost, mtbf, 0.0, work, rng)


def goodput_keeps_work(interval, cost, mtbf, restart, work, rng):  # a failure loses nothing done since the checkpoint
    t, saved, fail_at = 0.0, 0.0, rng.exponential(mtbf)
    while saved < work:
        chunk = min(interval, work - saved)
        t += chunk + cost
        saved += chunk
        if t > fail_at:
            t += restart
            fail_at = t + rng.exponential(mtbf)
    return work / t


WRONG = [
    ("detect", detect_blocking, "did not finish within"),
    ("detect", detect_dead_on_timeout, "it is alive and sends only later"),
    ("detect", detect_leaves_receive_pending, "cancel it"),
    ("recover", recover_own_step, "disagree on the step"),
    ("recover", recover_without_shrink, "return the one Shrink gave"),
    ("recover", recover_retrying, "did not finish within"),
    ("recover", recover_once, "a rank died while you recovered"),
    ("recover", recover_without_retry, "a rank died while you recovered"),
    ("train_resilient", train_fixed_split, "never used by the survivors"),
    ("train_resilient", train_dead_share_to_all, "counted twice"),
    ("train_resilient", train_retrying_revoked, "revoked"),
    ("train_resilient", train_without_agree, "disagreed on whether step|called comm.Agree only"),
    ("train_resilient", train_agree_outside_try, "comm.Agree raised"),
    ("rebuild_shards", rebuild_without_buddies, "buddy copy"),
    ("simulate_goodput", goodput_no_restart, "higher than it is"),
    ("simulate_goodput", goodput_keeps_work, "expected"),
]


@pytest.mark.parametrize(("exercise", "answer", "says"), WRONG, ids=[f"{e}-{a.__name__}" for e, a, _ in WRONG])
def test_wrong_answers_fail_naming_the_cause(exercise: str, answer, says: str) -> None:
    check = getattr(checks, f"check_{exercise}")
    start = time.monotonic()
    with pytest.raises(CheckFailed, match=says):
        check(answer, **({"timeout": SHORT} if answer.__name__ in HANGS else {}))
    if answer.__name__ in HANGS:
        assert time.monotonic() - start < 2 * SHORT + 15


@pytest.mark.parametrize("exercise", ["detect", "recover", "train_resilient", "rebuild_shards", "simulate_goodput"])
def test_the_checks_refuse_the_library_s_own_answer(exercise: str, refuses_the_reference) -> None:
    refuses_the_reference(exercise, f"ddlab.resilience.{exercise}")
