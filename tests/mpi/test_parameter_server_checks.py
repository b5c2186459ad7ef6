"""Lab 10's checks catch wrong gates, asynchronous workers, stale-synchronous servers and gossip steps, and accept valid
alternatives."""

import time

import numpy as np
import pytest
from ddlab.checks import CheckFailed, check_async_worker, check_gossip_step, check_ssp_gate, check_ssp_server
from ddlab.parameter_server import Consistency, gossip_step, may_start
from ddlab.parameter_server.messages import GRADIENT, GRADIENT_HEADER, PARAMETERS, PARAMETERS_HEADER
from ddlab.parameter_server.server import Server
from ddlab.parameter_server.worker import work
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
gossip_step = unguarded(gossip_step)
may_start = unguarded(may_start)
Server = unguarded(Server)
work = unguarded(work)


def gate_off_by_one(clocks, step, bound):
    """Lets a worker run s + 1 steps ahead."""
    return len(clocks) == 0 or step - int(np.min(clocks)) <= bound + 1


def gate_fails_on_empty(clocks, step, bound):
    """Right on every table with a worker; np.min raises on an empty one (no one left to wait for)."""
    return step - int(np.min(clocks)) <= bound


def gate_waits_on_empty(clocks, step, bound):
    """Makes a worker wait when no one is left to wait for."""
    return len(clocks) > 0 and step - int(np.min(clocks)) <= bound


def gate_never_blocks(clocks, step, bound):
    return True


def gate_alternative(clocks, step, bound):
    """Valid: every running worker has finished step - bound."""
    return bool(np.all(clocks >= step - bound))


def gate_sorts_in_place(clocks, step, bound):
    """Right answers, but sorts the server's clock table in place."""
    clocks.sort()
    return len(clocks) == 0 or step - int(clocks[0]) <= bound


def gate_sorts_a_copy(clocks, step, bound):
    """Valid: sorts a copy of the table."""
    ordered = np.sort(clocks)
    return len(ordered) == 0 or step - int(ordered[0]) <= bound


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


@pytest.mark.parametrize(
    "gate, message",
    [
        (gate_off_by_one, "the gate let it start"),
        (gate_never_blocks, "let it start"),
        (gate_sorts_in_place, "changed"),
        (gate_fails_on_empty, "an empty clock table .*raised ValueError"),
        (gate_waits_on_empty, r"clocks \[\] .*made it wait"),
    ],
)
def test_wrong_gates_fail(comm, gate, message):
    with pytest.raises(CheckFailed, match=f"clock tables: [^\n]*{message}") as failed:
        check_ssp_gate(gate)
    assert "\n" not in str(failed.value)  # said once, not once per rank


@pytest.mark.parametrize("gate", [may_start, gate_alternative, gate_sorts_a_copy])
def test_valid_gates_pass(comm, gate):
    check_ssp_gate(gate)


def test_gossip_that_overwrites_fails(comm):
    with pytest.raises(CheckFailed, match="wrong at"):
        check_gossip_step(gossip_overwrites)


def gossip_object_api(comm, params):
    """The right average, but the parameters go as a pickle."""
    rank, size = comm.Get_rank(), comm.Get_size()
    return (params + comm.sendrecv(params, (rank + 1) % size, source=(rank - 1) % size)) / 2


def gossip_replace(comm, params):
    """Valid: Sendrecv_replace on a copy."""
    rank, size = comm.Get_rank(), comm.Get_size()
    theirs = params.copy()
    comm.Sendrecv_replace(theirs, (rank + 1) % size, source=(rank - 1) % size)
    return (params + theirs) / 2


def test_gossip_with_the_object_api_fails(comm):
    with pytest.raises(CheckFailed, match="buffer API"):
        check_gossip_step(gossip_object_api)


@pytest.mark.parametrize("step", [gossip_step, gossip_alternative, gossip_replace])
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


def pushing_with(send):
    """A worker that pulls, computes and hands its gradient to send(comm, step, version, grad, more); never reads `go`."""

    def worker(comm, n, gradient, steps):
        incoming = np.empty(PARAMETERS_HEADER + n)
        for step in range(steps):
            comm.Recv(incoming, 0, PARAMETERS)
            grad = gradient(incoming[PARAMETERS_HEADER:].copy(), step)
            send(comm, step, incoming[0], grad, step < steps - 1)

    return worker


def push_float32(comm, step, version, grad, more):
    comm.Send(np.concatenate([[comm.Get_rank(), step, version, float(more)], grad]).astype(np.float32), 0, GRADIENT)


def push_a_pickle(comm, step, version, grad, more):
    """The object API: a pickle, larger than the server's buffer."""
    comm.send([comm.Get_rank(), step, version, float(more), *grad], 0, GRADIENT)


#: Reads the parameters but not `go`: computes and pushes after the server said stop.
worker_ignores_stop = pushing_with(push)
#: Never marks its last gradient, so the server waits for a step that never comes.
worker_forgets_last_flag = pushing_with(lambda comm, step, version, grad, more: push(comm, step, version, grad, True))
worker_float32 = pushing_with(push_float32)
worker_never_pushes = pushing_with(lambda comm, step, version, grad, more: None)
worker_pushes_twice = pushing_with(lambda *message: (push(*message), push(*message)))
worker_pushes_a_pickle = pushing_with(push_a_pickle)


def worker_object_api(comm, n, gradient, steps):
    """Receives the parameters with the object API: the server's arrays are not pickles."""
    for step in range(steps):
        incoming = comm.recv(source=0, tag=PARAMETERS)
        grad = gradient(incoming[PARAMETERS_HEADER:], step)
        push(comm, step, incoming[0], grad, step < steps - 1)


def async_worker_filled(comm, n, gradient, steps):
    """Valid: one outgoing buffer filled in place (NumPy ints in the header), synchronous sends, `go` read as 0/1."""
    incoming, outgoing = np.empty(PARAMETERS_HEADER + n), np.empty(GRADIENT_HEADER + n)
    for step in np.arange(steps):
        comm.Recv(incoming, 0, PARAMETERS)
        if incoming[1] != 1:
            break
        outgoing[:GRADIENT_HEADER] = comm.Get_rank(), step, incoming[0], step + 1 < steps
        outgoing[GRADIENT_HEADER:] = gradient(incoming[PARAMETERS_HEADER:].copy(), int(step))
        comm.Ssend(outgoing, 0, GRADIENT)


@pytest.mark.parametrize(
    "worker, message",
    [
        (worker_ignores_stop, "go = 0|waited"),
        (worker_never_pushes, "waited"),
        (worker_pushes_twice, "expected 1"),
        (worker_pulls_once, "never received"),
        (worker_keeps_stale_params, "parameters other than"),
        (worker_forgets_last_flag, "(?s)waited .* GRADIENT.*likely cause: did every step push"),
        (worker_object_api, "the object API's recv cannot read"),
        (worker_float32, "is the gradient message float64"),
        (worker_pushes_a_pickle, "larger than the receive buffer.*lowercase send pickles"),
    ],
)
def test_wrong_async_workers_fail(comm, worker, message):
    with pytest.raises(CheckFailed, match=message):
        check_async_worker(worker)


@pytest.mark.parametrize("worker", [async_worker, async_worker_nonblocking, async_worker_filled])
def test_valid_async_workers_pass(comm, worker):
    check_async_worker(worker)


def ssp_server(comm, params, steps, bound, lr, gate=may_start, step_size=None, version_of=None, stop=True):
    """The server's loop; the keyword arguments plant one mistake each in the wrong answers below."""
    params, workers = params.copy(), list(range(1, comm.Get_size()))
    clock = dict.fromkeys(workers, 0)
    running, waiting, version = set(workers), set(workers), 0
    incoming = np.empty(GRADIENT_HEADER + len(params))
    while True:
        clocks = np.array([clock[w] for w in running], dtype=np.int64)
        for w in sorted(waiting):
            if gate(clocks, clock[w], bound):
                waiting.discard(w)
                sent = version if version_of is None else version_of(clock)
                comm.Send(np.concatenate([[sent, 1.0], params]), w, PARAMETERS)
        if not running and stop:
            return params
        comm.Recv(incoming, MPI.ANY_SOURCE, GRADIENT)
        worker, _, _, more = incoming[:GRADIENT_HEADER].astype(int)
        params -= (step_size or lr / len(workers)) * incoming[GRADIENT_HEADER:]
        version += 1
        clock[worker] += 1
        if more:
            waiting.add(worker)
        else:
            running.discard(worker)


def server_nonblocking(comm, params, steps, bound, lr):
    """Valid: Probe then Recv from the status's source, Isend kept until Waitall, NumPy ints, 0/1 flags,
    and an end counted in updates (every worker runs `steps` steps) instead of read from `more`."""
    params, workers = np.array(params, dtype=np.float64), np.arange(1, comm.Get_size())
    clock, waiting, sends, version = {int(w): np.int64(0) for w in workers}, list(workers), [], np.int64(0)
    status = MPI.Status()
    while True:
        clocks = np.array([clock[int(w)] for w in workers if clock[int(w)] < steps], dtype=np.int64)
        for w in list(waiting):
            if may_start(clocks, clock[int(w)], bound):
                waiting.remove(w)
                buf = np.concatenate([np.array([version, 1]), params])
                sends.append((comm.Isend(buf, w, PARAMETERS), buf))
        if version == len(workers) * steps:
            MPI.Request.Waitall([r for r, _ in sends])
            return params
        comm.Probe(MPI.ANY_SOURCE, GRADIENT, status)
        buf = np.empty(GRADIENT_HEADER + len(params), dtype=np.float64)
        comm.Recv(buf, status.Get_source(), GRADIENT)
        worker = np.int64(buf[0])
        params = params - lr * buf[GRADIENT_HEADER:] / len(workers)
        version += 1
        clock[int(worker)] += 1
        if buf[3] == 1:
            waiting.append(worker)


def server_library(comm, params, steps, bound, lr):
    """Valid: the library's server (Irecv from any worker, polled; Isend of the parameters)."""
    server = Server(comm, params, list(range(1, comm.Get_size())), steps, lr, Consistency(bound), comm.watch)
    server.serve()
    return server.params


def server_ignores_bound(comm, params, steps, bound, lr):
    return ssp_server(comm, params, steps, bound, lr, gate=lambda clocks, step, s: True)


def server_gate_off_by_one(comm, params, steps, bound, lr):
    return ssp_server(comm, params, steps, bound, lr, gate=lambda clocks, step, s: may_start(clocks, step, s + 1))


def server_releases_only_the_pusher(comm, params, steps, bound, lr):
    """Checks the gate for the worker that just pushed, then forgets it: the others are left waiting."""
    workers = list(range(1, comm.Get_size()))
    params, clock, version = params.copy(), dict.fromkeys(workers, 0), 0
    for w in workers:
        comm.Send(np.concatenate([[version, 1.0], params]), w, PARAMETERS)
    incoming = np.empty(GRADIENT_HEADER + len(params))
    for _ in range(len(workers) * steps):
        comm.Recv(incoming, MPI.ANY_SOURCE, GRADIENT)
        worker, _, _, more = incoming[:GRADIENT_HEADER].astype(int)
        params -= lr / len(workers) * incoming[GRADIENT_HEADER:]
        version, clock[worker] = version + 1, clock[worker] + 1
        running = np.array([c for c in clock.values() if c < steps], dtype=np.int64)
        if more and may_start(running, clock[worker], bound):
            comm.Send(np.concatenate([[version, 1.0], params]), worker, PARAMETERS)
    return params


def server_never_ends(comm, params, steps, bound, lr):
    """Ignores `more`: waits for a gradient after the last one."""
    return ssp_server(comm, params, steps, bound, lr, stop=False)


def server_float32_buffer(comm, params, steps, bound, lr):
    """Receives the gradients into a float32 buffer."""
    workers = list(range(1, comm.Get_size()))
    for w in workers:
        comm.Send(np.concatenate([[0, 1.0], params]), w, PARAMETERS)
    incoming = np.empty(GRADIENT_HEADER + len(params), dtype=np.float32)
    comm.Recv(incoming, MPI.ANY_SOURCE, GRADIENT)
    return params


def server_rate_not_divided(comm, params, steps, bound, lr):
    return ssp_server(comm, params, steps, bound, lr, step_size=lr)


def server_sends_steps_as_version(comm, params, steps, bound, lr):
    return ssp_server(comm, params, steps, bound, lr, version_of=lambda clock: min(clock.values()))


def server_updates_its_input(comm, params, steps, bound, lr):
    result = ssp_server(comm, params, steps, bound, lr)
    params[:] = result
    return params


def server_object_api(comm, params, steps, bound, lr):
    """Receives with the object API: the workers' arrays are not pickles."""
    for w in range(1, comm.Get_size()):
        comm.Send(np.concatenate([[0, 1.0], params]), w, PARAMETERS)
    comm.recv(source=MPI.ANY_SOURCE, tag=GRADIENT)
    return params


@pytest.mark.parametrize(
    "server, message",
    [
        (server_ignores_bound, "ahead with s = 0"),
        (server_gate_off_by_one, "ahead with s = "),
        (server_rate_not_divided, "parameters other than"),
        (server_sends_steps_as_version, "version|updates"),
        (server_updates_its_input, "changed the params"),
        (server_float32_buffer, "Error|error"),
        (server_object_api, "Error|error"),
    ],
)
def test_wrong_ssp_servers_fail(comm, server, message):
    with pytest.raises(CheckFailed, match=message):
        check_ssp_server(server, timeout=2.0)


@pytest.mark.parametrize("server", [server_releases_only_the_pusher, server_never_ends])
def test_servers_that_leave_a_rank_waiting_fail_within_the_timeout(comm, server):
    began = time.monotonic()
    with pytest.raises(CheckFailed, match="(?s)waited.*likely cause: a worker waiting for its PARAMETERS"):
        check_ssp_server(server, timeout=0.5)
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("server", [server_nonblocking, server_library])
def test_valid_ssp_servers_pass(comm, server):
    check_ssp_server(server)


def server_stub(comm, params, steps, bound, lr):
    raise NotImplementedError("Exercise 10.3 (ssp_server) is not done yet")


def test_a_server_stub_fails_as_not_done(comm):
    with pytest.raises(NotImplementedError, match="ssp_server"):
        check_ssp_server(server_stub, timeout=2.0)


def worker_stub(comm, n, gradient, steps):
    raise NotImplementedError("Exercise 10.2 (async_worker) is not done yet")


@pytest.mark.parametrize("repeat", range(3))
def test_a_worker_stub_fails_as_not_done(comm, repeat):
    """The stubbed workers' notices stop the server on rank 0 whichever way its wait ends (it once read the
    buffer of the receive the watch gave up, failed otherwise, and waited in a collective the others had left)."""
    with pytest.raises(NotImplementedError, match="async_worker"):
        check_async_worker(worker_stub)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("ssp_gate", "ddlab.parameter_server.may_start", ()),
        ("async_worker", "ddlab.parameter_server.worker.work", ()),
        ("ssp_server", "ddlab.parameter_server.server.Server", ()),
        ("gossip_step", "ddlab.parameter_server.gossip_step", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
