"""deepwell: low-precision training for PyTorch on NVIDIA GPUs, with a Rust core.

`import deepwell` defines the `torch.ops.deepwell.*` schemas and fake kernels, then loads the Rust
library once, which registers the kernels. Importing needs no GPU.
"""

from . import _native
from .ops import (
    fp8_block_dequantize,
    fp8_block_gemm,
    fp8_block_grouped_gemm,
    fp8_block_grouped_wgrad,
    fp8_block_linear,
    fp8_block_quantize,
    fp8_block_quantize_rowcol,
    fp8_block_quantize_transposed,
    fp8_tensor_dequantize,
    fp8_tensor_linear,
    fp8_tensor_quantize,
    fp8_tensor_quantize_rowcol,
    grouped_linear,
    moe_combine,
    moe_dispatch,
    moe_permute_index,
    moe_route,
    mxfp8_dequantize,
    mxfp8_linear,
    mxfp8_quantize,
    mxfp8_quantize_rowcol,
    nvfp4_dequantize,
    nvfp4_quantize,
    scaled_linear,
    swizzle_scales,
    unswizzle_scales,
)

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
    "fp8_block_dequantize",
    "fp8_block_gemm",
    "fp8_block_grouped_gemm",
    "fp8_block_grouped_wgrad",
    "fp8_block_linear",
    "fp8_block_quantize",
    "fp8_block_quantize_rowcol",
    "fp8_block_quantize_transposed",
    "fp8_tensor_dequantize",
    "fp8_tensor_linear",
    "fp8_tensor_quantize",
    "fp8_tensor_quantize_rowcol",
    "grouped_linear",
    "moe_combine",
    "moe_dispatch",
    "moe_permute_index",
    "moe_route",
    "mxfp8_dequantize",
    "mxfp8_linear",
    "mxfp8_quantize",
    "mxfp8_quantize_rowcol",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "optimize",
    "optimize_for_blackwell",
    "pin_cores",
    "policy_report",
    "print_hardware_info",
    "probe",
    "reduce_gradients",
    "scaled_linear",
    "swap_attention",
    "swap_hf_moe",
    "swizzle_scales",
    "unswizzle_scales",
    "update_expert_biases",
]
