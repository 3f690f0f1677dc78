"""MXFP8 quantization (OCP MX v1.0 blocks of 32, E8M0 scales): schema, fake kernel, Python wrapper.

Kernels: rust/ops/src/ops/mxfp8/ (CPU reference: cpu.rs); maths: rust/core/src/mxfp8.rs; bit-exact rules:
docs/NUMERICS.md "MXFP8".
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define

BLOCK = 32
SCALE_MODES = ("rceil", "floor")
ELEMS = ("e4m3", "e5m2")
_ELEM_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

define('mxfp8_quantize(Tensor x, int dim=-1, str scale_mode="rceil", str elem="e4m3") -> (Tensor data, Tensor scale)')
define(
    'mxfp8_quantize_rowcol(Tensor x, str scale_mode="rceil", str elem="e4m3", bool col_transposed=False, '
    "bool swizzle=False) -> (Tensor row_data, Tensor row_scale, Tensor col_data, Tensor col_scale)"
)
define("mxfp8_dequantize(Tensor data, Tensor scale, int dim=-1, ScalarType? out_dtype=None) -> Tensor")


def _scale_shape(shape, d: int) -> list[int]:
    s = list(shape)
    s[d] //= BLOCK
    return s


@torch.library.register_fake("deepwell::mxfp8_quantize")
def _quantize_fake(x, dim=-1, scale_mode="rceil", elem="e4m3"):
    op = "mxfp8_quantize"
    _checks.choice(op, "scale_mode", scale_mode, SCALE_MODES)
    _checks.choice(op, "elem", elem, ELEMS)
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    _checks.non_empty(op, "x", x)
    d = _checks.dim(op, "dim", dim, x.dim())
    _checks.divisible(op, "x", x, d, BLOCK, "the MX block size along `dim`")
    data = x.new_empty(x.shape, dtype=_ELEM_DTYPE[elem])
    scale = x.new_empty(_scale_shape(x.shape, d), dtype=torch.float8_e8m0fnu)
    return data, scale


def _swizzled_len(rows: int, cols: int) -> int:
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


@torch.library.register_fake("deepwell::mxfp8_quantize_rowcol")
def _quantize_rowcol_fake(x, scale_mode="rceil", elem="e4m3", col_transposed=False, swizzle=False):
    op = "mxfp8_quantize_rowcol"
    _checks.choice(op, "scale_mode", scale_mode, SCALE_MODES)
    _checks.choice(op, "elem", elem, ELEMS)
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    if x.dim() != 2:
        _checks.fail(op, "x", "be 2-d (rows, k)", f"a {x.dim()}-d tensor")
    _checks.non_empty(op, "x", x, 2)
    _checks.divisible(op, "x", x, 0, BLOCK, "column-wise blocks run along rows")
    _checks.divisible(op, "x", x, 1, BLOCK, "row-wise blocks run along k")
    m, k = x.shape
    col_shape, col_scale = ((k, m), (k, m // BLOCK)) if col_transposed else ((m, k), (m // BLOCK, k))
    scales = [(m, k // BLOCK), col_scale]
    if swizzle:
        scales = [(_swizzled_len(*s),) for s in scales]
    e8 = torch.float8_e8m0fnu
    dt = _ELEM_DTYPE[elem]
    return x.new_empty((m, k), dtype=dt), x.new_empty(scales[0], dtype=e8), x.new_empty(col_shape, dtype=dt), x.new_empty(scales[1], dtype=e8)


@torch.library.register_fake("deepwell::mxfp8_dequantize")
def _dequantize_fake(data, scale, dim=-1, out_dtype=None):
    op = "mxfp8_dequantize"
    out = _checks.out_dtype(op, out_dtype)
    _checks.dtype_in(op, "data", data, tuple(_ELEM_DTYPE.values()))
    _checks.dtype_in(op, "scale", scale, (torch.float8_e8m0fnu,))
    _checks.same_device(op, ("data", data), ("scale", scale))
    _checks.non_empty(op, "data", data)
    d = _checks.dim(op, "dim", dim, data.dim())
    _checks.divisible(op, "data", data, d, BLOCK, "the MX block size along `dim`")
    _checks.shape_eq(op, "scale", scale, _scale_shape(data.shape, d))
    return data.new_empty(data.shape, dtype=out)


# Not differentiable: backprop through these raises a clear error (ops/_nondiff.py).
_nondiff.register("mxfp8_quantize", "mxfp8_quantize_rowcol", "mxfp8_dequantize")


def mxfp8_quantize(
    x: torch.Tensor, dim: int = -1, scale_mode: str = "rceil", elem: str = "e4m3"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes `x` to MXFP8 in blocks of 32 consecutive elements along `dim`.

    Args:
        x: float32, bfloat16 or float16; `x.size(dim)` must be a multiple of 32. Any strides.
        dim: the dimension the blocks run along (the GEMM's K dimension for this operand).
        scale_mode: "rceil" (default; NVIDIA's MXFP8 recipe: no element overflows) or "floor" (OCP
            MX v1.0: elements may saturate).
        elem: "e4m3" (default) or "e5m2".

    Returns:
        (data, scale): data has x's shape and dtype float8_e4m3fn / float8_e5m2; scale has x's shape
        with `dim` divided by 32 and dtype float8_e8m0fnu. A block holding NaN or ±Inf gets scale
        0xFF (NaN), so the whole block dequantizes to NaN.
    """
    return torch.ops.deepwell.mxfp8_quantize(x, dim, scale_mode, elem)


def mxfp8_quantize_rowcol(
    x: torch.Tensor, scale_mode: str = "rceil", elem: str = "e4m3", col_transposed: bool = False, swizzle: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both MXFP8 copies training needs, from one read of the (m, k) tensor x.

    Exactly `mxfp8_quantize(x, -1)` (row-wise, blocks along k) and `mxfp8_quantize(x, 0)` (column-wise,
    blocks along m); with `col_transposed`, the column-wise copy is `mxfp8_quantize(x.t().contiguous(), -1)`
    ((k, m) data, (k, m/32) scales). With `swizzle`, both scales come in the 1-D 128x4 tiled layout of
    `swizzle_scales` (what Blackwell's block-scaled GEMM reads). m and k must be multiples of 32.

    Returns:
        (row_data, row_scale, col_data, col_scale).
    """
    return torch.ops.deepwell.mxfp8_quantize_rowcol(x, scale_mode, elem, col_transposed, swizzle)


def mxfp8_dequantize(
    data: torch.Tensor, scale: torch.Tensor, dim: int = -1, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Inverse of `mxfp8_quantize`: `float(q) * 2^(e - 127)`, rounded to `out_dtype` (default bfloat16)."""
    return torch.ops.deepwell.mxfp8_dequantize(data, scale, dim, out_dtype)
