"""Lab 15, expert parallelism: a mixture of experts over all-to-all. The router with top-k gates,
capacity and Switch Transformer's balancing loss (`router`), the dispatch and combine by Alltoall of
counts and Alltoallv of rows (`dispatch`), the layer for lab 14's GPT and its dense fallback
(`layer`), experts combined with data parallelism (`data_parallel`), and the lab's figures (`figures`)."""

from .data_parallel import average_gradients, expert_and_data_groups, expert_parameters, train_with_experts
from .dispatch import DispatchPlan, ExchangeRows, combine, dispatch, dispatch_plan, experts_per_rank, owner
from .layer import MoE, aux_loss, use_experts
from .router import Routing, balancing_loss, capacity, route
