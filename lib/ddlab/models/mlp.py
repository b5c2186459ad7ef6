"""The network of labs 04-05: an MLP from a stress-strain curve to two material parameters.

600 inputs (strain, stress and flag at 200 points) -> 192 -> 128 -> 64 -> 2, with
ReLU between layers: 148,482 parameters, 0.6 MB in float32. Small on purpose: on a
laptop a training step takes milliseconds, so the allreduce of its gradients is a
visible share of the step, as it is for big networks on fast accelerators.
`hidden` makes wider variants (the benchmarks use one of ~10^7 parameters);
`batch_norm` puts a BatchNorm1d after each hidden layer (lab 12: statistics per rank).
"""

from __future__ import annotations

import torch
from torch import nn

from ..data.curves import N_FEATURES

HIDDEN = (192, 128, 64)


class CurveMLP(nn.Sequential):
    """Fully connected layers with ReLU in between; the last layer is linear."""

    def __init__(
        self,
        hidden: tuple[int, ...] = HIDDEN,
        in_features: int = N_FEATURES,
        out_features: int = 2,
        batch_norm: bool = False,
    ):
        widths = [in_features, *hidden, out_features]
        layers: list[nn.Module] = []
        for i, (w_in, w_out) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(w_in, w_out))
            if i < len(widths) - 2:
                layers.extend([nn.BatchNorm1d(w_out), nn.ReLU()] if batch_norm else [nn.ReLU()])
        super().__init__(*layers)


def make_mlp(
    seed: int = 0, dtype: torch.dtype = torch.float32, hidden: tuple[int, ...] = HIDDEN, batch_norm: bool = False
) -> CurveMLP:
    """A CurveMLP whose initial weights depend only on `seed` (not on torch's global state)."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = CurveMLP(hidden, batch_norm=batch_norm)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(dtype)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
