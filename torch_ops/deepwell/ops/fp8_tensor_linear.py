"""`fp8_tensor_linear(x, weight, bias, recipe="fp8_tensor", x_codes=None, x_scale_inv=None,
x_codes_t=None, weight_amax=None, x_amax=None) -> (y, codes_t, scale_inv)`: `scaled_linear` in the
fp8_tensor recipe (one scale per tensor, docs/NUMERICS.md "FP8 tensor") that saves x's FP8 codes for
the backward instead of x. Outputs and gradients are bit-identical to `scaled_linear(x, weight,
bias, "fp8_tensor")`.

With one scale per tensor, x's weight-gradient operand is its forward codes transposed, so the
forward quantizes x once into both copies and autograd keeps the transposed codes (1 byte per
element, as uint8: autograd treats every output as something it can sum, which float8 is not) and
the scale; the backward never reads x again. x's operands are those of
`fp8_tensor_quantize_rowcol(x2, "e4m3", amax, copies)` (x2: x seen as (tokens, in_features)); the
optional arguments say which arrive made:

| given | the forward | autograd saves | outputs 1-2 |
|---|---|---|---|
| none | quantizes x into both copies | the transposed codes and scale it made | those (codes as uint8) |
| x_codes, x_scale_inv, x_codes_t (`copies="both"`) | reads the row codes | the given transposed codes | empty |
| x_codes, x_scale_inv (`copies="rows"`) | reads the row codes | x and `x_amax`: the backward makes the transposed codes (`copies="cols"`) | empty |

`deepwell.Linear` runs the first for every fp8_tensor layer. The deepwell backend runs the second:
the layers that read one tensor (q/k/v, gate/up) get one quantization and one saved copy of its
codes, and x's amax as a reduction Inductor fuses into x's producer. The backward reduces dy's amax
the same way (`grad_amax`), so neither quantizer makes a pass of its own for the amax. The third is
the backend's `recompute_codes` (as for `fp8_block_linear`); `x_amax` is the forward's amax, so the
backward's scale is the forward's. `weight_amax` is W's amax (`amax_of(weight)`), which the backend
reduces once per step in the graph: the forward's cast of W and the backward's transposing cast
both read it instead of reducing W each. Kernels: rust/ops/src/ops/linear/fp8_tensor_linear.rs.

Every amax argument must be the amax of its tensor (`amax_of`). On CPU tensors the op checks it (a
RuntimeError when it gives another scale than the tensor's own amax, is NaN for a tensor without
NaN, or is negative: one pass over the tensor, rust/ops/src/ops/fp8_tensor/mod.rs
`check_amax_value`). On CUDA it is trusted, as the pass and host sync it saves are the point: a
wrong amax there gives silently wrong codes (too small saturates the largest values, NaN quantizes
with scale 1).
"""

from __future__ import annotations

import torch

from . import _nondiff
from ._library import define
from .fp8_tensor import amax_of
from .linear import layer_grads

define(
    "fp8_tensor_linear(Tensor x, Tensor weight, Tensor? bias, str recipe=\"fp8_tensor\", Tensor? x_codes=None, "
    "Tensor? x_scale_inv=None, Tensor? x_codes_t=None, Tensor? weight_amax=None, Tensor? x_amax=None) "
    "-> (Tensor y, Tensor codes_t, Tensor scale_inv)"
)
define(
    "fp8_tensor_linear_backward(Tensor grad_out, Tensor x_codes_t, Tensor x_scale_inv, Tensor weight, "
    "str recipe, bool need_input, bool need_weight, Tensor? grad_amax=None, Tensor? weight_amax=None) "
    "-> (Tensor grad_input, Tensor grad_weight)"
)


# The fake kernels give the outputs' shapes and dtypes only: the kernels check the arguments at
# dispatch (rust/ops/src/ops/linear/fp8_tensor_linear.rs) and raise the errors.


@torch.library.register_fake("deepwell::fp8_tensor_linear")
def _forward_fake(x, weight, bias, recipe="fp8_tensor", x_codes=None, x_scale_inv=None, x_codes_t=None,
                  weight_amax=None, x_amax=None):
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    if x_codes is not None:  # outputs 1-2 empty: the codes were given
        return y, x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.float32)
    k = weight.shape[1]  # x seen as (m, k): the transposed codes (k, m) as uint8, the scale 0-d
    return y, x.new_empty((k, x.numel() // k), dtype=torch.uint8), x.new_empty((), dtype=torch.float32)


@torch.library.register_fake("deepwell::fp8_tensor_linear_backward")
def _backward_fake(grad_out, x_codes_t, x_scale_inv, weight, recipe, need_input, need_weight, grad_amax=None,
                   weight_amax=None):
    dx = grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]) if need_input else (0,))
    return dx, weight.new_empty(weight.shape if need_weight else (0,))


def _setup(ctx, inputs, output):
    """Saves the transposed codes and scale (made by the op, or given), or x and its amax where only
    the row codes were given; W's amax where given."""
    x, weight, bias, recipe, x_codes, scale, codes_t, weight_amax, x_amax = inputs
    _, made_t, made_scale = output
    ctx.mark_non_differentiable(made_t, made_scale)
    if x_codes is None:
        codes_t, scale = made_t, made_scale
    if codes_t is None:
        ctx.save_for_backward(x, x_amax, None, None, weight, weight_amax)
    else:
        ctx.save_for_backward(None, None, codes_t, scale, weight, weight_amax)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad, _grad_codes, _grad_scale):
    """(dx, dW, db): one backward call for dx and dW, db a reduction. With both wanted, dy is
    quantized once for both from its amax, reduced here as torch ops so that under torch.compile
    Inductor fuses it into dy's producer (the kernel skips its own pass over dy). Where the forward
    read the row codes alone, the transposed codes are made here from x and the forward's amax: the
    layers reading one x make the same call on the same x, which under torch.compile AOTAutograd's
    CSE runs once."""
    x, x_amax, codes_t, scale, weight, weight_amax = ctx.saved_tensors
    if codes_t is None:
        x2 = x.detach().reshape(-1, weight.shape[1])
        _, codes_t, scale = torch.ops.deepwell.fp8_tensor_quantize_rowcol(x2, "e4m3", x_amax, "cols")

    def backward(need_x, need_w):
        amax = amax_of(grad) if need_x and need_w else None
        w_amax = weight_amax if need_x else None  # only dgrad reads W
        return torch.ops.deepwell.fp8_tensor_linear_backward(
            grad, codes_t, scale, weight, ctx.recipe, need_x, need_w, amax, w_amax
        )

    dx, dw, db = layer_grads(backward, grad, *ctx.needs_input_grad[:3], ctx.bias_dtype)
    return dx, dw, db, None, None, None, None, None, None


_nondiff.register_once_differentiable("fp8_tensor_linear", _backward, _setup)


def fp8_tensor_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "fp8_tensor"
) -> torch.Tensor:
    """`scaled_linear(x, weight, bias, "fp8_tensor")`, saving x's FP8 codes (1 byte per element)
    for the backward instead of x. `recipe`: "fp8_tensor", or "fp8_tensor@sm_90" on CPU tensors to
    run the GEMMs sm_90 would run through the CPU model. Returns y only."""
    return torch.ops.deepwell.fp8_tensor_linear(x, weight, bias, recipe)[0]
