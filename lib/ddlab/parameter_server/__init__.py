"""Lab 10: parameter servers and consistency (synchronous, asynchronous, stale-synchronous, gossip).

Ranks get roles: the first `servers` ranks each own a slice of the parameters, the
others are workers that pull parameters, compute a gradient and push it back, with
point-to-point messages (`protocol`). The server applies gradients under a
consistency mode (`gate`): synchronously (the average of every worker's step t),
asynchronously (each on arrival, its staleness recorded), or stale-synchronously
(a worker starts step t only once the slowest has finished step t - s).
Decentralized training needs no server: an allreduce per step, or asynchronous
gossip with a ring neighbour (`gossip`). `straggler` slows one worker down by a
seeded factor; `run.train` runs any mode on a communicator and returns its record.
"""

from .gate import Consistency, may_start
from .gossip import gossip_step
from .problem import LeastSquares
from .run import Record, train
from .straggler import slowdowns

__all__ = ["Consistency", "LeastSquares", "Record", "gossip_step", "may_start", "slowdowns", "train"]
