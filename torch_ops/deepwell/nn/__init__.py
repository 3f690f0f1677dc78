"""Modules and training-time state: `deepwell.Linear` (`linear`), `deepwell.DeepwellMoE` (`moe`, with
the Hugging Face conversion in `moe_hf`, expert parallelism in `moe_ep` / `moe_ep_state`, and
what is done to a whole model's MoE blocks in `moe_model`), its run-time guardrails
(`guardrails`), and when the linear layers may reuse a quantized weight (`weight_cache`)."""

from .linear import Linear
from .moe import DeepwellMoE, update_expert_biases
from .moe_model import swap_hf_moe

__all__ = ["DeepwellMoE", "Linear", "swap_hf_moe", "update_expert_biases"]
