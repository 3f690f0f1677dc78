"""`quantized_linear(x, weight_data, weight_scale, weight_global_scale, bias, recipe)`: the forward
of `scaled_linear` on a weight quantized beforehand (an exported model's stored codes,
artifact/quantized.py; the codes FSDP2 gathers, distributed/fp8_weights.py). Schema, fake kernel, wrapper;
not differentiable itself. `quantized_linear_backward(grad_out, x, weight_data, weight_scale, recipe,
weight_dtype, need_input, need_weight)` is `scaled_linear_backward` from the same codes, fp8_block
only (its 128x128 tiles transposed are W^T's for dgrad, docs/NUMERICS.md "Transposes and layouts";
wgrad reads dy and x alone): (dx, dW in `weight_dtype`), bit-identical to `scaled_linear_backward`
on the weight the codes came from. FSDP2's FP8 all-gather builds the training step from the two.

Kernel: rust/ops/src/ops/linear/quantized_linear.rs. It quantizes x and runs the fprop GEMM through
the same dispatch table as `scaled_linear` (native block-scaled GEMMs where the device has them,
exact emulation elsewhere), so the output is bit-identical to `scaled_linear`'s forward on the
weight the codes came from, on every device.

| recipe | weight_data | weight_scale | weight_global_scale |
|---|---|---|---|
| fp8_block | (n, k) float8_e4m3fn | (n/128, k/128) float32, per 128x128 tile | None |
| mxfp8 | (n, k) float8_e4m3fn | (n, k/32) float8_e8m0fnu, per 1x32 | None |
| nvfp4 | (n, k/2) uint8, two E2M1 codes per byte | (n, k/16) float8_e4m3fn (16x16 tiles) | 0-d float32 |
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from .linear import _check_bias, _parse_recipe
from ._library import define

_OP = "quantized_linear"

define(
    "quantized_linear(Tensor x, Tensor weight_data, Tensor weight_scale, Tensor? weight_global_scale, "
    "Tensor? bias, str recipe) -> Tensor"
)
define(
    "quantized_linear_backward(Tensor grad_out, Tensor x, Tensor weight_data, Tensor weight_scale, str recipe, "
    "ScalarType weight_dtype, bool need_input, bool need_weight) -> (Tensor grad_input, Tensor grad_weight)"
)

_E4M3, _E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
# recipe -> (block, data dtype, data columns per in_feature, scale dtype, scale shape(n, k))
_LAYOUT = {
    "fp8_block": (128, _E4M3, 1, torch.float32, lambda n, k: [n // 128, k // 128]),
    "mxfp8": (32, _E4M3, 1, _E8M0, lambda n, k: [n, k // 32]),
    "nvfp4": (16, torch.uint8, 2, _E4M3, lambda n, k: [n, k // 16]),
}


def _check_codes(op, x, weight_data, weight_scale, weight_global_scale, recipe, others) -> list[int]:
    """Mirrors `codes` in rust/ops/src/ops/linear/quantized_linear.rs; returns y's shape."""
    name, modelled = _parse_recipe(op, recipe)
    if name not in _LAYOUT:
        _checks.fail(op, "recipe", "be a quantized recipe ('mxfp8', 'nvfp4', 'fp8_block')", _checks.quoted(recipe))
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    others = [("weight_global_scale", weight_global_scale), *others]
    _checks.same_device(op, ("x", x), ("weight_data", weight_data), ("weight_scale", weight_scale),
                        *[(a, t) for a, t in others if t is not None])
    _checks.non_empty(op, "x", x, 1)
    if weight_data.dim() != 2:
        _checks.fail(op, "weight_data", "be 2-d (out_features, stored in_features)", f"a {weight_data.dim()}-d tensor")
    block, data_dtype, per_byte, scale_dtype, scale_shape = _LAYOUT[name]
    n, k = weight_data.shape[0], x.shape[-1]
    if k % block or n % block:
        raise RuntimeError(
            f"deepwell.{op}: {name} needs in_features ({k}, x's last dim) and out_features ({n}) in multiples of {block}"
        )
    _checks.dtype_in(op, "weight_data", weight_data, (data_dtype,))
    _checks.shape_eq(op, "weight_data", weight_data, [n, k // per_byte])
    _checks.dtype_in(op, "weight_scale", weight_scale, (scale_dtype,))
    _checks.shape_eq(op, "weight_scale", weight_scale, scale_shape(n, k))
    if name == "nvfp4":
        if weight_global_scale is None:
            _checks.fail(op, "weight_global_scale", "be given for nvfp4 (its per-tensor decode scale)", "None")
        _checks.dtype_in(op, "weight_global_scale", weight_global_scale, (torch.float32,))
        _checks.shape_eq(op, "weight_global_scale", weight_global_scale, [])
    elif weight_global_scale is not None:
        _checks.fail(op, "weight_global_scale", f"be None for {name}", "a tensor")
    if modelled and x.device.type not in ("cpu", "meta"):
        _checks.fail(op, "recipe", "name a GPU to model after '@' only for CPU tensors", _checks.quoted(recipe))
    return [*x.shape[:-1], n]


@torch.library.register_fake("deepwell::quantized_linear")
def _quantized_linear_fake(x, weight_data, weight_scale, weight_global_scale, bias, recipe):
    """Mirrors the checks of `forward` in rust/ops/src/ops/linear/quantized_linear.rs."""
    out_shape = _check_codes(_OP, x, weight_data, weight_scale, weight_global_scale, recipe, [("bias", bias)])
    _check_bias(_OP, bias, x, out_shape[-1])
    return x.new_empty(out_shape)


@torch.library.register_fake("deepwell::quantized_linear_backward")
def _quantized_linear_backward_fake(grad_out, x, weight_data, weight_scale, recipe, weight_dtype, need_input, need_weight):
    """Mirrors the checks of `backward` in rust/ops/src/ops/linear/quantized_linear.rs."""
    op = "quantized_linear_backward"
    if _parse_recipe(op, recipe)[0] != "fp8_block":
        _checks.fail(op, "recipe", "be 'fp8_block' (its 128x128 weight tiles, transposed, are W^T's for dgrad)",
                     _checks.quoted(recipe))
    out_shape = _check_codes(op, x, weight_data, weight_scale, None, recipe, [("grad_out", grad_out)])
    if weight_dtype not in _checks.FLOAT_INPUTS:
        _checks.fail(op, "weight_dtype", "be torch.float32, torch.bfloat16 or torch.float16", weight_dtype)
    _checks.dtype_in(op, "grad_out", grad_out, _checks.FLOAT_INPUTS)
    _checks.shape_eq(op, "grad_out", grad_out, out_shape)
    dx = x.new_empty(x.shape) if need_input else x.new_empty((0,))
    shape = (weight_data.shape[0], x.shape[-1]) if need_weight else (0,)
    return dx, x.new_empty(shape, dtype=weight_dtype)


_nondiff.register(_OP, hint="quantized_linear is inference only: train with deepwell.scaled_linear")
_nondiff.register(
    "quantized_linear_backward",
    hint="second derivatives through FP8-gathered weights (distributed/fp8_weights.py) are not supported",
)


def quantized_linear(
    x: torch.Tensor,
    weight_data: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    recipe: str = "fp8_block",
) -> torch.Tensor:
    """`x @ W.T + bias` with W given by its stored codes (the table in this module's docstring), as
    `scaled_linear(x, W, bias, recipe)` computes its forward. x: (..., in_features), a float dtype;
    returns (..., out_features) in x's dtype."""
    return torch.ops.deepwell.quantized_linear(x, weight_data, weight_scale, weight_global_scale, bias, recipe)


def quantized_linear_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight_data: torch.Tensor,
    weight_scale: torch.Tensor,
    recipe: str = "fp8_block",
    weight_dtype: torch.dtype = torch.bfloat16,
    need_input: bool = True,
    need_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) of `y = x @ W.T` with W given by its fp8_block codes (weight_data (n, k) E4M3,
    weight_scale (n/128, k/128) fp32): `scaled_linear_backward`'s on the weight the codes came from,
    bit for bit. dx in x's dtype, dW in `weight_dtype`; an unwanted one is an empty tensor."""
    return torch.ops.deepwell.quantized_linear_backward(
        grad_out, x, weight_data, weight_scale, recipe, weight_dtype, need_input, need_weight
    )
