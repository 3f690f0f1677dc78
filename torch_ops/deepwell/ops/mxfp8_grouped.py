"""Blackwell's native MXFP8 grouped GEMMs for MoE experts, through `torch._scaled_grouped_mm`
(grouped_linear.py's `mxfp8_grouped` backend, chosen in Rust: deepwell_core::policy::grouped).

The operands are exactly the grouped emulation's (grouped_linear.py `_GroupedEmulated`): x and dy
quantized along K per row, each expert's W along K (forward) and along N (dgrad: W^T), and for the
wgrad dy and x along the tokens, in blocks of 32 that never span two experts when the groups are
padded to 32. What differs is where the scales go. The grouped GEMM reads E8M0 scales in the 128x4
tiled layout of `swizzle_scales` (docs/NUMERICS.md "Transposes and layouts"), per group:
- an expert's weight: its own tiled scales, one row of the (E, tiled bytes) tensor per expert;
- a 2-D operand grouped along its rows (x, dy in the forward and dgrad): each group's scale rows
  start at the next multiple of 128 of a buffer with 128 spare rows per group (`row_group_scales`);
- a 2-D operand grouped along its blocks (the wgrad's tokens): each group's scale columns start at
  the next multiple of 4 and its tiles follow the previous group's (`column_group_scales`).
These are the layouts torchao's MXFP8 MoE training hands the same torch kernel. Every index is
computed on the device from the offsets: no host sync.

This path has not run on a Blackwell GPU here (the test GPU is Hopper). On CPU the tests check the
layouts against per-group `swizzle_scales`, and the whole autograd path against the grouped
emulation with `torch._scaled_grouped_mm` replaced by a float64 decoder of those layouts, and
torch's own shape checks through its fake kernel. On a GPU the first use on each device compares it
with the grouped emulation on a small problem (`trusted_on`) and falls back to the emulation, with
a warning, if they disagree.
"""

from __future__ import annotations

import functools
import warnings

import torch

from . import _checks, _nondiff
from ._function import cast
from ._library import define

#: MXFP8's block along the quantized dimension, and the tiled layout's tile (rows x scale columns).
BLOCK, TILE_ROWS, TILE_COLS = 32, 128, 4

# The experts' weight operands, through the weight cache (rust/ops/src/ops/linear/expert_weight.rs):
# want "fprop" -> mxfp8_quantize(weight, -1) with expert_scales of its scales; "dgrad" -> the same of
# weight.transpose(1, 2) (each expert's W^T along N).
define("mxfp8_expert_weight(Tensor weight, str want) -> (Tensor data, Tensor scale)")


@torch.library.register_fake("deepwell::mxfp8_expert_weight")
def _expert_weight_fake(weight, want):
    e, n, k = _checks.expert_weight("mxfp8_expert_weight", weight, want, (
        "an expert's MXFP8 scales tile 128 rows (W) and W^T quantizes along out_features in 128x4 tiles",
        "W's MXFP8 scales tile 4 blocks of 32 along in_features, 128 rows of W^T"))
    rows, cols = (n, k) if want == "fprop" else (k, n)
    return (weight.new_empty((e, rows, cols), dtype=torch.float8_e4m3fn),
            weight.new_empty((e, rows * cols // BLOCK), dtype=torch.float8_e8m0fnu))


_nondiff.register("mxfp8_expert_weight")


def available_on(device: torch.device) -> bool:
    """Whether this torch has the MXFP8 grouped GEMM on `device`: compute capability 10.x and a
    build with FBGEMM GenAI or MSLK (the flags torch's own tests gate it on)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(device)[0] != 10:
        return False
    config = torch.__config__.show()
    return "USE_MSLK" in config or "USE_FBGEMM_GENAI" in config


def _ceil(n, m):
    return (n + m - 1) // m * m


def expert_scales(scale: torch.Tensor) -> torch.Tensor:
    """(E, rows, C) scales of stacked expert weights -> (E, rows * C): each expert's scales tiled
    on their own (rows a multiple of 128, C of 4, so no tile spans two experts). The layout of
    `mxfp8_expert_weight`'s scales, which the Rust op makes itself (through the weight cache); this
    is its definition in torch ops, the one the tests compare it with."""
    e, rows, cols = scale.shape
    return torch.ops.deepwell.swizzle_scales(scale.reshape(e * rows, cols)).view(e, rows * cols)


def row_group_scales(scale: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(R, C) scales of an operand whose rows are grouped by `offsets` ((E + 1,) start rows) ->
    (R + 128 E, C): group g's scale rows from row sum_{h<g} ceil128(rows of h), zeros elsewhere,
    then the whole buffer tiled (a group starts on a tile, so this is each group's own tiling,
    placed at its start; the groups end by row R + 127 E, so cutting the tiling there loses none)."""
    rows, cols = scale.shape
    experts = offsets.numel() - 1
    starts, ends = offsets[:-1].long(), offsets[1:].long()
    padded = _ceil(ends - starts, TILE_ROWS)
    first = torch.cumsum(padded, 0) - padded
    r = torch.arange(rows, device=scale.device)
    group = torch.searchsorted(ends, r, right=True)
    placed = torch.zeros(rows + TILE_ROWS * experts, cols, dtype=torch.uint8, device=scale.device)
    placed.index_copy_(0, first[group] + r - starts[group], scale.view(torch.uint8))
    return torch.ops.deepwell.swizzle_scales(placed.view(scale.dtype)).view(-1, cols)[:rows + TILE_ROWS * experts]


def column_group_scales(scale: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(rows, R / 32) scales of an operand quantized along grouped tokens (`offsets`: (E + 1,) start
    tokens, each group a multiple of 32) -> (rows padded to 128, R / 32 + 4 E): group g's scale
    columns padded to a multiple of 4 and tiled on their own, the groups' tiles one after another
    (group g from byte rows128 * sum_{h<g} ceil4(columns of h)), zeros elsewhere."""
    rows, cols = scale.shape
    experts = offsets.numel() - 1
    starts, ends = offsets[:-1].long() // BLOCK, offsets[1:].long() // BLOCK
    width = _ceil(ends - starts, TILE_COLS)
    first = torch.cumsum(width, 0) - width
    tall = _ceil(rows, TILE_ROWS)
    c = torch.arange(cols, device=scale.device)
    group = torch.searchsorted(ends, c, right=True)
    k, across = c - starts[group], width[group] // TILE_COLS
    r = torch.arange(rows, device=scale.device)[:, None]
    # The byte of (r, c) in its group's tiling (swizzle_scales' formula), after the earlier groups.
    dest = (first[group] * tall + ((r // TILE_ROWS) * across + k // TILE_COLS) * (TILE_ROWS * TILE_COLS)
            + (r % 32) * 16 + (r % TILE_ROWS) // 32 * 4 + k % TILE_COLS)
    placed = torch.zeros(tall * (cols + TILE_COLS * experts), dtype=torch.uint8, device=scale.device)
    placed.index_copy_(0, dest.reshape(-1), scale.view(torch.uint8).reshape(-1))
    return placed.view(scale.dtype).view(tall, cols + TILE_COLS * experts)


class GroupedMxfp8(torch.autograd.Function):
    """`grouped_linear` in MXFP8 on torch's grouped GEMM: forward and dgrad over the row groups,
    wgrad over the token groups; x's column copy saved for the wgrad instead of x."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        ops = torch.ops.deepwell
        x_rows, x_rows_s, x_cols, x_cols_s = ops.mxfp8_quantize_rowcol(x.contiguous(), "rceil", "e4m3", True, False)
        # (E, N, K) along K, each expert's scales tiled; through the weight cache (made here outside
        # a reuse scope, once per optimizer step for both passes inside deepwell.microbatches()).
        w, w_s = ops.mxfp8_expert_weight(weight, "fprop")
        out = torch._scaled_grouped_mm(x_rows, w.transpose(-2, -1), row_group_scales(x_rows_s, offsets),
                                       w_s, offs=offsets[1:], out_dtype=torch.bfloat16)
        ctx.save_for_backward(x_cols, x_cols_s, weight, offsets)
        ctx.x_dtype = x.dtype
        return cast(out, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        ops = torch.ops.deepwell
        x_cols, x_cols_s, weight, offsets = ctx.saved_tensors
        dy_rows, dy_rows_s, dy_cols, dy_cols_s = ops.mxfp8_quantize_rowcol(grad.contiguous(), "rceil", "e4m3", True, False)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # W^T along N: the codes of each expert's (K, N) transpose (the quantizer reads the
            # transposed view and writes contiguous codes), read column-major as (N, K).
            wt, wt_s = ops.mxfp8_expert_weight(weight, "dgrad")
            dx = torch._scaled_grouped_mm(dy_rows, wt.transpose(-2, -1), row_group_scales(dy_rows_s, offsets),
                                          wt_s, offs=offsets[1:], out_dtype=torch.bfloat16)
            dx = dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            # dW_e = dy_e^T x_e: (N, R) row-major times (R, K) column-major, both along the tokens.
            dw = torch._scaled_grouped_mm(dy_cols, x_cols.t(), column_group_scales(dy_cols_s, offsets),
                                          column_group_scales(x_cols_s, offsets), offs=offsets[1:],
                                          out_dtype=torch.bfloat16)
            dw = dw.to(weight.dtype)
        return dx, dw, None


@functools.cache
def trusted_on(device: str, emulation: type) -> bool:
    """Whether the native path matches the grouped emulation (`emulation`, grouped_linear's autograd
    function, given by its caller: this module sits below it) on `device` (a small problem with an
    empty expert, forward and both gradients, relative error under 2e-2: the two differ only in
    accumulation order and the bf16 rounding of dequantized operands). Checked once per device;
    on a mismatch (or an error) a warning says so and the experts run emulated."""
    try:
        worst = _worst_error(device, emulation)
    except RuntimeError as err:  # e.g. a compute capability torch's kernel does not take
        worst, why = float("inf"), f"fails ({err})"
    else:
        why = f"differ from the exact emulation by {worst:.3g} (relative)"
    if not worst < 2e-2:
        warnings.warn(f"deepwell: torch._scaled_grouped_mm's MXFP8 experts on {device} {why}; "
                      "MXFP8 experts run emulated there", stacklevel=2)
        return False
    return True


def _worst_error(device: str, emulation: type) -> float:
    """`trusted_on`'s problem: the largest relative error of the native path's output, dx and dw
    against the grouped emulation's."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.enable_grad():
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(160, 256, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        w = torch.randn(3, 128, 256, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        dy = torch.randn(160, 128, device=device, dtype=torch.bfloat16, generator=g)
        offsets = torch.tensor([0, 32, 32, 160], device=device, dtype=torch.int32)
        runs = []
        for fn in (GroupedMxfp8.apply, lambda *a: emulation.apply(*a, "mxfp8")):
            y = fn(x, w, offsets)
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            runs.append((y.detach(), dx, dw))
    return max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)) for a, b in zip(*runs))
