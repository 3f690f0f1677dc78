"""`fp8_block_linear(x, weight, bias, recipe="fp8_block", x_codes=None, x_scale_inv=None,
x_codes_t=None, x_scale_inv_t=None) -> (y, codes_t, scale_inv_t)`: `scaled_linear(x, weight, bias,
"fp8_block")` saving x's wgrad operand (the column copy, 1 byte per element) for the backward
instead of x. Outputs and gradients are bit-identical to `scaled_linear(x, weight, bias,
"fp8_block")`; x's token count (x.numel() / in_features) must be a multiple of 128.

fp8_block quantizes x twice per step, along K for fprop and along the tokens for wgrad (1x128
blocks each way: the two copies differ, docs/NUMERICS.md "FP8 block"). `scaled_linear` makes the
first in the forward and the second in the backward from x again, per layer. Here one rowcol pass
writes both. x's operands are those of `fp8_block_quantize_rowcol(x2, True, True, copies)` (x2: x
seen as (tokens, in_features)); the optional arguments say which arrive made:

| given | the forward | autograd saves | outputs 1-2 |
|---|---|---|---|
| none | quantizes x into both copies | the column copy it made | that copy (codes as uint8, scales) |
| all four (`copies="both"`) | reads the row copy | the given column copy | empty |
| x_codes, x_scale_inv (`copies="rows"`) | reads the row copy | x: the backward makes the column copy (`copies="cols"`) | empty |

With all four, the layers that read one x (q/k/v, gate/up) share one quantization and its one saved
column copy (the deepwell backend groups them: compiler/backend.py), and the backward never reads x.
The trade against `scaled_linear` under torch.compile: there the partitioner recomputes x (a norm's
or SwiGLU's output) in the backward instead of saving it, so nothing per x is kept; here the column
copy is (1 byte per element, about half of x in bf16), for one quantizing pass per x instead of two
per layer reading it. The row copy alone is the backend's `recompute_codes`: under torch.compile
the partitioner recomputes x (or keeps it anyway), and the column passes of the layers reading one x
are one call after AOTAutograd's CSE. Each pass writes only the copy its GEMMs read; the bits are
the same on all three. Kernels: rust/ops/src/ops/linear/fp8_block_linear.rs.
"""

from __future__ import annotations

import torch

from . import _nondiff
from ._library import define
from .linear import layer_grads

define(
    "fp8_block_linear(Tensor x, Tensor weight, Tensor? bias, str recipe=\"fp8_block\", Tensor? x_codes=None, "
    "Tensor? x_scale_inv=None, Tensor? x_codes_t=None, Tensor? x_scale_inv_t=None) "
    "-> (Tensor y, Tensor codes_t, Tensor scale_inv_t)"
)
define(
    "fp8_block_linear_backward(Tensor grad_out, Tensor x_codes_t, Tensor x_scale_inv_t, Tensor weight, "
    "str recipe, bool need_input, bool need_weight) -> (Tensor grad_input, Tensor grad_weight)"
)

_BLOCK = 128


def column_copy(like, m: int, k: int) -> tuple:
    """The column copy of an (m, k) matrix as the forward ops return it: codes (k, m) uint8 and
    scales stored M-major (m/128, k) fp32, on `like`'s device."""
    return like.new_empty((k, m), dtype=torch.uint8), like.new_empty((m // _BLOCK, k), dtype=torch.float32)


# The fake kernels give the outputs' shapes and dtypes only: the kernels check the arguments at
# dispatch (rust/ops/src/ops/linear/fp8_block_linear.rs) and raise the errors.


@torch.library.register_fake("deepwell::fp8_block_linear")
def _forward_fake(x, weight, bias, recipe="fp8_block", x_codes=None, x_scale_inv=None, x_codes_t=None,
                  x_scale_inv_t=None):
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    if x_codes is not None:  # outputs 1-2 empty: the codes were given
        return y, x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.float32)
    k = weight.shape[1]
    return y, *column_copy(x, x.numel() // k, k)


@torch.library.register_fake("deepwell::fp8_block_linear_backward")
def _backward_fake(grad_out, x_codes_t, x_scale_inv_t, weight, recipe, need_input, need_weight):
    dx = grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]) if need_input else (0,))
    return dx, weight.new_empty(weight.shape if need_weight else (0,))


def _setup(ctx, inputs, output):
    """Saves the column copy (made by the op, or given), or x where only the row copy was given."""
    x, weight, bias, recipe, x_codes, _, codes_t, scale_t = inputs
    _, made_t, made_scale = output
    ctx.mark_non_differentiable(made_t, made_scale)
    if x_codes is None:
        codes_t, scale_t = made_t, made_scale
    ctx.save_for_backward(x if codes_t is None else None, codes_t, scale_t, weight)
    ctx.recipe = recipe
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad, _grad_codes, _grad_scale):
    """(dx, dW, db) from one backward call on x's column copy (dy quantized once for both), db a
    reduction; None for the codes, which carry no gradient (x's comes back through dx). Where the
    forward read the row copy alone, the column copy is made here from x: the layers reading one x
    make the same call on the same x, which under torch.compile AOTAutograd's CSE runs once."""
    x, codes_t, scale_t, weight = ctx.saved_tensors
    if codes_t is None:
        x2 = x.detach().reshape(-1, weight.shape[1])
        _, _, codes_t, scale_t = torch.ops.deepwell.fp8_block_quantize_rowcol(x2, True, True, "cols")

    def backward(need_x, need_w):
        return torch.ops.deepwell.fp8_block_linear_backward(grad, codes_t, scale_t, weight, ctx.recipe, need_x, need_w)

    dx, dw, db = layer_grads(backward, grad, *ctx.needs_input_grad[:3], ctx.bias_dtype)
    return dx, dw, db, None, None, None, None, None


_nondiff.register_once_differentiable("fp8_block_linear", _backward, _setup)


def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "fp8_block"
) -> torch.Tensor:
    """`scaled_linear(x, weight, bias, "fp8_block")` with x quantized once (both copies, one read)
    and x's wgrad operand saved for the backward instead of x; x's token count (x.numel() /
    in_features) must be a multiple of 128. `recipe`: "fp8_block", or "fp8_block@sm_90" on CPU
    tensors to run the GEMMs sm_90 would run through the CPU model. Returns y only."""
    return torch.ops.deepwell.fp8_block_linear(x, weight, bias, recipe)[0]
