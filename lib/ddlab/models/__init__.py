"""Models for the labs: the materials MLP (lab 04), the UNet (labs 06-07) and a small GPT (lab 14)."""

from .gpt import GPT, GPTConfig, make_gpt
from .mlp import CurveMLP, count_parameters, make_mlp
from .unet import UNet, layer_names
