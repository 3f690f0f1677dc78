"""The torch.ops.deepwell op catalogue: one module per op family, each with its schema, fake kernel
and typed wrapper. Importing this package defines the schemas; `deepwell._native.load()` then
registers the Rust kernels behind them."""

import torch

from .linear import mxfp8_linear, scaled_linear
from .fp8_tensor_linear import fp8_tensor_linear
from .fp8_block_linear import fp8_block_linear
from .fp8_block_mlp import fp8_block_swiglu_mlp
from .quantized_linear import quantized_linear, quantized_linear_backward
from .grouped_linear import grouped_linear
from .moe import moe_combine, moe_dispatch, moe_permute_index, moe_route
from .fp8_attention import fp8_attention
from .fp8_block import (
    fp8_block_dequantize,
    fp8_block_quantize,
    fp8_block_quantize_rowcol,
    fp8_block_quantize_transposed,
)
from .fp8_gemm import fp8_block_gemm, fp8_block_grouped_gemm, fp8_block_grouped_wgrad
from .fp8_tensor import fp8_tensor_dequantize, fp8_tensor_quantize, fp8_tensor_quantize_rowcol
from .mxfp8 import mxfp8_dequantize, mxfp8_quantize, mxfp8_quantize_rowcol
from .nvfp4 import nvfp4_dequantize, nvfp4_quantize
from .swiglu import fp8_block_swiglu_backward_quantize_rowcol, fp8_block_swiglu_quantize_rowcol, swiglu
from .swizzle import swizzle_scales, unswizzle_scales

# DTensor sharding rules for the linear ops (tensor parallelism); torch builds without distributed
# (some macOS and mobile wheels) have no DTensor, and deepwell must still import there.
if torch.distributed.is_available():
    from . import sharding  # noqa: F401

__all__ = [
    "fp8_attention",
    "fp8_block_dequantize",
    "fp8_block_gemm",
    "fp8_block_grouped_gemm",
    "fp8_block_grouped_wgrad",
    "fp8_block_linear",
    "fp8_block_quantize",
    "fp8_block_quantize_rowcol",
    "fp8_block_quantize_transposed",
    "fp8_block_swiglu_backward_quantize_rowcol",
    "fp8_block_swiglu_mlp",
    "fp8_block_swiglu_quantize_rowcol",
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
    "quantized_linear",
    "quantized_linear_backward",
    "scaled_linear",
    "swiglu",
    "swizzle_scales",
    "unswizzle_scales",
]

# The building blocks only this package exports (fused passes, the stored-codes linear, the
# reference SwiGLU); `import deepwell` re-exports every other op, as `EXPORTED` lists them.
_BUILDING_BLOCKS = (
    "fp8_block_swiglu_backward_quantize_rowcol",
    "fp8_block_swiglu_mlp",
    "fp8_block_swiglu_quantize_rowcol",
    "quantized_linear",
    "quantized_linear_backward",
    "swiglu",
)
EXPORTED = tuple(name for name in __all__ if name not in _BUILDING_BLOCKS)
