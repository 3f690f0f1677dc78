"""The routed experts' SwiGLU FFN over the expert-grouped buffer, `down(swiglu(gate_up(x)))` per
expert: `swiglu_experts(x, gate_up_proj, down_proj, offsets, recipes)` (docs/DESIGN.md "MoE").

Where both projections run deepwell's FP8 grouped GEMMs (fp8_block on sm_90, groups padded to 128,
the grouped dispatch's `fp8_block_grouped`), the activation never exists in bf16 between them:

| pass | unfused (`grouped_linear`, `swiglu`, `grouped_linear`) | fused (`_SwigluExpertsFp8Block`) |
|---|---|---|
| forward | swiglu writes h, rowcol reads it | `fp8_block_swiglu_quantize_rowcol(gate_up)` |
| backward | swiglu_backward writes d_gate_up, rowcol reads it | `..._backward_quantize_rowcol(gate_up, dh)` |

The fused kernels give exactly the codes and scales rowcol gives of `swiglu`'s / `swiglu_backward`'s
output (tests/ops/test_swiglu.py), so both ways compute the same bits, forward and every gradient
(tests/ops/test_swiglu_experts.py). Everything else runs the unfused way.
"""

from __future__ import annotations

import torch

from .grouped_linear import backend_on, grouped_linear
from .swiglu import swiglu


def fused_on(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, recipes, groups_aligned: bool
) -> bool:
    """Whether both projections run deepwell's FP8 grouped GEMMs (Rust's grouped dispatch says
    `fp8_block_grouped` for each), so the activation can go straight to FP8."""
    if tuple(recipes) != ("fp8_block", "fp8_block") or not groups_aligned:
        return False
    tiled = all(d % 128 == 0 for w in (gate_up_proj, down_proj) for d in w.shape[1:])
    return tiled and backend_on("fp8_block", str(x.device), True, True) == "fp8_block_grouped"


def swiglu_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    offsets: torch.Tensor,
    recipes: tuple[str, str],
    groups_aligned: bool = False,
) -> torch.Tensor:
    """Per expert e, `down_proj[e] @ swiglu(gate_up_proj[e] @ x_e)` over the expert-grouped rows.

    Args:
        x: (R, D), rows grouped by expert (`deepwell.moe_dispatch`).
        gate_up_proj: (E, 2F, D), each expert's gate rows then its up rows.
        down_proj: (E, D, F).
        offsets: (E + 1,) int32 group starts, offsets[E] == R: `grouped_linear`'s contract (checked
            on CPU tensors, the caller's on CUDA).
        recipes: the two projections' recipes (`grouped_linear`'s).
        groups_aligned: every group's rows are a multiple of the recipes' block (`grouped_linear`).

    Returns:
        (R, D) in x's dtype.
    """
    if fused_on(x, gate_up_proj, down_proj, recipes, groups_aligned):
        return _SwigluExpertsFp8Block.apply(x, gate_up_proj, down_proj, offsets)
    gate_up = grouped_linear(x, gate_up_proj, offsets, recipes[0], groups_aligned=groups_aligned)
    return grouped_linear(swiglu(gate_up), down_proj, offsets, recipes[1], groups_aligned=groups_aligned)


class _SwigluExpertsFp8Block(torch.autograd.Function):
    """Both projections on deepwell's FP8 grouped GEMMs, exactly as two `grouped_linear`
    fp8_block_grouped calls around `swiglu` compute them (the same quantizations, GEMMs and order),
    with the activation's quantizations fused into SwiGLU. Saves what the unfused way saves: x's
    transposed codes, gate_up (for SwiGLU's gradient), h's transposed codes, the weights."""

    @staticmethod
    def forward(ctx, x, gate_up_proj, down_proj, offsets):
        ops = torch.ops.deepwell
        x_rows, x_rows_s, x_cols, x_cols_s = ops.fp8_block_quantize_rowcol(x.contiguous())
        w1, w1_s = ops.fp8_block_expert_weight(gate_up_proj, "fprop")
        gate_up = ops.fp8_block_grouped_gemm(x_rows, x_rows_s, w1, w1_s, offsets, x.dtype)
        h_rows, h_rows_s, h_cols, h_cols_s = ops.fp8_block_swiglu_quantize_rowcol(gate_up)
        w2, w2_s = ops.fp8_block_expert_weight(down_proj, "fprop")
        ctx.save_for_backward(x_cols, x_cols_s, gate_up, h_cols, h_cols_s, gate_up_proj, down_proj, offsets)
        ctx.x_dtype = x.dtype
        return ops.fp8_block_grouped_gemm(h_rows, h_rows_s, w2, w2_s, offsets, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        ops = torch.ops.deepwell
        x_cols, x_cols_s, gate_up, h_cols, h_cols_s, gate_up_proj, down_proj, offsets = ctx.saved_tensors
        need_x, need_w1, need_w2 = ctx.needs_input_grad[:3]
        dy_rows, dy_rows_s, dy_cols, dy_cols_s = ops.fp8_block_quantize_rowcol(grad.contiguous())
        dx = dw1 = dw2 = None
        if need_w2:
            dw2 = ops.fp8_block_grouped_wgrad(dy_cols, dy_cols_s, h_cols, h_cols_s, offsets, down_proj.dtype)
        if need_x or need_w1:
            w2t, w2t_s = ops.fp8_block_expert_weight(down_proj, "dgrad")
            dh = ops.fp8_block_grouped_gemm(dy_rows, dy_rows_s, w2t, w2t_s, offsets, ctx.x_dtype)
            g_rows, g_rows_s, g_cols, g_cols_s = ops.fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh)
            if need_x:
                w1t, w1t_s = ops.fp8_block_expert_weight(gate_up_proj, "dgrad")
                dx = ops.fp8_block_grouped_gemm(g_rows, g_rows_s, w1t, w1t_s, offsets, ctx.x_dtype)
            if need_w1:
                dw1 = ops.fp8_block_grouped_wgrad(
                    g_cols, g_cols_s, x_cols, x_cols_s, offsets, gate_up_proj.dtype
                )
        return dx, dw1, dw2, None
