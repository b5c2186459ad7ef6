"""Lab 04's multi-rank checks pass on right answers and fail, on every rank, on wrong ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab import checks
from ddlab import data_parallel as dp
from ddlab.allreduce import allreduce_ring
from ddlab.runtime.reference import unguarded
from mpi4py import MPI

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
allreduce_ring = unguarded(allreduce_ring)
broadcast_parameters = unguarded(dp.broadcast_parameters)
average_gradients = unguarded(dp.average_gradients)


def fails(check, fn, *words):
    """The check raises CheckFailed on every rank, with all of `words` in its message."""
    with pytest.raises(checks.CheckFailed) as caught:
        check(fn)
    message = str(caught.value)
    assert all(word in message for word in words), message


# broadcast_parameters -------------------------------------------------------------


def broadcast_parameters_only(model, comm, root=0):
    for p in model.parameters():
        comm.Bcast(p.detach().numpy(), root=root)


def broadcast_into_new_tensors(model, comm, root=0):
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            value = comm.bcast(p.detach().clone(), root=root)
            setattr(module, name, torch.nn.Parameter(value))
    for b in model.buffers():
        comm.Bcast(b.numpy(), root=root)


def broadcast_from_rank_0_always(model, comm, root=0):
    broadcast_parameters(model, comm, root=0)


def test_broadcast_check_passes_the_reference(comm):
    checks.check_broadcast_parameters(broadcast_parameters)


def test_broadcast_check_fails_without_buffers(comm):
    fails(checks.check_broadcast_parameters, broadcast_parameters_only, "buffer")


def test_broadcast_check_fails_on_new_tensors(comm):
    fails(checks.check_broadcast_parameters, broadcast_into_new_tensors, "in place")


def test_broadcast_check_fails_when_root_is_ignored(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank has one root")
    fails(checks.check_broadcast_parameters, broadcast_from_rank_0_always, "differs")


def broadcast_objects(model, comm, root=0):
    """Valid too: the object broadcast, one tensor at a time, copied in place."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.copy_(comm.bcast(t, root=root))


def broadcast_by_the_root_only(model, comm, root=0):
    if comm.Get_rank() == root:
        broadcast_parameters(model, comm, root)


def test_broadcast_check_passes_the_object_broadcast(comm):
    checks.check_broadcast_parameters(broadcast_objects)


def test_broadcast_check_fails_when_only_the_root_broadcasts_and_does_not_hang(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank is the root")
    fails(
        lambda fn: checks.check_broadcast_parameters(fn, timeout=3), broadcast_by_the_root_only, "broadcast_parameters"
    )


def broadcast_then_barrier(model, comm, root=0):
    broadcast_parameters(model, comm, root)
    comm.Barrier()


def test_broadcast_check_names_the_collectives_it_allows(comm):
    fails(checks.check_broadcast_parameters, broadcast_then_barrier, "Barrier", "comm.Bcast")


def test_broadcast_check_passes_a_stub_error_through(comm):
    def stub(model, comm, root=0):
        raise NotImplementedError("Exercise 4.2")

    with pytest.raises(NotImplementedError):
        checks.check_broadcast_parameters(stub)


# average_gradients ------------------------------------------------------------------


def summed_gradients(model, comm, allreduce):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    total = torch.from_numpy(allreduce(comm, flat))
    offset = 0
    for p in model.parameters():
        p.grad.copy_(total[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def per_parameter(model, comm, allreduce):
    for p in model.parameters():
        p.grad.copy_(torch.from_numpy(allreduce(comm, p.grad.reshape(-1).numpy())).view_as(p) / comm.Get_size())


def ignores_the_allreduce_given(model, comm, allreduce):
    average_gradients(model, comm, None)


def nothing(model, comm, allreduce):
    allreduce(comm, np.zeros(1))


def test_average_check_passes_the_reference(comm):
    checks.check_average_gradients(average_gradients)


def test_average_check_fails_on_sums(comm):
    if comm.Get_size() == 1:
        pytest.skip("the sum of one is the mean")
    fails(checks.check_average_gradients, summed_gradients, "sum over ranks")


def test_average_check_fails_on_one_allreduce_per_parameter(comm):
    fails(checks.check_average_gradients, per_parameter, "8 allreduce calls")


def test_average_check_fails_when_the_allreduce_given_is_not_used(comm):
    fails(checks.check_average_gradients, ignores_the_allreduce_given, "never called")


def test_average_check_fails_when_nothing_is_averaged(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank's gradient is the mean")
    fails(checks.check_average_gradients, nothing, "not the mean")


def averaged_on_rank_0_only(model, comm, allreduce):
    if comm.Get_rank() == 0:
        average_gradients(model, comm, allreduce)


def test_average_check_fails_when_a_rank_skips_the_allreduce_and_does_not_hang(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank has no one to wait for")
    fails(lambda fn: checks.check_average_gradients(fn, timeout=3), averaged_on_rank_0_only, "average_gradients")


# train_step -----------------------------------------------------------------------------


def reference_step(model, optimizer, x, y, comm, allreduce=None):
    optimizer.zero_grad()
    loss = dp.squared_error(model(x), y).mean()
    loss.backward()
    average_gradients(model, comm, allreduce)
    optimizer.step()
    return loss.item()


def step_without_averaging(model, optimizer, x, y, comm, allreduce=None):
    optimizer.zero_grad()
    loss = dp.squared_error(model(x), y).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def step_with_sums(model, optimizer, x, y, comm, allreduce=None):
    optimizer.zero_grad()
    loss = dp.squared_error(model(x), y).mean() * comm.Get_size()
    loss.backward()
    average_gradients(model, comm, allreduce)
    optimizer.step()
    return loss.item() / comm.Get_size()


def step_before_averaging(model, optimizer, x, y, comm, allreduce=None):
    optimizer.zero_grad()
    loss = dp.squared_error(model(x), y).mean()
    loss.backward()
    optimizer.step()
    average_gradients(model, comm, allreduce)
    return loss.item()


def test_train_step_check_passes_the_reference(comm):
    checks.check_train_step(reference_step)


@pytest.mark.parametrize(
    "wrong, words",
    [
        (step_without_averaging, "this rank's batch alone"),
        (step_with_sums, "SUM"),
        (step_before_averaging, "differ"),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_train_step_check_fails_on_wrong_steps(comm, wrong, words):
    if comm.Get_size() == 1:
        pytest.skip("one rank needs no averaging")
    fails(checks.check_train_step, wrong, words)


def step_averaging_on_the_last_rank_only(model, optimizer, x, y, comm, allreduce=None):
    optimizer.zero_grad()
    loss = dp.squared_error(model(x), y).mean()
    loss.backward()
    if comm.Get_rank() == comm.Get_size() - 1:
        average_gradients(model, comm, allreduce)
    optimizer.step()
    return loss.item()


def step_returning_a_numpy_float(model, optimizer, x, y, comm, allreduce=None):
    return np.float64(reference_step(model, optimizer, x, y, comm, allreduce))


def test_train_step_check_fails_when_a_rank_skips_the_allreduce_and_does_not_hang(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank has no one to wait for")
    fails(lambda fn: checks.check_train_step(fn, timeout=3), step_averaging_on_the_last_rank_only, "train_step")


def test_train_step_check_accepts_a_numpy_float(comm):
    checks.check_train_step(step_returning_a_numpy_float)


# overlapped_averaging ------------------------------------------------------------------


def overlapped(
    model,
    comm,
    groups,
    register="register_post_accumulate_grad_hook",
    order=None,
    divide=True,
    at_the_end=False,
    skip_last=False,
    flatten=None,
    no_reset=False,
):
    """The lab's solution, with switches that make the wrong answers below.

    order: None (bucket order), "reversed", or "as_completed" (each bucket as soon as it is complete).
    """
    fixed = list(range(len(groups)))[:: -1 if order == "reversed" else 1]
    completed = []  # buckets in the order their last gradient arrived
    size = comm.Get_size()
    owner = {p: k for k, group in enumerate(groups) for p in group}
    ready = [0] * len(groups)
    flats, requests, started = [None] * len(groups), [None] * len(groups), [0]

    def start_ready():
        queue = completed if order == "as_completed" else fixed
        while started[0] < len(queue) and ready[queue[started[0]]] == len(groups[queue[started[0]]]):
            k = queue[started[0]]
            flats[k] = (flatten or (lambda g: torch.cat([p.grad.reshape(-1) for p in g])))(groups[k]).numpy()
            if not (skip_last and k == len(groups) - 1):
                requests[k] = comm.Iallreduce(MPI.IN_PLACE, flats[k])
            started[0] += 1

    def hook(p):
        ready[owner[p]] += 1
        if ready[owner[p]] == len(groups[owner[p]]):
            completed.append(owner[p])
        if not at_the_end:
            start_ready()

    for group in groups:
        for p in group:
            getattr(p, register)(hook)

    def finish():
        if at_the_end:
            start_ready()
        for k, group in enumerate(groups):
            if requests[k] is not None or no_reset:
                requests[k].Wait()
            requests[k] = None if no_reset else requests[k]
            offset = 0
            for p in group:
                piece = torch.from_numpy(flats[k][offset : offset + p.numel()]).view_as(p)
                p.grad.copy_(piece / size if divide else piece)
                offset += p.numel()
        if not no_reset:
            ready[:] = [0] * len(groups)
            completed.clear()
            started[0] = 0

    return finish


def flattened_by_copy(group):
    """A valid alternative: a preallocated NumPy buffer filled slice by slice."""
    flat = np.empty(sum(p.numel() for p in group))
    offset = 0
    for p in group:
        flat[offset : offset + p.numel()] = p.grad.reshape(-1).numpy()
        offset += p.numel()
    return torch.from_numpy(flat)


def test_overlap_check_passes_the_solution_and_another_flattening(comm):
    checks.check_overlapped_averaging(overlapped)
    checks.check_overlapped_averaging(lambda m, c, g: overlapped(m, c, g, flatten=flattened_by_copy))


@pytest.mark.parametrize(
    "options, words",
    [
        ({"register": "register_hook"}, ["register_post_accumulate_grad_hook"]),
        ({"order": "reversed"}, ["bucket order"]),
        ({"order": "as_completed"}, ["first layer first", "bucket order"]),
        ({"at_the_end": True}, ["after backward had returned"]),
        ({"divide": False}, ["SUM"]),
    ],
    ids=["hook_before_accumulation", "buckets_out_of_order", "buckets_as_they_complete", "no_overlap", "no_division"],
)
def test_overlap_check_fails_wrong_answers(comm, options, words):
    if comm.Get_size() == 1 and not options.keys() & {"register", "order", "at_the_end"}:
        pytest.skip("one rank's sum is its mean")
    fails(checks.check_overlapped_averaging, lambda m, c, g: overlapped(m, c, g, **options), *words)


def test_overlap_check_fails_a_forgotten_bucket(comm):
    fails(
        checks.check_overlapped_averaging,
        lambda m, c, g: overlapped(m, c, g, skip_last=True),
        "expected one per bucket",
    )


def test_overlap_check_names_the_step_when_the_state_is_not_reset(comm):
    fails(
        checks.check_overlapped_averaging,
        lambda m, c, g: overlapped(m, c, g, no_reset=True),
        "step 1 failed after step 0 went through",
        "start again from zero",
    )


def test_overlap_check_names_the_call_to_use_for_a_blocking_allreduce(comm):
    def blocking(model, comm, groups):
        def hook(p):
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy())
            p.grad /= comm.Get_size()

        for group in groups:
            for p in group:
                p.register_post_accumulate_grad_hook(hook)
        return lambda: None

    fails(checks.check_overlapped_averaging, blocking, "Iallreduce")


def test_overlap_check_fails_within_the_timeout_when_one_rank_skips_a_bucket(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank has no one to wait for")
    fails(
        lambda fn: checks.check_overlapped_averaging(fn, timeout=3),
        lambda m, c, g: overlapped(m, c, g, skip_last=c.Get_rank() == 0),
        "overlapped_averaging",
    )


# trains_with_allreduce ---------------------------------------------------------------


def no_communication(comm, x):
    return x.copy()


def doubled(comm, x):
    return 2 * allreduce_ring(comm, x)


def in_place(comm, x):
    """Sums into x and returns it: lab 03 promised a new array and x unchanged."""
    x[:] = allreduce_ring(comm, x)
    return x


def as_float64(comm, x):
    """Right sums, but always float64."""
    return allreduce_ring(comm, x.astype(np.float64))


def powers_of_two_only(comm, x):
    """Recursive doubling without the fold: wrong (or stuck) when P is not a power of two."""
    rank, size, total, distance = comm.Get_rank(), comm.Get_size(), x.copy(), 1
    while distance < size:
        incoming = np.empty_like(total)
        partner = rank ^ distance
        if partner < size:
            comm.Sendrecv(total, dest=partner, recvbuf=incoming, source=partner)
            total += incoming
        distance *= 2
    return total


def test_trains_with_check_passes_lab_03_algorithms(comm):
    checks.check_trains_with_allreduce(allreduce_ring)


@pytest.mark.parametrize("wrong", [no_communication, doubled], ids=lambda f: f.__name__)
def test_trains_with_check_fails_on_wrong_sums(comm, wrong):
    if comm.Get_size() == 1 and wrong is no_communication:
        pytest.skip("on one rank the input is the sum")
    fails(checks.check_trains_with_allreduce, wrong, "wrong at")


@pytest.mark.parametrize(
    "wrong, words",
    [(in_place, "new array"), (as_float64, "dtype float64, expected float32"), (powers_of_two_only, "on 3 ranks")],
    ids=["in_place", "float64", "pof2"],
)
def test_trains_with_check_holds_lab_03s_contract(comm, wrong, words):
    if comm.Get_size() < 3:
        pytest.skip("needs 3 ranks or more")
    fails(checks.check_trains_with_allreduce, wrong, words)


def test_average_gradients_check_names_a_float32_round_trip(comm):
    def through_float32(model, comm, allreduce):
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).float()
        mean = torch.as_tensor(allreduce(comm, flat.numpy())) / comm.Get_size()
        offset = 0
        for p in model.parameters():
            p.grad.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    fails(checks.check_average_gradients, through_float32, "float32 precision", "torch.float64")


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("broadcast_parameters", "ddlab.data_parallel.broadcast_parameters", ()),
        ("average_gradients", "ddlab.data_parallel.average_gradients", ()),
        ("train_step", "ddlab.data_parallel.DataParallel", ()),
        ("overlapped_averaging", "ddlab.data_parallel.DataParallel", ()),
        ("trains_with_allreduce", "ddlab.allreduce.allreduce_ring", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
