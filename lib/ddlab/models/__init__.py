"""Models for the labs: the materials MLP (lab 04) and the UNet (labs 06-07)."""

from .mlp import CurveMLP, count_parameters, make_mlp
from .unet import UNet, layer_names
