"""How often to checkpoint: Young's interval, Daly's, the goodput they give, and a run with failures injected.

- `young_interval(cost, mtbf)`: sqrt(2 C M), Young's first-order optimum (J. W. Young, "A first order
  approximation to the optimum checkpoint interval", CACM 17(9), 1974).
- `daly_interval(cost, mtbf)`: Daly's higher-order estimate (J. T. Daly, "A higher order estimate of the
  optimum checkpoint interval for restart dumps", FGCS 22(3), 2006, eq. 37), for C < 2M.
- `expected_goodput(interval, cost, mtbf, restart)`: the fraction of wall-clock time that is useful work
  with exponential failures (Daly's model: each segment of `interval` work plus `cost` retried until it
  runs without a failure, `restart` paid after each failure).
- `simulate_goodput(interval, cost, mtbf, restart, work, rng)`, exercise 19.5: the same measured by
  replaying a run with failures drawn at random (exponential inter-arrival times of mean `mtbf`).
- `interruption_rate(...)`, `goodput_at_scale(...)`: the paper part, from Llama 3's 54-day snapshot.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime.reference import reference


def young_interval(cost: float, mtbf: float) -> float:
    """sqrt(2 C M): the work between checkpoints that loses least, to first order (Young 1974)."""
    if cost <= 0 or mtbf <= 0:
        raise ValueError(f"need a checkpoint cost and a mean time between failures > 0, got {cost}, {mtbf}")
    return math.sqrt(2 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum; M itself when C >= 2M (checkpointing then barely pays)."""
    if cost <= 0 or mtbf <= 0:
        raise ValueError(f"need a checkpoint cost and a mean time between failures > 0, got {cost}, {mtbf}")
    if cost >= 2 * mtbf:
        return mtbf
    r = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - cost


def expected_goodput(interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """Useful work over wall-clock time, failures exponential of mean `mtbf`, checkpoints every `interval` of work."""
    if interval <= 0 or cost < 0 or mtbf <= 0 or restart < 0:
        raise ValueError(
            f"need interval > 0, cost >= 0, mtbf > 0, restart >= 0; got {interval}, {cost}, {mtbf}, {restart}"
        )
    # expected wall-clock time of one segment of length T = interval + cost that must run failure-free,
    # paying `restart` after each failure (Daly 2006, eq. 13 with R = restart)
    segment = mtbf * math.exp(restart / mtbf) * (math.exp((interval + cost) / mtbf) - 1)
    return interval / segment


@reference("simulate_goodput")
def simulate_goodput(
    interval: float, cost: float, mtbf: float, restart: float, work: float, rng: np.random.Generator
) -> float:
    """Useful work / wall-clock time of a run of `work` seconds of work, failures drawn from `rng.exponential(mtbf)`."""
    clock, done = 0.0, 0.0
    next_failure = rng.exponential(mtbf)
    while done < work:
        segment = min(interval, work - done)
        needed = segment + cost  # the work, then its checkpoint
        if clock + needed <= next_failure:
            clock += needed
            done += segment
            continue
        clock = next_failure + restart  # the segment is lost; restart from the last checkpoint
        next_failure = clock + rng.exponential(mtbf)
    return work / clock


#: Llama 3 405B's pre-training snapshot: 466 interruptions in 54 days on up to 16,384 H100 GPUs, 419 of them
#: unexpected, about 78% of those attributed to confirmed or suspected hardware (Dubey et al. 2024, "The Llama 3
#: Herd of Models", section 3.3.4, Table 5).
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_UNEXPECTED = 419
LLAMA3_INTERRUPTIONS = 466


def interruption_rate(
    interruptions: int = LLAMA3_UNEXPECTED, days: float = LLAMA3_DAYS, gpus: int = LLAMA3_GPUS
) -> float:
    """Failures per GPU-hour that give `interruptions` in `days` days of `gpus` GPUs."""
    return interruptions / (days * 24 * gpus)


def mtbf_at(gpus: int, per_gpu_hour: float) -> float:
    """The job's mean time between failures, in seconds, when any of `gpus` GPUs failing stops it."""
    return 3600.0 / (gpus * per_gpu_hour)


def checkpoint_cost(state_bytes: float, bandwidth: float) -> float:
    """Seconds to write `state_bytes` at `bandwidth` bytes per second (in aggregate)."""
    return state_bytes / bandwidth


def bandwidth_for(goodput: float, state_bytes: float, mtbf: float, restart: float) -> float:
    """The aggregate bytes/s a checkpoint must be written at for `goodput` at Young's interval (bisection)."""
    if not 0 < goodput < 1:
        raise ValueError(f"goodput is a fraction in (0, 1), got {goodput}")

    def best(bandwidth: float) -> float:
        cost = checkpoint_cost(state_bytes, bandwidth)
        return expected_goodput(young_interval(cost, mtbf), cost, mtbf, restart)

    lo, hi = 1.0, 1e18
    if best(hi) < goodput:
        raise ValueError(f"no bandwidth gives {goodput:.0%}: the restart time alone costs more")
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if best(mid) < goodput else (lo, mid)
    return hi
