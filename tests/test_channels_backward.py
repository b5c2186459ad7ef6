"""Filter and channel parallel convolutions send no backward message for the data's gradient (one process)."""

from __future__ import annotations

import torch
from ddlab.intra_layer import ChannelParallelConv, FilterParallelConv
from mpi4py import MPI


class Recording:
    """COMM_SELF that records the collectives called on it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def Allreduce(self, *args, **kwargs) -> None:
        self.calls.append("Allreduce")
        MPI.COMM_SELF.Allreduce(*args, **kwargs)

    def Allgather(self, *args, **kwargs) -> None:
        self.calls.append("Allgather")
        MPI.COMM_SELF.Allgather(*args, **kwargs)

    def Allgatherv(self, *args, **kwargs) -> None:
        self.calls.append("Allgatherv")
        MPI.COMM_SELF.Allgatherv(*args, **kwargs)


def _run(layer, x_grad: bool) -> tuple[list[str], torch.Tensor | None]:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=x_grad)
    weight = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    comm = Recording()
    layer.apply(x, weight, None, comm, 1).square().sum().backward()
    assert weight.grad is not None
    return comm.calls, x.grad


def test_filter_conv_allreduces_the_input_gradient_only_when_wanted():
    calls, grad = _run(FilterParallelConv, x_grad=True)
    assert calls.count("Allreduce") == 1 and grad is not None
    calls, grad = _run(FilterParallelConv, x_grad=False)  # a first layer, on the data
    assert "Allreduce" not in calls and grad is None


def test_channel_conv_sends_nothing_backward():
    for wanted in (True, False):
        calls, grad = _run(ChannelParallelConv, x_grad=wanted)
        assert calls == ["Allreduce"] and (grad is not None) == wanted  # the forward's sum only
