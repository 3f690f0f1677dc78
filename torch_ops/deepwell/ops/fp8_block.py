"""Block-scaled FP8 (DeepSeek-V3 style, Hopper's native block-scaled GEMM): schema, fake kernel,
Python wrapper.

Kernels: rust/ops/src/ops/fp8_block/ (CPU reference: cpu.rs); maths: rust/core/src/fp8_block.rs; rules:
docs/NUMERICS.md "FP8 block".
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define

BLOCKS = ((1, 128), (128, 1), (128, 128))
#: The rowcol op's `copies`: which of the two copies it writes (the other comes back empty).
COPIES = ("both", "rows", "cols")

define(
    "fp8_block_quantize(Tensor x, int block_rows=1, int block_cols=128, bool pow2=True) "
    "-> (Tensor data, Tensor scale_inv)"
)
define(
    'fp8_block_quantize_rowcol(Tensor x, bool pow2=True, bool m_major_scales=False, str copies="both") '
    "-> (Tensor row_data, Tensor row_scale_inv, Tensor col_data, Tensor col_scale_inv)"
)
define("fp8_block_quantize_transposed(Tensor x, bool pow2=True) -> (Tensor data, Tensor scale_inv)")
define(
    "fp8_block_dequantize(Tensor data, Tensor scale_inv, int block_rows=1, int block_cols=128, "
    "ScalarType? out_dtype=None) -> Tensor"
)


def _scale_shape(op: str, arg: str, t: torch.Tensor, br: int, bc: int) -> list[int]:
    if (br, bc) not in BLOCKS:
        _checks.fail(op, "block_rows, block_cols", "be (1, 128), (128, 1) or (128, 128)", f"({br}, {bc})")
    _checks.non_empty(op, arg, t, 2)
    n = t.dim()
    _checks.divisible(op, arg, t, n - 2, br, "block_rows")
    _checks.divisible(op, arg, t, n - 1, bc, "block_cols")
    return [*t.shape[:-2], t.shape[-2] // br, t.shape[-1] // bc]


@torch.library.register_fake("deepwell::fp8_block_quantize")
def _quantize_fake(x, block_rows=1, block_cols=128, pow2=True):
    op = "fp8_block_quantize"
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    scale_shape = _scale_shape(op, "x", x, block_rows, block_cols)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(scale_shape, dtype=torch.float32)


def _check_transposing(op: str, x: torch.Tensor) -> tuple[int, int]:
    """The (m, k) input of a transposing quantizer (rowcol, transposed): the Rust ops check both alike."""
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    if x.dim() != 2:
        _checks.fail(op, "x", "be 2-d (rows, k)", f"a {x.dim()}-d tensor")
    _checks.non_empty(op, "x", x, 2)
    _checks.divisible(op, "x", x, 0, 128, "the transposed copy has 1x128 blocks along rows")
    _checks.divisible(op, "x", x, 1, 128, "the row-wise copy has 1x128 blocks along k")
    return x.shape


@torch.library.register_fake("deepwell::fp8_block_quantize_transposed")
def _quantize_transposed_fake(x, pow2=True):
    m, k = _check_transposing("fp8_block_quantize_transposed", x)
    return x.new_empty((k, m), dtype=torch.float8_e4m3fn), x.new_empty((k // 128, m // 128), dtype=torch.float32)


def rowcol_like(x: torch.Tensor, m: int, k: int, m_major_scales: bool = False, copies: str = "both"):
    """Empty tensors like rowcol's outputs for an (m, k) matrix on x's device (the fake kernels'); a
    copy `copies` leaves out has shape (0,)."""
    e4, f32 = torch.float8_e4m3fn, torch.float32
    row_scales, col_scales = ((k // 128, m), (m // 128, k)) if m_major_scales else ((m, k // 128), (k, m // 128))
    rows, cols = copies != "cols", copies != "rows"
    return (
        x.new_empty((m, k) if rows else (0,), dtype=e4),
        x.new_empty(row_scales if rows else (0,), dtype=f32),
        x.new_empty((k, m) if cols else (0,), dtype=e4),
        x.new_empty(col_scales if cols else (0,), dtype=f32),
    )


@torch.library.register_fake("deepwell::fp8_block_quantize_rowcol")
def _quantize_rowcol_fake(x, pow2=True, m_major_scales=False, copies="both"):
    op = "fp8_block_quantize_rowcol"
    m, k = _check_transposing(op, x)
    _checks.choice(op, "copies", copies, COPIES)
    return rowcol_like(x, m, k, m_major_scales, copies)


@torch.library.register_fake("deepwell::fp8_block_dequantize")
def _dequantize_fake(data, scale_inv, block_rows=1, block_cols=128, out_dtype=None):
    op = "fp8_block_dequantize"
    out = _checks.out_dtype(op, out_dtype)
    _checks.dtype_in(op, "data", data, (torch.float8_e4m3fn,))
    _checks.dtype_in(op, "scale_inv", scale_inv, (torch.float32,))
    _checks.same_device(op, ("data", data), ("scale_inv", scale_inv))
    _checks.shape_eq(op, "scale_inv", scale_inv, _scale_shape(op, "data", data, block_rows, block_cols))
    return data.new_empty(data.shape, dtype=out)


# Not differentiable: backprop through these raises a clear error (ops/_nondiff.py).
_nondiff.register("fp8_block_quantize", "fp8_block_quantize_rowcol", "fp8_block_quantize_transposed", "fp8_block_dequantize")


def fp8_block_quantize(
    x: torch.Tensor, block_rows: int = 1, block_cols: int = 128, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes the last two dims of `x` to E4M3 in blocks of block_rows x block_cols.

    Blocks: (1, 128) for activations and gradients along K, (128, 1) for the same along M (the
    weight-gradient GEMM), (128, 128) for weights. `scale = 448 / amax`, rounded down to a power of two
    when `pow2` (the default, as in DeepSeek-V3 and Transformer Engine).

    Returns:
        (data, scale_inv): float8_e4m3fn of x's shape, and float32 dequantization factors of shape
        (..., rows / block_rows, cols / block_cols) in natural (row-major) layout.
    """
    return torch.ops.deepwell.fp8_block_quantize(x, block_rows, block_cols, pow2)


def fp8_block_quantize_rowcol(
    x: torch.Tensor, pow2: bool = True, m_major_scales: bool = False, copies: str = "both"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both copies a Hopper FP8 GEMM pipeline needs, from one read of the (m, k) tensor x.

    Exactly `fp8_block_quantize(x, 1, 128)` (row-wise) and `fp8_block_quantize(x.t().contiguous(), 1, 128)`
    (the column-wise copy, stored transposed because sm_90's FP8 GEMM is TN-only). m and k must be
    multiples of 128.

    Returns:
        (row_data (m, k), row_scale_inv (m, k/128), col_data (k, m), col_scale_inv (k, m/128)); with
        `m_major_scales` each scale tensor is stored transposed, (k/128, m) and (m/128, k): the layout
        Hopper's block-scaled GEMMs read (`fp8_block_linear` takes them so). `copies`:
        "both", or "rows" / "cols" to write one copy, the same codes for half the bytes written (the
        other copy's two tensors come back empty, shape (0,)): a layer whose backward makes the
        wgrad copy from x again (`fp8_block_linear` given the row copy alone).
    """
    return torch.ops.deepwell.fp8_block_quantize_rowcol(x, pow2, m_major_scales, copies)


def fp8_block_quantize_transposed(x: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x^T's 128x128-tile quantization from one read of the (m, k) tensor x: exactly
    `fp8_block_quantize(x, 128, 128)` with data and scales transposed (a tile's scale does not depend
    on its orientation, docs/NUMERICS.md "Transposes and layouts"), what a weight's dgrad GEMM reads.

    Returns:
        (data (k, m) float8_e4m3fn, scale_inv (k/128, m/128) float32).
    """
    return torch.ops.deepwell.fp8_block_quantize_transposed(x, pow2)


def fp8_block_dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block_rows: int = 1,
    block_cols: int = 128,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Inverse of `fp8_block_quantize`: `e4m3(q) * scale_inv`, as `out_dtype` (default bfloat16)."""
    return torch.ops.deepwell.fp8_block_dequantize(data, scale_inv, block_rows, block_cols, out_dtype)
