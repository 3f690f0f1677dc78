"""deepwell: low-precision training for PyTorch on NVIDIA GPUs, with a Rust core.

`import deepwell` defines the `torch.ops.deepwell.*` schemas and fake kernels, then loads the Rust
library once, which registers the kernels. Importing needs no GPU.
"""

from . import _native
from . import ops

from .api import optimize, optimize_for_blackwell
from .compiler.engine import IR, Engine, autoplan, capture, compile
from .core.policy import LayerDecision, LayerInfo, MicroscalingConfig, PrecisionPolicy
from .core.recipes import Precision, Recipe
from .nn.attention import DeepwellMultiheadAttention, swap_attention
from .nn.guardrails import GuardrailConfig, format_report, policy_report
from .nn.linear import Linear
from .nn.moe import DeepwellMoE, update_expert_biases
from .nn.moe_model import expert_parallel, reduce_gradients, swap_hf_moe
from .nn.moe_model import load_optimizer_state_dict as load_expert_optimizer_state_dict
from .nn.moe_model import optimizer_state_dict as expert_optimizer_state_dict
from .plan.dryrun import Estimate, dryrun
from .plan.hardware import Hardware, probe, print_hardware_info
from .plan.options import CompileOptions
from .plan.sites import Codes, Plan

_native.load()

from ._native import manual_seed  # noqa: E402
from .artifact.export import export, load  # noqa: E402
from .compiler.backend import last_plan  # noqa: E402
from .nn.weight_cache import clear_weight_cache, microbatches, weight_cache_info  # noqa: E402
from .train import Trainer  # noqa: E402
from .train.affinity import pin_cores  # noqa: E402

__version__ = _native.version()

# The op wrappers deepwell.ops names for re-export, so that the two lists cannot drift apart.
globals().update({name: getattr(ops, name) for name in ops.EXPORTED})

__all__ = [
    "Codes",
    "CompileOptions",
    "DeepwellMoE",
    "DeepwellMultiheadAttention",
    "Engine",
    "Estimate",
    "GuardrailConfig",
    "Hardware",
    "IR",
    "Plan",
    "Trainer",
    "LayerDecision",
    "LayerInfo",
    "Linear",
    "MicroscalingConfig",
    "Precision",
    "PrecisionPolicy",
    "Recipe",
    "autoplan",
    "capture",
    "clear_weight_cache",
    "compile",
    "dryrun",
    "expert_optimizer_state_dict",
    "expert_parallel",
    "export",
    "format_report",
    "last_plan",
    "load",
    "load_expert_optimizer_state_dict",
    "manual_seed",
    "microbatches",
    "weight_cache_info",
    "optimize",
    "optimize_for_blackwell",
    "pin_cores",
    "policy_report",
    "print_hardware_info",
    "probe",
    "reduce_gradients",
    "swap_attention",
    "swap_hf_moe",
    "update_expert_biases",
    *ops.EXPORTED,
]
