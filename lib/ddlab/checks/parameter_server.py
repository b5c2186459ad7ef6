"""Checks for lab 10 (parameter servers): the stale-synchronous gate, the asynchronous worker, the
stale-synchronous server's loop, a gossip step.

`check_ssp_gate` first compares the student's gate with the rule on clock tables,
the empty one too (on every rank, so a stub fails everywhere), then plugs it into a real server on
every sub-communicator of two ranks or more, with a straggler, and reads the
recorded clocks: no worker released more than s steps ahead of the slowest, no
deadlock, every gradient applied exactly once.

`check_async_worker` runs the student's worker loop on ranks 1..P-1 against the
library's asynchronous server on rank 0, all through a CountingComm (timeouts, no
hang), on 2 ranks up to all. It proves exactly-once updates (each worker's step t
applied once), that each gradient was computed at the parameters the server sent
for that step and pushed as computed, with the version it was computed at, and a
clean end: every worker returns, no message is left unreceived. On 3 ranks or more the
server tells the last worker to stop (go = 0) two steps early, while the others still
run: a worker that pushes after that, or waits for more, fails.

`check_ssp_server` runs the student's stale-synchronous server on rank 0 against the
check's workers, which push in the order a seeded schedule of compute delays gives
(one transient straggler; each push matched before the next is sent), so `ssp_model`
fixes every release: the check compares when each worker was released, the version
and parameters it got, the parameter messages and their bytes, and the final
parameters, with s = 0, 1 and inf. A loop that never ends or leaves a worker waiting
fails within the timeout.

`check_gossip_step` runs the student's step through a CountingComm and compares
with the average of each rank's parameters and its left neighbour's, the input
left unchanged, and exactly one message of the parameters' bytes to the right
(on one rank: none, or one to itself).

Under the grader's draw (`ddlab.checks._draw`, `ddlab grade --seed S`) every check runs drawn
ranks in a drawn order instead of the first P, and drawn cases within what the lab's text promises
(clock tables and bounds, parameter counts, step counts, which worker stops early, learning rates,
the straggler's delays, data); each check's docstring says what it draws. A failure names the drawn
case and the seed.
"""

from __future__ import annotations

import math
import pickle
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..parameter_server import Consistency, LeastSquares, may_start, train
from ..parameter_server.messages import GRADIENT, GRADIENT_HEADER, PARAMETERS, PARAMETERS_HEADER
from ..parameter_server.replay import replay
from ..parameter_server.server import Server
from ..runtime.comm import Comm, drain
from ..runtime.counting import CountingComm
from ..runtime.waiting import PeerFailed, Stalled, Watch
from ._core import array_problem, each_size, passed, run_counted
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

BOUNDS = (0, 1, 2, 3, math.inf)
STEPS = 6


def _tables(draw: Draw | None = None) -> list[np.ndarray]:
    """The clock tables the gate is tried on: 40 random ones of 1 to 4 workers, then the empty one (no one left).

    The grader's draw: 40 of 1 to 8 workers, clocks from 0 to a drawn 6-40, from its own seed."""
    if draw is None:
        rng, workers, most = np.random.default_rng(10), 4, 6
    else:
        rng, workers, most = np.random.default_rng(draw.data_seed("tables")), 8, draw.integer(6, 40, "clocks")
    return [rng.integers(0, most, rng.integers(1, workers + 1)) for _ in range(40)] + [np.zeros(0, dtype=np.int64)]


def _bounds(draw: Draw | None) -> tuple[float, ...]:
    """The bounds s the tables are tried with: 0 to 3 and inf, or 0, three drawn of 1 to 10, and inf."""
    return BOUNDS if draw is None else (0, *draw.lengths(3, 1, 10, "bounds"), math.inf)


def _table_problem(gate: Callable[[np.ndarray, int, float], bool], draw: Draw | None = None) -> str | None:
    """The first clock table where the gate disagrees with the rule, described; or None."""
    for clocks in _tables(draw):
        for bound in _bounds(draw):
            for step in range(int(clocks.min(initial=0)), int(clocks.max(initial=0)) + 5):
                given = clocks.copy()
                try:
                    got = gate(given, step, bound)
                except NotImplementedError:  # the lab's stub: reported as not done, not as a wrong gate
                    raise
                except Exception as err:
                    table = (
                        f"clocks {clocks.tolist()}" if clocks.size else "an empty clock table (no one left to wait for)"
                    )
                    return f"on {table}, bound s = {bound}, step {step}, the gate raised {type(err).__name__}: {err}"
                want = may_start(clocks, step, bound)
                if not np.array_equal(given, clocks):
                    return (
                        f"the gate changed the clocks it was given, {clocks.tolist()} -> {given.tolist()} "
                        "(sorted or written in place?): the server's clock table is not the gate's to change"
                    )
                if not isinstance(got, (bool, np.bool_)):
                    return f"the gate should return a bool, got {type(got).__name__}"
                if bool(got) != want:
                    verdict = "let it start" if got else "made it wait"
                    return (
                        f"clocks {clocks.tolist()} (steps finished), bound s = {bound}: a worker asked to "
                        f"start step {step} and the gate {verdict}; how far ahead of the slowest would it be?"
                    )
    return None


def check_ssp_gate(gate: Callable[[np.ndarray, int, float], bool]) -> None:
    """Exercise 10.1: gate(clocks, step, bound) -> may a worker start step? On tables, then on a real server.

    The grader's draw: the clock tables (40 of 1 to 8 workers, clocks up to a drawn 6-40, and the empty
    one), three bounds of 1 to 10 beside 0 and inf; on the real server, the ranks (each set in a drawn
    order), a bound of 1 to 3 beside 0, 4 to 8 steps, the straggler and the data."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "ssp_gate")
    found = [p for p in comm.allgather(_table_problem(gate, draw)) if p]  # the same tables on every rank: say it once
    if found:
        raise CheckFailed(f"check_ssp_gate on clock tables: {found[0]}{named(draw)}")
    if draw is None:
        problem, bounds, steps, seed = LeastSquares(n=6, samples=64, batch=4), (0, 2), STEPS, 0
    else:
        problem = LeastSquares(n=6, samples=64, batch=4, seed=draw.data_seed("problem"))
        bounds, steps, seed = (0, draw.integer(1, 3, "bound")), draw.integer(4, 8, "steps"), draw.data_seed("slow")
    case = "" if draw is None else f", {steps} steps, straggler seed {seed}, data seed {problem.seed}{named(draw)}"

    def body(sub: MPI.Comm) -> str | None:
        for bound in bounds:
            record = train(
                sub, f"ssp{bound}", problem, steps, gate=gate, compute=0.002, straggler=3.0, seed=seed, timeout=10.0
            )
            log = record.servers[0]
            if log.problem:
                return f"with s = {bound}{case} the server stopped: {log.problem}"
            ahead = [(w, step, slow) for w, step, slow in log.releases if step - slow > bound]
            if ahead:
                w, step, slow = ahead[0]
                return (
                    f"with s = {bound}{case}, rank {w} was let start step {step} while the slowest had finished {slow}"
                )
            if any(count != 1 for count in log.applied.values()) or len(log.applied) != (sub.size - 1) * steps:
                return f"with s = {bound}{case}, not every gradient was applied exactly once"
        return None

    each_size(comm, body, "check_ssp_gate on a real server", sizes=range(2, comm.Get_size() + 1), draw=draw)
    passed(
        comm, f"the gate keeps every worker within s steps of the slowest, and never blocks for nothing{named(draw)}"
    )


Worker = Callable[[Comm, int, Callable[[np.ndarray, int], np.ndarray], int], None]
GRADIENT_FORMAT = (
    f"is the gradient message float64, {GRADIENT_HEADER} header values [your rank, step, version, more] "
    "then the n gradient entries?"
)


def _explained(err: CheckFailed, cause: str) -> CheckFailed:
    """err with the protocol's tags named and, if a rank waited in vain, the likely cause appended."""
    text = str(err)
    for tag, name in ((GRADIENT, "GRADIENT"), (PARAMETERS, "PARAMETERS")):
        text = text.replace(f"(tag {tag})", f"(tag {name})")
    return CheckFailed(f"{text}\nlikely cause: {cause}" if "Stalled" in text else text)


class _RecordingServer(Server):
    """The asynchronous server, remembering what it sent each worker and what it applied.

    It tells the workers in `halt` to stop (go = 0) instead of sending the parameters of
    step halt[worker], and takes nothing more from them."""

    def __init__(
        self, comm: CountingComm, params: np.ndarray, workers: list[int], halt: dict[int, int], steps: int = STEPS
    ):
        super().__init__(comm, params, workers, steps, 0.05, Consistency.parse("async"), comm.watch)
        self.halt = halt
        self.sent: dict[int, list[tuple[int, np.ndarray]]] = defaultdict(list)  # worker -> (version, params)
        self.got: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # (worker, step) -> (version, gradient)

    def send_parameters(self, worker: int, go: bool) -> None:
        if go and self.clock[worker] == self.halt.get(worker):
            go = False
            self.running.discard(worker)
        if go:
            self.sent[worker].append((self.version, self.params.copy()))
        super().send_parameters(worker, go)

    def receive(self) -> tuple[int, int, int, bool, np.ndarray]:
        try:
            worker, step, version, more, grad = super().receive()
        except (ValueError, OverflowError) as err:  # a NaN or infinite header value
            raise RuntimeError(f"rank 0 could not read a gradient's header ({err}): {GRADIENT_FORMAT}") from None
        if worker not in self.clock or not 0 <= version <= self.version:
            raise RuntimeError(
                f"rank 0 read a gradient from worker {worker} computed at version {version} (workers are "
                f"{self.workers}, {self.version} updates applied so far): {GRADIENT_FORMAT}"
            )
        if worker in self.halt and step >= self.halt[worker]:
            raise RuntimeError(
                f"rank {worker} pushed step {step} after the server sent it go = 0: a worker told to stop must stop"
            )
        return worker, step, version, more, grad

    def apply(self, worker: int, step: int, version: int, grad: np.ndarray) -> None:
        self.got[worker, step] = (version, grad.copy())
        super().apply(worker, step, version, grad)


def _worker_problem(
    server: _RecordingServer | None, calls: list[tuple[int, np.ndarray, np.ndarray]], sub: MPI.Comm, planned: int
) -> str | None:
    """Compare what this worker's gradient was called with (and returned) with what the server sent and applied."""
    rank = sub.Get_rank()
    sent, got, applied, halt = sub.bcast((server.sent, server.got, server.log.applied, server.halt) if server else None)
    if rank == 0:
        return None
    steps = halt.get(rank, planned)
    if [step for step, _, _ in calls] != list(range(steps)):
        stop = f" (the server sent go = 0 for step {steps}: stop when told to)" if steps < planned else ""
        return (
            f"called gradient for steps {[step for step, _, _ in calls]}, expected {list(range(steps))} "
            f"(once per step, in order){stop}"
        )
    wrong = [t for (t, params, _), (_, want) in zip(calls, sent[rank]) if not np.array_equal(params, want)]
    if len(sent[rank]) != steps or wrong:
        return (
            f"computed the gradient of step {wrong[0] if wrong else len(sent[rank])} at parameters other than "
            "the ones the server sent for that step: receive fresh parameters before every step"
        )
    counts = Counter({step: applied[rank, step] for step in range(steps)})
    if any(count != 1 for count in counts.values()):
        return f"the server applied steps {sorted(counts.items())} (step, times): each step's gradient once"
    for (step, _, grad), (version, _) in zip(calls, sent[rank]):
        pushed_version, pushed = got[rank, step]
        if not np.array_equal(pushed, grad):
            return f"pushed a gradient for step {step} that is not what gradient(params, {step}) returned"
        if pushed_version != version:
            return f"pushed step {step} as computed at version {pushed_version}, but it pulled version {version}"
    return None


def _async_case(size: int, draw: Draw | None) -> tuple[LeastSquares, int, dict[int, int], str]:
    """(problem, steps, halt, its description) on `size` ranks: the notebook's (5 parameters, STEPS steps, the last
    worker told to stop two steps early on 3 ranks or more), or drawn: 1 to 12 parameters, 2 to 8 steps, the
    data, and on 3 ranks or more a drawn worker told to stop before a drawn step (0 to steps - 1)."""
    if draw is None:
        return LeastSquares(n=5, samples=64, batch=4), STEPS, {size - 1: STEPS - 2} if size > 2 else {}, ""
    problem = LeastSquares(n=draw.integer(1, 12, "n", size), samples=64, batch=4, seed=draw.data_seed("data", size))
    steps = draw.integer(2, 8, "steps", size)
    halt = {draw.integer(1, size - 1, "halted", size): draw.integer(0, steps - 1, "halt", size)} if size > 2 else {}
    stops = "".join(f", rank {w} told to stop before its step {t}" for w, t in halt.items())
    return (
        problem,
        steps,
        halt,
        f" ({problem.n} parameters, {steps} steps{stops}, data seed {problem.seed}{named(draw)})",
    )


def check_async_worker(async_worker: Worker) -> None:
    """Exercise 10.2: async_worker(comm, n, gradient, steps) against an asynchronous server on rank 0.

    The grader's draw: the ranks (each set in a drawn order, its first the server), and per size 1 to 12
    parameters, 2 to 8 steps, the data, and on 3 ranks or more which worker the server tells to stop
    (go = 0) and before which of its steps."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "async_worker")

    def roles(
        counting: CountingComm, problem: LeastSquares, steps: int, halt: dict[int, int]
    ) -> _RecordingServer | None:
        """Rank 0 serves, the others run the student's loop (a stub's notice stops the server at once,
        and run_counted reports the stub on every rank)."""
        rank, size = counting.Get_rank(), counting.Get_size()
        if rank == 0:
            server = _RecordingServer(counting, problem.start(), list(range(1, size)), halt, steps)
            server.serve()
            if server.log.problem:
                raise RuntimeError(f"the server on rank 0 stopped: {server.log.problem}")
            return server

        def gradient(params: np.ndarray, step: int) -> np.ndarray:
            grad = problem.gradient(params, rank, step)
            calls.append((step, np.array(params, dtype=float), grad.copy()))
            return grad

        try:
            async_worker(counting, problem.n, gradient, steps)
        except pickle.UnpicklingError as err:
            raise RuntimeError(
                f"rank {rank} could not unpickle the server's parameters ({err}): the server sends float64 "
                "arrays with the buffer API (Send), which the object API's recv cannot read; receive them "
                "into a float64 array with Recv or Irecv"
            ) from None
        return None

    def body(sub: MPI.Comm) -> str | None:
        calls.clear()
        problem, steps, halt, case = _async_case(sub.Get_size(), draw)
        try:
            server, traffic = run_counted(sub, roles, (problem, steps, halt), f"async_worker{case}", timeout=5.0)
        except CheckFailed as err:
            raise _explained(
                err,
                "did every step push its gradient, and did your last gradient say more = 0? After a "
                "gradient with more = 1 the server waits for another one.",
            ) from None
        leftover = traffic[sub.Get_rank()].unreceived
        problem_found = _worker_problem(server, calls, sub, steps)  # a collective: every rank calls it
        if leftover:
            return (
                f"messages (source, tag) {leftover} were never received{case}: every parameter message the server "
                "sends must be received, every gradient sent once"
            )
        return problem_found and problem_found + case

    calls: list[tuple[int, np.ndarray, np.ndarray]] = []
    each_size(comm, body, "check_async_worker", sizes=range(2, comm.Get_size() + 1), draw=draw)
    passed(
        comm, f"every step pulled, computed at the parameters pulled, pushed once; the loop ends cleanly{named(draw)}"
    )


Serve = Callable[[Comm, np.ndarray, int, float, float], np.ndarray]
SSP_BOUNDS = (0, 1, math.inf)
SSP_STEPS, SSP_LR, TOKEN = 5, 0.05, 7
Model = tuple[list[tuple[int, int]], dict[tuple[int, int], int], list[np.ndarray]]


def ssp_model(problem: LeastSquares, workers: int, steps: int, bound: float, lr: float, seed: int) -> Model:
    """What a stale-synchronous server prescribes when worker k's step t computes for a seeded delay.

    Replays the run on a clock (`replay`): one worker's step is six times slower (a transient
    straggler). Returns the order the gradients arrive in, as (worker, step); for each
    (worker, step) the number of updates applied when the gate released it; and the
    parameters after each update (each gradient applied on arrival, rate lr / workers).
    """
    rng = np.random.default_rng(seed)
    delay = rng.uniform(1.0, 2.0, (workers, steps))
    delay[rng.integers(workers), rng.integers(steps)] *= 6
    run = replay(problem, delay, bound, lr)
    return run.order, run.released, run.history


def _await_token(side: MPI.Comm, source: int, watch: Watch) -> None:
    """Wait (under the watch) for the previous pusher's go-ahead on the check's own communicator."""
    request = side.Irecv(np.empty(1, dtype=np.int64), source, TOKEN)
    try:
        watch.poll(request.Test, f"rank {source} to push its gradient (it waits for the server's parameters)")
    except (Stalled, PeerFailed):
        if request != MPI.REQUEST_NULL:  # still open (a request the watch gave up is complete already)
            request.Cancel()
            request.Wait()
        raise


def _sequenced_worker(
    comm: CountingComm, side: MPI.Comm, order: list[tuple[int, int]], problem: LeastSquares, steps: int
) -> list[tuple[int, float, np.ndarray]]:
    """The check's worker: pushes in the model's order, each push received before the next is sent.

    The gradient goes by synchronous send, so it is complete once the server has matched it;
    only then is the next pusher told to go. Returns (step, version, parameters) as received.
    """
    rank, n = comm.Get_rank(), problem.n
    got: list[tuple[int, float, np.ndarray]] = []
    incoming = np.full(PARAMETERS_HEADER + n, np.nan)
    request = comm.Irecv(incoming, 0, PARAMETERS)
    tokens = []
    for i, (k, step) in enumerate(order):
        if k + 1 != rank:
            continue
        if i > 0 and order[i - 1][0] + 1 != rank:
            _await_token(side, order[i - 1][0] + 1, comm.watch)
        request.Wait()
        comm.watch.check(f"the parameters of step {step} from rank 0")  # a cancelled wait raises here
        version, go = incoming[:PARAMETERS_HEADER]
        if go != 1:
            raise RuntimeError(
                f"the server sent rank {rank} go = {go} for its step {step}: send go = 1 to a worker it releases"
            )
        got.append((step, float(version), incoming[PARAMETERS_HEADER:].copy()))
        grad = problem.gradient(got[-1][2], k, step)
        more = step < steps - 1
        if more:
            incoming = np.full(PARAMETERS_HEADER + n, np.nan)
            request = comm.Irecv(incoming, 0, PARAMETERS)
        comm.Issend(np.concatenate([[rank, step, version, float(more)], grad]), 0, GRADIENT).Wait()
        comm.watch.check(f"rank 0 to receive the gradient of step {step}")
        if i + 1 < len(order) and order[i + 1][0] + 1 != rank:
            token = np.array([i], dtype=np.int64)
            tokens.append((side.Isend(token, order[i + 1][0] + 1, TOKEN), token))
    comm.watch.poll(lambda: all(r.Test() for r, _ in tokens), "the next pushers to take their go-ahead")
    return got


def _release_problem(
    rank: int, step: int, version: float, want: int, order: list[tuple[int, int]], steps: int, bound: float
) -> str:
    """Why the server's release of (rank, step) at `version` updates is wrong (version != want)."""
    if version != int(version) or not 0 <= version <= len(order):
        return f"sent rank {rank} version {version} for its step {step}: the version counts the updates applied"
    clocks = Counter(k for k, _ in order[: int(version)])
    running = [clocks[k] for k in range(max(k for k, _ in order) + 1) if clocks[k] < steps]
    if version < want:
        return (
            f"released rank {rank} for step {step} after {int(version)} updates, when the slowest running worker "
            f"had finished {min(running)} steps: {step - min(running)} ahead with s = {bound}"
        )
    return (
        f"released rank {rank} for step {step} only after {int(version)} updates; the gate let it start after "
        f"{want}: after each gradient, release every waiting worker the gate lets go"
    )


def _ssp_problem(
    model: Model,
    given: np.ndarray,
    result: object,
    got: list,
    sends: list[tuple[int, int, int]],
    bound: float,
    steps: int = SSP_STEPS,
) -> str | None:
    """Rank 0's verdict on one run: releases, parameters sent, messages, the final parameters."""
    order, released, history = model
    start, n = history[0], len(history[0])
    if not np.array_equal(given, start):
        return "changed the params it was given: copy them and update the copy"
    records = sorted(
        (version, rank, step, params) for rank, mine in enumerate(got[1:], 1) for step, version, params in mine
    )
    for version, rank, step, _ in records:  # the earliest wrong release first: later parameters follow from it
        if version != released[rank - 1, step]:
            return _release_problem(rank, step, version, released[rank - 1, step], order, steps, bound)
    for version, rank, step, params in records:
        if not np.allclose(params, history[int(version)], rtol=1e-10, atol=1e-12):
            return (
                f"sent rank {rank} for step {step} parameters other than those after its {int(version)} updates: "
                f"apply each gradient on arrival as params -= lr / workers * gradient"
            )
    want_sends = sorted((k + 1, PARAMETERS, 8 * (PARAMETERS_HEADER + n)) for k, _ in released)
    if sorted(sends) != want_sends:
        return (
            f"sent (rank, tag, bytes) {sorted(sends)}, expected one [version, go] + parameters message per step "
            f"and worker: {want_sends}"
        )
    return array_problem(result, history[-1], "the parameters it returned", rtol=1e-10, atol=1e-12)


@dataclass(frozen=True)
class SspCase:
    """What check_ssp_server runs: the problem, steps per worker, learning rate, bounds, the delays' seed (None:
    the notebook's, by workers and bound), and the grader's draw that made it (None: the notebook's case)."""

    problem: LeastSquares
    steps: int = SSP_STEPS
    lr: float = SSP_LR
    bounds: tuple[float, ...] = SSP_BOUNDS
    seed: int | None = None
    draw: Draw | None = None

    def delays_seed(self, workers: int, bound: float) -> int:
        """The seed of the compute delays of a run with `workers` workers and bound s."""
        if self.seed is None:
            return 10 * workers + int(min(bound, 9))
        return self.seed + 10 * workers + int(min(bound, 9))

    def __str__(self) -> str:
        if self.draw is None:
            return ""
        return (
            f" ({self.problem.n} parameters, {self.steps} steps, lr {self.lr}, delays of seed {self.seed}, "
            f"data seed {self.problem.seed}{named(self.draw)})"
        )


def _ssp_case(draw: Draw | None) -> SspCase:
    """The notebook's case, or the grader's: 1 to 12 parameters, 3 to 6 steps, a learning rate of 0.01 to 0.1,
    bounds 0, one of 1 to 3 and inf, the delays (so the order the workers push in) and the data."""
    if draw is None:
        return SspCase(LeastSquares(n=5, samples=64, batch=4))
    problem = LeastSquares(n=draw.integer(1, 12, "n"), samples=64, batch=4, seed=draw.data_seed("data"))
    return SspCase(
        problem,
        draw.integer(3, 6, "steps"),
        draw.integer(1, 10, "lr") / 100,
        (0, draw.integer(1, 3, "bound"), math.inf),
        draw.data_seed("delays") % 10**6,
        draw,
    )


def check_ssp_server(ssp_server: Serve, timeout: float = 5.0) -> None:
    """Exercise 10.3: ssp_server(comm, params, steps, bound, lr) on rank 0 against workers on the other ranks.

    The check's workers push in the order a seeded schedule of compute delays gives
    (one transient straggler), one push matched before the next is sent, so the model
    prescribes every release (`ssp_model`). For s = 0, 1 and inf, with two workers and with all
    ranks (one worker on two ranks), it
    compares: when each worker was released (never beyond the bound, never later than
    the gate allows), the version and parameters it got, one parameter message of
    2 + n float64 per step and worker, the final parameters, and the input unchanged.
    A server that never ends or leaves a worker waiting fails within `timeout` seconds.

    The grader's draw: the ranks (all of them, and a drawn 2 to P - 1 of them, each set in a drawn order,
    its first the server), 1 to 12 parameters, 3 to 6 steps, a learning rate of 0.01 to 0.1, the bounds
    0, one of 1 to 3 and inf, the delays (so the order of the pushes) and the data.
    """
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "ssp_server")
    case = _ssp_case(draw)
    problem, steps, lr = case.problem, case.steps, case.lr

    def one_run(sub: MPI.Comm, bound: float) -> str | None:
        workers = sub.Get_size() - 1
        model = ssp_model(problem, workers, steps, bound, lr, seed=case.delays_seed(workers, bound))
        side = sub.Dup()

        def roles(counting: CountingComm) -> object:
            """Rank 0 runs the student's server, the others the check's workers (a stub: see run_counted)."""
            if counting.Get_rank() == 0:
                given = problem.start()
                return given, ssp_server(counting, given, steps, bound, lr)
            return _sequenced_worker(counting, side, model[0], problem, steps)

        try:
            result, traffic = run_counted(sub, roles, (), f"ssp_server with s = {bound}{case}", timeout=timeout)
        except CheckFailed as err:  # a failed run may leave a go-ahead unreceived: take it, lest a later Dup meet it
            drain(side, timeout)
            raise _explained(
                err,
                "a worker waiting for its PARAMETERS: after each gradient, re-check every waiting worker "
                "against the gate, not only the one that pushed; rank 0 waiting for a GRADIENT: stop once every "
                "worker has sent its last one (more = 0).",
            ) from None
        except BaseException:
            drain(side, timeout)
            raise
        finally:
            side.Free()
        leftover = traffic[sub.Get_rank()].unreceived
        got = sub.gather(result, root=0)
        problem_found = None
        if got is not None:  # rank 0
            given, returned = result
            sends = [(e.peer, e.tag, e.nbytes) for e in traffic[0].sends]
            problem_found = _ssp_problem(model, given, returned, got, sends, bound, steps)
        if leftover:
            problem_found = (
                f"messages (source, tag) {leftover} reached rank {sub.Get_rank()} and were never received: "
                "send parameters only to a worker that will pull them (not after its last gradient)"
            )
        found = sub.allgather(problem_found)
        return next((f"with s = {bound}{case}: {p}" for p in found if p), None)

    def body(sub: MPI.Comm) -> str | None:
        for bound in case.bounds:
            found = one_run(sub, bound)
            if found:
                return found if sub.Get_rank() == 0 else None
        return None

    size = comm.Get_size()
    sizes = sorted({min(3, size), size} if draw is None else {draw.integer(2, max(2, size - 1), "size"), size})
    each_size(comm, body, "check_ssp_server", sizes=sizes, draw=draw)
    passed(
        comm,
        f"the server releases each worker exactly when the bound allows and applies every gradient once{named(draw)}",
    )


def check_gossip_step(gossip_step: Callable[[MPI.Comm, np.ndarray], np.ndarray]) -> None:
    """Exercise 10.4: gossip_step(comm, params) -> mean of params and the left neighbour's, one message sent.

    The grader's draw: the ranks (each set in a drawn order), and per size the parameters' length (1 to 64
    float64) and values."""
    comm = MPI.COMM_WORLD
    draw = grading_draw(comm, "gossip_step")

    def body(sub: MPI.Comm) -> str | None:
        rank, size = sub.Get_rank(), sub.Get_size()
        if draw is None:
            n, seed, case = 7, 3, ""
        else:
            n, seed = draw.integer(1, 64, "n", size), draw.data_seed("params", size)
            case = f" ({n} float64 parameters, data seed {seed}{named(draw)})"
        params = np.random.default_rng([seed, rank]).standard_normal(n)
        given = params.copy()
        result, traffic = run_counted(sub, gossip_step, (params,), f"gossip_step{case}", timeout=5.0)
        left = sub.allgather(given)[(rank - 1) % size]
        problem = array_problem(result, (given + left) / 2, "the result")
        if problem:
            return problem + case
        if not np.array_equal(params, given):
            return f"changed its input params{case}: return a new array and leave params as it was"
        if result is params or np.shares_memory(result, params):
            return f"returned (a view of) its input params{case}: return a new array"
        sends = traffic[rank].sends
        want = [((rank + 1) % size, params.nbytes)]
        if [(e.peer, e.nbytes) for e in sends] not in ([want, []] if size == 1 else [want]):
            return (
                f"sent {[(e.peer, e.nbytes) for e in sends]} (rank, bytes){case}, expected {want}: one message with "
                "the parameters to the right neighbour, sent with the buffer API (Sendrecv, or Send/Isend and Recv); "
                "the object API (sendrecv, send) sends a pickle, counted with its own bytes"
            )
        return None

    each_size(comm, body, "check_gossip_step", draw=draw)
    passed(comm, f"one gossip step averages with the left neighbour, one message per rank{named(draw)}")


__all__ = ["CheckFailed", "check_async_worker", "check_gossip_step", "check_ssp_gate", "check_ssp_server"]
