"""`fp8_block_swiglu_mlp(x, x_codes, x_scale_inv, x_codes_t, x_scale_inv_t, w_gate, w_up, w_down)`:
a LLaMA MLP, `w_down(silu(w_gate(x)) * w_up(x))` without biases, in the fp8_block recipe, with
SwiGLU fused into the FP8 quantizers on both sides of it. x's codes are
`fp8_block_quantize_rowcol(x, m_major_scales=True)`'s, as `fp8_block_linear` takes them.

| pass | three `fp8_block_linear` layers on x's codes | this op |
|---|---|---|
| forward | gate and up GEMMs; SwiGLU writes h (bf16); rowcol reads h | one GEMM for [w_gate; w_up]; `fp8_block_swiglu_quantize_rowcol(gate_up)` writes h's two FP8 copies |
| backward | SwiGLU's backward writes d_gate, d_up (bf16); each layer's backward reads its own to quantize it; two dx added | `fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh)` writes d_gate_up's two FP8 copies; one dgrad GEMM (K = 2f, dx rounded once) and one wgrad GEMM for both weights |

Saved for the backward: x's column copy (shared with other layers reading x), gate_up (what
SwiGLU's gradient reads) and h's column copy. The forward op returns them beside y (outputs 1-3,
no gradient). Every quantization is the one the three layers make; SwiGLU is deepwell's exact fp32
(docs/NUMERICS.md "SwiGLU"), so under torch.compile the fused op differs from the three layers by
SwiGLU's rounding and by dx's single rounding (tests/ops/test_fp8_block_mlp.py). The backend rewrites
the three layers into it (compiler/fuse_mlp.py). Kernels: rust/ops/src/ops/linear/fp8_block_mlp.rs.
"""

from __future__ import annotations

import torch

from . import _nondiff
from ._library import define
from .fp8_block_linear import column_copy

define(
    "fp8_block_swiglu_mlp(Tensor x, Tensor x_codes, Tensor x_scale_inv, Tensor x_codes_t, Tensor x_scale_inv_t, "
    "Tensor w_gate, Tensor w_up, Tensor w_down, str recipe=\"fp8_block\") "
    "-> (Tensor y, Tensor gate_up, Tensor h_codes_t, Tensor h_scale_inv_t)"
)
define(
    "fp8_block_swiglu_mlp_backward(Tensor grad_out, Tensor x_codes_t, Tensor x_scale_inv_t, Tensor gate_up, "
    "Tensor h_codes_t, Tensor h_scale_inv_t, Tensor w_gate, Tensor w_up, Tensor w_down, str recipe, "
    "bool need_input, bool need_weight) -> (Tensor grad_input, Tensor grad_gate_up, Tensor grad_down)"
)

# The fake kernels give the outputs' shapes and dtypes only: the kernels check the arguments at
# dispatch (rust/ops/src/ops/linear/fp8_block_mlp.rs) and raise the errors.


@torch.library.register_fake("deepwell::fp8_block_swiglu_mlp")
def _mlp_fake(x, x_codes, x_scale_inv, x_codes_t, x_scale_inv_t, w_gate, w_up, w_down, recipe="fp8_block"):
    f = w_gate.shape[0]
    y = x.new_empty((*x.shape[:-1], w_down.shape[0]))
    gate_up = x.new_empty((*x.shape[:-1], 2 * f))
    return y, gate_up, *column_copy(x, x.numel() // x.shape[-1], f)  # h's


@torch.library.register_fake("deepwell::fp8_block_swiglu_mlp_backward")
def _mlp_backward_fake(grad_out, x_codes_t, x_scale_inv_t, gate_up, h_codes_t, h_scale_inv_t, w_gate, w_up, w_down,
                       recipe, need_input, need_weight):
    f, k = w_gate.shape
    dx = gate_up.new_empty((*grad_out.shape[:-1], k) if need_input else (0,))
    d_gate_up = w_gate.new_empty((2 * f, k) if need_weight else (0,))
    return dx, d_gate_up, w_down.new_empty(w_down.shape if need_weight else (0,))


def _mlp_setup(ctx, inputs, output):
    _, _, _, x_codes_t, x_scale_inv_t, w_gate, w_up, w_down, recipe = inputs
    _, gate_up, h_codes_t, h_scale_inv_t = output
    ctx.save_for_backward(x_codes_t, x_scale_inv_t, gate_up, h_codes_t, h_scale_inv_t, w_gate, w_up, w_down)
    ctx.mark_non_differentiable(gate_up, h_codes_t, h_scale_inv_t)
    ctx.recipe = recipe


def _mlp_backward(ctx, grad, *_):
    """dx, d w_gate, d w_up, d w_down from one backward call (dy of y only: the other outputs are
    saved tensors, not differentiable); None for the codes, which carry no gradient."""
    need = ctx.needs_input_grad
    need_x, need_w = need[0], any(need[5:8])
    if not (need_x or need_w):
        return (None,) * 9
    saved = ctx.saved_tensors
    dx, d_gate_up, d_down = torch.ops.deepwell.fp8_block_swiglu_mlp_backward(grad, *saved, ctx.recipe, need_x, need_w)
    f = saved[5].shape[0]
    d_gate, d_up = (d_gate_up[:f], d_gate_up[f:]) if need_w else (None, None)
    return (dx if need_x else None, None, None, None, None, d_gate if need[5] else None,
            d_up if need[6] else None, d_down if need[7] else None, None)


_nondiff.register_once_differentiable("fp8_block_swiglu_mlp", _mlp_backward, _mlp_setup)


def fp8_block_swiglu_mlp(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, recipe: str = "fp8_block"
) -> torch.Tensor:
    """`w_down(silu(w_gate(x)) * w_up(x))` in fp8_block with SwiGLU fused into the quantizers, x
    quantized once (both copies, one read); x's token count must be a multiple of 128. `recipe`:
    "fp8_block", or "fp8_block@sm_90" on CPU tensors to run the GEMMs sm_90 would run through the
    CPU model."""
    codes = torch.ops.deepwell.fp8_block_quantize_rowcol(x.detach().reshape(-1, x.shape[-1]), True, True)
    return torch.ops.deepwell.fp8_block_swiglu_mlp(x, *codes, w_gate, w_up, w_down, recipe)[0]
