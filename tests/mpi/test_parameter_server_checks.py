"""Lab 10's checks catch wrong gates, asynchronous workers and gossip steps, and accept valid alternatives."""

import numpy as np
import pytest
from ddlab.checks import CheckFailed, check_async_worker, check_gossip_step, check_ssp_gate
from ddlab.parameter_server import gossip_step, may_start
from ddlab.parameter_server.messages import GRADIENT, PARAMETERS, PARAMETERS_HEADER
from ddlab.parameter_server.worker import work


def gate_off_by_one(clocks, step, bound):
    """Lets a worker run s + 1 steps ahead."""
    return len(clocks) == 0 or step - int(np.min(clocks)) <= bound + 1


def gate_never_blocks(clocks, step, bound):
    return True


def gate_alternative(clocks, step, bound):
    """Valid: every running worker has finished step - bound."""
    return bool(np.all(clocks >= step - bound))


def gossip_overwrites(comm, params):
    """Takes the neighbour's parameters instead of averaging with them."""
    return 2 * gossip_step(comm, params) - params


def gossip_alternative(comm, params):
    """Valid: non-blocking send, blocking receive, weights written out."""
    rank, size = comm.Get_rank(), comm.Get_size()
    theirs = np.empty_like(params)
    request = comm.Isend(params, (rank + 1) % size, 7)
    comm.Recv(theirs, (rank - 1) % size, 7)
    request.Wait()
    return 0.5 * params + 0.5 * theirs


@pytest.mark.parametrize("gate", [gate_off_by_one, gate_never_blocks])
def test_wrong_gates_fail(comm, gate):
    with pytest.raises(CheckFailed, match="clock tables"):
        check_ssp_gate(gate)


@pytest.mark.parametrize("gate", [may_start, gate_alternative])
def test_valid_gates_pass(comm, gate):
    check_ssp_gate(gate)


def test_gossip_that_overwrites_fails(comm):
    with pytest.raises(CheckFailed, match="wrong at"):
        check_gossip_step(gossip_overwrites)


@pytest.mark.parametrize("step", [gossip_step, gossip_alternative])
def test_valid_gossip_steps_pass(comm, step):
    check_gossip_step(step)


def push(comm, step, version, grad, more):
    comm.Send(np.concatenate([[comm.Get_rank(), step, version, float(more)], grad]), 0, GRADIENT)


def async_worker(comm, n, gradient, steps):
    """Valid: blocking receive of [version, go] + parameters, blocking send of the header and gradient."""
    incoming = np.empty(PARAMETERS_HEADER + n)
    for step in range(steps):
        comm.Recv(incoming, 0, PARAMETERS)
        if incoming[1] == 0:
            return
        grad = gradient(incoming[PARAMETERS_HEADER:].copy(), step)
        push(comm, step, incoming[0], grad, step < steps - 1)


def async_worker_nonblocking(comm, n, gradient, steps):
    """Valid: the library's worker (Irecv/Isend, waits at the end) against one server."""
    work(comm, [(0, n)], n, comm.Get_rank(), gradient, steps, comm.watch)


def worker_never_pushes(comm, n, gradient, steps):
    incoming = np.empty(PARAMETERS_HEADER + n)
    for step in range(steps):
        comm.Recv(incoming, 0, PARAMETERS)
        gradient(incoming[PARAMETERS_HEADER:].copy(), step)


def worker_pushes_twice(comm, n, gradient, steps):
    incoming = np.empty(PARAMETERS_HEADER + n)
    for step in range(steps):
        comm.Recv(incoming, 0, PARAMETERS)
        grad = gradient(incoming[PARAMETERS_HEADER:].copy(), step)
        push(comm, step, incoming[0], grad, step < steps - 1)
        push(comm, step, incoming[0], grad, step < steps - 1)


def worker_pulls_once(comm, n, gradient, steps):
    """Computes every step at the first parameters, never receives the others."""
    incoming = np.empty(PARAMETERS_HEADER + n)
    comm.Recv(incoming, 0, PARAMETERS)
    for step in range(steps):
        grad = gradient(incoming[PARAMETERS_HEADER:].copy(), step)
        push(comm, step, incoming[0], grad, step < steps - 1)


def worker_keeps_stale_params(comm, n, gradient, steps):
    """Receives every step but computes at the first parameters forever."""
    incoming, first = np.empty(PARAMETERS_HEADER + n), None
    for step in range(steps):
        comm.Recv(incoming, 0, PARAMETERS)
        first = incoming[PARAMETERS_HEADER:].copy() if first is None else first
        grad = gradient(first, step)
        push(comm, step, incoming[0], grad, step < steps - 1)


def worker_forgets_last_flag(comm, n, gradient, steps):
    """Never marks its last gradient, so the server waits for a step that never comes."""
    incoming = np.empty(PARAMETERS_HEADER + n)
    for step in range(steps):
        comm.Recv(incoming, 0, PARAMETERS)
        grad = gradient(incoming[PARAMETERS_HEADER:].copy(), step)
        push(comm, step, incoming[0], grad, True)


@pytest.mark.parametrize(
    "worker, message",
    [
        (worker_never_pushes, "waited"),
        (worker_pushes_twice, "expected 1"),
        (worker_pulls_once, "never received"),
        (worker_keeps_stale_params, "parameters other than"),
        (worker_forgets_last_flag, "waited"),
    ],
)
def test_wrong_async_workers_fail(comm, worker, message):
    with pytest.raises(CheckFailed, match=message):
        check_async_worker(worker)


@pytest.mark.parametrize("worker", [async_worker, async_worker_nonblocking])
def test_valid_async_workers_pass(comm, worker):
    check_async_worker(worker)
