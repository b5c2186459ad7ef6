"""The mark on the library's own answers (ddlab.runtime.reference): refused only to the student's code, only
while its exercise is checked."""

from __future__ import annotations

import pytest
from ddlab.runtime.reference import ReferenceCalled, answering, library_thread, reference, references_of


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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_the_answer_starts_is_the_answer_s():
    """A reference as a thread's target has no frame of the answer above it: the thread is the answer's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    with answering("double") as called:
        with ThreadPoolExecutor(1) as pool, pytest.raises(ReferenceCalled):
            pool.submit(double, 2).result()
        target = threading.Thread(target=double, args=(3,))  # raises in the thread; the refusal is remembered
        target.start()
        target.join()
    assert len(called) == 2
    with answering("double") as called:
        with ThreadPoolExecutor(1, initializer=library_thread) as pool:  # a thread of the library's
            assert pool.submit(double, 4).result() == 8
        helper = threading.Thread(target=double, args=(5,))
        library_thread(helper)
        helper.start()
        helper.join()
    assert called == []
    with answering("double") as called:  # named as the library names its threads, but not the library's
        with ThreadPoolExecutor(1, thread_name_prefix="ddlab-allreduce") as pool, pytest.raises(ReferenceCalled):
            pool.submit(double, 6).result()
    assert len(called) == 1


def test_torch_runs_backward_under_the_caller_s_frames():
    """An autograd Function's backward is called by torch's engine; the caller of backward() decides."""
    import torch

    class Twice(torch.autograd.Function):
        @staticmethod
        @reference("twice")
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        @reference("twice_backward")
        def backward(ctx, grad):
            return 2 * grad

    x = torch.ones(3, requires_grad=True)
    with answering("twice_backward") as called:
        y = Twice.apply(x)  # a forward of another exercise runs
        with pytest.raises(ReferenceCalled):
            y.sum().backward()
    assert called == [f"{__name__}.{Twice.__qualname__}.backward"]


def test_an_answer_that_is_a_reference_is_named_by_marked():
    """A check calls the answer itself, so its frames decide nothing: the checks look at what they are given."""
    import functools

    import torch
    from ddlab.runtime.reference import marked

    class Mine(Built):  # a subclass
        pass

    class Function(torch.autograd.Function):
        forward = staticmethod(reference("fn")(lambda ctx, x: x))

    class Sub(Function):
        pass

    alias = double
    assert marked([alias], "double") == f"{__name__}.double"
    assert marked([functools.partial(double, 2)], "double") == f"{__name__}.double"
    assert marked([1, Mine], "build") == f"{__name__}.Built"
    assert marked([Sub], "fn") is not None and marked([Sub], "other") is None
    assert marked([lambda x: double(x)], "double") is None  # refused when it runs, by the stack rule


def test_unguarded_gives_the_library_s_tests_the_reference_without_its_mark():
    import torch
    from ddlab.runtime.reference import marked, unguarded

    class Function(torch.autograd.Function):
        @staticmethod
        @reference("fn")
        def forward(ctx, x):
            return x + 1

        @staticmethod
        def backward(ctx, grad):
            return grad

    with answering("double") as called, answering("build"), answering("fn"):
        assert unguarded(double)(2) == 4 and unguarded(Built)(3).n == 3
        assert unguarded(Function).apply(torch.zeros(1)).item() == 1.0
    assert called == [] and marked([unguarded(Built), unguarded(Function)], "build") is None


def test_an_answer_written_in_a_notebook_cell_is_the_student_s(capsys):
    """A cell's code runs from a file IPython names (as each engine's under %%px): not the library's."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell(
        "import ddlab.checks\nfrom ddlab.runtime.blocks import block_range\n"
        "def mine(n, rank, size):\n    return block_range(n, rank, size)\n"
        "ddlab.checks.check_block_range(mine)"
    )
    shown = capsys.readouterr().out
    assert "your answer called ddlab.runtime.blocks.block_range, the library's own answer" in shown
