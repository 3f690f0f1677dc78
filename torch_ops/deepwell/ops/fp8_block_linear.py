"""`fp8_block_linear_from_codes(x, x_codes, x_scale_inv, x_codes_t, x_scale_inv_t, weight, bias)`:
`scaled_linear(x, weight, bias, "fp8_block")` on x's FP8 operands made beforehand by
`fp8_block_quantize_rowcol(x, m_major_scales=True)`, saving x's wgrad operand (the column copy, 1
byte per element) for the backward instead of x.

fp8_block quantizes x twice per step, along K for fprop and along the tokens for wgrad (1x128
blocks each way: the two copies differ, docs/NUMERICS.md "FP8 block"). `scaled_linear` makes the
first in the forward and the second in the backward from x again, per layer. Here one rowcol pass
writes both; the layers that read one x (q/k/v, gate/up) share it and its one saved column copy
(the deepwell backend groups them: compiler/backend.py), and the backward never reads x. Outputs and
gradients are bit-identical to `scaled_linear(x, weight, bias, "fp8_block")`.

The trade against `scaled_linear` under torch.compile: there the partitioner recomputes x (a norm's
or SwiGLU's output) in the backward instead of saving it, so nothing per x is kept; here the column
copy is (1 byte per element, about half of x in bf16), for one quantizing pass per x instead of two
per layer reading it. Kernels: rust/ops/src/ops/linear/fp8_block_linear.rs.

`fp8_block_linear_from_rows(x, x_codes, x_scale_inv, weight, bias)` is the same forward on the row
copy alone (`fp8_block_quantize_rowcol(x, True, True, "rows")`); its backward makes the column copy
from x (`copies="cols"`). Saved: x, as for `scaled_linear`. The deepwell backend's `recompute_codes`
uses it: under torch.compile the partitioner recomputes x (or keeps it anyway), and the column
passes of the layers reading one x are one call after AOTAutograd's CSE. Each pass writes only the
copy its GEMMs read. Same bits as `fp8_block_linear_from_codes`.
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define
from .linear import _bias_arg, _check_bias, _check_layer, _parse_recipe, check_saved_layer, layer_grads

define(
    "fp8_block_linear_from_codes(Tensor x, Tensor x_codes, Tensor x_scale_inv, Tensor x_codes_t, "
    "Tensor x_scale_inv_t, Tensor weight, Tensor? bias, str recipe=\"fp8_block\") -> Tensor"
)
define(
    "fp8_block_linear_from_rows(Tensor x, Tensor x_codes, Tensor x_scale_inv, Tensor weight, Tensor? bias, "
    "str recipe=\"fp8_block\") -> Tensor"
)
define(
    "fp8_block_linear_backward(Tensor grad_out, Tensor x_codes_t, Tensor x_scale_inv_t, Tensor weight, "
    "str recipe, bool need_input, bool need_weight) -> (Tensor grad_input, Tensor grad_weight)"
)

_BLOCK = 128


def _check_recipe(op: str, recipe: str) -> None:
    if _parse_recipe(op, recipe)[0] != "fp8_block":
        _checks.fail(op, "recipe", "be 'fp8_block' (optionally '@' a GPU to model)", _checks.quoted(recipe))


def _check_tokens(op: str, arg: str, m: int) -> None:
    if m % _BLOCK:
        _checks.fail(op, arg, f"have a token count that is a multiple of {_BLOCK} (x^T's 1x128 blocks)", m)


def _check_cols(op: str, x_codes_t, x_scale_inv_t, k: int, m: int) -> None:
    """x^T's codes (k, m) and their scales stored M-major (m/128, k), as rowcol makes them."""
    _checks.dtype_in(op, "x_codes_t", x_codes_t, (torch.float8_e4m3fn, torch.uint8))
    _checks.shape_eq(op, "x_codes_t", x_codes_t, [k, m])
    _checks.dtype_in(op, "x_scale_inv_t", x_scale_inv_t, (torch.float32,))
    _checks.shape_eq(op, "x_scale_inv_t", x_scale_inv_t, [m // _BLOCK, k])


@torch.library.register_fake("deepwell::fp8_block_linear_from_codes")
def _from_codes_fake(x, x_codes, x_scale_inv, x_codes_t, x_scale_inv_t, weight, bias, recipe="fp8_block"):
    out_shape = check_from_codes("fp8_block_linear_from_codes", x, (x_codes, x_scale_inv, x_codes_t, x_scale_inv_t),
                                 weight, bias, recipe)
    return x.new_empty(out_shape)


@torch.library.register_fake("deepwell::fp8_block_linear_from_rows")
def _from_rows_fake(x, x_codes, x_scale_inv, weight, bias, recipe="fp8_block"):
    return x.new_empty(check_from_codes("fp8_block_linear_from_rows", x, (x_codes, x_scale_inv), weight, bias, recipe))


def check_from_codes(op: str, x, codes: tuple, weight, bias, recipe: str) -> list[int]:
    """Mirrors `forward`'s checks in rust/ops/src/ops/linear/fp8_block_linear.rs: x against the
    weight (and bias), and x's codes (the row copy, then the column copy where `codes` has it);
    returns y's shape."""
    x_codes, x_scale_inv = codes[:2]
    _check_recipe(op, recipe)
    names = ("x_codes", "x_scale_inv", "x_codes_t", "x_scale_inv_t")
    out_shape = _check_layer(op, x, weight, recipe, (*zip(names, codes), *_bias_arg(bias)))
    _check_bias(op, bias, x, out_shape[-1])
    k = weight.shape[1]
    m = x.numel() // k
    _check_tokens(op, "x", m)
    _checks.dtype_in(op, "x_codes", x_codes, (torch.float8_e4m3fn,))
    _checks.shape_eq(op, "x_codes", x_codes, [m, k])
    _checks.dtype_in(op, "x_scale_inv", x_scale_inv, (torch.float32,))
    _checks.shape_eq(op, "x_scale_inv", x_scale_inv, [k // _BLOCK, m])
    if len(codes) == 4:
        _check_cols(op, *codes[2:], k, m)
    return out_shape


@torch.library.register_fake("deepwell::fp8_block_linear_backward")
def _backward_fake(grad_out, x_codes_t, x_scale_inv_t, weight, recipe, need_input, need_weight):
    op = "fp8_block_linear_backward"
    _check_recipe(op, recipe)
    m, k, _ = check_saved_layer(op, grad_out, x_codes_t, ("x_scale_inv_t", x_scale_inv_t), weight,
                                lambda m, k: [m // _BLOCK, k])
    _check_tokens(op, "grad_out", m)
    dx = grad_out.new_empty((*grad_out.shape[:-1], k)) if need_input else grad_out.new_empty((0,))
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty((0,))
    return dx, dw


def _from_codes_setup(ctx, inputs, output):
    _, _, _, codes_t, scale_t, weight, bias, recipe = inputs
    ctx.save_for_backward(codes_t, scale_t, weight)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype


def _grads(ctx, grad, codes_t, scale_t, weight, need_x: bool, need_w: bool, need_b: bool):
    """(dx, dW) from one backward call on x's column codes (dy quantized once for both), db a
    reduction."""

    def backward(need_x, need_w):
        return torch.ops.deepwell.fp8_block_linear_backward(grad, codes_t, scale_t, weight, ctx.recipe, need_x, need_w)

    return layer_grads(backward, grad, need_x, need_w, need_b, ctx.bias_dtype)


def _from_codes_backward(ctx, grad):
    """From the saved column codes; None for the codes, which carry no gradient (x's comes back
    through dx)."""
    codes_t, scale_t, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw, db = _grads(ctx, grad, codes_t, scale_t, weight, need[0], need[5], need[6])
    return dx, None, None, None, None, dw, db, None


def _from_rows_setup(ctx, inputs, output):
    x, _, _, weight, bias, recipe = inputs
    ctx.save_for_backward(x, weight)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype


def _from_rows_backward(ctx, grad):
    """x's column codes made here, from x (the forward wrote the row copy alone), then as
    `_from_codes_backward`. The layers reading one x make the same call on the same x: under
    torch.compile AOTAutograd's CSE runs it once for all of them."""
    x, weight = ctx.saved_tensors
    x2 = x.detach().reshape(-1, weight.shape[1])
    _, _, codes_t, scale_t = torch.ops.deepwell.fp8_block_quantize_rowcol(x2, True, True, "cols")
    need = ctx.needs_input_grad
    dx, dw, db = _grads(ctx, grad, codes_t, scale_t, weight, need[0], need[3], need[4])
    return dx, None, None, dw, db, None


torch.library.register_autograd(
    "deepwell::fp8_block_linear_from_codes", _from_codes_backward, setup_context=_from_codes_setup
)
torch.library.register_autograd(
    "deepwell::fp8_block_linear_from_rows", _from_rows_backward, setup_context=_from_rows_setup
)
_nondiff.register(
    "fp8_block_linear_backward",
    hint="second derivatives (double backward) through deepwell.fp8_block_linear are not supported",
)


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "fp8_block"
) -> torch.Tensor:
    """`scaled_linear(x, weight, bias, "fp8_block")` with x quantized once (both copies, one read)
    and x's wgrad operand saved for the backward instead of x; x's token count (x.numel() /
    in_features) must be a multiple of 128. `recipe`: "fp8_block", or "fp8_block@sm_90" on CPU
    tensors to run the GEMMs sm_90 would run through the CPU model."""
    codes = torch.ops.deepwell.fp8_block_quantize_rowcol(x.detach().reshape(-1, x.shape[-1]), True, True)
    return torch.ops.deepwell.fp8_block_linear_from_codes(x, *codes, weight, bias, recipe)
