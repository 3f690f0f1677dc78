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
    mxfp8_quantize,
    mxfp8_quantize_rowcol,
    nvfp4_dequantize,
    nvfp4_quantize,
    swizzle_scales,
    unswizzle_scales,
)

from .policy import LayerDecision, LayerInfo, PrecisionPolicy

_native.load()

__version__ = _native.version()

__all__ = [
    "LayerDecision",
    "LayerInfo",
    "PrecisionPolicy",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "fp8_block_quantize_rowcol",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_quantize_rowcol",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "swizzle_scales",
    "unswizzle_scales",
]
