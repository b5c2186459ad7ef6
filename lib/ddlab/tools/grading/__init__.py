"""Grade collected lab notebooks: `ddlab grade --lab 03 SUBMISSIONS...`.

Each submission runs in the course kernel on fresh engines, with its check cells
restored from the lab (`submission`), a timeout on every cell and the engines
restarted after a deadlock or a crash (`run`); the results go to a CSV grade sheet
and one HTML feedback page per student (`report`). `probe` is what the grader asks
the kernel and the engines between cells.
"""
