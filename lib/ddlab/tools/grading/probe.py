"""What the grader asks between cells: are the engines answering, and is an exercise the library's own?

`report(name)` runs in the student's kernel and prints one JSON line; its
`reference_name` runs on every engine, where the student's functions live.
"""

from __future__ import annotations

import json
import sys

#: Seconds the engines get to answer; engines stuck in MPI or dead do not.
ANSWER_TIMEOUT = 15.0


def reference_name(name: str | None) -> str | None:
    """On an engine: 'package.function' if the engine's `name` is one of ddlab's own functions, by identity
    (named from the package that exports it, e.g. ddlab.allreduce.allreduce_ring)."""
    from IPython import get_ipython

    shell = get_ipython()
    value = shell.user_ns.get(name) if shell is not None and name else None
    if value is None:
        return None
    home = getattr(value, "__module__", None) or ""
    found = []  # where it is defined, or a package above re-exporting it: the shortest is its public name
    for module_name, module in list(sys.modules.items()):
        if (
            module_name.split(".")[0] == "ddlab"
            and module_name != __name__
            and f"{home}.".startswith(f"{module_name}.")
        ):
            found += [
                f"{module_name}.{attribute}"
                for attribute, candidate in list(vars(module).items())
                if candidate is value
            ]
    return min(found, key=len, default=None)


def report(name: str | None = None) -> None:
    """In the kernel: print {"healthy": all engines answered, "reference": what `name` is, if ddlab's}.

    "healthy" is null when no cluster is running (before the notebook starts one, or after it stops it); an
    engine the notebook killed on purpose (`cluster.kill_engine`, lab 19) is not missed.
    """
    from ...runtime import cluster

    running = cluster.current()
    verdict: dict[str, object] = {"healthy": None if running is None else False, "reference": None}
    if running is not None and running.healthy():
        try:
            answers = running.client[:].apply_async(reference_name, name).get(timeout=ANSWER_TIMEOUT)
            verdict = {"healthy": True, "reference": answers[0]}
        except Exception as err:  # dead, stuck or unregistering engines: the grader restarts them
            verdict["problem"] = f"{type(err).__name__}: {err}"
    print(json.dumps(verdict))
