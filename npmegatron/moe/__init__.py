"""Mixture of experts (Megatron-Core's transformer/moe): the router, the token dispatch and the
experts, and the MoE layer that takes a block's MLP's place every --moe-layer-freq layers."""
from . import aux_loss
from .layer import MoELayer
from .router import TopKRouter, update_expert_biases

__all__ = ["MoELayer", "TopKRouter", "aux_loss", "update_expert_biases"]
