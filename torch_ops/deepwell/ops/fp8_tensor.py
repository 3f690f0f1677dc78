"""FP8 with one scale per tensor from its current amax (torchao's `tensorwise` recipe, Transformer
Engine's current scaling): schema, fake kernel, Python wrapper.

Kernels: rust/ops/src/ops/fp8_tensor/ (CPU reference: cpu.rs); maths: rust/core/src/fp8_tensor.rs;
rules: docs/NUMERICS.md "FP8 tensor".
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define

ELEMS = ("e4m3", "e5m2")
#: The rowcol ops' `copies`: which of the two copies they write (the other comes back empty).
COPIES = ("both", "rows", "cols")
_ELEM_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

define('fp8_tensor_quantize(Tensor x, str elem="e4m3") -> (Tensor data, Tensor scale_inv)')
define(
    'fp8_tensor_quantize_rowcol(Tensor x, str elem="e4m3", Tensor? amax=None, str copies="both") '
    "-> (Tensor row_data, Tensor col_data, Tensor scale_inv)"
)
define("fp8_tensor_dequantize(Tensor data, Tensor scale_inv, ScalarType? out_dtype=None) -> Tensor")


def _check_x(op: str, x: torch.Tensor, elem: str, min_dim: int) -> torch.dtype:
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    _checks.non_empty(op, "x", x, min_dim)
    _checks.choice(op, "elem", elem, ELEMS)
    return _ELEM_DTYPE[elem]


@torch.library.register_fake("deepwell::fp8_tensor_quantize")
def _quantize_fake(x, elem="e4m3"):
    codes = _check_x("fp8_tensor_quantize", x, elem, 1)
    return x.new_empty(x.shape, dtype=codes), x.new_empty((), dtype=torch.float32)


def check_amax(op: str, arg: str, amax: torch.Tensor, of: tuple[str, torch.Tensor]) -> None:
    """An amax argument: a 0-d float32 tensor on the device of the tensor it is the amax of. The
    CPU kernels also check its value (rust/ops/src/ops/fp8_tensor/mod.rs `check_amax_value`: the
    tensor's own scale, NaN exactly when it holds a NaN, not negative); fake tensors have none."""
    _checks.dtype_in(op, arg, amax, (torch.float32,))
    _checks.same_device(op, of, (arg, amax))
    _checks.shape_eq(op, arg, amax, [])


@torch.library.register_fake("deepwell::fp8_tensor_quantize_rowcol")
def _quantize_rowcol_fake(x, elem="e4m3", amax=None, copies="both"):
    op = "fp8_tensor_quantize_rowcol"
    codes = _check_x(op, x, elem, 1)
    if amax is not None:
        check_amax(op, "amax", amax, ("x", x))
    if x.dim() != 2:
        _checks.fail(op, "x", "be 2-d (rows, k)", f"a {x.dim()}-d tensor")
    _checks.choice(op, "copies", copies, COPIES)
    m, k = x.shape
    rows, cols = ((m, k) if copies != "cols" else (0,)), ((k, m) if copies != "rows" else (0,))
    return x.new_empty(rows, dtype=codes), x.new_empty(cols, dtype=codes), x.new_empty((), dtype=torch.float32)


@torch.library.register_fake("deepwell::fp8_tensor_dequantize")
def _dequantize_fake(data, scale_inv, out_dtype=None):
    op = "fp8_tensor_dequantize"
    out = _checks.out_dtype(op, out_dtype)
    _checks.dtype_in(op, "data", data, tuple(_ELEM_DTYPE.values()))
    _checks.dtype_in(op, "scale_inv", scale_inv, (torch.float32,))
    _checks.same_device(op, ("data", data), ("scale_inv", scale_inv))
    _checks.non_empty(op, "data", data, 1)
    if scale_inv.numel() != 1:
        _checks.fail(op, "scale_inv", "hold one value (the tensor's scale)", f"shape {_checks.shape_str(scale_inv.shape)}")
    return data.new_empty(data.shape, dtype=out)


# Not differentiable: backprop through these raises a clear error (ops/_nondiff.py).
_nondiff.register("fp8_tensor_quantize", "fp8_tensor_quantize_rowcol", "fp8_tensor_dequantize")


def fp8_tensor_quantize(x: torch.Tensor, elem: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes `x` to FP8 with one scale: `scale = max / amax(x)` rounded down to a power of two.

    `elem`: "e4m3" (activations, weights) or "e5m2" (gradients). The amax is reduced on the device
    and never synchronises with the host.

    Returns:
        (data, scale_inv): codes of x's shape (float8_e4m3fn or float8_e5m2) and the 0-d float32
        dequantization factor `1 / scale`.
    """
    return torch.ops.deepwell.fp8_tensor_quantize(x, elem)


def fp8_tensor_quantize_rowcol(
    x: torch.Tensor, elem: str = "e4m3", amax: torch.Tensor | None = None, copies: str = "both"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8_tensor_quantize` of the (m, k) tensor x with its codes also written transposed, from
    one read: with one scale the column-wise copy is exactly the row codes transposed (what sm_90's
    TN-only FP8 GEMM needs for the weight and input gradients).

    `amax`: x's NaN-propagating max |x| as a 0-d float32 tensor (`amax_of(x)`), when whoever made x
    already has it; the op then skips its own pass over x. Under torch.compile the reduction fuses
    into x's producer (the deepwell backend does this), so quantizing costs one read of x, not two.
    It is trusted, not checked: the codes equal the op's own only for x's true amax.

    `copies`: "both", or "rows" / "cols" to write one copy (the other is returned empty, shape (0,)),
    the same codes for half the bytes written: a layer whose backward makes the wgrad copy from x
    again (`fp8_tensor_linear` given the row codes alone).

    Returns:
        (row_data (m, k), col_data (k, m), scale_inv (0-d)).
    """
    return torch.ops.deepwell.fp8_tensor_quantize_rowcol(x, elem, amax, copies)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """x's NaN-propagating max |x| as a 0-d float32 tensor: the `amax` argument of
    `fp8_tensor_quantize_rowcol` and `fp8_tensor_linear_backward`. Exact (a max of bf16 values in
    fp32); one reduction in eager mode, fused into x's producer under Inductor."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def fp8_tensor_dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Inverse of `fp8_tensor_quantize`: `decode(q) * scale_inv`, as `out_dtype` (default bfloat16)."""
    return torch.ops.deepwell.fp8_tensor_dequantize(data, scale_inv, out_dtype)
