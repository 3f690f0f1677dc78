"""`fp8_tensor_linear(x, weight, bias)`: `scaled_linear` in the fp8_tensor recipe (one scale per
tensor, docs/NUMERICS.md "FP8 tensor") that saves x's FP8 codes for the backward instead of x.

With one scale per tensor, x's weight-gradient operand is its forward codes transposed, so the
forward quantizes x once into both copies and autograd keeps the transposed codes (1 byte per
element, as uint8: autograd treats every output as something it can sum, which float8 is not) and
the scale; the backward never reads x again. Outputs and gradients are bit-identical
to `scaled_linear(x, weight, bias, "fp8_tensor")`. The deepwell backend and `deepwell.Linear` use it
for every fp8_tensor layer. Kernels: rust/ops/src/ops/linear/fp8_tensor_linear.rs.
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define
from .linear import _bias_arg, _check_bias, _check_layer, _parse_recipe

define(
    "fp8_tensor_linear(Tensor x, Tensor weight, Tensor? bias, str recipe=\"fp8_tensor\") "
    "-> (Tensor y, Tensor x_codes_t, Tensor x_scale_inv)"
)
define(
    "fp8_tensor_linear_backward(Tensor grad_out, Tensor x_codes_t, Tensor x_scale_inv, Tensor weight, "
    "str recipe, bool need_input, bool need_weight) -> (Tensor grad_input, Tensor grad_weight)"
)


def _check_recipe(op: str, recipe: str) -> None:
    if _parse_recipe(op, recipe)[0] != "fp8_tensor":
        _checks.fail(op, "recipe", "be 'fp8_tensor' (optionally '@' a GPU to model)", _checks.quoted(recipe))


@torch.library.register_fake("deepwell::fp8_tensor_linear")
def _forward_fake(x, weight, bias, recipe="fp8_tensor"):
    op = "fp8_tensor_linear"
    _check_recipe(op, recipe)
    out_shape = _check_layer(op, x, weight, recipe, _bias_arg(bias))
    _check_bias(op, bias, x, out_shape[-1])
    k = weight.shape[1]
    m = x.numel() // k
    codes = x.new_empty((k, m), dtype=torch.uint8)
    return x.new_empty(out_shape), codes, x.new_empty((), dtype=torch.float32)


@torch.library.register_fake("deepwell::fp8_tensor_linear_backward")
def _backward_fake(grad_out, x_codes_t, x_scale_inv, weight, recipe, need_input, need_weight):
    op = "fp8_tensor_linear_backward"
    _check_recipe(op, recipe)
    _checks.dtype_in(op, "grad_out", grad_out, _checks.FLOAT_INPUTS)
    _checks.dtype_in(op, "weight", weight, _checks.FLOAT_INPUTS)
    _checks.dtype_in(op, "x_codes_t", x_codes_t, (torch.uint8,))
    _checks.dtype_in(op, "x_scale_inv", x_scale_inv, (torch.float32,))
    _checks.same_device(op, ("grad_out", grad_out), ("x_codes_t", x_codes_t), ("x_scale_inv", x_scale_inv),
                        ("weight", weight))
    _checks.shape_eq(op, "x_scale_inv", x_scale_inv, [])
    for arg, t in (("weight", weight), ("x_codes_t", x_codes_t)):
        if t.dim() != 2:
            _checks.fail(op, arg, "be 2-d", f"a {t.dim()}-d tensor")
    _checks.non_empty(op, "weight", weight, 2)
    _checks.non_empty(op, "grad_out", grad_out, 1)
    n, k = weight.shape
    _checks.shape_eq(op, "x_codes_t", x_codes_t, [k, grad_out.numel() // n])
    if grad_out.shape[-1] != n:
        raise RuntimeError(
            f"deepwell.{op}: grad_out has {grad_out.shape[-1]} features (shape {_checks.shape_str(grad_out.shape)}) "
            f"but weight has out_features {n}"
        )
    dx = grad_out.new_empty((*grad_out.shape[:-1], k)) if need_input else grad_out.new_empty((0,))
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty((0,))
    return dx, dw


def _setup(ctx, inputs, output):
    _, weight, bias, recipe = inputs
    _, codes, scale = output
    ctx.save_for_backward(codes, scale, weight)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(codes, scale)


def _backward(ctx, grad, _grad_codes, _grad_scale):
    codes, scale, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx = dw = db = None
    if need_x or need_w:
        gx, gw = torch.ops.deepwell.fp8_tensor_linear_backward(grad, codes, scale, weight, ctx.recipe, need_x, need_w)
        dx = gx if need_x else None
        dw = gw if need_w else None
    if need_b and ctx.bias_dtype is not None:
        db = grad.sum(dim=tuple(range(grad.dim() - 1)), dtype=torch.float32).to(ctx.bias_dtype)
    return dx, dw, db, None


torch.library.register_autograd("deepwell::fp8_tensor_linear", _backward, setup_context=_setup)
_nondiff.register(
    "fp8_tensor_linear_backward",
    hint="second derivatives (double backward) through deepwell.fp8_tensor_linear are not supported",
)


def fp8_tensor_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "fp8_tensor"
) -> torch.Tensor:
    """`scaled_linear(x, weight, bias, "fp8_tensor")`, saving x's FP8 codes (1 byte per element)
    for the backward instead of x. `recipe`: "fp8_tensor", or "fp8_tensor@sm_90" on CPU tensors to
    run the GEMMs sm_90 would run through the CPU model. Returns y only."""
    return torch.ops.deepwell.fp8_tensor_linear(x, weight, bias, recipe)[0]
