"""Checks of lab 19 (failures at scale): each kills ranks for real, in a fault-tolerant job of its own.

The lab's engines never run the student's code here: the check pickles it (cloudpickle), starts a
4-rank job with ULFM (`ddlab.resilience.run_job`, killed whole at the check's deadline: no orphan, no
hung notebook), SIGKILLs a rank in it, and reads what the survivors returned. Call them in the
notebook itself, not under %%px.

- `check_detect(fn)`: fn(comm, source, timeout) -> "arrived" | "dead" | "slow".
- `check_recover(fn)`: fn(comm, done) -> (survivors' communicator, the step all survivors completed); run
  once with one death, once with a second rank SIGKILLed as its Shrink returns (the retry is needed).
- `check_train_resilient(fn)`: fn(comm, problem, steps) -> mean losses, one process's, after a rank dies;
  two fixed failures (`TRAIN_SCENARIOS`): one in the gradient, one inside the Allreduce.

The failures are the same on every run; those inside a collective or a Shrink are staged on the
communicator handed to the answer (`_Watched`), which also counts Agree calls and raises Agree's own
errors as `AgreeError`, so the message can name the call.
- `check_rebuild_shards(fn)`: fn(comm, old_rank, old_size, mine, buddy, numel) -> the new shard.
- `check_simulate_goodput(fn)`: fn(interval, cost, mtbf, restart, work, rng) -> goodput, the reference's draws.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
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


def _job_problem(
    result: JobResult, exercise: str, seconds: float, stuck_hint: str, escaped: str | None = None
) -> str | None:
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
            if "AgreeError" in outcome.error:
                return (
                    f"rank {rank}: comm.Agree raised {_ERROR_NAMES.get(outcome.error_class or 0, 'an MPI error')} "
                    f"and it escaped your {exercise}. ULFM's Agree raises MPI.ERR_PROC_FAILED, on every survivor "
                    "alike, when a rank died that not every survivor had acknowledged (Ack_failed) before the call: "
                    "a rank that had not seen the death yet had nothing to acknowledge. Call Agree inside a try and "
                    "take the exception as a no (ok = 0): a rank failed, so the step did not complete on every rank"
                )
            if outcome.error_class in _ERROR_NAMES:
                return f"rank {rank}: {_ERROR_NAMES[outcome.error_class]} escaped your {exercise}: " + (
                    escaped
                    or "catch MPI.Exception, and after a failure go on with the survivors' communicator (revoke, "
                    "shrink), never the old one"
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


class AgreeError(MPI.Exception):
    """An MPI error raised by Agree on a check's communicator (an MPI.Exception, so the answer may catch it)."""


class _Watched(MPI.Intracomm):
    """The communicator a check hands the answer: the job's, plus what the check must see or stage.

    It counts Agree calls and raises an error of Agree as an AgreeError; Shrink returns one of its
    kind sharing the same `ledger`; and the ledger may stage a failure on this rank: stall `stall_at`-th
    Allreduce/allreduce by `stall` s before entering it, or SIGKILL this rank `kill_delay` s into its
    `kill_at`-th one (its peers are then inside it too, waiting for a stalled rank), or right after
    its `kill_after_shrink`-th Shrink returns."""

    ledger: dict[str, float]

    @classmethod
    def wrap(cls, comm: MPI.Comm, ledger: dict[str, float]) -> _Watched:
        watched = cls(comm)
        watched.ledger = ledger
        return watched

    def Agree(self, flag: int) -> int:  # noqa: N802 (MPI's name)
        self.ledger["agree"] = self.ledger.get("agree", 0) + 1
        try:
            return super().Agree(flag)
        except MPI.Exception as err:
            raise AgreeError(err.Get_error_code()) from None

    def Shrink(self) -> _Watched:  # noqa: N802
        new = _Watched.wrap(super().Shrink(), self.ledger)
        self.ledger["shrink"] = self.ledger.get("shrink", 0) + 1
        if self.ledger["shrink"] == self.ledger.get("kill_after_shrink"):
            _kill_self()
        return new

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> None:  # noqa: N802
        self._collective()
        super().Allreduce(sendbuf, recvbuf, op)

    def allreduce(self, sendobj: Any, op: Any = MPI.SUM) -> Any:
        self._collective()
        return super().allreduce(sendobj, op)

    def _collective(self) -> None:
        count = self.ledger["collectives"] = self.ledger.get("collectives", 0) + 1
        if count == self.ledger.get("stall_at"):
            time.sleep(self.ledger["stall"])
        if count == self.ledger.get("kill_at"):
            timer = threading.Timer(self.ledger["kill_delay"], _kill_self)
            timer.daemon = True
            timer.start()


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
        "detect, on 4 ranks: rank 1 sends at once, rank 2 is SIGKILLed, rank 3 sends only once rank 0 has asked about it (after its timeout)",
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
RETRY_HINT = (
    "a rank died while you recovered, after Shrink: the minimum over the new communicator raises on some ranks, so "
    "let Agree decide (in a try) whether every survivor got it, and if not, revoke, shrink and agree again"
)


def _recover_scenario(comm: MPI.Comm, fn: Callable[..., Any], victim: int, second: int | None) -> Any:
    old = comm.Get_rank()
    if old == victim:
        _kill_self()
    try:
        comm.Barrier()  # the failure shows here (on some ranks, as ERR_PROC_FAILED)
    except MPI.Exception:
        pass
    watched = _Watched.wrap(comm, {"kill_after_shrink": 1} if old == second else {})
    (survivors, step), called = _answer("recover", fn, watched, RECOVER_DONE[old])
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        total = survivors.allreduce(old)
        ranks = survivors.allgather(old)
    except MPI.Exception as err:
        return ("broken", err.Get_error_class()), called
    return (survivors.Get_size(), survivors.Get_rank(), step, total, ranks), called


def check_recover(fn: Callable[[Any, int], tuple[Any, int]], timeout: float = 60.0) -> None:
    """fn(comm, done) -> (survivors, step): revoke, shrink, agree on the smallest `done`, every survivor alike."""
    ranks = 4
    # the first rank dies (the new rank 0 is old rank 1); then, again, and old rank 2 dies as its Shrink returns
    for victim, second in ((0, None), (0, 2)):
        context = f"recover on {ranks} ranks, rank {victim} SIGKILLed, `done` = " + ", ".join(
            f"{RECOVER_DONE[r]} on rank {r}" for r in range(ranks) if r != victim
        )
        if second is not None:
            context += f"; then rank {second} SIGKILLed during the recovery, as soon as its Shrink returned"
        result = run_job(functools.partial(_recover_scenario, fn=fn, victim=victim, second=second), ranks, timeout)
        _fail(
            _job_problem(
                result,
                "recover",
                timeout,
                "A collective on the old communicator waits for the dead rank (or for a survivor that gave up): "
                "revoke it, then shrink it",
                escaped=RETRY_HINT if second is not None else None,
            ),
            context,
        )
        alive = [r for r in range(ranks) if r not in (victim, second)]
        retry = f" ({RETRY_HINT})" if second is not None else ""
        want_step = min(RECOVER_DONE[r] for r in alive)
        got = {r: result.outcomes[r].value[0] for r in alive if r in result.outcomes}
        problem = None
        if missing := [r for r in alive if r not in got]:
            problem = f"ranks {missing} returned nothing"
        elif broken := [r for r, v in got.items() if v[0] == "broken"]:
            error = _ERROR_NAMES.get(got[broken[0]][1], f"MPI error class {got[broken[0]][1]}")
            fix = RETRY_HINT if second is not None else "return the one Shrink gave, not the revoked one"
            problem = f"rank {broken[0]}: the communicator you returned fails ({error}): {fix}"
        elif any(v[0] != len(alive) for v in got.values()):
            problem = (
                f"the communicator you returned has {got[alive[0]][0]} ranks, not the {len(alive)} survivors{retry}"
            )
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
    passed(
        MPI.COMM_WORLD,
        "recover revokes, shrinks and agrees on the smallest step, every survivor alike, and again if a rank dies meanwhile",
    )


# ---------------------------------------------------------------- exercise 19.3: train_resilient

TRAIN_PROBLEM = Regression(samples=240, features=6, batch=12)  # 20 steps per epoch: a step's samples tell the step
TRAIN_STEPS = 12


#: The check's fixed failures, in the order run: (where the kill lands, the probe's Failures, the staging per rank).
#: A death inside the Allreduce is staged on the communicator: rank 0 enters its 5th collective 0.3 s late,
#: so rank 2, SIGKILLed 0.05 s into its own 5th, dies while the others wait in it; the result then depends on
#: how far the collective got on each rank, which only Agree turns into one decision.
TRAIN_SCENARIOS: tuple[tuple[str, list[Failure], dict[int, dict[str, float]]], ...] = (
    ("SIGKILLed in its gradient (its 3rd call)", [Failure(1, 3)], {}),
    (
        "SIGKILLed inside its 5th Allreduce (while rank 0 enters it 0.3 s late)",
        [],
        {2: {"kill_at": 5, "kill_delay": 0.05}, 0: {"stall_at": 5, "stall": 0.3}},
    ),
)


def _train_scenario(comm: MPI.Comm, fn: Callable[..., Any], failures: list[Failure], stage: Any) -> Any:
    ledger = dict(stage.get(comm.Get_rank(), {}))
    watched = _Watched.wrap(comm, ledger)
    value, called = _answer("train_resilient", fn, watched, probe(TRAIN_PROBLEM, failures), TRAIN_STEPS)
    return (value, int(ledger.get("agree", 0))), called


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


def _commit_problem(result: JobResult, survivors: list[int], agrees: dict[int, int]) -> str | None:
    """A survivor that went on past a step another redid, or committed steps without Agree; or None."""
    for rank in survivors:
        steps = [_step_of(ids) for ids in result.calls.get(rank, [])]
        for before, after in zip(steps, steps[1:]):
            if before is not None and after is not None and after < before:
                return (
                    f"rank {rank} went on to step {before} and then came back to redo step {after}: the ranks "
                    f"disagreed on whether step {after} completed (the Allreduce finished on some ranks and failed "
                    "on others). Commit each step with ok = comm.Agree(ok), the one decision every survivor shares"
                )
    for rank in survivors:
        if agrees.get(rank, 0) < TRAIN_STEPS:
            return (
                f"rank {rank} called comm.Agree only {agrees.get(rank, 0)} time(s) for {TRAIN_STEPS} steps: a step committed "
                "without Agree lets the ranks disagree on whether it completed (a death inside the Allreduce can "
                "leave some ranks with the sum and others with an error). Commit each step with ok = comm.Agree(ok)"
            )
    return None


def _losses_problem(result: JobResult, survivors: list[int], want: list[float]) -> str | None:
    curves = {r: result.outcomes[r].value[0][0] for r in survivors}
    first = survivors[0]
    for rank in survivors:
        got = curves[rank]
        if not isinstance(got, list) or len(got) != TRAIN_STEPS:
            size = len(got) if hasattr(got, "__len__") else "?"
            return f"rank {rank} returned {type(got).__name__} of {size} items, not a list of {TRAIN_STEPS} losses"
        if list(got) != list(curves[first]):
            return (
                f"ranks {first} and {rank} return different losses: did they resume from different steps? "
                "Agree on the step every survivor completed"
            )
        problem = array_problem(
            np.asarray(got, dtype=np.float64), np.asarray(want), "the loss list", rtol=1e-10, atol=0
        )
        if problem:
            return (
                f"rank {rank}: {problem} (one process's over the same batches); a step counted twice, "
                "or an update kept from a step that did not complete?"
            )
    return None


def check_train_resilient(fn: Callable[[Any, Any, int], list[float]], timeout: float = 90.0) -> None:
    """fn(comm, problem, steps) -> mean losses, equal to one process's although a rank is SIGKILLed mid-step.

    Two fixed failures on 4 ranks, the same on every run: a rank dies in its gradient, and one dies inside the
    Allreduce (`TRAIN_SCENARIOS`); `timeout` is each job's deadline."""
    want, _ = TRAIN_PROBLEM.one_process(TRAIN_STEPS)
    ranks = 4
    for where, failures, stage in TRAIN_SCENARIOS:
        dead = {f.rank for f in failures} | {r for r, plan in stage.items() if "kill_at" in plan}
        context = f"train_resilient on {ranks} ranks, {TRAIN_STEPS} steps, rank {min(dead)} {where}"
        result = run_job(functools.partial(_train_scenario, fn=fn, failures=failures, stage=stage), ranks, timeout)
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
        survivors = [r for r in range(ranks) if r not in dead]
        problem = None
        if missing := [r for r in survivors if r not in result.outcomes]:
            problem = f"ranks {missing} returned nothing (did your code kill or exit them?)"
        else:
            agrees = {r: result.outcomes[r].value[0][1] for r in survivors}
            problem = (
                _commit_problem(result, survivors, agrees)
                or _samples_problem(result, ranks, survivors)
                or _losses_problem(result, survivors, want)
            )
        _fail(problem, context)
    passed(
        MPI.COMM_WORLD,
        "train_resilient survives a rank SIGKILLed in its gradient and one inside the Allreduce, with one process's losses",
    )


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
