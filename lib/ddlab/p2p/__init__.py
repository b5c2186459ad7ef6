"""Lab 01, point-to-point messages: the reference exchange, collect, ping-pong, sweep and alpha-beta fit."""

from .pingpong import (
    LARGEST,
    SMALLEST,
    collect,
    default_repeats,
    default_sizes,
    exchange,
    fit_alpha_beta,
    idle_wait,
    ping_pong,
    sweep,
)
