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
- `zero_bubble` (lab 17): the backward split into B (`backward_input`) and W (`backward_weight`) after
  `forward_recorded`; op lists with W ops: `one_f_one_b_whole`, `zb_h1`, `zb_h2`, `zb_v` (two chunks per
  rank in a V, `v_stage`); `replay_split`, `split_spans`, `split_bubble`, `split_peak`, `split_peak_bytes` and the closed forms `bubble_1f1b`,
  `bubble_zb_h1`, `bubble_zb_h2`; `run_split`, which runs them on real ranks; `zero_bubble_runs`:
  `measure_split` runs each on real ranks (bubble, F/B/W times, peak activations from the ledger).
- `TorchPipeline`, `RelayStage`, `forward_bytes`: the same stages in torch.distributed.pipelining,
  which relays skip connections through the stages in between.
- `torch_zero_bubble.TorchZeroBubble`: torch's ScheduleZBVZeroBubble and ScheduleInterleavedZeroBubble
  on lab 17's stages over gloo, beside ddlab's `zb_v` and interleaved runs.
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
from .zero_bubble import (
    backward_input,
    backward_weight,
    bubble_1f1b,
    bubble_zb_h1,
    bubble_zb_h2,
    forward_recorded,
    one_f_one_b_whole,
    replay_split,
    run_split,
    split_bubble,
    split_peak,
    split_peak_bytes,
    split_spans,
    v_stage,
    zb_h1,
    zb_h2,
    zb_v,
)
