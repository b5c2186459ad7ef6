"""Lab 10's checks catch wrong gates and wrong gossip steps, and accept valid alternatives."""

import numpy as np
import pytest

from ddlab.checks import CheckFailed, check_gossip_step, check_ssp_gate
from ddlab.parameter_server import gossip_step, may_start


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
