"""Draw the README's picture with ddlab's own code: lab 07's two pipeline schedules as Gantt charts.

GPipe and 1F1B on 4 stages with 8 micro-batches, replayed by `ddlab.pipeline.simulate` (a
forward takes 1 ms, a backward 2 ms, messages take no time) and drawn by `ddlab.plots.gantt_pair`,
the chart lab 07 draws for its measured runs. Both schedules leave the same bubble,
(K-1)/(M+K-1); the picture shows how differently they fill the time.

    .venv/bin/python docs/figures.py            # writes docs/img/pipeline_schedules.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from ddlab.pipeline import as_spans, bubble, gpipe, one_f_one_b, simulate  # noqa: E402
from ddlab.plots import gantt_pair  # noqa: E402

STAGES, MICRO_BATCHES = 4, 8
FORWARD, BACKWARD = 1e-3, 2e-3  # seconds per micro-batch and stage; the chart's axis is in ms
OUT = Path(__file__).resolve().parent / "img" / "pipeline_schedules.png"


def draw(out: Path = OUT, dpi: int = 80) -> Path:
    """Write the picture to out (PNG) and return its path."""
    titles = []
    spans = []
    for schedule in (gpipe, one_f_one_b):
        timeline = simulate([schedule(STAGES, MICRO_BATCHES, s) for s in range(STAGES)], FORWARD, BACKWARD)
        spans.append(as_spans(timeline))
        name = "GPipe" if schedule is gpipe else "1F1B"
        titles.append(f"{name}: {STAGES} stages, {MICRO_BATCHES} micro-batches, bubble {bubble(timeline):.2f}")
    alt = f"GPipe above 1F1B on {STAGES} stages: both idle the same share; 1F1B holds fewer micro-batches per stage"
    fig = gantt_pair(spans[0], spans[1], (titles[0], titles[1]), alt=alt)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    path = draw(args.out)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
