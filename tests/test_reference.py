"""The mark on the library's own answers (ddlab.runtime.reference): refused only while its exercise is answered."""

from __future__ import annotations

import pytest
from ddlab.runtime.reference import ReferenceCalled, answering, reference, references_of


@reference("double")
def double(x: int) -> int:
    return 2 * x


@reference("build")
class Built:
    def __init__(self, n: int) -> None:
        self.n = n


def test_a_reference_runs_outside_a_check_and_for_other_exercises():
    assert double(2) == 4
    with answering("average"):
        assert double(3) == 6  # a building block of another exercise
    assert references_of(double) == ("double",) and references_of(Built) == ("build",)


def test_a_reference_is_refused_while_its_exercise_is_answered():
    with pytest.raises(ReferenceCalled, match=r"called .*double, the library's own answer"):
        with answering("double"):
            double(1)
    with pytest.raises(ReferenceCalled, match=r"Built"):
        with answering("build"):
            Built(3)
    assert double(5) == 10  # and runs again once the answer is done


def test_an_answer_that_catches_the_refusal_still_fails():
    with pytest.raises(ReferenceCalled):
        with answering("double"):
            try:
                double(1)
            except ReferenceCalled:
                pass


def test_a_mark_names_its_exercise():
    with pytest.raises(ValueError, match="needs the exercise"):
        reference()
