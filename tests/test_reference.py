"""The mark on the library's own answers (ddlab.runtime.reference): refused only to the student's code, only
while its exercise is checked."""

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
    with answering("average") as called:
        assert double(3) == 6  # a building block of another exercise
    assert called == []
    assert references_of(double) == ("double",) and references_of(Built) == ("build",)


def test_a_reference_is_refused_to_student_code_while_its_exercise_is_checked():
    with answering("double") as called, pytest.raises(ReferenceCalled, match=r"called .*double, the library's own"):
        double(1)
    assert called == [f"{__name__}.double"]
    with answering("build"), pytest.raises(ReferenceCalled, match=r"Built"):
        Built(3)
    assert double(5) == 10  # and runs again once the check is done


def test_a_refusal_the_answer_catches_is_remembered():
    with answering("double") as called:
        try:
            double(1)
        except ReferenceCalled:
            pass
    assert called


def test_through_a_library_helper_too():
    import functools

    via_stdlib = functools.partial(double, 4)  # a frame of the standard library between
    with answering("double"), pytest.raises(ReferenceCalled):
        via_stdlib()


def test_a_mark_names_its_exercise():
    with pytest.raises(ValueError, match="needs the exercise"):
        reference()
