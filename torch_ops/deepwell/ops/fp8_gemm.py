"""GEMMs of fp8_block operands (E4M3 codes, one fp32 scale per 128 elements along K; the codes and
scales `fp8_block_quantize` makes): schemas, fake kernels and Python wrappers.

On an H100/H200 (sm_90) they run deepwell's own kernel (cuda/fp8_gemm.cuh: TMA loads, wgmma, the
scales applied to each 128-wide K-block's fp32 partial sums); elsewhere, and for shapes that kernel
does not take, the product of the dequantized operands in fp32 (the CPU reference, which defines
what they compute). Kernels: rust/ops/src/ops/fp8_gemm/.
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define

_SCALED = "Tensor a, Tensor a_scale, Tensor b, Tensor b_scale"
define(f"fp8_block_gemm({_SCALED}, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor")
define(f"fp8_block_grouped_gemm({_SCALED}, Tensor offsets, ScalarType? out_dtype=None) -> Tensor")
define(f"fp8_block_grouped_wgrad({_SCALED}, Tensor offsets, ScalarType? out_dtype=None) -> Tensor")
# The experts' weight operands of the grouped GEMMs, through the weight cache (rust/ops/src/ops/
# linear/expert_weight.rs): want "fprop" -> fp8_block_quantize(weight, 128, 128); "dgrad" ->
# fp8_block_quantize_transposed(weight.reshape(E * N, K)).
define("fp8_block_expert_weight(Tensor weight, str want) -> (Tensor data, Tensor scale_inv)")


def _check_common(op, a, a_scale, b, b_scale, out_dtype, b_dim, groups_along_k=None):
    """The checks every FP8 GEMM op shares (as the Rust op makes them); `groups_along_k`: b holds
    that many groups side by side along K."""
    out = _checks.out_dtype(op, out_dtype)
    for name, t, dt in (("a", a, torch.float8_e4m3fn), ("b", b, torch.float8_e4m3fn),
                        ("a_scale", a_scale, torch.float32), ("b_scale", b_scale, torch.float32)):
        _checks.dtype_in(op, name, t, (dt,))
    if a.dim() != 2:
        _checks.fail(op, "a", "be 2-d (rows, K)", f"a {a.dim()}-d tensor")
    _checks.non_empty(op, "a", a, 2)
    _checks.divisible(op, "a", a, 1, 128, "fp8_block scales every 128 elements along K")
    rows, k = a.shape
    _checks.shape_eq(op, "a_scale", a_scale, (rows, k // 128))
    if b.dim() != b_dim:
        _checks.fail(op, "b", "be 3-d (groups, N, K)" if b_dim == 3 else "be 2-d (N, K)", f"a {b.dim()}-d tensor")
    _checks.non_empty(op, "b", b, b_dim)
    if b.shape[-1] != k * (groups_along_k or 1):
        side = f", expected {groups_along_k} groups x K" if groups_along_k else ""
        raise RuntimeError(
            f"deepwell.{op}: a has K = {k} (shape {_checks.shape_str(a.shape)}) but b has {b.shape[-1]} "
            f"(shape {_checks.shape_str(b.shape)}){side}"
        )
    return out, rows, k, b.shape[-2]


@torch.library.register_fake("deepwell::fp8_block_gemm")
def _gemm_fake(a, a_scale, b, b_scale, bias=None, out_dtype=None):
    op = "fp8_block_gemm"
    out, rows, k, cols = _check_common(op, a, a_scale, b, b_scale, out_dtype, 2)
    tiles, per_row = (cols // 128, k // 128), (cols, k // 128)
    if not ((cols % 128 == 0 and tuple(b_scale.shape) == tiles) or tuple(b_scale.shape) == per_row):
        _checks.fail(op, "b_scale", f"have shape [{tiles[0]}, {tiles[1]}] (128x128 tiles) or [{cols}, {k // 128}] "
                     "(1x128 rows)", f"shape {_checks.shape_str(b_scale.shape)}")
    tensors = [("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)]
    if bias is not None:
        _checks.dtype_in(op, "bias", bias, _checks.FLOAT_INPUTS)
        _checks.shape_eq(op, "bias", bias, (cols,))
        tensors.append(("bias", bias))
    _checks.same_device(op, *tensors)
    return a.new_empty((rows, cols), dtype=out)


def _check_offsets(op, offsets, groups, tensors):
    _checks.dtype_in(op, "offsets", offsets, (torch.int32,))
    if offsets.dim() != 1 or offsets.numel() < 2:
        _checks.fail(op, "offsets", "be 1-d with groups + 1 >= 2 entries", f"shape {_checks.shape_str(offsets.shape)}")
    if groups is not None and offsets.numel() != groups + 1:
        raise RuntimeError(
            f"deepwell.{op}: b has {groups} groups but offsets has {offsets.numel()} entries (expected groups + 1)"
        )
    _checks.same_device(op, *tensors, ("offsets", offsets))


@torch.library.register_fake("deepwell::fp8_block_grouped_gemm")
def _grouped_fake(a, a_scale, b, b_scale, offsets, out_dtype=None):
    op = "fp8_block_grouped_gemm"
    tensors = [("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)]
    if b.dim() == 2:  # the groups side by side along K: (N, G * K)
        groups = offsets.shape[0] - 1
        out, rows, k, cols = _check_common(op, a, a_scale, b, b_scale, out_dtype, 2, groups_along_k=groups)
        _checks.divisible(op, "b", b, 0, 128, "B's scales are 128x128 tiles")
        _checks.shape_eq(op, "b_scale", b_scale, (cols // 128, groups * (k // 128)))
        _check_offsets(op, offsets, None, tensors)
        return a.new_empty((rows, cols), dtype=out)
    out, rows, k, cols = _check_common(op, a, a_scale, b, b_scale, out_dtype, 3)
    _checks.divisible(op, "b", b, 1, 128, "B's scales are 128x128 tiles")
    _checks.shape_eq(op, "b_scale", b_scale, (b.shape[0], cols // 128, k // 128))
    _check_offsets(op, offsets, b.shape[0], tensors)
    return a.new_empty((rows, cols), dtype=out)


@torch.library.register_fake("deepwell::fp8_block_grouped_wgrad")
def _wgrad_fake(a, a_scale, b, b_scale, offsets, out_dtype=None):
    op = "fp8_block_grouped_wgrad"
    out, rows, k, cols = _check_common(op, a, a_scale, b, b_scale, out_dtype, 2)
    _checks.shape_eq(op, "b_scale", b_scale, (cols, k // 128))
    _check_offsets(op, offsets, None, [("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)])
    return a.new_empty((offsets.shape[0] - 1, rows, cols), dtype=out)


@torch.library.register_fake("deepwell::fp8_block_expert_weight")
def _expert_weight_fake(weight, want):
    e, n, k = _checks.expert_weight("fp8_block_expert_weight", weight, want, (
        "fp8_block quantizes W^T along out_features in 128x128 tiles",
        "fp8_block quantizes W along in_features in 128x128 tiles"))
    shapes = ((e, n, k), (e, n // 128, k // 128)) if want == "fprop" else ((k, e * n), (k // 128, e * n // 128))
    return (weight.new_empty(shapes[0], dtype=torch.float8_e4m3fn),
            weight.new_empty(shapes[1], dtype=torch.float32))


_nondiff.register("fp8_block_expert_weight")
_nondiff.register("fp8_block_gemm", "fp8_block_grouped_gemm", "fp8_block_grouped_wgrad",
                  hint="the FP8 GEMM ops take quantized codes; use deepwell.scaled_linear(..., 'fp8_block') "
                  "or deepwell.grouped_linear for a differentiable layer")


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`dequant(a) @ dequant(b).T + bias` for fp8_block operands.

    Args:
        a: (M, K) float8_e4m3fn codes, K a multiple of 128.
        a_scale: (M, K/128) float32 `scale_inv` per 1x128 block (`fp8_block_quantize(x, 1, 128)`'s).
        b: (N, K) float8_e4m3fn codes.
        b_scale: (N/128, K/128) per 128x128 tile (a weight) or (N, K/128) per 1x128 block.
        bias: (N,) float or None.
        out_dtype: bfloat16 (default), float16 or float32.
    """
    return torch.ops.deepwell.fp8_block_gemm(a, a_scale, b, b_scale, bias, out_dtype)


def fp8_block_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows `offsets[g]:offsets[g+1]` of `a` times group g of `b`, for every group (MoE experts).

    Args:
        a: (R, K) codes, rows grouped (`deepwell.moe_dispatch`); a_scale (R, K/128).
        b: (G, N, K) codes (one weight per group), b_scale (G, N/128, K/128) per 128x128 tile; or
            the groups side by side along K, (N, G * K) with b_scale (N/128, G * K/128) (what
            `fp8_block_quantize_transposed` of the stacked (G * K, N) weights gives: their W^T).
        offsets: (G + 1,) int32 row starts, 0 to R, non-decreasing (any group sizes).

    Returns:
        (R, N) in out_dtype (bfloat16 by default).
    """
    return torch.ops.deepwell.fp8_block_grouped_gemm(a, a_scale, b, b_scale, offsets, out_dtype)


def fp8_block_grouped_wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per group g, `dequant(a)[:, lo:hi] @ dequant(b)[:, lo:hi].T` with (lo, hi) = offsets[g:g+2]:
    the weight gradients of MoE experts (a = dy^T, b = x^T, both quantized along the rows R).

    Args:
        a: (M, R) codes with a_scale (M, R/128); b: (N, R) codes with b_scale (N, R/128).
        offsets: (G + 1,) int32, multiples of 128 from 0 to R (groups padded to the block).

    Returns:
        (G, M, N); an empty group's matrix is zeros.
    """
    return torch.ops.deepwell.fp8_block_grouped_wgrad(a, a_scale, b, b_scale, offsets, out_dtype)
