"""The `ddlab` command: `ddlab doctor` checks an installation, `ddlab grade` grades submitted notebooks.

$ ddlab doctor [--profile P] [-n N] [--timeout S]
$ ddlab grade --lab NN SUBMISSIONS...
"""

from __future__ import annotations

import argparse
import sys

from . import doctor
from .grading import cli as grading


def main(argv: list[str] | None = None) -> int:
    """Run the `ddlab` command on argv (default sys.argv[1:]); the exit status: 1 if a check failed.

    `doctor` runs `ddlab.tools.doctor.run`; `grade` grades collected notebooks (`ddlab.tools.grading.cli`).
    """
    parser = argparse.ArgumentParser(prog="ddlab", description="Tools of the ddlab course kit.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("doctor", help="check MPI and a cluster profile, and say what to fix")
    check.add_argument(
        "--profile", default=None, help="cluster profile: local, slurm, jupyterhub (default: $DDLAB_PROFILE or local)"
    )
    check.add_argument("-n", type=int, default=2, help="number of engines to start (default 2)")
    check.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the engines (default 120)")
    grading.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "grade":
        return grading.main(args)
    if args.n < 1:
        parser.error("-n must be at least 1")
    report = doctor.run(args.profile, args.n, args.timeout)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
