"""One rank of a fault-tolerant job of ddlab.resilience.job.run_job: `python -m ddlab.resilience.runner FOLDER`.

Loads FOLDER/target.pkl (cloudpickle), runs target(comm) on a duplicate of the world whose errors are
returned (MPI.ERRORS_RETURN), and writes the outcome (value, or error and MPI error class) to
FOLDER/result.RANK.pkl; a rank whose target returned leaves once every live rank is done (an Agree among the
survivors), one whose target raised at once. Kept out of the package's imports so that `python -m` runs it
cleanly.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import traceback
from pathlib import Path

from .job import Outcome, pid_file


def main(folder: Path) -> None:
    """One rank of the job: run the target on a world duplicate with errors returned; write the outcome."""
    import cloudpickle  # type: ignore[import-untyped]
    from mpi4py import MPI

    os.environ["DDLAB_JOB_FOLDER"] = str(folder)
    rank = MPI.COMM_WORLD.Get_rank()
    started = pid_file(folder, rank)  # run_job's sign that this rank started, and which process to look at
    part = started.with_name(started.name + ".part")
    part.write_text(str(os.getpid()))
    part.rename(started)
    # Where a rank was stuck, if it still runs near the deadline: the check names the call it waited in.
    stack = (folder / f"stack.{rank}.txt").open("w")
    faulthandler.dump_traceback_later(float((folder / "dump_after").read_text()), file=stack)
    MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        target = cloudpickle.loads((folder / "target.pkl").read_bytes())
        outcome = Outcome(value=target(comm))
    except MPI.Exception as err:
        outcome = Outcome(
            error=f"MPI.Exception: {err.Get_error_string()}\n{traceback.format_exc(limit=-3)}",
            error_class=err.Get_error_class(),
        )
    except BaseException as err:  # the student's error, reported by the check
        outcome = Outcome(error=f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-3)}")
    part = folder / f"result.{rank}.part"
    part.write_bytes(cloudpickle.dumps(outcome))
    part.rename(folder / f"result.{rank}.pkl")
    faulthandler.cancel_dump_traceback_later()
    # A rank whose part completed leaves only when every live rank is done: a rank that exits is a failed peer to
    # the others (ULFM), so leaving early could fail a rank that still has to receive what this one sent. Agree
    # completes among the survivors. A rank whose part raised leaves at once, so its peers fail fast, not at the
    # job's deadline.
    if outcome.error is None:
        try:
            MPI.COMM_WORLD.Agree(1)
        except MPI.Exception:
            pass  # some rank failed: the survivors agreed all the same
    # Leave without MPI_Finalize: after a failure, finalizing can wait on the dead; the outcome is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
