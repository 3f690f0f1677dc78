"""Low-precision linear layers: `scaled_linear(x, weight, bias, recipe)` and `mxfp8_linear(x, weight,
bias)`, `y = x @ weight.T + bias` with all three GEMMs (forward, input gradient, weight gradient) in
the recipe's precision. Schemas, fake kernels, the autograd formula and typed wrappers.

Kernels: rust/ops/src/ops/linear/ (which GEMM runs where: deepwell_core::policy::gemm_backend, the
dispatch table in docs/OPS.md "Linear layers"). Recipes:

| recipe | operands | GEMM on sm_90 (H100/H200) | on Blackwell | on CPU / other GPUs |
|---|---|---|---|---|
| fp8_block | E4M3, fp32 scales per 1x128 (x, dy), 128x128 (W) | cuBLASLt blockwise FP8 (native) | emulated | emulated |
| fp8_tensor | E4M3 (x, W), E5M2 (dy), one fp32 scale per tensor | cuBLASLt per-tensor FP8 (native) | native | native on sm_89, else emulated |
| mxfp8 | E4M3, E8M0 scale per 1x32 | emulated (dequantize + bf16 GEMM) | native MX GEMM | emulated |
| nvfp4 | E2M1, E4M3 per 1x16 (16x16 for W) + fp32 per tensor; SR on dy; RHT on wgrad | emulated | native | emulated |
| bf16 | bf16 | cuBLAS | cuBLAS | fp32 matmul of bf16 values |

Emulation is exact in the quantization (bit-identical operands) and differs from native hardware
only in the GEMM's fp32 accumulation order.
"""

from __future__ import annotations

import torch

from ..core import recipes
from . import _checks, _nondiff
from ._library import define


define("scaled_linear(Tensor x, Tensor weight, Tensor? bias, str recipe, int? seed=None) -> Tensor")
define("mxfp8_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
define(
    "scaled_linear_backward(Tensor grad_out, Tensor x, Tensor weight, str recipe, int? seed, "
    "bool need_input, bool need_weight) -> (Tensor grad_input, Tensor grad_weight)"
)


def _is_arch(s: str) -> bool:
    """Mirrors `Arch::from_str` (rust/core/src/policy/arch.rs): "cpu", "9.0", "sm_90", "sm_90a"."""

    def num(t: str) -> bool:
        return t.isascii() and t.isdigit() and int(t) < 2**32

    if s == "cpu":
        return True
    if "." in s:
        major, _, minor = s.partition(".")
        return num(major) and num(minor)
    if not s.startswith("sm_"):
        return False
    digits = s[3:].rstrip("af")
    return len(digits) >= 2 and num(digits[:-1]) and num(digits[-1])


def _parse_recipe(op: str, recipe: str) -> tuple[str, bool]:
    """Mirrors `parse_recipe` in rust/ops/src/ops/linear/mod.rs: "recipe", or "recipe@arch" (CPU
    tensors only) to run the GEMMs that GPU would run through a CPU model. (name, modelled)."""
    name, at, arch = recipe.partition("@")
    _checks.choice(op, "recipe", name, recipes.names())
    if at and not _is_arch(arch):
        _checks.fail(op, "recipe", "name a known GPU after '@' (e.g. 'fp8_block@sm_90')", _checks.quoted(recipe))
    return name, bool(at)


def _check_layer(op: str, x, weight, recipe_arg: str, others=()) -> list[int]:
    """Mirrors `Layer::new` in rust/ops/src/ops/linear/mod.rs; returns y's shape."""
    recipe, modelled = _parse_recipe(op, recipe_arg)
    _checks.dtype_in(op, "x", x, _checks.FLOAT_INPUTS)
    _checks.dtype_in(op, "weight", weight, _checks.FLOAT_INPUTS)
    _checks.same_device(op, ("x", x), ("weight", weight), *others)
    _checks.non_empty(op, "x", x, 1)
    if weight.dim() != 2:
        _checks.fail(op, "weight", "be 2-d (out_features, in_features)", f"a {weight.dim()}-d tensor")
    _checks.non_empty(op, "weight", weight, 2)
    n, k = weight.shape
    _checks.features(op, "x", x, "weight", weight, "in_features", k)
    block = recipes.block_k(recipe)
    if block is not None:
        _checks.divisible(op, "weight", weight, 1, block, f"{recipe} quantizes along in_features in blocks of {block}")
        _checks.divisible(
            op, "weight", weight, 0, block, f"{recipe} quantizes W along out_features for dgrad in blocks of {block}"
        )
    if modelled and x.device.type not in ("cpu", "meta"):
        _checks.fail(op, "recipe", "name a GPU to model after '@' only for CPU tensors", _checks.quoted(recipe_arg))
    return [*x.shape[:-1], n]


def _check_bias(op: str, bias, x, n: int) -> None:
    if bias is None:
        return
    _checks.dtype_in(op, "bias", bias, _checks.FLOAT_INPUTS)
    _checks.shape_eq(op, "bias", bias, [n])


def _bias_arg(bias) -> tuple:
    return () if bias is None else (("bias", bias),)


@torch.library.register_fake("deepwell::scaled_linear")
def _scaled_linear_fake(x, weight, bias, recipe, seed=None):
    out_shape = _check_layer("scaled_linear", x, weight, recipe, _bias_arg(bias))
    _check_bias("scaled_linear", bias, x, out_shape[-1])
    return x.new_empty(out_shape)


@torch.library.register_fake("deepwell::mxfp8_linear")
def _mxfp8_linear_fake(x, weight, bias=None):
    out_shape = _check_layer("mxfp8_linear", x, weight, "mxfp8", _bias_arg(bias))
    _check_bias("mxfp8_linear", bias, x, out_shape[-1])
    return x.new_empty(out_shape)


@torch.library.register_fake("deepwell::scaled_linear_backward")
def _backward_fake(grad_out, x, weight, recipe, seed, need_input, need_weight):
    op = "scaled_linear_backward"
    out_shape = _check_layer(op, x, weight, recipe, (("grad_out", grad_out),))
    _checks.dtype_in(op, "grad_out", grad_out, _checks.FLOAT_INPUTS)
    _checks.shape_eq(op, "grad_out", grad_out, out_shape)
    dx = x.new_empty(x.shape) if need_input else x.new_empty((0,))
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty((0,))
    return dx, dw


# ---------------------------------------------------------------------------------------------
# Autograd: dx and dW come from one Rust call (dy is quantized once for both), the bias gradient is
# a plain reduction that Inductor fuses.


def _setup(ctx, x, weight, bias, recipe: str, seed) -> None:
    ctx.save_for_backward(x, weight)
    ctx.recipe, ctx.seed = recipe, seed
    ctx.bias_dtype = None if bias is None else bias.dtype


def _bias_grad(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """db: dy summed over every leading dim in fp32, in the bias's dtype."""
    return grad.sum(dim=tuple(range(grad.dim() - 1)), dtype=torch.float32).to(dtype)


def layer_grads(backward, grad, need_x: bool, need_w: bool, need_b: bool, bias_dtype):
    """(dx, dW, db) of a linear layer: dx and dW from one call of its backward op,
    `backward(need_x, need_w) -> (dx, dW)` (dy quantized once for both), made only when either is
    wanted; db a plain reduction of dy, which Inductor fuses. None for what is not wanted."""
    dx = dw = db = None
    if need_x or need_w:
        gx, gw = backward(need_x, need_w)
        dx = gx if need_x else None
        dw = gw if need_w else None
    if need_b and bias_dtype is not None:
        db = _bias_grad(grad, bias_dtype)
    return dx, dw, db


def _grads(ctx, grad):
    x, weight = ctx.saved_tensors
    # needs_input_grad lists the arguments actually passed (mxfp8_linear(x, w) has no bias entry).
    need_x, need_w, need_b = (tuple(ctx.needs_input_grad) + (False,) * 3)[:3]

    def backward(need_x, need_w):
        return torch.ops.deepwell.scaled_linear_backward(grad, x, weight, ctx.recipe, ctx.seed, need_x, need_w)

    return layer_grads(backward, grad, need_x, need_w, need_b, ctx.bias_dtype)


def _scaled_linear_setup(ctx, inputs, output):
    x, weight, bias, recipe, seed = inputs
    _setup(ctx, x, weight, bias, recipe, seed)


def _scaled_linear_backward(ctx, grad):
    return (*_grads(ctx, grad), None, None)


def _mxfp8_linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    _setup(ctx, x, weight, bias, "mxfp8", None)


def _mxfp8_linear_backward(ctx, grad):
    return _grads(ctx, grad)


torch.library.register_autograd(
    "deepwell::scaled_linear", _scaled_linear_backward, setup_context=_scaled_linear_setup
)
torch.library.register_autograd("deepwell::mxfp8_linear", _mxfp8_linear_backward, setup_context=_mxfp8_linear_setup)
# The backward's own backward: second derivatives raise instead of coming back silently zero.
_nondiff.register(
    "scaled_linear_backward",
    hint="second derivatives (double backward) through deepwell.scaled_linear / mxfp8_linear are not supported",
)


# ---------------------------------------------------------------------------------------------
# Wrappers


def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: str = "mxfp8",
    seed: int | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` with the forward, input-gradient and weight-gradient GEMMs in `recipe`.

    Args:
        x: (..., in_features), float32/bfloat16/float16; any leading dims.
        weight: (out_features, in_features), a float dtype; both dims multiples of the recipe's block
            (mxfp8 32, nvfp4 16, fp8_block 128).
        bias: (out_features,) or None.
        recipe: "mxfp8", "nvfp4", "fp8_block", "fp8_tensor" or "bf16" (the table in this module's
            docstring). For training in fp8_tensor, `fp8_tensor_linear` saves x's FP8 codes instead of x.
        seed: seed of NVFP4's stochastic rounding of gradients; None draws a fresh one per backward
            from deepwell's sequence (`deepwell.manual_seed`).

    Returns:
        y: (..., out_features) in x's dtype. The weight is quantized by every call, except inside
        `deepwell.microbatches()` (rust/ops/src/ops/linear/weight_cache.rs says when it is reused).
    """
    return torch.ops.deepwell.scaled_linear(x, weight, bias, recipe, seed)


def mxfp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`scaled_linear(x, weight, bias, "mxfp8")`: MXFP8 (E4M3, 1x32 E8M0 scales) forward and backward."""
    return torch.ops.deepwell.mxfp8_linear(x, weight, bias)
