"""Lab 15, expert parallelism: a mixture of experts over all-to-all. The router with top-k gates,
capacity and Switch Transformer's balancing loss (`router`), the dispatch and combine by Alltoall of
counts and Alltoallv of rows (`dispatch`), the layer for lab 14's GPT and its dense fallback
(`layer`), and the lab's figures (`figures`)."""

from .dispatch import DispatchPlan, ExchangeRows, combine, dispatch, dispatch_plan, experts_per_rank, owner
from .layer import MoE, aux_loss, use_experts
from .router import Routing, balancing_loss, capacity, route
