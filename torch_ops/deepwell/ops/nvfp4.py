"""NVFP4 quantization (E2M1 elements, E4M3 scales per 16, an fp32 per-tensor scale): schema, fake
kernel, Python wrapper.

Kernels: rust/ops/src/ops/nvfp4/ (CPU reference: cpu.rs); maths: rust/core/src/nvfp4.rs; bit-exact rules:
docs/NUMERICS.md "NVFP4" (the NVFP4 training recipe of arXiv 2509.25149).
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define

BLOCK = 16

define(
    "nvfp4_quantize(Tensor x, Tensor? global_amax=None, bool block_2d=False, bool stochastic=False, "
    "int seed=0, bool hadamard=False) -> (Tensor data, Tensor scale, Tensor global_scale)"
)
define("nvfp4_dequantize(Tensor data, Tensor scale, Tensor global_scale, ScalarType? out_dtype=None) -> Tensor")


def _scalar_f32(op: str, arg: str, t: torch.Tensor) -> None:
    _checks.dtype_in(op, arg, t, (torch.float32,))
    if t.numel() != 1:
        _checks.fail(op, arg, "have exactly one element", f"shape {_checks.shape_str(t.shape)}")


@torch.library.register_fake("deepwell::nvfp4_quantize")
def _quantize_fake(x, global_amax=None, block_2d=False, stochastic=False, seed=0, hadamard=False):
    op = "nvfp4_quantize"
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    if global_amax is not None:
        _checks.same_device(op, ("x", x), ("global_amax", global_amax))
    _checks.non_empty(op, "x", x)
    last = x.dim() - 1
    _checks.divisible(op, "x", x, last, BLOCK, "the NVFP4 block size along the last dim")
    if block_2d:
        if x.dim() < 2:
            _checks.fail(op, "x", "be at least 2-d when block_2d=True", f"a {x.dim()}-d tensor")
        _checks.divisible(op, "x", x, last - 1, BLOCK, "16x16 blocks need rows in multiples of 16")
    if global_amax is not None:
        _scalar_f32(op, "global_amax", global_amax)
    data = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    scale = x.new_empty((*x.shape[:-1], x.shape[-1] // BLOCK), dtype=torch.float8_e4m3fn)
    global_scale = x.new_empty((), dtype=torch.float32)
    return data, scale, global_scale


@torch.library.register_fake("deepwell::nvfp4_dequantize")
def _dequantize_fake(data, scale, global_scale, out_dtype=None):
    op = "nvfp4_dequantize"
    out = _checks.out_dtype(op, out_dtype)
    _checks.dtype_in(op, "data", data, (torch.uint8,))
    _checks.dtype_in(op, "scale", scale, (torch.float8_e4m3fn,))
    _checks.same_device(op, ("data", data), ("scale", scale), ("global_scale", global_scale))
    _checks.non_empty(op, "data", data)
    _scalar_f32(op, "global_scale", global_scale)
    _checks.divisible(op, "data", data, data.dim() - 1, BLOCK // 2, "8 packed bytes per 16-element block")
    shape = (*data.shape[:-1], data.shape[-1] * 2)
    _checks.shape_eq(op, "scale", scale, (*shape[:-1], shape[-1] // BLOCK))
    return data.new_empty(shape, dtype=out)


# Not differentiable: backprop through these raises a clear error (ops/_nondiff.py).
_nondiff.register("nvfp4_quantize", "nvfp4_dequantize")


def nvfp4_quantize(
    x: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    block_2d: bool = False,
    stochastic: bool = False,
    seed: int = 0,
    hadamard: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes `x` to NVFP4 along its last dim.

    Args:
        x: float32, bfloat16 or float16 with last dim a multiple of 16.
        global_amax: optional float32 one-element tensor; computed from `x` when None (after the
            Hadamard transform when `hadamard`).
        block_2d: 16x16 blocks (weights): one scale per tile, written to each of its 16 rows, so
            the row- and column-wise copies agree.
        stochastic: stochastic rounding (for gradients), deterministic given `seed`.
        hadamard: apply the 16x16 random Hadamard transform along the last dim first (for the
            operands of the weight-gradient GEMM; the GEMM of two transformed operands equals the
            GEMM of the originals, so the data is not transformed back).

    Returns:
        (data, scale, global_scale): uint8 (..., K/2) with two E2M1 codes per byte (element 2i in the
        low nibble); float8_e4m3fn (..., K/16) block scales; float32 0-d decode scale S_dec.
    """
    return torch.ops.deepwell.nvfp4_quantize(x, global_amax, block_2d, stochastic, seed, hadamard)


def nvfp4_dequantize(
    data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Inverse of `nvfp4_quantize`: `e2m1(q) * float(scale) * global_scale`, as `out_dtype` (bf16 default)."""
    return torch.ops.deepwell.nvfp4_dequantize(data, scale, global_scale, out_dtype)
