"""Pipeline parallelism (lab 07): micro-batches flowing through the lab 06 stages.

- `gpipe`, `one_f_one_b`: per-stage op orders; `simulate`, `in_flight`, `theory_bubble`.
- `pipedream_partition`: balanced stages by dynamic programming over stage times;
  `measured_stage_times`: those times from measured layer and message costs;
  `calibrate`: correct them with measured pipeline steps and solve again.
- `interleaved_1f1b`, `run_interleaved`, `simulate_interleaved`, `interleaved_bubble`: v model chunks per
  rank (Narayanan et al., SC 2021, section 2.2.2; exercise 16.3's reference), its bubble (p - 1)/(v m).
- `run_schedule`: exercise 7.3's reference, a schedule's ops run on a chain of stages, one per rank.
- `weight_versions`: how many weight versions each stage keeps under flushless 1F1B (weight stashing).
- `pipeline_step`: one training step of M micro-batches on a `ddlab.model_parallel.Stage`
  (`Stage(..., recompute=True)` recomputes activations in backward).
- `measure_pipeline`, `PipelineRun`: per-rank timelines on the busy and wall clocks,
  bubble, stage times and peak activation memory of one step; `hidden_share`: the work a
  lone micro-batch's ops do off the critical path, which `theory_bubble(k, m, hidden)` accounts for.
- `TorchPipeline`, `RelayStage`, `forward_bytes`: the same stages in torch.distributed.pipelining,
  which relays skip connections through the stages in between.
"""

from .balance import Calibration, calibrate
from .executor import micro_batch_loss, run_schedule
from .interleaved import (
    ChunkOp,
    chunk_in_flight,
    interleaved_1f1b,
    interleaved_bubble,
    run_interleaved,
    simulate_interleaved,
    virtual_stage,
)
from .partition import StageTimes, measured_stage_times, message_cost, pipedream_partition
from .runner import PipelineRun, expected_bubble, hidden_share, measure_pipeline, micro_batches, pipeline_step
from .schedules import Op, Schedule, as_spans, bubble, gpipe, in_flight, one_f_one_b, simulate, theory_bubble
from .stashing import weight_versions
from .torch_pipelining import RelayStage, TorchPipeline, alternate_wall_times, forward_bytes
