"""Lab 17's checks: each fails the wrong answers of its class, passes valid alternatives, refuses the library's own.

Every rank runs the same tests; the checks make all ranks raise the same error. The classes are
issue 51's item 5: an op list violating a dependency (a B before its F, a W before its B, a stage
waiting for a gradient its neighbour computes later) fails naming the first violation; an executor
that waits forever fails within the deadline naming the stage and op; m not a multiple of p and
p = 1 are among the sizes tried; a W that drops a weight's gradient or runs twice fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ddlab.checks import CheckFailed, check_run_zero_bubble, check_split_backward, check_zb_h1, check_zb_v
from ddlab.pipeline import micro_batch_loss, zero_bubble
from ddlab.pipeline.zero_bubble import backward_input, backward_weight, forward_recorded
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


# 17.1 the split backward ------------------------------------------------------------------


def own_input(y, grad_y, x, records):
    """A valid B of the student's own: a dict for W, clones instead of views."""
    wanted = ([x] if x.requires_grad else []) + [z for _, _, z in records]
    grads = torch.autograd.grad(y, wanted, grad_y)
    grad_x = grads[0] if x.requires_grad else None
    gs = grads[len(grads) - len(records) :]
    return grad_x, {n: (layer, a.detach().clone(), g) for n, ((layer, a, _), g) in enumerate(zip(records, gs))}


def own_weight(pending):
    for layer, a, g in pending.values():
        a2, g2 = a.flatten(0, -2), g.flatten(0, -2)
        layer.weight.grad = layer.weight.grad + torch.einsum("ro,ri->oi", g2, a2)
        if layer.bias is not None:
            layer.bias.grad = layer.bias.grad + g2.sum(0)


def retaining_input(y, grad_y, x, records):
    """Keeps the graph and each layer's output for W (autograd to the weights later)."""
    wanted = ([x] if x.requires_grad else []) + [z for _, _, z in records]
    grads = torch.autograd.grad(y, wanted, grad_y, retain_graph=True)
    return (grads[0] if x.requires_grad else None), [
        (layer, z, g) for (layer, _, z), g in zip(records, grads[len(grads) - len(records) :])
    ]


def undetached_input(y, grad_y, x, records):
    """Keeps each layer's input as the forward made it: with its grad_fn, so the graph behind it stays."""
    grad_x, pending = own_input(y, grad_y, x, records)
    return grad_x, {n: (layer, a, g) for n, ((layer, a, _), (_, _, g)) in enumerate(zip(records, pending.values()))}


def autograd_weight(pending):
    for layer, z, g in pending:
        params = [q for q in (layer.weight, layer.bias) if q is not None]
        for q, grad in zip(params, torch.autograd.grad(z, params, g)):
            q.grad = grad if q.grad is None else q.grad + grad


def whole_in_b(y, grad_y, x, records):
    """The whole backward in B: weight gradients too early."""
    y.backward(grad_y)
    return x.grad, {}


def weight_twice(pending):
    own_weight(pending)
    own_weight(pending)


def drops_bias(pending):
    for layer, a, g in pending.values():
        layer.weight.grad += g.reshape(-1, g.shape[-1]).T @ a.reshape(-1, a.shape[-1])


def overwrites(pending):
    for layer, a, g in pending.values():
        a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        layer.weight.grad = g2.T @ a2
        if layer.bias is not None:
            layer.bias.grad = g2.sum(0)


def weights_by_autograd_in_b(y, grad_y, x, records):
    """Differentiates to the weights in B too and hands W their gradients: W's work done in B."""
    params = [q for layer, _, _ in records for q in layer.parameters()]
    grads = torch.autograd.grad(y, ([x] if x.requires_grad else []) + params, grad_y)
    return (grads[0] if x.requires_grad else None), list(zip(params, grads[len(grads) - len(params) :]))


def adds_what_b_computed(pending):
    for q, g in pending:
        q.grad = g.clone() if q.grad is None else q.grad + g


def delegates_b(y, grad_y, x, records):
    return zero_bubble.backward_input(y, grad_y, x, records)


def test_split_backward_passes_the_students_own_valid_answer():
    check_split_backward(own_input, own_weight)


@pytest.mark.parametrize(
    "b, w, words",
    [
        (retaining_input, autograd_weight, "stay alive for W"),
        (undetached_input, own_weight, "stay alive for W .*grad_fn"),
        (whole_in_b, own_weight, "changed a parameter's .grad"),
        (weights_by_autograd_in_b, adds_what_b_computed, "differentiated to parameter 0 .*W's work"),
        (own_input, weight_twice, "differs from the whole backward"),
        (own_input, drops_bias, "parameter 1"),
        (own_input, overwrites, "differs from the whole backward"),
        (delegates_b, own_weight, "the library's own answer"),
    ],
    ids=[
        "keeps-the-graph",
        "keeps-a-with-its-grad-fn",
        "weights-in-b",
        "weight-gradients-in-b",
        "w-twice",
        "w-drops-bias",
        "w-overwrites",
        "library",
    ],
)
def test_split_backward_fails(b, w, words):
    with pytest.raises(CheckFailed, match=words):
        check_split_backward(b, w)


# 17.2 ZB-H1's op list --------------------------------------------------------------------


def trailing_w_reversed(p, m, s):
    """A valid alternative: the W's left at the end in another order."""
    ops = own_zb_h1(p, m, s)
    k = len(ops)
    while k and ops[k - 1][0] == "W":
        k -= 1
    return ops[:k] + ops[k:][::-1]


def own_zb_h1(p, m, s):
    warm = min(p - s - 1, m)
    fb = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        fb += [("F", warm + i), ("B", i)]
    fb += [("B", i) for i in range(m - warm, m)]
    out, w = [], 0
    for op in fb:
        out.append(op)
        if op[0] == "B" and op[1] >= s:
            out.append(("W", w))
            w += 1
    return out + [("W", j) for j in range(w, m)]


def w_right_after_b(p, m, s):
    return [o for op in own_zb_h1(p, m, s) if op[0] != "W" for o in ([op, ("W", op[1])] if op[0] == "B" else [op])]


def cross_deadlock(p, m, s):
    """Stage 1 runs F1 before F0 while stage 0 runs B0 before F1: each waits for the other (p >= 2, m >= 2)."""
    ops = own_zb_h1(p, m, s)
    if p >= 2 and m >= 2 and s == 0:
        return [("F", 0), ("B", 0), ("W", 0)] + [op for op in ops if op not in (("F", 0), ("B", 0), ("W", 0))]
    if p >= 2 and m >= 2 and s == 1:
        return [("F", 1)] + [op for op in ops if op != ("F", 1)]
    return ops


def delegates_h1(p, m, s):
    return zero_bubble.zb_h1(p, m, s)


def test_zb_h1_passes_valid_orders():
    check_zb_h1(own_zb_h1)
    check_zb_h1(trailing_w_reversed)


@pytest.mark.parametrize(
    "fn, words",
    [
        (
            lambda p, m, s: [("B", 0)] + [op for op in own_zb_h1(p, m, s) if op != ("B", 0)],
            r"\('B', 0\) at position 0 comes before \('F', 0\)",
        ),
        (
            lambda p, m, s: [("W", 0)] + [op for op in own_zb_h1(p, m, s) if op != ("W", 0)],
            r"\('W', 0\) at position 0 comes before \('B', 0\)",
        ),
        (cross_deadlock, r"deadlock: stage 0 at \('B', 0\)"),
        (lambda p, m, s: own_zb_h1(p, m, s)[:-1], "is missing"),
        (lambda p, m, s: own_zb_h1(p, m, s) + [("W", 0)], "appears 2 times"),
        (w_right_after_b, "your step takes"),
        (zero_bubble.zb_h2, "activations alive"),
        (delegates_h1, "the library's own answer"),
    ],
    ids=["b-before-f", "w-before-b", "deadlock", "w-missing", "w-twice", "1f1b", "too-much-memory", "library"],
)
def test_zb_h1_fails(fn, words):
    with pytest.raises(CheckFailed, match=words):
        check_zb_h1(fn)


# 17.3 the executor ---------------------------------------------------------------------


def plain(comm, layers, ops, inputs, targets, bug=None):
    """A student's executor on Isend/Recv of NumPy arrays, the split backward from 17.1, or one with a bug."""
    rank, size = comm.Get_rank(), comm.Get_size()
    kept, waiting, losses, sends = {}, {}, {}, []

    def post(t, dest, tag):
        buf = t.detach().numpy().astype(np.float64)
        sends.append((comm.Isend(buf, dest, tag), buf))

    def take(source, tag):
        buf = np.empty(tuple(inputs[0].shape), np.float64)
        comm.Recv(buf, source, tag + 1000 * (bug == "wrong tag"))
        return torch.from_numpy(buf)

    for kind, i in ops:
        if kind == "F":
            x = inputs[i] if rank == 0 else take(rank - 1, i).requires_grad_()
            y, records = forward_recorded(layers, x)
            if rank == size - 1:
                y = micro_batch_loss(y, targets[i])
                losses[i] = y.item()
            else:
                post(y, rank + 1, i)
            kept[i] = (x, y, records)
        elif kind == "B":
            x, y, records = kept.pop(i)
            grad = None if rank == size - 1 else take(rank + 1, i)
            if bug == "whole backward in b":
                y.backward(grad)
                grad_x, waiting[i] = (x.grad if rank > 0 else None), []
            else:
                grad_x, waiting[i] = backward_input(y, grad, x, records)
            if bug in ("w in b", "only w in b"):
                backward_weight(waiting[i])
            if bug == "only w in b":
                waiting[i] = []
            if rank > 0:
                post(grad_x, rank - 1, i)
        elif bug != "skips w":
            if bug == "w twice":
                backward_weight(waiting[i])
            backward_weight(waiting.pop(i))
    MPI.Request.Waitall([r for r, _ in sends])
    return [losses[i] for i in sorted(losses)]


def test_run_zero_bubble_passes_a_plain_executor():
    check_run_zero_bubble(plain)


def pickled(comm, layers, ops, inputs, targets):
    """Another valid executor: pickled tensors (isend/recv), the ops taken by index, a Wait per request."""
    rank, last = comm.Get_rank(), comm.Get_rank() == comm.Get_size() - 1
    kept, waiting, losses, requests = {}, {}, [None] * len(inputs), []
    for n in range(len(ops)):
        kind, i = ops[n]
        if kind == "F":
            x = inputs[i] if rank == 0 else comm.recv(source=rank - 1, tag=i).requires_grad_()
            y, records = forward_recorded(layers, x)
            if last:
                y = micro_batch_loss(y, targets[i])
                losses[i] = float(y.detach())
            else:
                requests.append(comm.isend(y.detach(), rank + 1, i))
            kept[i] = (x, y, records)
        elif kind == "B":
            x, y, records = kept.pop(i)
            grad_x, waiting[i] = backward_input(y, None if last else comm.recv(source=rank + 1, tag=i), x, records)
            if rank > 0:
                requests.append(comm.isend(grad_x, rank - 1, i))
        else:
            backward_weight(waiting.pop(i))
    for request in requests:
        request.wait()
    return losses if last else []


def test_run_zero_bubble_passes_another_valid_executor():
    check_run_zero_bubble(pickled)


@pytest.mark.parametrize(
    "bug, words",
    [
        ("skips w", "has no gradient"),
        ("w twice", "2 means a W ran twice"),
        ("w in b", "2 means a W ran twice"),
        ("only w in b", r"when B of micro-batch 0 sent .* the weights' gradients were computed in B"),
        ("whole backward in b", r"when B of micro-batch 0 sent .* the weights' gradients were computed in B"),
        ("wrong tag", r"stage 0 was running op \('B', 0\)"),
    ],
)
def test_run_zero_bubble_fails(bug, words):
    def wrong(comm, layers, ops, inputs, targets):
        return plain(comm, layers, ops, inputs, targets, bug=bug)

    with pytest.raises(CheckFailed, match=words):
        check_run_zero_bubble(wrong, timeout=2.0 if bug == "wrong tag" else 10.0)


def test_run_zero_bubble_refuses_the_library():
    def delegates(comm, layers, ops, inputs, targets):
        return zero_bubble.run_split(comm, [layers], ops, inputs, targets)

    with pytest.raises(CheckFailed, match="the library's own answer"):
        check_run_zero_bubble(delegates)


# 17.4 ZB-V's op list ---------------------------------------------------------------------


def test_zb_v_fails_wrong_lists_and_refuses_the_library():
    with pytest.raises(CheckFailed, match="is missing"):
        check_zb_v(lambda p, m, r: [op for op in zero_bubble._greedy_v(p, m)[r] if op != ("W", 1, m - 1)])
    with pytest.raises(CheckFailed, match=r"your step takes .*\(the V\)"):
        check_zb_v(
            lambda p, m, r: [
                o
                for op in zero_bubble._greedy_v(p, m)[r]
                if op[0] != "W"
                for o in ([op, ("W", *op[1:])] if op[0] == "B" else [op])
            ]
        )
    with pytest.raises(CheckFailed, match="the library's own answer"):
        check_zb_v(lambda p, m, r: zero_bubble.zb_v(p, m, r))


def test_zb_v_passes_a_valid_list():
    check_zb_v(lambda p, m, r: zero_bubble._greedy_v(p, m)[r])
