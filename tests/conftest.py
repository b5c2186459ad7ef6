"""Fixtures shared by test modules: the private single-node Slurm (tests/slurm/single_node.py).

The Slurm node starts once per session, at its first use, and stops at the end: the
Slurm profile tests (tests/test_slurm.py) and the JupyterHub test (tests/browser/)
run on the same node. Each module that uses it sees it through $SLURM_CONF.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
IN_CI = os.environ.get("CI", "").lower() == "true"

_spec = importlib.util.spec_from_file_location("single_node", HERE / "slurm" / "single_node.py")
single_node = sys.modules["single_node"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(single_node)


@pytest.fixture(scope="session")
def slurm_node():
    """A running single-node Slurm, installed (apt-get, as root) if need be."""
    if os.environ.get("DDLAB_SLURM_TESTS") == "0" and not IN_CI:
        pytest.skip("Slurm tests skipped: DDLAB_SLURM_TESTS=0.")
    try:
        single_node.install(timeout=300)
    except single_node.CannotInstall as err:
        if IN_CI:
            pytest.fail(f"CI=true, so the Slurm tests must run, but Slurm could not be installed: {err}")
        pytest.skip(
            f"Slurm tests skipped: {err}. They install Slurm with apt-get as root (Debian, Ubuntu), "
            "and always run in CI."
        )
    node = single_node.SingleNode.create()
    try:
        node.start()
        yield node
    finally:
        node.stop()
    assert not node.processes(), "Slurm daemons or job processes survived stop()"


@pytest.fixture(scope="module")
def slurm(slurm_node):
    """The session's Slurm node; $SLURM_CONF points every Slurm command at it during this module."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in slurm_node.env.items():
            env.setenv(name, value)
        # The test node claims more CPUs than this machine has, so Open MPI does not know its
        # ranks share cores: make them yield while they wait, as it does when oversubscribed.
        env.setenv("OMPI_MCA_mpi_yield_when_idle", "1")
        yield slurm_node


@pytest.fixture(scope="session")
def course_site(tmp_path_factory):
    """The course site, built once as `make site` builds it: (its html folder, its settings).

    Set-up installs the site's pinned tools (docs/site/requirements-site.txt) with pip where
    they are missing; where that fails the tests skip saying why, and with CI=true they fail.
    """
    if importlib.util.find_spec("myst_nb") is None:
        requirements = HERE.parent / "docs" / "site" / "requirements-site.txt"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "-r", str(requirements)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            message = f"the site's tools could not be installed (pip install -r {requirements}): {done.stderr[-1500:]}"
            if IN_CI:
                pytest.fail(f"CI=true, so the site must build, but {message}")
            pytest.skip(f"site tests skipped: {message}")
    from ddlab.tools.site import build, load_settings

    settings = load_settings()
    return build(tmp_path_factory.mktemp("site"), settings).parent, settings


def _calling(reference):
    """An answer that only calls `reference`: a function or class, or an autograd Function's forward and backward."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(reference, type) and issubclass(reference, torch.autograd.Function):
        return type(
            "Calling",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(lambda ctx, *args: reference.forward(ctx, *args)),
                "backward": staticmethod(lambda ctx, *grads: reference.backward(ctx, *grads)),
            },
        )
    return lambda *args, **kwargs: reference(*args, **kwargs)


@pytest.fixture
def seed(monkeypatch):
    """seed(S) grades on the draw of seed S: DDLAB_GRADE_SEED in this process's environment (on every rank of a
    multi-rank test), as `ddlab grade --seed S` sets it in the kernel and its engines; unset until called."""
    from ddlab.checks._draw import SEED_VARIABLE

    def grading(value: int | str) -> None:
        monkeypatch.setenv(SEED_VARIABLE, str(value))

    monkeypatch.delenv(SEED_VARIABLE, raising=False)
    return grading


#: The seeds the tests of the grader's draw (tests/test_grading_draws*.py, tests/mpi/test_grading_draws*.py) grade on.
GRADING_SEEDS = (11, 2027, 90210)


@pytest.fixture
def grading_seeds() -> tuple[int, ...]:
    """The seeds the tests of the grader's draw grade on, in order."""
    return GRADING_SEEDS


@pytest.fixture
def passes_on_every_seed(seed, capsys, monkeypatch):
    """passes(run, *, without, seeds, comm, ending, nothing_else) -> the "passed:" lines of a right answer's runs.

    Calls run() (a check given a right answer) with no seed set if `without`, then under each of `seeds`, and asserts
    one "passed:" line a run: the unseeded one naming no seed, each other ending with "(the grader's draw, seed S)"
    and its seed S (holding it anywhere if not `ending`). With `comm` (a multi-rank test), the lines are printed and
    asserted on its rank 0 only; the other ranks get []. With `nothing_else`, the captured output must hold nothing
    but those lines."""
    from ddlab.checks._draw import SEED_VARIABLE

    def passes(run, *, without=True, seeds=GRADING_SEEDS, comm=None, ending=True, nothing_else=False) -> list[str]:
        if without:
            monkeypatch.delenv(SEED_VARIABLE, raising=False)
            run()
        for value in seeds:
            seed(value)
            run()
        if comm is not None and comm.Get_rank() != 0:
            return []
        said = capsys.readouterr().out.splitlines()
        lines = [line for line in said if line.startswith("passed:")]
        assert len(lines) == without + len(seeds), said
        assert not nothing_else or lines == said, said
        assert not without or "seed" not in lines[0], lines
        for line, value in zip(lines[without:], seeds):
            named = f"(the grader's draw, seed {value})"
            assert line.endswith(named) if ending else named in line, lines
        return lines

    return passes


@pytest.fixture
def seed_with():
    """first(draws_it, check_name, among=the grading seeds): the first seed of `among` whose draw for check_name meets
    draws_it (where an answer fitted to the notebook's cases shows its gap); draws_it None: any draw does."""
    from ddlab.checks._draw import Draw

    def first(draws_it, check_name: str, *, among=GRADING_SEEDS) -> int:
        return next(s for s in among if draws_it is None or draws_it(Draw(s, check_name)))

    return first


@pytest.fixture
def refuses_the_reference():
    """refuses(exercise, "module.name", *others): check_<exercise>(answer, *others) fails with the refusal when the
    answer is the library's own (as it is, an alias) and when it only calls it, on every rank at its first call."""

    def refuses(exercise: str, reference: str, *others) -> None:
        import importlib

        import ddlab.checks

        module, name = reference.rsplit(".", 1)
        found = getattr(importlib.import_module(module), name)
        for answer in (found, _calling(found)):
            with pytest.raises(ddlab.checks.CheckFailed, match="the library's own answer"):
                getattr(ddlab.checks, f"check_{exercise}")(answer, *others)

    return refuses
