"""`fp8_tensor_linear(x, weight, bias)`: `scaled_linear` in the fp8_tensor recipe (one scale per
tensor, docs/NUMERICS.md "FP8 tensor") that saves x's FP8 codes for the backward instead of x.

With one scale per tensor, x's weight-gradient operand is its forward codes transposed, so the
forward quantizes x once into both copies and autograd keeps the transposed codes (1 byte per
element, as uint8: autograd treats every output as something it can sum, which float8 is not) and
the scale; the backward never reads x again. Outputs and gradients are bit-identical
to `scaled_linear(x, weight, bias, "fp8_tensor")`. The deepwell backend and `deepwell.Linear` use it
for every fp8_tensor layer. Kernels: rust/ops/src/ops/linear/fp8_tensor_linear.rs.

`fp8_tensor_linear_from_codes(x, x_codes, x_codes_t, x_scale_inv, weight, bias)` is the same layer
on codes made beforehand by `fp8_tensor_quantize_rowcol(x, "e4m3", amax)`: the backend gives the
layers that read one tensor (q/k/v, gate/up) one quantization and one saved copy of its codes, and
x's amax as a reduction Inductor fuses into x's producer. The backward reduces dy's amax the same way
(`grad_amax`), so neither quantizer makes a pass of its own for the amax. `weight_amax` is W's amax
(`amax_of(weight)`), which the backend reduces once per step in the graph: the forward's cast of W
and the backward's transposing cast both read it instead of reducing W each.

`fp8_tensor_linear_from_rows(x, x_codes, x_scale_inv, weight, bias, recipe, weight_amax, x_amax)` is
the same forward on the row codes alone (`fp8_tensor_quantize_rowcol(x, "e4m3", amax, "rows")`); its
backward makes the transposed codes from x and `x_amax` (the forward's amax, so the forward's
scale). Saved: x and the amax. The deepwell backend's `recompute_codes` uses it (as
`fp8_block_linear_from_rows`). Same bits as `fp8_tensor_linear_from_codes`.

Every amax argument must be the amax of its tensor (`amax_of`). On CPU tensors the op checks it (a
RuntimeError when it gives another scale than the tensor's own amax, is NaN for a tensor without
NaN, or is negative: one pass over the tensor, rust/ops/src/ops/fp8_tensor/mod.rs
`check_amax_value`). On CUDA it is trusted, as the pass and host sync it saves are the point: a
wrong amax there gives silently wrong codes (too small saturates the largest values, NaN quantizes
with scale 1).
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define
from .fp8_tensor import amax_of, check_amax
from .linear import _bias_arg, _check_bias, _check_layer, _parse_recipe, check_saved_layer, layer_grads

define(
    "fp8_tensor_linear(Tensor x, Tensor weight, Tensor? bias, str recipe=\"fp8_tensor\") "
    "-> (Tensor y, Tensor x_codes_t, Tensor x_scale_inv)"
)
define(
    "fp8_tensor_linear_from_codes(Tensor x, Tensor x_codes, Tensor x_codes_t, Tensor x_scale_inv, Tensor weight, "
    "Tensor? bias, str recipe=\"fp8_tensor\", Tensor? weight_amax=None) -> Tensor"
)
define(
    "fp8_tensor_linear_from_rows(Tensor x, Tensor x_codes, Tensor x_scale_inv, Tensor weight, Tensor? bias, "
    "str recipe=\"fp8_tensor\", Tensor? weight_amax=None, Tensor? x_amax=None) -> Tensor"
)
define(
    "fp8_tensor_linear_backward(Tensor grad_out, Tensor x_codes_t, Tensor x_scale_inv, Tensor weight, "
    "str recipe, bool need_input, bool need_weight, Tensor? grad_amax=None, Tensor? weight_amax=None) "
    "-> (Tensor grad_input, Tensor grad_weight)"
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
def _backward_fake(grad_out, x_codes_t, x_scale_inv, weight, recipe, need_input, need_weight, grad_amax=None,
                   weight_amax=None):
    op = "fp8_tensor_linear_backward"
    _check_recipe(op, recipe)
    if grad_amax is not None:
        check_amax(op, "grad_amax", grad_amax, ("grad_out", grad_out))
    if weight_amax is not None:
        check_amax(op, "weight_amax", weight_amax, ("weight", weight))
    _, k, _ = check_saved_layer(op, grad_out, x_codes_t, ("x_scale_inv", x_scale_inv), weight, lambda m, k: [])
    dx = grad_out.new_empty((*grad_out.shape[:-1], k)) if need_input else grad_out.new_empty((0,))
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty((0,))
    return dx, dw


@torch.library.register_fake("deepwell::fp8_tensor_linear_from_codes")
def _from_codes_fake(x, x_codes, x_codes_t, x_scale_inv, weight, bias, recipe="fp8_tensor", weight_amax=None):
    return _on_codes_fake("fp8_tensor_linear_from_codes", x, x_codes, x_codes_t, x_scale_inv, weight, bias, recipe,
                          weight_amax)


@torch.library.register_fake("deepwell::fp8_tensor_linear_from_rows")
def _from_rows_fake(x, x_codes, x_scale_inv, weight, bias, recipe="fp8_tensor", weight_amax=None, x_amax=None):
    op = "fp8_tensor_linear_from_rows"
    out = _on_codes_fake(op, x, x_codes, None, x_scale_inv, weight, bias, recipe, weight_amax)
    if x_amax is not None:
        check_amax(op, "x_amax", x_amax, ("x", x))
    return out


def _on_codes_fake(op, x, x_codes, x_codes_t, x_scale_inv, weight, bias, recipe, weight_amax):
    """Mirrors `on_codes`' checks in rust/ops/src/ops/linear/fp8_tensor_linear.rs (`x_codes_t`:
    None for from_rows) and returns an empty y."""
    _check_recipe(op, recipe)
    if weight_amax is not None:
        check_amax(op, "weight_amax", weight_amax, ("weight", weight))
    others = (("x_codes", x_codes), *([("x_codes_t", x_codes_t)] if x_codes_t is not None else []),
              ("x_scale_inv", x_scale_inv), *_bias_arg(bias))
    out_shape = _check_layer(op, x, weight, recipe, others)
    _check_bias(op, bias, x, out_shape[-1])
    k = weight.shape[1]
    m = x.numel() // k
    _checks.dtype_in(op, "x_codes", x_codes, (torch.float8_e4m3fn,))
    _checks.shape_eq(op, "x_codes", x_codes, [m, k])
    if x_codes_t is not None:
        _checks.dtype_in(op, "x_codes_t", x_codes_t, (torch.float8_e4m3fn, torch.uint8))
        _checks.shape_eq(op, "x_codes_t", x_codes_t, [k, m])
    _checks.dtype_in(op, "x_scale_inv", x_scale_inv, (torch.float32,))
    _checks.shape_eq(op, "x_scale_inv", x_scale_inv, [])
    return x.new_empty(out_shape)


def _save(ctx, codes_t, scale, weight, bias, recipe, weight_amax=None) -> None:
    ctx.save_for_backward(codes_t, scale, weight, weight_amax)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype


def _grads(ctx, grad, need_x: bool, need_w: bool, need_b: bool, saved=None):
    """(dx, dW, db) from x's transposed codes, its scale, W and W's amax (`saved`, else the saved
    tensors): one backward call for dx and dW, db a reduction. With both wanted, dy is quantized
    once for both from its amax, reduced here as torch ops so that under torch.compile Inductor
    fuses it into dy's producer (the kernel skips its own pass over dy)."""
    codes_t, scale, weight, weight_amax = saved or ctx.saved_tensors

    def backward(need_x, need_w):
        amax = amax_of(grad) if need_x and need_w else None
        w_amax = weight_amax if need_x else None  # only dgrad reads W
        return torch.ops.deepwell.fp8_tensor_linear_backward(
            grad, codes_t, scale, weight, ctx.recipe, need_x, need_w, amax, w_amax
        )

    return layer_grads(backward, grad, need_x, need_w, need_b, ctx.bias_dtype)


def _setup(ctx, inputs, output):
    _, weight, bias, recipe = inputs
    _, codes_t, scale = output
    _save(ctx, codes_t, scale, weight, bias, recipe)
    ctx.mark_non_differentiable(codes_t, scale)


def _backward(ctx, grad, _grad_codes, _grad_scale):
    return (*_grads(ctx, grad, *ctx.needs_input_grad[:3]), None)


def _from_codes_setup(ctx, inputs, output):
    _, _, codes_t, scale, weight, bias, recipe, weight_amax = inputs
    _save(ctx, codes_t, scale, weight, bias, recipe, weight_amax)


def _from_codes_backward(ctx, grad):
    need = ctx.needs_input_grad
    dx, dw, db = _grads(ctx, grad, need[0], need[4], need[5])
    return dx, None, None, None, dw, db, None, None


def _from_rows_setup(ctx, inputs, output):
    x, _, _, weight, bias, recipe, weight_amax, x_amax = inputs
    ctx.save_for_backward(x, weight, weight_amax, x_amax)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype


def _from_rows_backward(ctx, grad):
    """x's transposed codes made here, from x and the forward's amax (the forward wrote the row
    codes alone), then as `_from_codes_backward`. The layers reading one x make the same call on the
    same x: under torch.compile AOTAutograd's CSE runs it once for all of them."""
    x, weight, weight_amax, x_amax = ctx.saved_tensors
    x2 = x.detach().reshape(-1, weight.shape[1])
    _, codes_t, scale = torch.ops.deepwell.fp8_tensor_quantize_rowcol(x2, "e4m3", x_amax, "cols")
    need = ctx.needs_input_grad
    dx, dw, db = _grads(ctx, grad, need[0], need[3], need[4], (codes_t, scale, weight, weight_amax))
    return dx, None, None, dw, db, None, None, None


torch.library.register_autograd("deepwell::fp8_tensor_linear", _backward, setup_context=_setup)
torch.library.register_autograd(
    "deepwell::fp8_tensor_linear_from_codes", _from_codes_backward, setup_context=_from_codes_setup
)
torch.library.register_autograd(
    "deepwell::fp8_tensor_linear_from_rows", _from_rows_backward, setup_context=_from_rows_setup
)
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
