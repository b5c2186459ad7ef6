"""The drawing helpers and figures several labs share; every name is public (ddlab.plots.NAME).

- `alt`: the text alternative every figure carries (`subplots`, `describe`; `show` for a lab's own figure);
- `helpers`: boxes and arrows, byte-size axes and labels, a colour per rank, side-by-side panels;
- `cluster`: the cluster a notebook drives (lab 00, which has no package of its own);
- `messages`: data movement between ranks (labs 02-03), times against message size (labs 02, 05);
- `unet`: the UNet and its split over ranks (labs 06-07);
- `timelines`: the one Gantt chart of spans per rank (labs 04-07).

A lab's own figures live in its package's `figures.py` and draw with these. Every figure
function takes `alt`, a required keyword: what the figure shows (`ddlab.plots.alt`).
"""

from .alt import Described, describe, show, subplots
from .cluster import cluster_diagram
from .helpers import arrow, box, byte_label, finish_panels, rank_colour, size_axis
from .messages import data_movement, time_vs_size
from .timelines import COLOURS, gantt, gantt_pair
from .unet import unet_diagram

__all__ = [
    "COLOURS",
    "Described",
    "arrow",
    "box",
    "byte_label",
    "cluster_diagram",
    "data_movement",
    "describe",
    "finish_panels",
    "gantt",
    "gantt_pair",
    "rank_colour",
    "show",
    "size_axis",
    "subplots",
    "time_vs_size",
    "unet_diagram",
]
