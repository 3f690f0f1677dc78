"""SwiGLU, `silu(gate) * up`, and its fused FP8-block quantizers: schemas, fake kernels, autograd.

- `swiglu(gate_up)`: h (rows, f) from gate_up (rows, 2f), each row's gate values then its up values
  (Hugging Face's fused experts). Differentiable: its backward is `swiglu_backward`.
- `fp8_block_swiglu_quantize_rowcol(gate_up)`: exactly `fp8_block_quantize_rowcol(swiglu(gate_up))`,
  without writing h (the MoE experts' down projection reads only these operands).
- `fp8_block_swiglu_backward_quantize_rowcol(gate_up, grad)`: exactly
  `fp8_block_quantize_rowcol(swiglu_backward(gate_up, grad))`, without writing d_gate_up (the
  gate_up projection's dgrad and wgrad read only these operands).

Kernels: rust/ops/src/ops/swiglu/ (CPU reference: cpu.rs); maths: rust/core/src/swiglu.rs; rules:
docs/NUMERICS.md "SwiGLU" (fp32, the sigmoid from deepwell's own exp, one rounding to the dtype).
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from .fp8_block import rowcol_like
from ._library import define

define("swiglu(Tensor gate_up) -> Tensor")
define("swiglu_backward(Tensor gate_up, Tensor grad) -> Tensor")
define(
    "fp8_block_swiglu_quantize_rowcol(Tensor gate_up, bool pow2=True) "
    "-> (Tensor row_data, Tensor row_scale_inv, Tensor col_data, Tensor col_scale_inv)"
)
define(
    "fp8_block_swiglu_backward_quantize_rowcol(Tensor gate_up, Tensor grad, bool pow2=True) "
    "-> (Tensor row_data, Tensor row_scale_inv, Tensor col_data, Tensor col_scale_inv)"
)


def _check(
    op: str, gate_up: torch.Tensor, grad: torch.Tensor | None = None, blocks: bool = False
) -> tuple[int, int]:
    """(rows, f) of a valid call; the Rust ops check the same things in the same order, with the same
    messages. `blocks`: the fused quantizers' 128 x 128 tiles, which must lie wholly in one half."""
    _checks.dtype_in(op, "gate_up", gate_up, _checks.FLOAT_INPUTS)
    if gate_up.dim() != 2:
        layout = "be 2-d (rows, 2 * ffn): gate then up along the last dim"
        _checks.fail(op, "gate_up", layout, f"a {gate_up.dim()}-d tensor")
    _checks.divisible(op, "gate_up", gate_up, 1, 2, "gate and up halves of equal width")
    if blocks:
        _checks.non_empty(op, "gate_up", gate_up, 2)
        _checks.divisible(op, "gate_up", gate_up, 0, 128, "the transposed copy has 1x128 blocks along rows")
        _checks.divisible(op, "gate_up", gate_up, 1, 256, "gate and up are each whole 128-column blocks")
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    if grad is not None:
        _checks.dtype_in(op, "grad", grad, (gate_up.dtype,))
        _checks.shape_eq(op, "grad", grad, (rows, f))
        _checks.same_device(op, ("gate_up", gate_up), ("grad", grad))
    return rows, f


@torch.library.register_fake("deepwell::swiglu")
def _swiglu_fake(gate_up):
    rows, f = _check("swiglu", gate_up)
    return gate_up.new_empty((rows, f))


@torch.library.register_fake("deepwell::swiglu_backward")
def _swiglu_backward_fake(gate_up, grad):
    _check("swiglu_backward", gate_up, grad)
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


@torch.library.register_fake("deepwell::fp8_block_swiglu_quantize_rowcol")
def _quantize_fake(gate_up, pow2=True):
    op = "fp8_block_swiglu_quantize_rowcol"
    rows, f = _check(op, gate_up, blocks=True)
    return rowcol_like(gate_up, rows, f)


@torch.library.register_fake("deepwell::fp8_block_swiglu_backward_quantize_rowcol")
def _backward_quantize_fake(gate_up, grad, pow2=True):
    op = "fp8_block_swiglu_backward_quantize_rowcol"
    rows, f = _check(op, gate_up, grad, blocks=True)
    return rowcol_like(gate_up, rows, 2 * f)


def _setup(ctx, inputs, output) -> None:
    (gate_up,) = inputs
    ctx.save_for_backward(gate_up)


def _backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.deepwell.swiglu_backward(gate_up, grad.contiguous())


def _backward_setup(ctx, inputs, output) -> None:
    pass  # its backward only refuses


def _backward_backward(ctx, grad):
    raise RuntimeError(
        "deepwell.swiglu_backward: double backward (second derivatives of SwiGLU) is not implemented"
    )


torch.library.register_autograd("deepwell::swiglu", _backward, setup_context=_setup)
torch.library.register_autograd(
    "deepwell::swiglu_backward", _backward_backward, setup_context=_backward_setup
)
# The fused quantizers give codes and scales: no gradient (ops/_nondiff.py).
_nondiff.register("fp8_block_swiglu_quantize_rowcol", "fp8_block_swiglu_backward_quantize_rowcol")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of each row of gate_up (rows, 2f) = [gate | up], in gate_up's dtype, with
    autograd. Computed in fp32 (docs/NUMERICS.md "SwiGLU") and rounded once; the CPU and CUDA
    kernels give the same bits.

    Returns:
        h (rows, f).
    """
    return torch.ops.deepwell.swiglu(gate_up)


def fp8_block_swiglu_quantize_rowcol(
    gate_up: torch.Tensor, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8_block_quantize_rowcol(swiglu(gate_up))` from one read of gate_up, h never written.
    rows and f must be multiples of 128.

    Returns:
        (row_data (rows, f), row_scale_inv (rows, f/128), col_data (f, rows), col_scale_inv (f, rows/128)).
    """
    return torch.ops.deepwell.fp8_block_swiglu_quantize_rowcol(gate_up, pow2)


def fp8_block_swiglu_backward_quantize_rowcol(
    gate_up: torch.Tensor, grad: torch.Tensor, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8_block_quantize_rowcol(swiglu_backward(gate_up, grad))`: the gradient of gate_up for h's
    gradient `grad` (rows, f), quantized, from one read of both; d_gate_up never written.

    Returns:
        (row_data (rows, 2f), row_scale_inv (rows, 2f/128), col_data (2f, rows),
        col_scale_inv (2f, rows/128)).
    """
    return torch.ops.deepwell.fp8_block_swiglu_backward_quantize_rowcol(gate_up, grad, pow2)
