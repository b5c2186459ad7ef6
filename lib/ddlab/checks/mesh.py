"""Checks for lab 16: the mesh's coordinates and sub-communicators (exercise 16.1), the mesh trainer
assembled from earlier labs' parts (16.2) and the interleaved 1F1B schedule (16.3).

The student's `split_mesh(comm, sizes)` runs on the first P ranks for P = 1 .. world size,
on every layout of P ranks over the four dimensions, through a counting communicator that
offers Split, Dup, Create_cart and a grid's Sub, each entered by every rank under the
check's deadline (a rank that never calls it fails the check instead of hanging it).
"""

from __future__ import annotations

import copy
import math
from typing import Any, cast

import torch
from mpi4py import MPI
from torch import nn

from ..mesh.layout import DIMS, Mesh, SplitMesh, coordinates, layouts
from ..pipeline.interleaved import (
    Interleaved,
    chunk_in_flight,
    interleaved_bubble,
    run_interleaved,
    simulate_interleaved,
    virtual_stage,
    warmup_forwards,
)
from ..pipeline.schedules import bubble
from ..runtime.counting import ALLOWABLE, CountingComm, MismatchedCollective, underlying
from ._core import count, deadline, each_size, fail_together, fail_together_once, passed, run_counted
from ._draw import Draw, grading_draw, named
from .errors import CheckFailed

TIMEOUT = 10.0
#: The communicator constructors the check's communicator offers; the ranks must call the same one.
CALLS = ("Split", "Dup", "Create_cart", "Sub")


class _MeshComm(CountingComm):
    """The check's communicator: the counting one, with Create_cart and a grid's Sub besides Split and Dup."""

    def _same_call(self, name: str) -> None:
        codes = self.agree(CALLS.index(name), f"{name} to be called on every rank")
        if len(set(codes)) > 1:
            calls = ", ".join(f"rank {rank} {CALLS[code]}" for rank, code in enumerate(codes))
            raise MismatchedCollective(
                f"the ranks called different collectives at the same point ({calls}): every "
                "rank must make the same collective calls, in the same order"
            )

    def Create_cart(self, dims: Any, periods: Any = None, reorder: bool = False) -> Any:
        self._same_call("Create_cart")
        return _MeshComm(cast(MPI.Intracomm, self.comm).Create_cart(dims, periods, reorder), self.timeout, parent=self)

    def Sub(self, remain_dims: Any) -> Any:
        self._same_call("Sub")
        return _MeshComm(cast(MPI.Cartcomm, self.comm).Sub(remain_dims), self.timeout, parent=self)


def _run(sub: MPI.Comm, fn: SplitMesh, cases: list[dict[str, int]], timeout: float) -> list[tuple[Any, str | None]]:
    """fn(comm, sizes) on sub's ranks for each sizes in turn: (its result, None), or (None, the ValueError's text)."""

    def call(counting: CountingComm) -> list[tuple[Any, str | None]]:
        comm = cast(MPI.Comm, _MeshComm(counting.comm, timeout, parent=counting))  # what the student's code calls
        out: list[tuple[Any, str | None]] = []
        for sizes in cases:
            try:
                out.append((fn(comm, dict(sizes)), None))
            except ValueError as err:
                out.append((None, str(err)))
        return out

    results, _ = run_counted(sub, call, (), f"split_mesh on {sub.Get_size()} ranks", timeout=timeout)
    return results


def _communicators(result: Any) -> list[MPI.Comm]:
    """The real communicators among what fn returned (to free them)."""
    comms = result[1] if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict) else {}
    found: list[MPI.Comm] = []
    for value in comms.values():
        raw = underlying(value) if isinstance(value, (CountingComm, MPI.Comm)) else None
        if isinstance(raw, MPI.Comm) and raw != MPI.COMM_NULL and all(raw is not f for f in found):
            found.append(raw)
    return found


def _shape_problem(result: Any, sizes: dict[str, int], rank: int) -> str | None:
    if not (isinstance(result, tuple) and len(result) == 2):
        return f"should return (coords, comms), got {type(result).__name__}"
    coords, comms = result
    if not isinstance(coords, dict) or set(coords) != set(DIMS):
        return f"coords should be a dict with the keys {DIMS}, got {coords!r}"
    if not isinstance(comms, dict) or set(comms) != set(DIMS):
        return f"comms should be a dict with the keys {DIMS}, got {comms!r}"
    want = coordinates(rank, sizes)
    if {name: coords[name] for name in DIMS} != want or not all(type(v) is int for v in coords.values()):
        return (
            f"coords are {coords}, expected {want} (ints; ranks numbered row-major over {DIMS}, "
            "tensor fastest, pipeline slowest)"
        )
    for name in DIMS:
        raw = underlying(comms[name]) if isinstance(comms[name], (CountingComm, MPI.Comm)) else None
        if not isinstance(raw, MPI.Intracomm) or raw == MPI.COMM_NULL:
            return f"comms[{name!r}] should be a communicator, got {type(comms[name]).__name__}"
        if not isinstance(comms[name], CountingComm):  # every communicator made from comm is one
            return (
                f"comms[{name!r}] was not made from the communicator passed in: split `comm`, not MPI.COMM_WORLD "
                "(the check also runs split_mesh on fewer ranks than the world, where a split of MPI.COMM_WORLD "
                "would wait forever for the others)"
            )
    return None


def _group_problem(sub: MPI.Comm, comms: dict[str, Any], sizes: dict[str, int], coords: dict[str, int]) -> str | None:
    """The first thing wrong with this rank's groups; every group is gathered (all its members call it)."""
    rank, problems = sub.Get_rank(), []
    everyone = [coordinates(r, sizes) for r in range(sub.Get_size())]
    for name in DIMS:
        raw = underlying(comms[name])
        members = raw.allgather(rank)
        want = [r for r, c in enumerate(everyone) if all(c[o] == coords[o] for o in DIMS if o != name)]
        if members != want:
            problems.append(
                f"comms[{name!r}] holds ranks {members} in that order, expected {want}: the ranks that "
                f"differ from this one only in the {name} coordinate, ranked by it"
            )
        elif raw == sub:
            problems.append(f"comms[{name!r}] is the communicator passed in: return a new one (the caller frees it)")
    return problems[0] if problems else None


def _layout_problem(sub: MPI.Comm, sizes: dict[str, int], result: Any, refused: str | None) -> None:
    shown = " x ".join(f"{sizes[name]} {name}" for name in DIMS)
    problem = f"raised ValueError on valid sizes {shown}: {refused}" if refused is not None else None
    problem = problem or _shape_problem(result, sizes, sub.Get_rank())
    fail_together(sub, problem, f"split_mesh is wrong for {shown}")
    problem = _group_problem(sub, result[1], sizes, result[0])
    fail_together(sub, problem, f"split_mesh's communicators are wrong for {shown}")


def _wrong_sizes(size: int, draw: Draw | None) -> dict[str, int]:
    """Sizes whose product is not `size`: the notebook's size + 1 ranks of data, or the grader's, a layout of a
    drawn other count from 1 to 2 size + 1 (fewer ranks than comm's, or more) over the four dimensions."""
    if draw is None:
        return {**dict.fromkeys(DIMS, 1), "data": size + 1}
    other = draw.choose([n for n in range(1, 2 * size + 2) if n != size], 1, "wrong", size)[0]
    return draw.choose(layouts(other, DIMS), 1, "wrong layout", size)[0]


def check_split_mesh(fn: SplitMesh, timeout: float = TIMEOUT) -> None:
    """fn(comm, sizes) -> (coords, comms), as ddlab.mesh.split_mesh (exercise 16.1's signature).

    timeout: seconds a rank waits for the others at each collective call before the check fails.
    The grader's draw: the same rank counts and every layout of each, but the ranks of each count drawn from
    the world's in a drawn order, and the sizes to refuse a layout of another drawn count (fewer or more ranks)."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "split_mesh")

    def body(sub: MPI.Comm) -> str | None:
        size = sub.Get_size()
        valid = layouts(size, DIMS)
        wrong = _wrong_sizes(size, draw)
        results = _run(sub, fn, [*valid, wrong], timeout)
        try:
            for sizes, (result, refused) in zip(valid, results):
                _layout_problem(sub, sizes, result, refused)  # each_size names the drawn ranks
        finally:
            for result, _ in results:
                for raw in _communicators(result):
                    if raw != sub:
                        raw.Free()
        if results[-1][1] is None:
            product = math.prod(wrong.values())
            return f"accepted sizes {wrong} whose product {product} is not the {size} ranks: raise ValueError saying so"
        return None

    # The world's size first: an answer splitting MPI.COMM_WORLD completes there, and is seen to.
    each_size(world, body, "split_mesh is wrong", sizes=[world.Get_size(), *range(1, world.Get_size())], draw=draw)
    passed(
        world,
        "split_mesh: every layout's coordinates and its four sub-communicators are right, and sizes "
        f"that do not multiply to the ranks are refused{named(draw)}",
    )


# Exercise 16.2: the mesh trainer assembled from labs 07, 13, 14 and 15's parts ---------------------------
#: (data, tensor, pipeline, context, micro-batches, zero, sequence parallelism) on 4 ranks: a pipeline beside data,
#: sequence parallelism beside a pipeline, ZeRO-1 over data x context, and context with
#: sequence parallelism; on other world sizes pure data, tensor (with and without sequence parallelism), pipeline.
TRAINER_CASES = {
    4: [
        (2, 1, 2, 1, 2, 0, False),
        (1, 2, 2, 1, 2, 0, True),
        (2, 1, 1, 2, 1, 1, False),
        (1, 2, 1, 2, 1, 0, True),
    ],
}
#: Steps per case: step 3's loss is the first that gradients never zeroed change (step 2's update then adds
#: step 1's gradients to its own; the losses of steps 1 and 2 come before it).
TRAINER_STEPS = 3
#: The split case: the k-th mesh's batches are the sampler's from step k x SPLIT_OFFSET on, unlike the others'.
SPLIT_OFFSET = 100
#: Seconds a rank of the trainer waits at any one call (a message, a collective) before the check fails.
TRAINER_TIMEOUT = 20.0
#: The MPI collectives the trainer's communicators offer, each under the deadline (what the library's parts
#: and the loss's average and broadcast use); any other is refused, as exercise 16.2's text says.
TRAINER_COLLECTIVES = tuple(name for name in ALLOWABLE if not name.startswith("Alltoall"))
TRAINER_HINT = (
    "A rank waited in vain: the ranks of a communicator must make the same collective calls in the same "
    "order. Is a call made on some ranks only (the loss's broadcast left out on the last stage?), or over "
    "another communicator on some ranks (mesh.data on some, mesh.replicas on others)?"
)
ZERO_GRAD_HINT = (
    "the first {same} steps' losses are one process's and step {step}'s is not: are the gradients zeroed "
    "before every step's backward (optimizer.zero_grad())? Gradients left from step 1 first change step 2's "
    "update, which step 3's loss shows"
)
SPLIT_HINT = (
    "In this case every mesh spans {ranks} of the world's {world}, and each trains on batches of its own, "
    "all at the same time (the layouts before it spanned the whole world). A loss or a "
    "gradient averaged, summed or broadcast over MPI.COMM_WORLD (the notebook's `comm`) mixes in the other "
    "meshes' ranks: use the mesh's communicators, mesh.replicas for the loss's mean and the gradients, "
    "mesh.pipeline for the loss's broadcast, and their sizes and ranks"
)

Case = tuple[int, int, int, int, int, int, bool]


def _trainer_cases(world: int) -> list[Case]:
    if world in TRAINER_CASES:
        return TRAINER_CASES[world]
    return [(world, 1, 1, 1, 1, 0, False), (1, world, 1, 1, 1, 0, True), (1, 1, world, 1, 2, 0, False)]


def _split_case(world: int) -> tuple[int, Case] | None:
    """(ranks per mesh, its case) of the case whose meshes span part of the world: half of an even world, one
    rank of an odd one, every mesh pure data parallelism (the ranks of every mesh make the same calls, so an
    answer calling MPI.COMM_WORLD's collectives completes, and mixes the meshes); None on one rank."""
    if world == 1:
        return None
    ranks = world // 2 if world % 2 == 0 else 1
    return ranks, (ranks, 1, 1, 1, 1, 0, False)


def _described(case: Case) -> str:
    data, tensor, pipeline, context, micro, zero, sp = case
    what = f"{data} data x {tensor} tensor x {pipeline} pipeline x {context} context"
    return (
        what
        + f", {micro} micro-batch"
        + "es" * (micro != 1)
        + (f", ZeRO-{zero}" if zero else "")
        + (", sequence parallel" if sp else "")
    )


class TrainerPlan:
    """What check_mesh_trainer runs: the world's ranks in some order, the layouts, the batch and its sampler's seed.

    The notebook's: the world in its order, TRAINER_CASES (or `_trainer_cases`), 12 samples of seed 0. The grader's
    (`draw`): the world's ranks in a drawn order, the notebook's layouts (each there for a class of mistake) with
    drawn micro-batches (1 to 3; 2 or 3 where the notebook's are 2) and ZeRO stage (1 to 3 where the notebook's
    uses ZeRO), a batch a drawn multiple (up to 16) of every case's data ranks x micro-batches, of a drawn seed."""

    def __init__(self, size: int, draw: Draw | None = None) -> None:
        self.draw = draw
        self.split = _split_case(size)
        self.order, self.cases, self.batch, self.seed = list(range(size)), _trainer_cases(size), 12, 0
        if draw is None:
            return
        self.order = draw.ranks(size, size)
        self.cases = [
            (
                data,
                tensor,
                pipeline,
                context,
                draw.integer(min(micro, 2), 3, "micro", i),
                zero and draw.integer(1, 3, "zero", i),
                sp,
            )
            for i, (data, tensor, pipeline, context, micro, zero, sp) in enumerate(self.cases)
        ]
        ways = math.lcm(*(case[0] * case[4] for case in self.cases), self.split[0] if self.split else 1)
        self.batch = ways * draw.integer(1, max(1, 16 // ways), "batch")
        self.seed = draw.data_seed("batches") % 10**6

    def __str__(self) -> str:
        """' (batches of B samples of seed S, the world's ranks in the order ...; the grader's draw, seed S)' or ''."""
        if self.draw is None:
            return ""
        order = ", ".join(map(str, self.order))
        return f" (batches of {self.batch} samples of seed {self.seed}, the world's ranks in the order {order}; {self.draw})"


def check_mesh_trainer(fn: Any, steps: int = TRAINER_STEPS, timeout: float = TRAINER_TIMEOUT) -> None:
    """fn(model, mesh, batch_at, steps, micro_batches, zero, sequence_parallel) -> the losses of `steps` steps.

    Each case trains lab 16's 4-block GPT (float64, block size 8, batch 12) from the same weights as one
    process, on a mesh built here on the check's counting communicator: every wait gives up after `timeout`
    seconds (or as soon as another rank fails), and only the collectives of TRAINER_COLLECTIVES are offered,
    so ranks that make different collective calls fail the check instead of hanging it. First the layouts
    of TRAINER_CASES on the whole world; then the split case: the world cut into meshes of fewer ranks
    (`_split_case`), each training on batches of its own at the same time, where an answer that averages or
    broadcasts over MPI.COMM_WORLD instead of the mesh's communicators mixes the meshes. Every rank's
    losses must be one process's (on its mesh's batches) to 1e-8, every step's: with TRAINER_STEPS (3) steps,
    gradients never zeroed show.
    The grader's draw (TrainerPlan): the world's ranks in a drawn order (the meshes built on it, the split case's
    too), the notebook's layouts with drawn micro-batches and ZeRO stage, the batch size and the batches' seed."""
    from ..data.text import BatchSampler, make_corpus
    from ..models.gpt import GPTConfig

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    block = 8 if 8 % size == 0 else 2 * size  # the rows split over the tensor ranks
    config = GPTConfig(vocab_size=256, block_size=block, n_layer=4, n_head=4, n_embd=16, tied=False)
    draw = grading_draw(world, "mesh_trainer")
    plan = TrainerPlan(size, draw)
    sampler = BatchSampler(make_corpus().train, batch=plan.batch, block=config.block_size, seed=plan.seed)
    comm = world.Split(0, plan.order.index(rank))  # the world's ranks, in the plan's order
    try:
        want: list[float] | None = None  # one process's losses, computed once fn has returned (a stub fails first)
        for case in plan.cases:
            got = _run_trainer(comm, fn, config, sampler.batch_at, steps, case, timeout, plan)
            want = want if want is not None else _one_process(comm, config, sampler.batch_at, steps)
            fail_together(comm, _losses_problem(got, want), f"the mesh trainer is wrong on {_described(case)}{plan}")
        if plan.split is not None:
            ranks, case = plan.split
            mesh_index = comm.Get_rank() // ranks
            group = comm.Split(mesh_index, rank)
            try:
                _check_split(
                    comm, group, fn, config, _shifted(sampler.batch_at, mesh_index), steps, case, timeout, plan
                )
            finally:
                group.Free()
    finally:
        comm.Free()
    passed(
        world,
        f"the mesh trainer takes one process's steps (float64, 1e-8, {steps} steps) on every layout tried, "
        f"on the whole world and on meshes of part of it{named(draw)}",
    )


def _shifted(batch_at: Any, mesh_index: int) -> Any:
    """The batches of the split case's mesh `mesh_index`: batch_at(step + mesh_index x SPLIT_OFFSET)."""
    return lambda step: batch_at(step + mesh_index * SPLIT_OFFSET)


def _check_split(
    comm: MPI.Comm,
    group: MPI.Comm,
    fn: Any,
    config: Any,
    batch_at: Any,
    steps: int,
    case: Case,
    timeout: float,
    plan: TrainerPlan,
) -> None:
    """The split case: every mesh (group) trains at once; one verdict on every rank of comm, with SPLIT_HINT."""
    what = _described(case)
    members = group.allgather(MPI.COMM_WORLD.Get_rank())
    if plan.draw is not None:
        ranks = (
            f"world ranks {', '.join(map(str, members))}, in that order"
            if len(members) > 1
            else f"world rank {members[0]} alone"
        )
    elif len(members) > 1:
        ranks = f"world ranks {members[0]} to {members[-1]}"
    else:
        ranks = f"world rank {members[0]} alone"
    hint = SPLIT_HINT.format(ranks=count(group.Get_size(), "rank"), world=comm.Get_size())
    problem = None
    try:
        got = _run_trainer(group, fn, config, batch_at, steps, case, timeout, plan)
        want = _one_process(group, config, batch_at, steps)
        found = _losses_problem(got, want)
        problem = f"the mesh trainer is wrong on a mesh of {what} ({ranks}){plan}: {found}" if found else None
    except (CheckFailed, NotImplementedError) as err:  # the same on every rank of the group; another may pass
        problem = str(err)
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise CheckFailed(f"{problems[0]}\n{hint}")


def _run_trainer(
    comm: MPI.Comm, fn: Any, config: Any, batch_at: Any, steps: int, case: Case, timeout: float, plan: TrainerPlan
) -> Any:
    """fn's losses on the mesh of `case` over comm's ranks, run under the counting communicator's deadlines."""
    what = f"{_described(case)}{plan}"
    try:
        got, _ = run_counted(
            comm,
            _train_case,
            (fn, config, batch_at, steps, case),
            f"the mesh trainer on {what}",
            timeout=timeout,
            allow=TRAINER_COLLECTIVES,
        )
    except CheckFailed as err:  # the advice on collectives only where a rank waited in vain
        waited = any(word in str(err) for word in ("Stalled", "PeerFailed", "MismatchedCollective"))
        raise CheckFailed(f"{err}\n{TRAINER_HINT}" if waited else str(err)) from None
    return got


def _one_process(comm: MPI.Comm, config: Any, batch_at: Any, steps: int) -> list[float]:
    """One process's losses of `steps` steps on batch_at's batches: trained on comm's rank 0, sent to the others."""
    from ..models.gpt import make_gpt, train_gpt

    one = train_gpt(make_gpt(config, dtype=torch.float64), batch_at, steps) if comm.Get_rank() == 0 else None
    return cast(list[float], comm.bcast(one))


def _train_case(counting: CountingComm, fn: Any, config: Any, batch_at: Any, steps: int, case: Case) -> Any:
    """fn's losses on the mesh of one case, built on the check's counting communicator (and freed after)."""
    from ..models.gpt import make_gpt

    data, tensor, pipeline, context, micro, zero, sp = case
    mesh = Mesh.build(cast(MPI.Comm, counting), data=data, tensor=tensor, pipeline=pipeline, context=context)
    try:
        return fn(make_gpt(config, dtype=torch.float64), mesh, batch_at, steps, micro, zero, sp)
    finally:
        mesh.free()


def _losses_problem(got: Any, want: list[float]) -> str | None:
    if not isinstance(got, (list, tuple)) or len(got) != len(want):
        return f"should return a list of {len(want)} losses (one per step), got {got!r}"
    if not all(isinstance(x, float) for x in got):
        return f"the losses should be floats (the step's mean loss), got {[type(x).__name__ for x in got]}"
    errors = [abs(a - b) for a, b in zip(got, want)]
    wrong = [step for step, error in enumerate(errors) if not error <= 1e-8]  # a nan is wrong too
    if not wrong:
        return None
    shown = " ".join(f"{x:.6f}" for x in got)
    problem = (
        f"losses {shown} differ from one process's {' '.join(f'{x:.6f}' for x in want)} by up to {max(errors):.2e}"
    )
    if wrong[0] >= 2:
        return f"{problem}: {ZERO_GRAD_HINT.format(same=wrong[0], step=wrong[0] + 1)}"
    return (
        f"{problem}: check which rows of the batch this rank takes, the loss's scale per micro-batch, and which "
        "gradients are summed or averaged over which communicator"
    )


# Exercise 16.3: the interleaved 1F1B schedule ---------------------------------------------------------------
#: (p, v, m) the schedule is simulated on: m a multiple of p, 1 to 4 ranks, 1 to 3 chunks per rank.
#: Seconds to build and simulate one (p, v, m)'s op lists: milliseconds when right.
SCHEDULE_DEADLINE = 10.0
SCHEDULE_CAUSE = "a loop that never ends? (a counter of forwards or backwards that never advances)"
INTERLEAVED_SIZES = [(p, v, m) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)] + [
    (p, 1, m)
    for p, m in ((2, 3), (3, 4), (4, 5))  # v = 1 takes any m (lab 07's 1F1B)
]


def _schedule_problem(fn: Interleaved, p: int, v: int, m: int) -> str | None:
    """What is wrong with fn's op lists for p ranks, v chunks, m micro-batches (simulated), else None."""
    schedules = []
    for rank in range(p):
        try:
            ops = fn(p, m, rank, v)
        except ValueError as err:  # every size tried is valid: m a multiple of p, or v = 1
            return f"rank {rank}: raised ValueError on valid sizes (with v = 1 any m is valid): {err}"
        except (NotImplementedError, CheckFailed):  # the stub, or past the deadline
            raise
        except Exception as err:  # the student's code failed: one verdict, naming the sizes
            return f"rank {rank}: raised {type(err).__name__}: {err}"
        if not isinstance(ops, list) or not all(isinstance(op, tuple) and len(op) == 3 for op in ops):
            return f"rank {rank}: should return a list of (kind, chunk, micro-batch) tuples, got {ops!r}"
        ops = [(kind, int(j), int(i)) for kind, j, i in ops]
        want = {(kind, j, i) for kind in "FB" for j in range(v) for i in range(m)}
        if len(ops) != len(want) or set(ops) != want:
            return f"rank {rank}: the ops should be every ('F' or 'B', chunk < {v}, micro-batch < {m}) once, got {ops}"
        if any(ops.index(("B", j, i)) < ops.index(("F", j, i)) for _, j, i in ops):
            return f"rank {rank}: a backward comes before its own forward: {ops}"
        most = min(warmup_forwards(p, m, rank, v) + 1, v * m)
        formula = "p - r - 1, lab 07's, with v = 1" if v == 1 else "2(p - r - 1) + (v - 1)p"
        if chunk_in_flight(ops) > most:
            return (
                f"rank {rank} keeps {chunk_in_flight(ops)} activations at once, more than 1F1B's warm-up "
                f"{warmup_forwards(p, m, rank, v)} ({formula}, at most v m) + 1: start the backwards as soon as "
                "the warm-up ends"
            )
        schedules.append(ops)
    try:
        timeline = simulate_interleaved(schedules, v)
    except ValueError as err:
        return str(err)
    got, want_bubble = bubble(timeline), interleaved_bubble(p, m, v)
    if abs(got - want_bubble) > 1e-9:
        return f"the bubble is {got:.4f} of the step, not (p - 1)/(v m + p - 1) = {want_bubble:.4f}"
    for rank, ops in enumerate(schedules):  # runs and has the bubble: now the warm-up the text gives
        most = min(warmup_forwards(p, m, rank, v) + 1, v * m)
        formula = "p - r - 1, lab 07's, with v = 1" if v == 1 else "2(p - r - 1) + (v - 1)p"
        before = next(i for i, op in enumerate(ops) if op[0] == "B")  # forwards before the first backward
        if before != most:
            return (
                f"rank {rank} runs {before} forwards before its first backward, not {most}: the warm-up's "
                f"{warmup_forwards(p, m, rank, v)} ({formula}, at most v m), then the steady state's first forward"
            )
    return None


class _Interleaved:
    """The cases of check_interleaved: the notebook's, or the grader's (`draw`)."""

    def __init__(self, world: int, draw: Draw | None) -> None:
        self.draw = draw
        if draw is None:
            self.sizes, self.refused = INTERLEAVED_SIZES, (2, 2, 3)
            self.m, self.width, self.seed = 2 * world, 4, 0
            return
        drawn = [
            (draw.integer(1, 4, "p", i), draw.integer(1, 3, "v", i), draw.integer(1, 6, "m", i)) for i in range(12)
        ]
        self.sizes = [(p, v, p * groups) for p, v, groups in drawn]  # m a multiple of p
        ps = [draw.integer(2, 4, "p, v = 1", i) for i in range(3)]  # v = 1 takes any m
        self.sizes += [
            (p, 1, draw.choose([m for m in range(1, 5 * p) if m % p], 1, "m, v = 1", i)[0]) for i, p in enumerate(ps)
        ]
        p = draw.integer(2, 4, "refused p")
        self.refused = (
            p,
            draw.integer(2, 3, "refused v"),
            draw.choose([m for m in range(1, 6 * p) if m % p], 1, "refused m")[0],
        )
        self.m, self.width, self.seed = (
            world * draw.integer(1, 3, "run m"),
            draw.integer(2, 5, "width"),
            draw.data_seed("run"),
        )
        self.sizes.append((world, 2, self.m))  # the lists run below are checked first

    def run(self, world: int) -> str:
        """The run on the ranks, for a message."""
        if self.draw is None:
            return ""
        return f" (p = {world}, v = 2, m = {self.m}, width {self.width}, layers and data of seed {self.seed}{named(self.draw)})"


def check_interleaved(fn: Interleaved, timeout: float = TIMEOUT) -> None:
    """fn(p, m, rank, v) -> rank's ops [(kind, chunk, micro-batch)], as ddlab.pipeline.interleaved_1f1b.

    Simulated on every (p, v, m) of INTERLEAVED_SIZES (every op once, none before its forward, at most
    1F1B's warm-up + 1 activations kept, exactly the warm-up's forwards before the first backward, no
    deadlock, the bubble (p - 1)/(v m + p - 1); with v = 1, m need not be a multiple of p); m not a multiple
    of p with v > 1 refused (ValueError); then run on the world's ranks, 2 chunks each of a chain of
    linear layers, in float64 and float32: every gradient one process's.
    The grader's draw: 12 (p, v, m) with p 1 to 4, v 1 to 3 and m a multiple of p up to 6p, 3 with v = 1 and m
    not a multiple of p, a drawn (p, v > 1, m not a multiple) to refuse; the run on the world's ranks in a drawn
    order, m a drawn multiple of p up to 3p, layers of a drawn width and seed."""
    world = MPI.COMM_WORLD
    draw = grading_draw(world, "interleaved")
    cases = _Interleaved(world.Get_size(), draw)
    problem = None
    try:
        for p, v, m in cases.sizes:
            with deadline(SCHEDULE_DEADLINE, f"the schedule for p = {p}, v = {v}, m = {m}", SCHEDULE_CAUSE):
                problem = _schedule_problem(fn, p, v, m)
            if problem:
                problem = f"p = {p} ranks, v = {v} chunks, m = {m} micro-batches{named(draw)}: {problem}"
                break
        if problem is None:
            p, v, m = cases.refused
            try:
                with deadline(SCHEDULE_DEADLINE, f"the schedule for p = {p}, v = {v}, m = {m}", SCHEDULE_CAUSE):
                    fn(p, m, 0, v)
                problem = (
                    f"accepted m = {m} micro-batches on p = {p} ranks with v = {v}{named(draw)}: raise ValueError "
                    "(m must be a multiple of p)"
                )
            except ValueError:
                pass
    except CheckFailed as err:  # past the deadline
        problem = str(err) + named(draw)
    fail_together_once(world, problem, "the interleaved schedule is wrong")

    def run(sub: MPI.Comm) -> None:
        for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            _run_problem(sub, fn, dtype, tolerance, timeout, cases)

    if draw is None:
        run(world)
    else:  # on the world's ranks in a drawn order
        each_size(world, run, "the interleaved schedule", sizes=[world.Get_size()], draw=draw)
    passed(
        world,
        "the interleaved schedule runs every op once, keeps at most 1F1B's activations, has the bubble "
        f"(p - 1)/(v m + p - 1), and its gradients on the ranks are one process's (float64, float32){named(draw)}",
    )


def _run_problem(
    world: MPI.Comm, fn: Interleaved, dtype: torch.dtype, tolerance: float, timeout: float, cases: _Interleaved
) -> None:
    p, v = world.Get_size(), 2
    m, width = cases.m, cases.width
    with torch.random.fork_rng():
        torch.manual_seed(cases.seed)
        layers: list[nn.Module] = [nn.Sequential(nn.Linear(width, width, dtype=dtype), nn.Tanh()) for _ in range(v * p)]
        inputs = list(torch.randn(m, 2, width, dtype=dtype).unbind())
        targets = list(torch.randn(m, 2, width, dtype=dtype).unbind())

    def loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((y - target) ** 2).sum()

    whole = copy.deepcopy(nn.Sequential(*layers))
    for x, target in zip(inputs, targets):
        loss(whole(x), target).backward()
    rank = world.Get_rank()
    chunks = [copy.deepcopy(layers[virtual_stage(p, rank, j)]) for j in range(v)]
    ops = fn(p, m, rank, v)
    run_counted(
        world,
        lambda comm: run_interleaved(comm, chunks, ops, inputs, targets, loss),
        (),
        f"the schedule{cases.run(p)}",
        timeout,
    )
    problem = None
    for j, chunk in enumerate(chunks):
        mine = whole[virtual_stage(p, rank, j)]
        for (name, got), want in zip(chunk.named_parameters(), mine.parameters()):
            assert got.grad is not None and want.grad is not None
            error = float((got.grad - want.grad).abs().max())
            if error > tolerance * max(1.0, float(want.grad.abs().max())):
                problem = f"chunk {j} ({name}) in {dtype}: gradient differs from one process's by {error:.2e}"
                break
    fail_together(world, problem, f"the interleaved schedule's gradients are wrong{cases.run(p)}")
