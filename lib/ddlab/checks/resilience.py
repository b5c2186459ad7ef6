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

The failures are the same on every run (under the grader's draw, DDLAB_GRADE_SEED, the same for the same seed:
which ranks die, when, and on what data are drawn, see each check's "The grader's draw"); those inside a collective
or a Shrink are staged on the communicator handed to the answer (`_Watched`), which also counts Agree calls and
raises Agree's own errors as `AgreeError`, so the message can name the call.
- `check_rebuild_shards(fn)`: fn(comm, old_rank, old_size, mine, buddy, numel) -> the new shard.
- `check_simulate_goodput(fn)`: fn(interval, cost, mtbf, restart, work, rng) -> goodput, the reference's draws.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..resilience import Failure, JobResult, Regression, probe, recover, run_job
from ..resilience import reshard as reference_reshard
from ..resilience import simulate_goodput as reference_goodput
from ..runtime.reference import answering, refusal
from ._core import array_problem, deadline, passed
from ._draw import Draw, grading_draw, named
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
        if unstarted := sorted(set(range(result.ranks)) - result.started):
            stuck.append(f"ranks {unstarted} never got through MPI's start-up (the launcher's part, not your code)")
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


@dataclass(frozen=True)
class _DetectPlan:
    """Who does what in 19.1's job: `asker` calls detect on each of `order` (ranks sending at once, SIGKILLed, or
    sending only once the asker is done asking) with `timeout`; messages of `items` float64 with `tag`."""

    asker: int = 0
    arrived: int = 1
    dead: int = 2
    slow: int = 3
    order: tuple[int, ...] = (1, 2, 3)
    timeout: float = DETECT_TIMEOUT
    items: int = 3
    tag: int = 7

    def role(self, source: int) -> str:
        return {self.arrived: "arrived", self.dead: "dead", self.slow: "slow"}[source]

    def __str__(self) -> str:
        return (
            f"rank {self.arrived} sends at once, rank {self.dead} is SIGKILLed, rank {self.slow} sends only once rank "
            f"{self.asker} has asked about it (after its timeout)"
        )


def _detect_plan(draw: Draw | None) -> _DetectPlan:
    """The notebook's plan, or the grader's: every role on a drawn rank, asked in a drawn order, a timeout from 1.2
    to 2 s, messages of 1 to 8 items (the lab's "at most 8"), any tag up to 99."""
    if draw is None:
        return _DetectPlan()
    asker, arrived, dead, slow = (int(r) for r in draw.rng("roles").permutation(4))
    order = tuple(int(r) for r in draw.rng("order").permutation([arrived, dead, slow]))
    timeout, items, tag = draw.integer(12, 20, "timeout") / 10, draw.integer(1, 8, "items"), draw.integer(0, 98, "tag")
    return _DetectPlan(asker, arrived, dead, slow, order, timeout, items, tag)


def _detect_scenario(comm: MPI.Comm, fn: Callable[..., str], plan: _DetectPlan) -> Any:
    """plan.arrived sends at once, plan.dead dies, plan.slow sends only when the asker is done asking; the asker
    asks about each source of plan.order."""
    rank = comm.Get_rank()
    message = np.full(plan.items, float(rank))
    if rank == plan.arrived:
        comm.Send(message, dest=plan.asker, tag=plan.tag)
        return None
    if rank == plan.dead:
        _kill_self()
    if rank == plan.slow:
        comm.Recv(np.empty(1), source=plan.asker, tag=99)  # go: the asker asked about us already
        comm.Send(message, dest=plan.asker, tag=plan.tag)
        return None
    verdicts, called, times = [], [], []
    try:
        for source in plan.order:
            start = time.monotonic()
            verdict, refused = _answer("detect", fn, comm, source, plan.timeout)
            verdicts.append(verdict)
            called += refused
            times.append(time.monotonic() - start)
    finally:
        comm.Send(np.zeros(1), dest=plan.slow, tag=99)
    late = np.zeros(plan.items)
    request = comm.Irecv(late, source=plan.slow, tag=plan.tag)  # the late message must still be there for a new receive
    end, arrived = time.monotonic() + 10.0, False
    try:  # a receive the answer left pending takes the message, and this one never completes (or fails)
        while not (arrived := request.Test()) and time.monotonic() < end:
            time.sleep(1e-3)
    except MPI.Exception:
        arrived = False
    return (verdicts, times, late.tolist() if arrived else None), called


def check_detect(fn: Callable[[Any, int, float], str], timeout: float = 60.0) -> None:
    """fn(comm, source, timeout) -> "arrived" (a message came), "dead" (MPI says source failed), "slow" (neither).

    The grader's draw: which of the 4 ranks asks, sends at once, dies and sends late, the order asked in, the
    timeout (1.2 to 2 s), the messages' items (1 to 8) and tag."""
    draw = grading_draw(None, "detect")
    plan = _detect_plan(draw)
    drawn = (
        ""
        if draw is None
        else f"; rank {plan.asker} asks about {list(plan.order)} with a timeout of {plan.timeout} s, messages of "
        f"{plan.items} items with tag {plan.tag}{named(draw)}"
    )
    result = run_job(functools.partial(_detect_scenario, fn=fn, plan=plan), 4, timeout)
    _fail(
        _job_problem(
            result,
            "detect",
            timeout,
            "A receive without a deadline (Recv, or Wait on the request) waits for a slow peer forever: poll with "
            "Test until the timeout",
        ),
        f"detect, on 4 ranks: {plan}{drawn}",
    )
    if plan.asker not in result.outcomes:
        _fail(
            f"rank {plan.asker} left no result: it died (did your code exit or kill it?)\n{result.output[-1500:]}",
            f"detect{drawn}",
        )
    (verdicts, times, late), _ = result.outcomes[plan.asker].value
    for source, got, took in zip(plan.order, verdicts, times):
        expected, problem = plan.role(source), None
        if got != expected:
            why = {
                "arrived": "its message was waiting",
                "dead": "it was SIGKILLed: the pending receive raises MPI.Exception with error class "
                "MPI.ERR_PROC_FAILED; a dead peer is not a slow one",
                "slow": "it is alive and sends only later: after the timeout, say 'slow'",
            }[expected]
            problem = f"source {source}: returned {got!r}, expected {expected!r} ({why})"
        elif expected == "slow" and not plan.timeout * 0.9 <= took <= plan.timeout + SLACK:
            problem = f"source {source} (slow): returned after {took:.2f} s; the timeout was {plan.timeout} s"
        elif expected != "slow" and took > plan.timeout + SLACK:
            problem = f"source {source}: took {took:.2f} s, longer than the timeout ({plan.timeout} s)"
        _fail(problem, f"detect, on 4 ranks, asked by rank {plan.asker}" + (f": {plan}{drawn}" if draw else ""))
    if late is None:
        _fail(
            f"rank {plan.slow}'s late message never reached a new receive: a receive you left pending took it; cancel "
            "it (request.Cancel(), then request.Wait()) before returning 'slow'",
            f"detect, after 'slow'{drawn}",
        )
    passed(
        MPI.COMM_WORLD,
        f"detect tells a message that arrived, a dead peer (SIGKILLed) and a slow one, in time{named(draw)}",
    )


# ---------------------------------------------------------------- exercise 19.2: recover

RECOVER_DONE = {0: 5, 1: 7, 2: 6, 3: 7}  # the step each old rank completed; the survivors must agree on 6
RETRY_HINT = (
    "a rank died while you recovered, after Shrink: the minimum over the new communicator raises on some ranks, so "
    "let Agree decide (in a try) whether every survivor got it, and if not, revoke, shrink and agree again"
)


def _recover_scenario(
    comm: MPI.Comm, fn: Callable[..., Any], victim: int, second: int | None, done: dict[int, int]
) -> Any:
    old = comm.Get_rank()
    if old == victim:
        _kill_self()
    try:
        comm.Barrier()  # the failure shows here (on some ranks, as ERR_PROC_FAILED)
    except MPI.Exception:
        pass
    watched = _Watched.wrap(comm, {"kill_after_shrink": 1} if old == second else {})
    (survivors, step), called = _answer("recover", fn, watched, done[old])
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        total = survivors.allreduce(old)
        ranks = survivors.allgather(old)
    except MPI.Exception as err:
        return ("broken", err.Get_error_class()), called
    return (survivors.Get_size(), survivors.Get_rank(), step, total, ranks), called


def _recover_cases(ranks: int, draw: Draw | None) -> list[tuple[int, int | None, dict[int, int]]]:
    """(victim, the rank SIGKILLed as its Shrink returns or None, each old rank's `done`) of 19.2's two runs: the
    notebook's, or the grader's draw: any victim, any second rank, `done` drawn from 1 to 50, the second rank's the
    smallest of the first survivors' (so the minimum before the retry is the wrong answer)."""
    if draw is None:
        return [(0, None, RECOVER_DONE), (0, 2, RECOVER_DONE)]
    cases: list[tuple[int, int | None, dict[int, int]]] = []
    for run in range(2):
        victim = draw.integer(0, ranks - 1, "victim", run)
        done = {r: draw.integer(1, 50, "done", run, r) for r in range(ranks)}
        second = None
        if run == 1:
            others = [r for r in range(ranks) if r != victim]
            second = others[draw.integer(0, len(others) - 1, "second")]
            done[second] = min(done[r] for r in others) - 1
        cases.append((victim, second, done))
    return cases


def check_recover(fn: Callable[[Any, int], tuple[Any, int]], timeout: float = 60.0) -> None:
    """fn(comm, done) -> (survivors, step): revoke, shrink, agree on the smallest `done`, every survivor alike.

    The grader's draw: in each of the two runs which rank dies, in the second which one dies as its Shrink returns,
    and every rank's `done` (1 to 50; the second victim's the smallest, so only a retry finds the answer)."""
    ranks = 4
    draw = grading_draw(None, "recover")
    # the notebook's: the first rank dies (the new rank 0 is old rank 1); then again, and old rank 2 dies as its Shrink
    # returns
    for victim, second, done in _recover_cases(ranks, draw):
        context = f"recover on {ranks} ranks, rank {victim} SIGKILLed, `done` = " + ", ".join(
            f"{done[r]} on rank {r}" for r in range(ranks) if r != victim
        )
        if second is not None:
            context += f"; then rank {second} SIGKILLed during the recovery, as soon as its Shrink returned"
        context += named(draw)
        target = functools.partial(_recover_scenario, fn=fn, victim=victim, second=second, done=done)
        result = run_job(target, ranks, timeout)
        hang = (  # the run with one death went through: a hang in the second is the death during the recovery
            "A collective on the old communicator waits for the dead rank (or for a survivor that gave up): "
            "revoke it, then shrink it"
            if second is None
            else f"A collective on the new communicator waits for the rank that died (or for a survivor that gave "
            f"up): {RETRY_HINT}"
        )
        _fail(
            _job_problem(result, "recover", timeout, hang, escaped=RETRY_HINT if second is not None else None),
            context,
        )
        alive = [r for r in range(ranks) if r not in (victim, second)]
        retry = f" ({RETRY_HINT})" if second is not None else ""
        want_step = min(done[r] for r in alive)
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
        "recover revokes, shrinks and agrees on the smallest step, every survivor alike, and again if a rank dies "
        f"meanwhile{named(draw)}",
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


def _train_scenario(
    comm: MPI.Comm, fn: Callable[..., Any], failures: list[Failure], stage: Any, problem: Regression, steps: int
) -> Any:
    ledger = dict(stage.get(comm.Get_rank(), {}))
    watched = _Watched.wrap(comm, ledger)
    value, called = _answer("train_resilient", fn, watched, probe(problem, failures), steps)
    return (value, int(ledger.get("agree", 0))), called


@dataclass(frozen=True)
class _TrainCase:
    """One run of 19.3's check: the problem, the steps, where a rank dies (see TRAIN_SCENARIOS), what was drawn."""

    problem: Regression
    steps: int
    where: str
    failures: list[Failure] = field(default_factory=list)
    stage: dict[int, dict[str, float]] = field(default_factory=dict)
    drawn: str = ""

    def dead(self) -> set[int]:
        return {f.rank for f in self.failures} | {r for r, plan in self.stage.items() if "kill_at" in plan}


def _train_cases(ranks: int, draw: Draw | None) -> list[_TrainCase]:
    """The notebook's two runs (TRAIN_SCENARIOS), or the grader's draw: a problem of drawn features (2 to 8), data
    seed and batch (8 to 20, not a multiple of 12, so a split by batch // P loses samples on 3 or 4 ranks), 8 to 14
    steps; a drawn rank SIGKILLed in a drawn call of its gradient (2 to steps - 1), then one SIGKILLed inside a drawn
    Allreduce (2 to steps - 2) while another drawn rank enters it 0.3 s late."""
    if draw is None:
        return [
            _TrainCase(TRAIN_PROBLEM, TRAIN_STEPS, where, failures, stage) for where, failures, stage in TRAIN_SCENARIOS
        ]
    steps = draw.integer(8, 14, "steps")
    batches = [b for b in range(8, 21) if b % 12]
    batch = batches[draw.integer(0, len(batches) - 1, "batch")]
    problem = Regression(
        samples=batch
        * draw.integer(steps, steps + 5, "epoch"),  # an epoch of at least `steps`: a step's samples tell it
        features=draw.integer(2, 8, "features"),
        batch=batch,
        seed=draw.integer(0, 10**6, "data"),
    )
    drawn = (
        f"; {problem.samples} samples of {problem.features} features, a batch of {batch}, data seed {problem.seed}"
        f"{named(draw)}"
    )
    victim, call = draw.integer(0, ranks - 1, "victim"), draw.integer(2, steps - 1, "call")
    killed, stalled = (int(r) for r in draw.rng("inside").permutation(ranks)[:2])
    at = draw.integer(2, steps - 2, "collective")
    return [
        _TrainCase(problem, steps, f"SIGKILLed in its gradient (its call {call})", [Failure(victim, call)], {}, drawn),
        _TrainCase(
            problem,
            steps,
            f"SIGKILLed inside its Allreduce number {at} (while rank {stalled} enters it 0.3 s late)",
            [],
            {killed: {"kill_at": at, "kill_delay": 0.05}, stalled: {"stall_at": at, "stall": 0.3}},
            drawn,
        ),
    ]


def _step_of(ids: list[int], problem: Regression, steps: int) -> int | None:
    for step in range(steps):
        if set(ids) <= set(problem.batch_ids(step).tolist()):
            return step
    return None


def _samples_problem(result: JobResult, ranks: int, survivors: list[int], case: _TrainCase) -> str | None:
    """Which samples the committed attempt at each step lost or counted twice, or None.

    A step's committed attempt is the survivors' last one; the dead rank's call belongs to it only when the
    survivors made no more attempts at that step than it did (it died after the step completed)."""
    attempts: dict[int, dict[int, list[list[int]]]] = {}  # step -> rank -> the samples of each attempt
    for rank in range(ranks):
        for ids in result.calls.get(rank, []):
            step = _step_of(ids, case.problem, case.steps)
            if step is not None:
                attempts.setdefault(step, {}).setdefault(rank, []).append(ids)
    for step in range(case.steps):
        tries = attempts.get(step, {})
        final = max((len(tries[r]) for r in survivors if r in tries), default=0)
        used = sorted(i for r, each in tries.items() if r in survivors or len(each) >= final for i in each[-1])
        batch = sorted(case.problem.batch_ids(step).tolist())
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


def _commit_problem(result: JobResult, survivors: list[int], agrees: dict[int, int], case: _TrainCase) -> str | None:
    """A survivor that went on past a step another redid, or committed steps without Agree; or None."""
    for rank in survivors:
        steps = [_step_of(ids, case.problem, case.steps) for ids in result.calls.get(rank, [])]
        for before, after in zip(steps, steps[1:]):
            if before is not None and after is not None and after < before:
                return (
                    f"rank {rank} went on to step {before} and then came back to redo step {after}: the ranks "
                    f"disagreed on whether step {after} completed (the Allreduce finished on some ranks and failed "
                    "on others). Commit each step with ok = comm.Agree(ok), the one decision every survivor shares"
                )
    for rank in survivors:
        if agrees.get(rank, 0) < case.steps:
            return (
                f"rank {rank} called comm.Agree only {agrees.get(rank, 0)} time(s) for {case.steps} steps: a step "
                "committed without Agree lets the ranks disagree on whether it completed (a death inside the Allreduce "
                "can leave some ranks with the sum and others with an error). Commit each step with ok = comm.Agree(ok)"
            )
    return None


def _losses_problem(result: JobResult, survivors: list[int], want: list[float], steps: int) -> str | None:
    curves = {r: result.outcomes[r].value[0][0] for r in survivors}
    first = survivors[0]
    for rank in survivors:
        got = curves[rank]
        if not isinstance(got, list) or len(got) != steps:
            size = len(got) if hasattr(got, "__len__") else "?"
            return f"rank {rank} returned {type(got).__name__} of {size} items, not a list of {steps} losses"
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
    Allreduce (`TRAIN_SCENARIOS`); `timeout` is each job's deadline.
    The grader's draw: the problem (features, data, a batch that 3 or 4 ranks do not divide), the steps, which rank
    dies in which call of its gradient, and which dies inside which Allreduce while which other is late (_train_cases)."""
    ranks = 4
    draw = grading_draw(None, "train_resilient")
    for case in _train_cases(ranks, draw):
        want, _ = case.problem.one_process(case.steps)
        dead = case.dead()
        context = f"train_resilient on {ranks} ranks, {case.steps} steps, rank {min(dead)} {case.where}{case.drawn}"
        target = functools.partial(
            _train_scenario, fn=fn, failures=case.failures, stage=case.stage, problem=case.problem, steps=case.steps
        )
        result = run_job(target, ranks, timeout)
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
                _commit_problem(result, survivors, agrees, case)
                or _samples_problem(result, ranks, survivors, case)
                or _losses_problem(result, survivors, want, case.steps)
            )
        _fail(problem, context)
    passed(
        MPI.COMM_WORLD,
        "train_resilient survives a rank SIGKILLed in its gradient and one inside the Allreduce, with one process's "
        f"losses{named(draw)}",
    )


# ---------------------------------------------------------------- exercise 19.4: rebuild_shards


#: (items, dtype) of the flat buffers the check rebuilds, one after the other, in one job
REBUILD_CASES = ((13, "float32"), (11, "float64"), (3, "float64"))
#: The dtypes the grader draws flat buffers of (the lab: "in the shards' dtype", any).
REBUILD_DTYPES = ("float32", "float64", "float16", "int32", "int64")


def _flat(numel: int, dtype: str, seed: int | None) -> np.ndarray:
    """The flat buffer of a case: 1.5, 2.5, ... (the notebook's), or drawn values of the dtype from `seed`."""
    if seed is None:
        return (np.arange(numel) + 1.5).astype(dtype)
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, numel).astype(dtype)
    return (rng.standard_normal(numel) * 100).astype(dtype)


def _rebuild_scenario(
    comm: MPI.Comm, fn: Callable[..., Any], victim: int, cases: tuple[tuple[int, str], ...], seed: int | None
) -> Any:
    old_rank, old_size = comm.Get_rank(), comm.Get_size()
    buffers = []
    for i, (numel, dtype) in enumerate(cases):
        flat = _flat(numel, dtype, None if seed is None else seed + i)
        shards = [reference_reshard([flat], numel, old_size, q) for q in range(old_size)]
        buffers.append((numel, shards, shards[old_rank], shards[(old_rank + 1) % old_size]))
    if old_rank == victim:
        _kill_self()
    try:
        comm.Barrier()
    except MPI.Exception:
        pass
    survivors, _ = recover(comm, 0)
    results, refused = [], []
    for numel, shards, mine, buddy in buffers:
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


def _rebuild_cases(draw: Draw | None) -> tuple[int, int, tuple[tuple[int, str], ...], int | None]:
    """(ranks, victim, (items, dtype) of each flat buffer, data seed or None): the notebook's (4 ranks, rank 0 dies,
    REBUILD_CASES, 1.5, 2.5, ...), or the grader's draw: 3 or 4 ranks, any victim, three buffers of 1 to 40 items of
    drawn dtypes (REBUILD_DTYPES) and drawn values."""
    if draw is None:
        return 4, 0, REBUILD_CASES, None
    ranks = draw.integer(3, 4, "ranks")
    cases = tuple(
        (draw.integer(1, 40, "items", i), REBUILD_DTYPES[draw.integer(0, len(REBUILD_DTYPES) - 1, "dtype", i)])
        for i in range(3)
    )
    return ranks, draw.integer(0, ranks - 1, "victim"), cases, draw.data_seed("values")


def check_rebuild_shards(fn: Callable[..., np.ndarray], timeout: float = 60.0) -> None:
    """fn(comm, old_rank, old_size, mine, buddy, numel) -> this survivor's shard for comm's size, from the buddies.

    The grader's draw: 3 or 4 ranks, which one dies, the buffers' items (1 to 40), dtypes and values (_rebuild_cases)."""
    draw = grading_draw(None, "rebuild_shards")
    ranks, victim, cases, seed = _rebuild_cases(
        draw
    )  # the notebook's victim 0: its shard survives on rank 3, across the wrap
    target = functools.partial(_rebuild_scenario, fn=fn, victim=victim, cases=cases, seed=seed)
    result = run_job(target, ranks, timeout)
    drawn = "" if seed is None else f", values of seed {seed}{named(draw)}"
    context = f"rebuild_shards on {ranks} -> {ranks - 1} ranks, rank {victim} SIGKILLed"
    _fail(
        _job_problem(result, "rebuild_shards", timeout, "Exchange on the survivors' communicator only"), context + drawn
    )
    if missing := [r for r in range(ranks) if r != victim and r not in result.outcomes]:
        _fail(f"old ranks {missing} left no result: they died (did your code exit or kill them?)", context + drawn)
    for rank in sorted(result.outcomes):
        for (numel, dtype), (got, want, untouched, shares) in zip(cases, result.outcomes[rank].value[0]):
            problem = array_problem(got, want, "the new shard", rtol=0, atol=0)
            if problem:
                problem += (
                    f" (old rank {rank}); the dead rank's shard is the buddy copy its left neighbour "
                    f"(old rank {(victim - 1) % ranks}) holds; gather every old shard, then reshard"
                )
            elif shares:
                problem = f"old rank {rank}: the new shard shares memory with `mine` or `buddy`: return a new array"
            elif not untouched:
                problem = f"old rank {rank}: `mine` or `buddy` was changed: read them, do not write them"
            _fail(problem, f"{context}, {numel} items of {dtype}{drawn}")
    dtypes = "float32 and float64" if draw is None else " and ".join(sorted({d for _, d in cases}))
    passed(
        MPI.COMM_WORLD,
        f"rebuild_shards rebuilds every shard from the buddies and reshards {ranks} -> {ranks - 1}, {dtypes}{named(draw)}",
    )


# ---------------------------------------------------------------- exercise 19.5: simulate_goodput

GOODPUT_CASES = [  # interval, cost, mtbf, restart, work: no failures, some, many, work not a multiple of the interval
    (10.0, 1.0, 1e12, 5.0, 100.0),
    (10.0, 1.0, 50.0, 5.0, 1000.0),
    (4.0, 0.5, 8.0, 1.0, 300.0),
    (7.0, 2.0, 60.0, 0.0, 250.0),
]


def _goodput_cases(draw: Draw | None) -> list[tuple[tuple[float, float, float, float, float], list[int]]]:
    """(interval, cost, mtbf, restart, work) and the rng seeds of each case: the notebook's (seeds 0, 1, 2), or the
    grader's draw: intervals 1 to 20, costs 0 to 4, restarts 0 to 10, works of 5 to 100 intervals, the last case's
    not a multiple; no failures (mtbf 1e12), some (mtbf 5 to 20 segments) and many (2 to 4); three seeds each."""
    if draw is None:
        return [(case, [0, 1, 2]) for case in GOODPUT_CASES]
    cases = []
    for i, segments in enumerate(
        (0, draw.integer(5, 20, "some"), draw.integer(2, 4, "many"), draw.integer(3, 20, "any"))
    ):
        interval, cost = float(draw.integer(1, 20, "interval", i)), draw.integer(0, 40, "cost", i) / 10
        mtbf = 1e12 if segments == 0 else (interval + cost) * segments
        work = interval * draw.integer(5, 100, "work", i) + (
            draw.integer(1, 9, "rest", i) * interval / 10 if i == 3 else 0
        )
        seeds = [draw.integer(0, 10**6, "rng", i, k) for k in range(3)]
        cases.append(((interval, cost, mtbf, float(draw.integer(0, 10, "restart", i)), work), seeds))
    return cases


def check_simulate_goodput(fn: Callable[..., float], timeout: float = 30.0) -> None:
    """fn(interval, cost, mtbf, restart, work, rng) -> goodput, drawing failures from rng as the lab states.

    The grader's draw: the four cases' interval, cost, mtbf, restart and work, and their rng seeds (_goodput_cases)."""
    draw = grading_draw(None, "simulate_goodput")
    for (interval, cost, mtbf, restart, work), seeds in _goodput_cases(draw):
        context = f"simulate_goodput(interval={interval}, cost={cost}, mtbf={mtbf}, restart={restart}, work={work})"
        for seed in seeds:
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
                raise CheckFailed(f"{context}, rng seed {seed}{named(draw)}: returned {got!r}, expected {want!r}{hint}")
    passed(
        MPI.COMM_WORLD, f"simulate_goodput replays failures exactly as the reference draws them, 4 cases{named(draw)}"
    )
