"""`quantized_linear(x, weight_data, weight_scale, weight_global_scale, bias, recipe)`: the forward
of `scaled_linear` on a weight quantized beforehand (an exported model's stored codes,
train/quantized.py). Schema, fake kernel, wrapper; inference only (not differentiable).

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

_E4M3, _E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
# recipe -> (block, data dtype, data columns per in_feature, scale dtype, scale shape(n, k))
_LAYOUT = {
    "fp8_block": (128, _E4M3, 1, torch.float32, lambda n, k: [n // 128, k // 128]),
    "mxfp8": (32, _E4M3, 1, _E8M0, lambda n, k: [n, k // 32]),
    "nvfp4": (16, torch.uint8, 2, _E4M3, lambda n, k: [n, k // 16]),
}


@torch.library.register_fake("deepwell::quantized_linear")
def _quantized_linear_fake(x, weight_data, weight_scale, weight_global_scale, bias, recipe):
    """Mirrors the checks of `forward` in rust/ops/src/ops/linear/quantized_linear.rs."""
    name, modelled = _parse_recipe(_OP, recipe)
    if name not in _LAYOUT:
        _checks.fail(_OP, "recipe", "be a quantized recipe ('mxfp8', 'nvfp4', 'fp8_block')", _checks.quoted(recipe))
    _checks.dtype_in(_OP, "x", x, _checks.FLOAT_INPUTS)
    others = [("weight_global_scale", weight_global_scale), ("bias", bias)]
    _checks.same_device(_OP, ("x", x), ("weight_data", weight_data), ("weight_scale", weight_scale),
                        *[(a, t) for a, t in others if t is not None])
    _checks.non_empty(_OP, "x", x, 1)
    if weight_data.dim() != 2:
        _checks.fail(_OP, "weight_data", "be 2-d (out_features, stored in_features)", f"a {weight_data.dim()}-d tensor")
    block, data_dtype, per_byte, scale_dtype, scale_shape = _LAYOUT[name]
    n, k = weight_data.shape[0], x.shape[-1]
    if k % block or n % block:
        raise RuntimeError(
            f"deepwell.{_OP}: {name} needs in_features ({k}, x's last dim) and out_features ({n}) in multiples of {block}"
        )
    _checks.dtype_in(_OP, "weight_data", weight_data, (data_dtype,))
    _checks.shape_eq(_OP, "weight_data", weight_data, [n, k // per_byte])
    _checks.dtype_in(_OP, "weight_scale", weight_scale, (scale_dtype,))
    _checks.shape_eq(_OP, "weight_scale", weight_scale, scale_shape(n, k))
    if name == "nvfp4":
        if weight_global_scale is None:
            _checks.fail(_OP, "weight_global_scale", "be given for nvfp4 (its per-tensor decode scale)", "None")
        _checks.dtype_in(_OP, "weight_global_scale", weight_global_scale, (torch.float32,))
        _checks.shape_eq(_OP, "weight_global_scale", weight_global_scale, [])
    elif weight_global_scale is not None:
        _checks.fail(_OP, "weight_global_scale", f"be None for {name}", "a tensor")
    _check_bias(_OP, bias, x, n)
    if modelled and x.device.type not in ("cpu", "meta"):
        _checks.fail(_OP, "recipe", "name a GPU to model after '@' only for CPU tensors", _checks.quoted(recipe))
    return x.new_empty((*x.shape[:-1], n))


_nondiff.register(_OP, hint="quantized_linear is inference only: train with deepwell.scaled_linear")


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
