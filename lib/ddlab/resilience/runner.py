"""One rank of a fault-tolerant job of ddlab.resilience.job.run_job: `python -m ddlab.resilience.runner FOLDER`.

Loads FOLDER/target.pkl (cloudpickle), runs target(comm) on a duplicate of the world whose errors are
returned (MPI.ERRORS_RETURN), and writes the outcome (value, or error and MPI error class) to
FOLDER/result.RANK.pkl; a rank whose target returned leaves once every other rank has written its outcome or
exited, one whose target raised at once. Kept out of the package's imports so that `python -m` runs it
cleanly.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback
from pathlib import Path

from .job import Outcome, pid_file, rank_alive


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
    # A rank whose part completed leaves only when every other rank is done (its outcome written) or gone: a rank
    # that exits is a failed peer to the others (ULFM), so leaving early could fail a rank that still has to receive
    # what this one sent. Watched from the job's folder, not agreed by MPI: a collective at the exit could wait past
    # the job's deadline with every outcome written. A rank whose part raised leaves at once, so its peers fail
    # fast, not at the job's deadline. (The traceback dump stays armed: a wait here is named too.)
    if outcome.error is None:
        others = [r for r in range(MPI.COMM_WORLD.Get_size()) if r != rank]
        while any(not (folder / f"result.{r}.pkl").exists() and rank_alive(folder, r) for r in others):
            time.sleep(0.01)
    faulthandler.cancel_dump_traceback_later()
    # Leave without MPI_Finalize: after a failure, finalizing can wait on the dead; the outcome is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
