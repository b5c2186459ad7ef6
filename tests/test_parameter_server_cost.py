"""Lab 10's cost model: a server's step grows with the workers and shrinks with the shards; the ring's does not."""

import pytest
from ddlab.allreduce.cost import Link, predict
from ddlab.parameter_server.cost import GAMMA, allreduce_seconds, predicted, server_seconds

MACHINE = Link(alpha=1e-6, beta=1e-9, gamma=1e-10)


def test_server_time_is_2_p_gamma_m_g_over_s_plus_2_l():
    assert server_seconds(3, 1, 1000, MACHINE) == pytest.approx(2 * 3 * GAMMA * 1000 * 1e-9 + 2e-6)
    assert server_seconds(4, 2, 1000, MACHINE) == pytest.approx(server_seconds(2, 1, 1000, MACHINE))


def test_the_ring_is_lab_03s_model_and_nearly_flat_in_p():
    assert allreduce_seconds(3, 2**20, MACHINE) == pytest.approx(predict("ring", 3, GAMMA * 2**20, MACHINE))
    models = predicted([2, 8], 2**20, MACHINE)
    assert models["server"][1] / models["server"][0] == pytest.approx(4, rel=0.01)
    assert models["ring allreduce"][1] / models["ring allreduce"][0] < 2
