"""Lab 13's ZeRO-3 unit check (one process): it accepts hooks placed right, written two ways, and fails the wrong ones."""

from __future__ import annotations

import functools

import pytest
import torch
from ddlab.checks import CheckFailed, check_zero3_unit


def zero3_hooks(
    unit,
    gather,
    free,
    reduce,
    *,
    free_after_forward=True,
    gather_for_backward=True,
    reduce_early=False,
    free_after_reduce=True,
    input_dtype=None,
    output_dtype=None,
    grad_dtype=None,
    clamp_input=False,
    reused_output=False,
):
    """The lab's answer (the switches make the wrong ones): module hooks, a hook on the output's gradient,
    and post-accumulate-grad hooks that count the unit's gradients. The dtype switches cast a tensor to a
    fixed dtype (input_dtype=unit: to the unit's own, which is valid)."""
    params = list(unit.parameters())
    left = [0]
    kept = []

    def before_forward(module, args):
        gather()
        if clamp_input:  # normalise the input in place
            args[0].clamp_(-0.5, 0.5)
        if input_dtype == "unit":
            return (args[0].to(params[0].dtype),)
        if input_dtype is not None:
            return (args[0].to(input_dtype),)
        return None

    def before_backward(grad):
        if gather_for_backward:
            gather()
        left[0] = len(params)
        return grad.to(grad_dtype) if grad_dtype is not None else grad

    def after_forward(module, args, output):
        if free_after_forward:
            free()
        if output.requires_grad:
            output.register_hook(before_backward)
        if output_dtype is not None:
            return output.to(output_dtype)
        if reused_output:  # one buffer per unit, refilled every step
            if not kept or kept[0].shape != output.shape:
                kept[:] = [torch.empty_like(output)]
            return kept[0].copy_(output)
        return None

    def on_gradient(param):
        left[0] -= 1
        if left[0] == 0 or (reduce_early and left[0] == len(params) - 1):
            reduce()
            if free_after_reduce:
                free()

    unit.register_forward_pre_hook(before_forward)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(on_gradient)


def zero3_by_tensor_counts(unit, gather, free, reduce):
    """Another valid answer: one hook object per unit, gradients counted in a set of parameter ids."""

    class Hooks:
        def __init__(self):
            self.done = set()
            unit.register_forward_pre_hook(self.forward_pre)
            unit.register_forward_hook(self.forward)
            for p in unit.parameters():
                p.register_post_accumulate_grad_hook(self.gradient)

        def forward_pre(self, module, args):
            gather()

        def forward(self, module, args, output):
            free()
            output.register_hook(self.backward_pre)

        def backward_pre(self, grad):
            gather()
            self.done = set()

        def gradient(self, param):
            self.done.add(id(param))
            if len(self.done) == len(list(unit.parameters())):
                reduce()
                free()

    Hooks()


@pytest.mark.parametrize(
    "fn",
    [zero3_hooks, zero3_by_tensor_counts, functools.partial(zero3_hooks, input_dtype="unit")],
    ids=["counter", "set of ids", "input cast to the unit's dtype"],
)
def test_zero3_check_accepts(fn) -> None:
    check_zero3_unit(fn)


@pytest.mark.parametrize(
    "switch, message",
    [
        ({"free_after_forward": False}, "not freed after its forward"),
        ({"gather_for_backward": False}, "gather\\(\\) the unit again before its backward"),
        ({"reduce_early": True}, "reduce-scattered before its backward ended"),
        ({"free_after_reduce": False}, "still holds its parameters after backward"),
        ({"input_dtype": torch.float64}, "float32, step 0: the forward failed"),
        ({"output_dtype": torch.float64}, "float32, step 0: the forward failed"),
        ({"grad_dtype": torch.float64}, "float32, step 0: backward failed"),
        ({"clamp_input": True}, "input was changed in place"),
        ({"reused_output": True}, "step 1: backward failed.*reused across steps"),
    ],
    ids=str,
)
def test_zero3_check_fails(switch, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_zero3_unit(lambda *args: zero3_hooks(*args, **switch))
