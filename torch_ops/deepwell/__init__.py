"""deepwell: low-precision training for PyTorch on NVIDIA GPUs, with a Rust core.

`import deepwell` defines the `torch.ops.deepwell.*` schemas and fake kernels, then loads the Rust
library once, which registers the kernels. Importing needs no GPU.
"""

from . import _native
from .ops import (
    fp8_block_dequantize,
    fp8_block_quantize,
    fp8_block_quantize_rowcol,
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

from .guardrails import GuardrailConfig, format_report, policy_report
from .nn import Linear
from .policy import LayerDecision, LayerInfo, PrecisionPolicy

_native.load()

from ._native import clear_weight_cache, manual_seed, weight_cache_info  # noqa: E402

__version__ = _native.version()

__all__ = [
    "GuardrailConfig",
    "LayerDecision",
    "LayerInfo",
    "Linear",
    "PrecisionPolicy",
    "clear_weight_cache",
    "format_report",
    "manual_seed",
    "weight_cache_info",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "fp8_block_quantize_rowcol",
    "mxfp8_dequantize",
    "mxfp8_linear",
    "mxfp8_quantize",
    "mxfp8_quantize_rowcol",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "policy_report",
    "scaled_linear",
    "swizzle_scales",
    "unswizzle_scales",
]
