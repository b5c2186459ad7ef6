"""Lab 12, shuffling: global, local and partial-local shuffling over file-backed shards (`shuffler`,
`storage`), the I/O cost model (`iocost`), the training runs (`runs`) and the lab's figures (`figures`)."""

from .iocost import affordable_ranks, epoch_read_time
from .runs import BATCH_NORMS, SyncedBatchNorm1d, synchronise_batch_norm, train_for_seconds, train_shuffled
from .shuffler import STRATEGIES, IOCounters, Shuffler, exchange_plan, exchange_samples, exchanged_count, redistribute
from .storage import FILES, SampleFiles, remove_store, stage, write_files, write_shared
