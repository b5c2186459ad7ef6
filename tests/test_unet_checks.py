"""The single-process checks of labs 06 and 07 pass the reference and fail plausible mistakes."""

from __future__ import annotations

import numpy as np
import pytest
from ddlab.checks import CheckFailed, check_balanced_split, check_gpipe, check_one_f_one_b, check_pipedream_partition
from ddlab.model_parallel import balanced_split, naive_split
from ddlab.pipeline import gpipe, one_f_one_b, pipedream_partition
from ddlab.runtime.reference import unguarded

# The library's own answers without their mark: the checks refuse them to an answer (see
# test_the_checks_refuse_the_library_s_own_answer), and these tests use them as valid answers and as
# the bases of wrong ones.
balanced_split = unguarded(balanced_split)
gpipe = unguarded(gpipe)
one_f_one_b = unguarded(one_f_one_b)
pipedream_partition = unguarded(pipedream_partition)


def greedy_without_search(costs, k):
    """Cuts when a stage passes the average: balanced-looking, not optimal."""
    target, bounds, total = sum(costs) / k, [0], 0.0
    for i, c in enumerate(costs):
        if total + c > target and i > bounds[-1] and len(bounds) < k:
            bounds.append(i)
            total = 0.0
        total += c
    while len(bounds) < k:  # too few stages: split the end
        bounds.append(bounds[-1] + 1)
    return sorted(set(bounds))[:k] + [len(costs)]


def test_balanced_split_check_passes_the_reference(capsys):
    check_balanced_split(balanced_split)
    check_balanced_split(lambda costs, k: [np.int64(b) for b in balanced_split(costs, k)])  # NumPy ints are ints
    check_balanced_split(lambda costs, k: tuple(balanced_split(costs, k)))
    assert capsys.readouterr().out.count("passed") == 3


@pytest.mark.parametrize(
    "wrong, says",
    [
        (lambda costs, k: naive_split(len(costs), k), "get the largest down to"),
        (greedy_without_search, "bounds"),
        (lambda costs, k: balanced_split(costs, k)[1:], "are not"),
        (lambda costs, k: None, "return a list"),
        (lambda costs, k: [float(b) for b in balanced_split(costs, k)], "return a list"),
        (lambda costs, k: [True, *balanced_split(costs, k)[1:]], "return a list"),
    ],
)
def test_balanced_split_check_fails_wrong_answers(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        check_balanced_split(wrong)


def gpipe_backwards_reversed(k, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def one_f_one_b_without_warmup(k, m, stage):
    ops = []
    for i in range(m):
        ops += [("F", i), ("B", i)]
    return ops


def one_f_one_b_warmup_too_long(k, m, stage):
    return one_f_one_b(k + 1, m, stage)


def test_schedule_checks_pass_the_reference(capsys):
    check_gpipe(gpipe)
    check_one_f_one_b(one_f_one_b)
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize(
    "check, wrong",
    [
        (check_gpipe, gpipe_backwards_reversed),
        (check_gpipe, one_f_one_b),
        (check_one_f_one_b, gpipe),
        (check_one_f_one_b, one_f_one_b_without_warmup),
        (check_one_f_one_b, one_f_one_b_warmup_too_long),
        (check_one_f_one_b, lambda k, m, stage: None),
    ],
)
def test_schedule_checks_fail_wrong_orders(check, wrong):
    with pytest.raises(CheckFailed, match="expected|returned"):
        check(wrong)


def test_partition_check_passes_the_reference_and_fails_mistakes():
    check_pipedream_partition(pipedream_partition)

    def ignores_messages(n, k, stage_time):
        return balanced_split([stage_time(i, i + 1) for i in range(n)], k)

    def one_stage_too_few(n, k, stage_time):
        return pipedream_partition(n, max(k - 1, 1), stage_time) if k > 1 else [0, n]

    for wrong, says in ((ignores_messages, "make the slowest"), (one_stage_too_few, "are not")):
        with pytest.raises(CheckFailed, match=says):
            check_pipedream_partition(wrong)


def test_partition_check_does_not_show_the_answer_for_malformed_bounds():
    from ddlab.checks.pipeline import _cases

    n, k, stage_time, _ = _cases()[0]

    def drops_the_end(n, k, stage_time):
        return pipedream_partition(n, k, stage_time)[:-1]

    with pytest.raises(CheckFailed, match="are not") as failure:
        check_pipedream_partition(drops_the_end)
    assert str(pipedream_partition(n, k, stage_time)) not in str(failure.value)


@pytest.mark.parametrize(
    "exercise, reference, others",
    [
        ("balanced_split", "ddlab.model_parallel.balanced_split", ()),
        ("gpipe", "ddlab.pipeline.gpipe", ()),
        ("one_f_one_b", "ddlab.pipeline.one_f_one_b", ()),
        ("pipedream_partition", "ddlab.pipeline.pipedream_partition", ()),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_the_checks_refuse_the_library_s_own_answer(refuses_the_reference, exercise, reference, others):
    refuses_the_reference(exercise, reference, *others)
