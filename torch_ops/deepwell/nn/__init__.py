"""Modules and training-time state: `deepwell.Linear` (`linear`), `deepwell.DeepwellMoE` (`moe`, with
the Hugging Face conversion in `moe_hf`, expert parallelism in `moe_ep` / `moe_ep_state`, and
what is done to a whole model's MoE blocks in `moe_model`), its run-time guardrails
(`guardrails`), when the linear layers may reuse a quantized weight (`weight_cache`), and the
drop-in for `nn.MultiheadAttention` that runs SDPA, with the whole-model swap to it (`attention`)."""

from .attention import DeepwellMultiheadAttention, swap_attention
from .linear import Linear
from .moe import DeepwellMoE, update_expert_biases
from .moe_model import swap_hf_moe

__all__ = ["DeepwellMoE", "DeepwellMultiheadAttention", "Linear", "swap_attention", "swap_hf_moe", "update_expert_biases"]
