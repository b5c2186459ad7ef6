"""Weight stashing: how many versions of its weights a stage keeps when the pipeline never flushes.

Without a flush, a stage updates its weights while micro-batches are still in
flight. A micro-batch's backward must use the weights its forward used (PipeDream's
weight stashing, Narayanan et al., SOSP 2019), so a stage keeps every version some
in-flight micro-batch used, plus the newest. PipeDream updates after every
backward; PipeDream-2BW (Narayanan et al., ICML 2021) after every batch of
several micro-batches; PipeDream-Flush updates only after a flush, with nothing in flight.
"""

from __future__ import annotations

from .schedules import one_f_one_b


def weight_versions(k: int, micro_batches: int, update_every: int = 1) -> list[int]:
    """Per stage of k, the most weight versions it holds at once under 1F1B without a flush.

    The stages run one_f_one_b(k, micro_batches, s) as one continuous stream and
    update their weights after every `update_every` backwards (1: PipeDream; the
    micro-batches of a batch: PipeDream-2BW; all of them, one step then a flush:
    PipeDream-Flush). A forward uses the newest version, its backward the same one.
    """
    if update_every < 1:
        raise ValueError(f"update_every must be at least 1, got {update_every}")
    most = []
    for stage in range(k):
        version, backwards, used = 0, 0, {}
        peak = 1
        for kind, i in one_f_one_b(k, micro_batches, stage):
            if kind == "F":
                used[i] = version
            else:
                del used[i]
                backwards += 1
                if backwards % update_every == 0:
                    version += 1
            peak = max(peak, len(set(used.values()) | {version}))
        most.append(peak)
    return most
