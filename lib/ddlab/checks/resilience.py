"""Checks of lab 19 (failures at scale): each kills ranks for real, in a fault-tolerant job of its own.

The lab's engines never run the student's code here: the check pickles it (cloudpickle), starts a
4-rank job with ULFM (`ddlab.resilience.run_job`, killed whole at the check's deadline: no orphan, no
hung notebook), SIGKILLs a rank in it, and reads what the survivors returned. Call them in the
notebook itself, not under %%px.

- `check_detect(fn)`: fn(comm, source, timeout) -> "arrived" | "dead" | "slow".
- `check_recover(fn)`: fn(comm, done) -> (survivors' communicator, the step all survivors completed).
- `check_train_resilient(fn)`: fn(comm, problem, steps) -> mean losses, one process's, after a rank dies.
- `check_rebuild_shards(fn)`: fn(comm, old_rank, old_size, mine, buddy, numel) -> the new shard.
- `check_simulate_goodput(fn)`: fn(interval, cost, mtbf, restart, work, rng) -> goodput, the reference's draws.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..resilience import Failure, JobResult, Regression, probe, recover, run_job
from ..resilience import reshard as reference_reshard
from ..resilience import simulate_goodput as reference_goodput
from ..runtime.reference import answering, refusal
from ._core import array_problem, deadline, passed
from .errors import CheckFailed

_ERROR_NAMES = {
    MPI.ERR_PROC_FAILED: "MPI.ERR_PROC_FAILED (a peer died)",
    MPI.ERR_PROC_FAILED_PENDING: "MPI.ERR_PROC_FAILED_PENDING (a peer died)",
    MPI.ERR_REVOKED: "MPI.ERR_REVOKED (the communicator was revoked)",
}


def _answer(exercise: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, list[str]]:
    """fn(*args) in a rank of the job, with the library's answer to `exercise` refused; (value, refused names)."""
    with answering(exercise) as called:
        value = fn(*args)
    return value, list(called)


def _where(stack: str) -> str:
    """The innermost frame of a faulthandler dump: 'line N in NAME (file)'."""
    for line in stack.splitlines():
        line = line.strip()
        if line.startswith("File "):
            return line.removeprefix("File ")
    return "(no Python frame)"


def _job_problem(result: JobResult, exercise: str, seconds: float, stuck_hint: str) -> str | None:
    """What went wrong with the job as a whole (a hang, an error, the reference called), or None."""
    for outcome in result.outcomes.values():
        if outcome.error is None and isinstance(outcome.value, tuple) and len(outcome.value) == 2 and outcome.value[1]:
            return refusal(outcome.value[1][0])
    if result.timed_out:
        stuck = [f"rank {r} at {_where(s)}" for r, s in sorted(result.stacks.items()) if r not in result.outcomes]
        return (
            f"{exercise} did not finish within {seconds:.0f} s (the job was killed); still running: "
            f"{'; '.join(stuck) or 'every survivor'}. {stuck_hint}"
        )
    for rank, outcome in sorted(result.outcomes.items()):
        if outcome.error is not None:
            if outcome.error_class in _ERROR_NAMES:
                return (
                    f"rank {rank}: {_ERROR_NAMES[outcome.error_class]} escaped your {exercise}: catch MPI.Exception, "
                    "and after a failure go on with the survivors' communicator (revoke, shrink), never the old one"
                )
            if "ReferenceCalled" in outcome.error:
                return outcome.error.splitlines()[0].split(": ", 1)[-1]
            return f"rank {rank} raised {outcome.error.strip()}"
    return None


def _fail(problem: str | None, context: str) -> None:
    if problem:
        raise CheckFailed(f"{context}:\n  {problem}")


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- exercise 19.1: detect

DETECT_TIMEOUT = 1.0  # seconds given to the student's detect
SLACK = 1.5  # seconds a loaded machine may add to a wait


def _detect_scenario(comm: MPI.Comm, fn: Callable[..., str]) -> Any:
    """Rank 1 sends at once, rank 2 dies, rank 3 sends only when rank 0 is done asking; rank 0 asks about each."""
    rank = comm.Get_rank()
    if rank == 1:
        comm.Send(np.full(3, 1.0), dest=0, tag=7)
        return None
    if rank == 2:
        _kill_self()
    if rank == 3:
        comm.Recv(np.empty(1), source=0, tag=99)  # go: rank 0 asked about us already
        comm.Send(np.full(3, 3.0), dest=0, tag=7)
        return None
    verdicts, called, times = [], [], []
    try:
        for source in (1, 2, 3):
            start = time.monotonic()
            verdict, refused = _answer("detect", fn, comm, source, DETECT_TIMEOUT)
            verdicts.append(verdict)
            called += refused
            times.append(time.monotonic() - start)
    finally:
        comm.Send(np.zeros(1), dest=3, tag=99)
    late = np.zeros(3)
    request = comm.Irecv(late, source=3, tag=7)  # the late message must still be there for a new receive
    end, arrived = time.monotonic() + 10.0, False
    try:  # a receive the answer left pending takes the message, and this one never completes (or fails)
        while not (arrived := request.Test()) and time.monotonic() < end:
            time.sleep(1e-3)
    except MPI.Exception:
        arrived = False
    return (verdicts, times, late.tolist() if arrived else None), called


def check_detect(fn: Callable[[Any, int, float], str], timeout: float = 60.0) -> None:
    """fn(comm, source, timeout) -> "arrived" (a message came), "dead" (MPI says source failed), "slow" (neither)."""
    result = run_job(functools.partial(_detect_scenario, fn=fn), 4, timeout)
    _fail(
        _job_problem(
            result,
            "detect",
            timeout,
            "A receive without a deadline (Recv, or Wait on the request) waits for a slow peer forever: poll with "
            "Test until the timeout",
        ),
        "detect, on 4 ranks: rank 1 sends, rank 2 is SIGKILLed, rank 3 sends only after the timeout",
    )
    if 0 not in result.outcomes:
        _fail(f"rank 0 left no result: it died (did your code exit or kill it?)\n{result.output[-1500:]}", "detect")
    (verdicts, times, late), _ = result.outcomes[0].value
    want = ["arrived", "dead", "slow"]
    for source, got, expected, took in zip((1, 2, 3), verdicts, want, times):
        problem = None
        if got != expected:
            why = {
                "arrived": "its message was waiting",
                "dead": "it was SIGKILLed: the pending receive raises MPI.Exception with error class "
                "MPI.ERR_PROC_FAILED; a dead peer is not a slow one",
                "slow": "it is alive and sends only later: after the timeout, say 'slow'",
            }[expected]
            problem = f"source {source}: returned {got!r}, expected {expected!r} ({why})"
        elif expected == "slow" and not DETECT_TIMEOUT * 0.9 <= took <= DETECT_TIMEOUT + SLACK:
            problem = f"source 3 (slow): returned after {took:.2f} s; the timeout was {DETECT_TIMEOUT} s"
        elif expected != "slow" and took > DETECT_TIMEOUT + SLACK:
            problem = f"source {source}: took {took:.2f} s, longer than the timeout ({DETECT_TIMEOUT} s)"
        _fail(problem, "detect, on 4 ranks, asked by rank 0")
    if late is None:
        _fail(
            "rank 3's late message never reached a new receive: a receive you left pending took it; cancel it "
            "(request.Cancel(), then request.Wait()) before returning 'slow'",
            "detect, after 'slow'",
        )
    passed(MPI.COMM_WORLD, "detect tells a message that arrived, a dead peer (SIGKILLed) and a slow one, in time")


# ---------------------------------------------------------------- exercise 19.2: recover

RECOVER_DONE = {0: 5, 1: 7, 2: 6, 3: 7}  # the step each old rank completed; the survivors must agree on 6


def _recover_scenario(comm: MPI.Comm, fn: Callable[..., Any], victim: int) -> Any:
    old = comm.Get_rank()
    if old == victim:
        _kill_self()
    try:
        comm.Barrier()  # the failure shows here (on some ranks, as ERR_PROC_FAILED)
    except MPI.Exception:
        pass
    (survivors, step), called = _answer("recover", fn, comm, RECOVER_DONE[old])
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        total = survivors.allreduce(old)
        ranks = survivors.allgather(old)
    except MPI.Exception as err:
        return ("broken", err.Get_error_class()), called
    return (survivors.Get_size(), survivors.Get_rank(), step, total, ranks), called


def check_recover(fn: Callable[[Any, int], tuple[Any, int]], timeout: float = 60.0) -> None:
    """fn(comm, done) -> (survivors, step): revoke, shrink, agree on the smallest `done`, every survivor alike."""
    for victim, ranks in ((0, 4),):  # the first rank dies: the new rank 0 is old rank 1
        context = f"recover on {ranks} ranks, rank {victim} SIGKILLed, `done` = " + ", ".join(
            f"{RECOVER_DONE[r]} on rank {r}" for r in range(ranks) if r != victim
        )
        result = run_job(functools.partial(_recover_scenario, fn=fn, victim=victim), ranks, timeout)
        _fail(
            _job_problem(
                result,
                "recover",
                timeout,
                "A collective on the old communicator waits for the dead rank (or for a survivor that gave up): "
                "revoke it, then shrink it",
            ),
            context,
        )
        alive = [r for r in range(ranks) if r != victim]
        want_step = min(RECOVER_DONE[r] for r in alive)
        got = {r: result.outcomes[r].value[0] for r in alive if r in result.outcomes}
        problem = None
        if missing := [r for r in alive if r not in got]:
            problem = f"ranks {missing} returned nothing"
        elif broken := [r for r, v in got.items() if v[0] == "broken"]:
            problem = (
                f"rank {broken[0]}: the communicator you returned fails ({_ERROR_NAMES.get(got[broken[0]][1], 'error')}): "
                "return the one Shrink gave, not the revoked one"
            )
        elif any(v[0] != len(alive) for v in got.values()):
            problem = f"the communicator you returned has {got[alive[0]][0]} ranks, not the {len(alive)} survivors"
        elif len({v[2] for v in got.values()}) > 1:
            steps = ", ".join(f"rank {r} from step {v[2]}" for r, v in got.items())
            problem = f"the survivors disagree on the step to resume from ({steps}): agree on one, the smallest"
        elif got[alive[0]][2] != want_step:
            problem = (
                f"every survivor resumes from step {got[alive[0]][2]}, but one completed only step {want_step}: "
                "agree on the smallest `done` (MPI.MIN), not your own or the largest"
            )
        elif any(v[4] != alive for v in got.values()):
            problem = f"the new communicator orders the old ranks {got[alive[0]][4]}, not {alive} (Shrink keeps it)"
        _fail(problem, context)
    passed(MPI.COMM_WORLD, "recover revokes, shrinks and agrees on the smallest step, every survivor alike")


# ---------------------------------------------------------------- exercise 19.3: train_resilient

TRAIN_PROBLEM = Regression(samples=240, features=6, batch=12)  # 20 steps per epoch: a step's samples tell the step
TRAIN_STEPS = 12


def _train_scenario(comm: MPI.Comm, fn: Callable[..., Any], failures: list[Failure]) -> Any:
    return _answer("train_resilient", fn, comm, probe(TRAIN_PROBLEM, failures), TRAIN_STEPS)


def _step_of(ids: list[int]) -> int | None:
    for step in range(TRAIN_STEPS):
        if set(ids) <= set(TRAIN_PROBLEM.batch_ids(step).tolist()):
            return step
    return None


def _samples_problem(result: JobResult, ranks: int, survivors: list[int]) -> str | None:
    """Which samples the committed attempt at each step lost or counted twice, or None.

    A step's committed attempt is the survivors' last one; the dead rank's call belongs to it only when the
    survivors made no more attempts at that step than it did (it died after the step completed)."""
    attempts: dict[int, dict[int, list[list[int]]]] = {}  # step -> rank -> the samples of each attempt
    for rank in range(ranks):
        for ids in result.calls.get(rank, []):
            step = _step_of(ids)
            if step is not None:
                attempts.setdefault(step, {}).setdefault(rank, []).append(ids)
    for step in range(TRAIN_STEPS):
        tries = attempts.get(step, {})
        final = max((len(tries[r]) for r in survivors if r in tries), default=0)
        used = sorted(i for r, each in tries.items() if r in survivors or len(each) >= final for i in each[-1])
        batch = sorted(TRAIN_PROBLEM.batch_ids(step).tolist())
        lost = sorted(set(batch) - set(used))
        twice = sorted({i for i in used if used.count(i) > 1})
        if lost:
            return (
                f"step {step}: samples {lost} of the global batch were never used by the survivors (the dead rank's "
                "share?): split each step's batch over the ranks of the communicator you have now"
            )
        if twice:
            return f"step {step}: samples {twice} were counted twice: each sample of a step goes to one rank"
    return None


def check_train_resilient(fn: Callable[[Any, Any, int], list[float]], timeout: float = 90.0) -> None:
    """fn(comm, problem, steps) -> mean losses, equal to one process's although a rank is SIGKILLed mid-step."""
    want, _ = TRAIN_PROBLEM.one_process(TRAIN_STEPS)
    rng = random.Random()
    for ranks in (4,):
        failure = Failure(rng.randrange(ranks), rng.randrange(2, 8), rng.uniform(0.0, 0.002))
        context = (
            f"train_resilient on {ranks} ranks, {TRAIN_STEPS} steps, rank {failure.rank} SIGKILLed at its "
            f"gradient call {failure.call} (+{failure.delay * 1e3:.1f} ms)"
        )
        result = run_job(functools.partial(_train_scenario, fn=fn, failures=[failure]), ranks, timeout)
        _fail(
            _job_problem(
                result,
                "train_resilient",
                timeout,
                "Retrying a call on the revoked communicator, or waiting on the dead rank, never ends: after a "
                "failure, recover and go on with the survivors",
            ),
            context,
        )
        survivors = [r for r in range(ranks) if r != failure.rank]
        problem = None
        if missing := [r for r in survivors if r not in result.outcomes]:
            problem = f"ranks {missing} returned nothing (did your code kill or exit them?)"
        else:
            problem = _samples_problem(result, ranks, survivors)
        if problem is None:
            curves = {r: result.outcomes[r].value[0] for r in survivors}
            first = survivors[0]
            for rank in survivors:
                got = curves[rank]
                if not isinstance(got, list) or len(got) != TRAIN_STEPS:
                    problem = f"rank {rank} returned {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'} items, not a list of {TRAIN_STEPS} losses (one per step)"
                elif list(got) != list(curves[first]):
                    problem = (
                        f"ranks {first} and {rank} return different losses: did they resume from different steps? "
                        "Agree on the step every survivor completed"
                    )
                else:
                    problem = array_problem(
                        np.asarray(got, dtype=np.float64), np.asarray(want), "the losses", rtol=1e-10, atol=0
                    )
                    if problem:
                        problem = (
                            f"rank {rank}: {problem} (one process's over the same batches); a step counted twice, "
                            "or an update kept from a step that did not complete?"
                        )
                if problem:
                    break
        _fail(problem, context)
    passed(MPI.COMM_WORLD, "train_resilient survives a rank SIGKILLed mid-step on 4 ranks with one process's losses")


# ---------------------------------------------------------------- exercise 19.4: rebuild_shards


#: (items, dtype) of the flat buffers the check rebuilds, one after the other, in one job
REBUILD_CASES = ((13, "float32"), (11, "float64"), (3, "float64"))


def _rebuild_scenario(comm: MPI.Comm, fn: Callable[..., Any], victim: int) -> Any:
    old_rank, old_size = comm.Get_rank(), comm.Get_size()
    cases = []
    for numel, dtype in REBUILD_CASES:
        flat = (np.arange(numel) + 1.5).astype(dtype)
        shards = [reference_reshard([flat], numel, old_size, q) for q in range(old_size)]
        cases.append((numel, shards, shards[old_rank], shards[(old_rank + 1) % old_size]))
    if old_rank == victim:
        _kill_self()
    try:
        comm.Barrier()
    except MPI.Exception:
        pass
    survivors, _ = recover(comm, 0)
    results, refused = [], []
    for numel, shards, mine, buddy in cases:
        given_mine, given_buddy = mine.copy(), buddy.copy()
        got, called = _answer("rebuild_shards", fn, survivors, old_rank, old_size, given_mine, given_buddy, numel)
        refused += called
        untouched = np.array_equal(given_mine, mine) and np.array_equal(given_buddy, buddy)
        shares = isinstance(got, np.ndarray) and (
            np.shares_memory(got, given_mine) or np.shares_memory(got, given_buddy)
        )
        results.append(
            (got, reference_reshard(shards, numel, survivors.Get_size(), survivors.Get_rank()), untouched, shares)
        )
    return results, refused


def check_rebuild_shards(fn: Callable[..., np.ndarray], timeout: float = 60.0) -> None:
    """fn(comm, old_rank, old_size, mine, buddy, numel) -> this survivor's shard for comm's size, from the buddies."""
    victim = 0  # old rank 0's shard survives only on old rank 3, across the wrap
    result = run_job(functools.partial(_rebuild_scenario, fn=fn, victim=victim), 4, timeout)
    context = f"rebuild_shards on 4 -> 3 ranks, rank {victim} SIGKILLed"
    _fail(_job_problem(result, "rebuild_shards", timeout, "Exchange on the survivors' communicator only"), context)
    if missing := [r for r in range(4) if r != victim and r not in result.outcomes]:
        _fail(f"old ranks {missing} left no result: they died (did your code exit or kill them?)", context)
    for rank in sorted(result.outcomes):
        for (numel, dtype), (got, want, untouched, shares) in zip(REBUILD_CASES, result.outcomes[rank].value[0]):
            problem = array_problem(got, want, "the new shard", rtol=0, atol=0)
            if problem:
                problem += (
                    f" (old rank {rank}); the dead rank's shard is the buddy copy its left neighbour "
                    f"(old rank {(victim - 1) % 4}) holds; gather every old shard, then reshard"
                )
            elif shares:
                problem = f"old rank {rank}: the new shard shares memory with `mine` or `buddy`: return a new array"
            elif not untouched:
                problem = f"old rank {rank}: `mine` or `buddy` was changed: read them, do not write them"
            _fail(problem, f"{context}, {numel} items of {dtype}")
    passed(
        MPI.COMM_WORLD, "rebuild_shards rebuilds every shard from the buddies and reshards 4 -> 3, float32 and float64"
    )


# ---------------------------------------------------------------- exercise 19.5: simulate_goodput

GOODPUT_CASES = [  # interval, cost, mtbf, restart, work: no failures, some, many, work not a multiple of the interval
    (10.0, 1.0, 1e12, 5.0, 100.0),
    (10.0, 1.0, 50.0, 5.0, 1000.0),
    (4.0, 0.5, 8.0, 1.0, 300.0),
    (7.0, 2.0, 60.0, 0.0, 250.0),
]


def check_simulate_goodput(fn: Callable[..., float], timeout: float = 30.0) -> None:
    """fn(interval, cost, mtbf, restart, work, rng) -> goodput, drawing failures from rng as the lab states."""
    for interval, cost, mtbf, restart, work in GOODPUT_CASES:
        context = f"simulate_goodput(interval={interval}, cost={cost}, mtbf={mtbf}, restart={restart}, work={work})"
        for seed in range(3):
            with answering("simulate_goodput") as called, deadline(timeout, context, "a loop that never ends?"):
                got = fn(interval, cost, mtbf, restart, work, np.random.default_rng(seed))
            if called:
                raise CheckFailed(refusal(called[0]))
            want = reference_goodput(interval, cost, mtbf, restart, work, np.random.default_rng(seed))
            if not isinstance(got, (float, np.floating)) or not np.isclose(got, want, rtol=1e-12, atol=0):
                hint = ""
                if isinstance(got, (float, np.floating)) and got > want:
                    hint = (
                        " (higher than it is: is a checkpoint's cost, the restart, or the work lost since the last "
                        "checkpoint left out?)"
                    )
                raise CheckFailed(f"{context}, rng seed {seed}: returned {got!r}, expected {want!r}{hint}")
    passed(MPI.COMM_WORLD, "simulate_goodput replays failures exactly as the reference draws them, 4 cases")
