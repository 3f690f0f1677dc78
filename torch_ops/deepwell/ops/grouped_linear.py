"""Grouped linear layers for the experts of a Mixture-of-Experts layer: `grouped_linear(x, weight,
offsets, recipe)` computes, for every expert e, `y[offsets[e]:offsets[e+1]] = x[...] @ weight[e].T`
over the expert-grouped buffer of `deepwell.moe_dispatch` (docs/DESIGN.md "MoE"). Forward, input
gradient (dgrad) and weight gradient (wgrad) all run in `recipe`. Which way runs is Rust's decision
(`deepwell_core::policy::grouped_backend`, the `grouped_backend` entry):

| backend | when | how |
|---|---|---|
| `grouped_mm` | bf16 (and fp32/fp16 inputs) | `torch._grouped_mm` with torch's autograd: one CUTLASS grouped kernel on sm_90 / sm_100 for bf16, torch's own per-group loop elsewhere (through `deepwell_moe::grouped_mm` where torch's fake kernel refuses the dtype: grouped_mm.py) |
| `fp8_block_grouped` | fp8_block on sm_90, groups padded to 128 | deepwell's FP8 grouped GEMMs (cuda/fp8_gemm.cuh): x and W quantized once for the whole buffer / all experts, forward and dgrad as row-grouped GEMMs (W^T's tiles from one transposing pass over the stacked weights), wgrad as a K-grouped GEMM over each expert's tokens; x^T's codes and the weight saved for the backward; no host sync |
| `mxfp8_grouped` | mxfp8 on sm_100 with torch's MXFP8 grouped GEMM, groups padded to 32, features multiples of 128 | `torch._scaled_grouped_mm` per pass on the grouped emulation's operands, their scales in the grouped GEMM's tiled layouts (mxfp8_grouped.py; checked against the emulation on first use, never run here: no Blackwell GPU); no host sync |
| `emulated_grouped` | fp8_block, mxfp8 where Rust's dispatch marks them emulated (fp8_block off sm_90, mxfp8 off Blackwell, the CPU), groups padded | grouped exact emulation: the dense layer's quantizers on the whole buffer / all experts, dequantized, then `torch._grouped_mm` per pass (no host sync) |
| `per_expert_loop` | nvfp4, fp8_tensor, native mxfp8 without torch's MXFP8 grouped GEMM or 128-multiple features, or groups not padded | a loop over `deepwell.scaled_linear` / `scaled_linear_backward` per expert, each dispatched by Rust exactly like a dense layer (a host read of the offsets: a sync on CUDA) |

Groups should be padded to the recipe's block (`moe_permute_index(..., align=block)`, and
`groups_aligned=True`): wgrad's K is the expert's rows, and a group whose rows are not a multiple
of the block runs its wgrad unquantized in the per-expert loop (the dense layer's rule).
"""

from __future__ import annotations

import functools

import torch

from .. import _native
from ..core import recipes
from . import _checks, mxfp8_grouped
from ._function import cast
from .grouped_mm import grouped_mm

_OP = "grouped_linear"


@torch._dynamo.assume_constant_result
def recipe_blocks() -> tuple[tuple[str, int], ...]:
    """(recipe, block along K; 1 for bf16) from Rust's recipe table, a constant to torch.compile
    (the table comes through the JSON C API, which Dynamo cannot trace)."""
    return tuple((r, recipes.block_k(r) or 1) for r in recipes.names())


def block_of(recipe: str) -> int | None:
    """The recipe's block along K (1 for bf16), None for an unknown recipe."""
    return dict(recipe_blocks()).get(recipe)


def _check(x, weight, offsets, recipe) -> None:
    _checks.choice(_OP, "recipe", recipe, tuple(r for r, _ in recipe_blocks()))
    _checks.dtype_in(_OP, "x", x, _checks.FLOAT_INPUTS)
    _checks.dtype_in(_OP, "weight", weight, _checks.FLOAT_INPUTS)
    _checks.dtype_in(_OP, "offsets", offsets, (torch.int32,))
    _checks.same_device(_OP, ("x", x), ("weight", weight), ("offsets", offsets))
    if x.dim() != 2:
        _checks.fail(_OP, "x", "be 2-d (rows, in_features)", f"a {x.dim()}-d tensor")
    if weight.dim() != 3:
        _checks.fail(_OP, "weight", "be 3-d (experts, out_features, in_features)", f"a {weight.dim()}-d tensor")
    _checks.shape_eq(_OP, "offsets", offsets, (weight.shape[0] + 1,))
    _checks.features(_OP, "x", x, "weight", weight, "in_features", weight.shape[2])
    block = block_of(recipe)
    if recipe != "bf16":
        for d, what in ((2, "in_features"), (1, "out_features")):
            _checks.divisible(_OP, "weight", weight, d, block, f"{recipe} quantizes along {what} in blocks of {block}")


@torch.library.custom_op("deepwell_moe::grouped_scaled_linear", mutates_args=())
def _grouped_scaled_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: str) -> torch.Tensor:
    out = x.new_zeros((x.shape[0], weight.shape[1]))
    bounds = offsets.tolist()
    # On the host anyway (this loop's sync): checked on CUDA too, where grouped_linear could not.
    _checks.group_bounds(_OP, bounds, x.shape[0], "the rows of x")
    for e in range(weight.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = torch.ops.deepwell.scaled_linear(x[lo:hi], weight[e], None, recipe, None)
    return out


@_grouped_scaled_linear.register_fake
def _(x, weight, offsets, recipe):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op("deepwell_moe::grouped_scaled_linear_backward", mutates_args=())
def _grouped_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: str,
    need_input: bool, need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.zeros_like(x) if need_input else x.new_empty((0,))
    # An expert without rows gets an exact zero weight gradient.
    dw = torch.zeros_like(weight) if need_weight else weight.new_empty((0,))
    bounds = offsets.tolist()
    _checks.group_bounds(_OP, bounds, x.shape[0], "the rows of x")
    for e in range(weight.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            gx, gw = torch.ops.deepwell.scaled_linear_backward(
                grad[lo:hi].contiguous(), x[lo:hi], weight[e], recipe, None, need_input, need_weight
            )
            if need_input:
                dx[lo:hi] = gx
            if need_weight:
                dw[e] = gw
    return dx, dw


@_grouped_backward.register_fake
def _(grad, x, weight, offsets, recipe, need_input, need_weight):
    dx = torch.empty_like(x) if need_input else x.new_empty((0,))
    dw = torch.empty_like(weight) if need_weight else weight.new_empty((0,))
    return dx, dw


def _setup(ctx, inputs, output):
    x, weight, offsets, recipe = inputs
    ctx.save_for_backward(x, weight, offsets)
    ctx.recipe = recipe


def _backward(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return None, None, None, None
    dx, dw = _grouped_backward(grad, x, weight, offsets, ctx.recipe, need_x, need_w)
    return (dx if need_x else None), (dw if need_w else None), None, None


_grouped_scaled_linear.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------
# Grouped exact emulation (fp8_block, mxfp8 where Rust's dispatch marks the recipe emulated): the
# operands quantized by the same kernels and rules as the dense layer's emulation
# (rust/ops/src/gemm/quantize.rs: x, dy along K per row; W per expert, 128x128 tiles or 1x32 along
# K, and for dgrad W^T from the same tiles or 1x32 along N; wgrad's x and dy along the rows M, whose
# blocks never straddle two experts when groups are padded to the block), dequantized exactly (bf16
# on CUDA, fp32 on the CPU), then multiplied by torch._grouped_mm: the per-expert loop's operands
# bit for bit, one grouped GEMM per pass, no host sync.

def _dense_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.device.type == "cpu" else torch.bfloat16


def _fake(recipe: str, t: torch.Tensor, along: int, role: str) -> torch.Tensor:
    """t quantized along dim `along` as `role` ("act", "weight") and dequantized exactly."""
    out = _dense_dtype(t)
    if recipe == "mxfp8":
        data, scale = torch.ops.deepwell.mxfp8_quantize(t, along)
        return torch.ops.deepwell.mxfp8_dequantize(data, scale, along, out)
    block = (128, 128) if role == "weight" else ((1, 128) if along in (-1, t.dim() - 1) else (128, 1))
    data, scale = torch.ops.deepwell.fp8_block_quantize(t, *block)
    return torch.ops.deepwell.fp8_block_dequantize(data, scale, *block, out)


class _GroupedEmulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets, recipe):
        ctx.save_for_backward(x, weight, offsets)
        ctx.recipe = recipe
        xq, wq = _fake(recipe, x, -1, "act"), _fake(recipe, weight, -1, "weight")
        return cast(grouped_mm(xq, wq.transpose(-2, -1), offsets[1:]), x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        recipe, ends = ctx.recipe, offsets[1:]
        grad = grad.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # W^T along N: fp8_block's 128x128 tiles are the same either way; MXFP8 re-quantizes.
            wt = _fake(recipe, weight, -1 if recipe == "fp8_block" else 1, "weight")
            dx = grouped_mm(_fake(recipe, grad, -1, "act"), wt, ends).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gq, xq = _fake(recipe, grad, 0, "act"), _fake(recipe, x, 0, "act")
            dw = grouped_mm(gq.t(), xq, ends).to(weight.dtype)
        return dx, dw, None, None


# ---------------------------------------------------------------------------------------------
# deepwell's FP8 grouped GEMMs (fp8_block on sm_90): the same quantization as the per-expert loop
# (x and dy in 1x128 blocks along K per row; each expert's W in 128x128 tiles, and W^T's tiles for
# the dgrad from one transposing pass over all experts' stacked weights, the experts then side by
# side along K; dy^T and x^T in 1x128 blocks along the tokens, which never span two experts when the
# groups are padded to 128), every pass one launch.


class _GroupedFp8Block(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):
        ops = torch.ops.deepwell
        x_rows, x_rows_s, x_cols, x_cols_s = ops.fp8_block_quantize_rowcol(x.contiguous())
        # The weight's operands come through the weight cache: made here outside a reuse scope,
        # once per optimizer step for both passes inside deepwell.microbatches().
        w, w_s = ops.fp8_block_expert_weight(weight, "fprop")
        ctx.save_for_backward(x_cols, x_cols_s, weight, offsets)
        ctx.x_dtype = x.dtype
        return ops.fp8_block_grouped_gemm(x_rows, x_rows_s, w, w_s, offsets, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        ops = torch.ops.deepwell
        x_cols, x_cols_s, weight, offsets = ctx.saved_tensors
        dy_rows, dy_rows_s, dy_cols, dy_cols_s = ops.fp8_block_quantize_rowcol(grad.contiguous())
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # (k, e * n): W_e^T is columns [e * n, (e + 1) * n), its tiles those of W_e transposed.
            wt, wt_s = ops.fp8_block_expert_weight(weight, "dgrad")
            dx = ops.fp8_block_grouped_gemm(dy_rows, dy_rows_s, wt, wt_s, offsets, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = ops.fp8_block_grouped_wgrad(dy_cols, dy_cols_s, x_cols, x_cols_s, offsets, weight.dtype)
        return dx, dw, None


@torch._dynamo.assume_constant_result
def backend_on(recipe: str, device: str, aligned: bool, tiled: bool = False) -> str:
    """How Rust's grouped dispatch runs `recipe`'s experts on `device` (deepwell_core policy);
    `tiled`: in_features and out_features are multiples of 128."""
    return _backend_on(recipe, device, aligned, tiled)


@functools.cache
def _backend_on(recipe: str, device: str, aligned: bool, tiled: bool) -> str:
    request = {"recipe": recipe, "arch": recipes.device_arch(device), "aligned": aligned, "tiled": tiled,
               "torch_mxfp8_grouped": mxfp8_grouped.available_on(torch.device(device))}
    backend = _native.call("grouped_backend", request)["backend"]
    if backend == "mxfp8_grouped" and not mxfp8_grouped.trusted_on(device, _GroupedEmulated):
        return "emulated_grouped"  # trusted_on warned
    return backend


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, recipe: str = "bf16", groups_aligned: bool = False
) -> torch.Tensor:
    """Per-expert `x @ weight[e].T` over contiguous row groups, with autograd.

    Args:
        x: (R, in_features), rows grouped by expert (`deepwell.moe_dispatch`).
        weight: (E, out_features, in_features), nn.Linear layout per expert.
        offsets: (E + 1,) int32 start rows: offsets[0] == 0, non-decreasing, offsets[E] == R
            (`deepwell.moe_permute_index`'s). Checked on CPU tensors (a RuntimeError). On CUDA they
            are read only by the per-expert loop (which reads them to the host anyway, and checks
            them there); elsewhere they are the caller's contract, since reading them would be a
            host sync. Broken there (seen on an H200, torch 2.11): bf16's torch._grouped_mm leaves
            the rows past offsets[E] uninitialised, ignores offsets[0], and trips a device-side
            assert (which ends the CUDA context) on decreasing or too-large offsets; deepwell's FP8
            grouped GEMM computes no row outside the groups and returns wrong rows, silently, for
            decreasing or too-large offsets (its reads are clamped into x).
        recipe: "bf16" (unquantized: computes in x's dtype), "fp8_block", "mxfp8" or "nvfp4"; the
            quantized recipes need in_features and out_features multiples of their block.
        groups_aligned: the caller promises every group's rows are a multiple of the recipe's block
            (`moe_permute_index(..., align=block)`); then fp8_block runs deepwell's FP8 grouped GEMMs
            on sm_90, mxfp8 torch's MXFP8 grouped GEMM on sm_100 (where torch has it), and an
            emulated fp8_block / mxfp8 the grouped exact emulation (no host sync any way) instead
            of the per-expert loop. Checked on CPU tensors with the offsets (multiples of the block).

    Returns:
        (R, out_features) in x's dtype.
    """
    _check(x, weight, offsets, recipe)
    # The offsets' values last (the checks above need no data): bad ones would leave rows unwritten
    # (torch._grouped_mm, the FP8 kernels) or cut x wrongly.
    _checks.group_offsets(_OP, offsets, x.shape[0], "the rows of x", block_of(recipe) if groups_aligned else 1)
    if recipe == "bf16":
        # torch._grouped_mm takes the groups' end offsets and wants both operands in one dtype.
        return grouped_mm(x, weight.to(x.dtype).transpose(-2, -1), offsets[1:])
    tiled = weight.shape[1] % 128 == 0 and weight.shape[2] % 128 == 0
    backend = backend_on(recipe, str(x.device), bool(groups_aligned), tiled)
    if backend == "fp8_block_grouped":
        return _GroupedFp8Block.apply(x, weight, offsets)
    if backend == "mxfp8_grouped":
        return mxfp8_grouped.GroupedMxfp8.apply(x, weight, offsets)
    if backend == "emulated_grouped":
        return _GroupedEmulated.apply(x, weight, offsets, recipe)
    return _grouped_scaled_linear(x, weight, offsets, recipe)
