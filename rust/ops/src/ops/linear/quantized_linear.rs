//! `deepwell.quantized_linear(x, weight_data, weight_scale, weight_global_scale, bias, recipe)`: the
//! forward of `scaled_linear` from a weight quantized beforehand (an exported model's stored codes,
//! torch_ops/deepwell/artifact/quantized.py; the codes FSDP2 gathers, torch_ops/deepwell/distributed/fp8_weights.py).
//! Not differentiable itself; `quantized_linear_backward(grad_out, x, weight_data, weight_scale,
//! recipe, weight_dtype, need_input, need_weight)` is `scaled_linear_backward` from the same codes,
//! fp8_block only: dgrad reads W^T's operand, which for 128x128 tiles is the tiles transposed
//! (docs/NUMERICS.md "Transposes and layouts"; `quantize::weight_dgrad_from_codes`), and wgrad
//! needs dy and x alone; both run `run_backward`, the body of `scaled_linear_backward`, so dx and
//! dW (in `weight_dtype`) are bit-identical to it on the weight the codes came from.
//!
//! The stored codes are what the recipe's forward computes from W (`quantize::along_k` with the
//! weight role: fp8_block 128x128 tiles, MXFP8 1x32 along in_features, NVFP4 16x16 tiles with
//! its per-tensor decode scale), so the fprop GEMM gets the operand the trained layer's forward
//! built, in the form its backend reads (`quantize::weight_from_codes`), x is quantized by the
//! same call, and the pass dispatches through the same table (deepwell_core::policy::gemm_backend).
//! On every device the output is bit-identical to `scaled_linear`'s forward on the weight the codes
//! came from; tests/ops/test_quantized_linear.py proves it against that op.

use deepwell_core::policy::{Pass, Recipe};

use super::{arch_of, check_bias, parse_recipe, run_backward, Passes};
use crate::aten;
use crate::check;
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::gemm::{self, quantize, Form, Role};
use crate::kernel::{one_body, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static QUANTIZED_FORWARD: OpSpec = OpSpec {
    name: "quantized_linear",
    args: &[
        ("x", Kind::Tensor),
        ("weight_data", Kind::Tensor),
        ("weight_scale", Kind::Tensor),
        ("weight_global_scale", Kind::OptTensor),
        ("bias", Kind::OptTensor),
        ("recipe", Kind::Str),
    ],
    returns: 1,
};

pub static QUANTIZED_BACKWARD: OpSpec = OpSpec {
    name: "quantized_linear_backward",
    args: &[
        ("grad_out", Kind::Tensor),
        ("x", Kind::Tensor),
        ("weight_data", Kind::Tensor),
        ("weight_scale", Kind::Tensor),
        ("recipe", Kind::Str),
        ("weight_dtype", Kind::ScalarType),
        ("need_input", Kind::Bool),
        ("need_weight", Kind::Bool),
    ],
    returns: 2,
};

/// One body for both devices, as `scaled_linear`'s.
pub fn kernels() -> Vec<Kernel> {
    [one_body!(QUANTIZED_FORWARD, forward), one_body!(QUANTIZED_BACKWARD, backward)].concat()
}

/// The stored codes' dtypes and shapes for an (n, k) weight: (data dtype, data cols, scale dtype,
/// scale shape); None for the recipes that have no stored-codes form. Mirrors `quantize_weight` in torch_ops/deepwell/artifact/quantized.py.
fn layout(recipe: Recipe, n: i64, k: i64) -> Option<(DType, i64, DType, [i64; 2])> {
    match recipe {
        Recipe::Fp8Block => Some((DType::E4M3, k, DType::F32, [n / 128, k / 128])),
        Recipe::Mxfp8 => Some((DType::E4M3, k, DType::E8M0, [n, k / 32])),
        Recipe::Nvfp4 => Some((DType::U8, k / 2, DType::E4M3, [n, k / 16])),
        // fp8_tensor re-quantizes its weights every call (one scale per tensor: a stored copy
        // would have to carry the scale of the tensor it came from, i.e. of the whole weight).
        Recipe::Fp8Tensor | Recipe::Bf16 => None,
    }
}

/// A validated call on stored codes: the passes (x, recipe, device, arch, shapes) and the codes.
struct Codes {
    p: Passes,
    data: Tensor,
    scale: Tensor,
    global: Option<Tensor>,
}

/// Checks x and W's stored codes for `recipe_arg` (the table of `layout`), with `others` (bias,
/// grad_out) on the same device.
fn codes(
    op: Op,
    x: Tensor,
    (data, scale, global): (Tensor, Tensor, Option<Tensor>),
    others: &[(&'static str, &Tensor)],
    recipe_arg: &str,
) -> Result<Codes> {
    let (recipe, modelled) = parse_recipe(op, recipe_arg)?;
    check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
    let mut tensors = vec![("x", &x), ("weight_data", &data), ("weight_scale", &scale)];
    tensors.extend(global.iter().map(|g| ("weight_global_scale", g)));
    tensors.extend_from_slice(others);
    let device = check::same_device(op, check::Backend::of(op, x.device())?, &tensors)?;
    check::non_empty(op, "x", &x, 1)?;
    check::ndim(op, "weight_data", &data, 2, "(out_features, stored in_features)")?;
    let n = data.sizes()[0];
    let k = *x.sizes().last().unwrap_or(&0);
    let Some((data_dtype, data_cols, scale_dtype, scale_shape)) = layout(recipe, n, k) else {
        return Err(Error::arg(
            op,
            "recipe",
            "be a quantized recipe ('mxfp8', 'nvfp4', 'fp8_block')",
            check::quoted(recipe_arg),
        ));
    };
    let block = recipe.block_k().unwrap_or(1) as i64;
    if k % block != 0 || n % block != 0 {
        return Err(Error::Mismatch {
            op,
            msg: format!(
                "{recipe} needs in_features ({k}, x's last dim) and out_features ({n}) in multiples of {block}"
            ),
        });
    }
    check::dtype_in(op, "weight_data", &data, &[data_dtype])?;
    check::shape_eq(op, "weight_data", &data, &[n, data_cols])?;
    check::dtype_in(op, "weight_scale", &scale, &[scale_dtype])?;
    check::shape_eq(op, "weight_scale", &scale, &scale_shape)?;
    match (recipe, &global) {
        (Recipe::Nvfp4, Some(g)) => {
            check::dtype_in(op, "weight_global_scale", g, &[DType::F32])?;
            check::shape_eq(op, "weight_global_scale", g, &[])?;
        }
        (Recipe::Nvfp4, None) => {
            return Err(Error::arg(
                op,
                "weight_global_scale",
                "be given for nvfp4 (its per-tensor decode scale)",
                "None",
            ));
        }
        (_, Some(_)) => {
            return Err(Error::arg(op, "weight_global_scale", format!("be None for {recipe}"), "a tensor"));
        }
        (_, None) => {}
    }
    let arch = arch_of(op, device, modelled, recipe_arg)?;
    let m = x.numel() / k as usize;
    let mut out_shape = x.sizes().to_vec();
    *out_shape.last_mut().unwrap_or(&mut 0) = n;
    let (n, k) = (n as usize, k as usize);
    let contiguous = |t: Tensor| aten::contiguous(op, t);
    let (data, scale) = (contiguous(data)?, contiguous(scale)?);
    Ok(Codes { p: Passes { x, recipe, device, arch, m, k, n, out_shape }, data, scale, global })
}

fn forward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (x, data, scale) = (a.tensor("x")?, a.tensor("weight_data")?, a.tensor("weight_scale")?);
    let (global, bias) = (a.opt_tensor("weight_global_scale")?, a.opt_tensor("bias")?);
    let recipe_arg = a.str("recipe")?;
    let others: Vec<_> = bias.iter().map(|b| ("bias", b)).collect();
    let Codes { p, data, scale, global } = codes(op, x, (data, scale, global), &others, &recipe_arg)?;
    check_bias(op, bias.as_ref(), p.n as i64)?;

    let backend = p.choice(Pass::Fprop).backend;
    let (x_form, w_form) = Form::of(backend);
    let xa = quantize::along_k(op, p.recipe, x_form, Role::Activation, p.x_2d(op)?, 0)?;
    let wb = quantize::weight_from_codes(op, p.recipe, w_form, data, scale, global)?;
    let y = gemm::run::run(op, backend, xa, wb, bias, p.x.dtype())?;
    Ok(vec![aten::contiguous(op, y)?.reshape_contiguous(op, &p.out_shape)?])
}

fn backward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (dy, x) = (a.tensor("grad_out")?, a.tensor("x")?);
    let (data, scale) = (a.tensor("weight_data")?, a.tensor("weight_scale")?);
    let recipe_arg = a.str("recipe")?;
    let w_dtype = a.scalar_type("weight_dtype")?;
    let (need_x, need_w) = (a.bool("need_input")?, a.bool("need_weight")?);
    if parse_recipe(op, &recipe_arg)?.0 != Recipe::Fp8Block {
        return Err(Error::arg(
            op,
            "recipe",
            "be 'fp8_block' (its 128x128 weight tiles, transposed, are W^T's for dgrad)",
            check::quoted(&recipe_arg),
        ));
    }
    let Codes { p, data, scale, .. } = codes(op, x, (data, scale, None), &[("grad_out", &dy)], &recipe_arg)?;
    if !check::FLOAT_INPUTS.contains(&w_dtype) {
        return Err(Error::arg(op, "weight_dtype", "be torch.float32, torch.bfloat16 or torch.float16", w_dtype));
    }
    let dgrad_weight = || {
        let (fprop, dgrad) = (Form::of(p.choice(Pass::Fprop).backend).1, Form::of(p.choice(Pass::Dgrad).backend).1);
        quantize::weight_dgrad_from_codes(op, p.recipe, fprop, dgrad, data, scale)
    };
    // fp8_block rounds gradients to nearest: the seed of stochastic rounding is never read.
    let x_wgrad = |form| p.x_wgrad(op, form, 0);
    run_backward(op, &p, (dy, None), 0, (need_x, need_w), (p.x.dtype(), w_dtype), dgrad_weight, x_wgrad)
}
