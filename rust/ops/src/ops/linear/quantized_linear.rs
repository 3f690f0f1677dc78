//! `deepwell.quantized_linear(x, weight_data, weight_scale, weight_global_scale, bias, recipe)`: the
//! forward of `scaled_linear` from a weight quantized beforehand (an exported model's stored codes,
//! torch_ops/deepwell/train/quantized.py). Inference only: no backward.
//!
//! The stored codes are what the recipe's forward computes from W (`quantize::along_k` with the
//! weight role: fp8_block 128x128 tiles, MXFP8 1x32 along in_features, NVFP4 16x16 tiles with
//! its per-tensor decode scale), so the fprop GEMM gets the operand the trained layer's forward
//! built, in the form its backend reads (`quantize::weight_from_codes`), x is quantized by the
//! same call, and the pass dispatches through the same table (deepwell_core::policy::gemm_backend).
//! On every device the output is bit-identical to `scaled_linear`'s forward on the weight the codes
//! came from; tests/test_quantized_linear.py proves it against that op.

use deepwell_core::policy::{gemm_backend, GemmShape, Pass, Recipe};

use super::{arch_of, check_bias, parse_recipe};
use crate::aten;
use crate::check;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gemm::{self, quantize, Form, Role};
use crate::kernel::{boxed_kernel, Kernel};
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

pub fn kernels() -> Vec<Kernel> {
    ["CPU", "CUDA"]
        .into_iter()
        .map(|key| Kernel {
            spec: &QUANTIZED_FORWARD,
            dispatch_key: key,
            boxed: boxed_kernel!(QUANTIZED_FORWARD, forward),
        })
        .collect()
}

/// The stored codes' dtypes and shapes for an (n, k) weight: (data dtype, data cols, scale dtype,
/// scale shape). Mirrors `quantize_weight` in torch_ops/deepwell/train/quantized.py.
fn layout(recipe: Recipe, n: i64, k: i64) -> Option<(DType, i64, DType, [i64; 2])> {
    match recipe {
        Recipe::Fp8Block => Some((DType::E4M3, k, DType::F32, [n / 128, k / 128])),
        Recipe::Mxfp8 => Some((DType::E4M3, k, DType::E8M0, [n, k / 32])),
        Recipe::Nvfp4 => Some((DType::U8, k / 2, DType::E4M3, [n, k / 16])),
        Recipe::Bf16 => None,
    }
}

fn forward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (x, data, scale) = (a.tensor("x")?, a.tensor("weight_data")?, a.tensor("weight_scale")?);
    let (global, bias) = (a.opt_tensor("weight_global_scale")?, a.opt_tensor("bias")?);
    let recipe_arg = a.str("recipe")?;
    let (recipe, modelled) = parse_recipe(op, &recipe_arg)?;

    check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
    let mut tensors = vec![("x", &x), ("weight_data", &data), ("weight_scale", &scale)];
    tensors.extend(global.iter().map(|g| ("weight_global_scale", g)));
    tensors.extend(bias.iter().map(|b| ("bias", b)));
    let device = check::same_device(op, check::Backend::of(op, x.device())?, &tensors)?;
    check::non_empty(op, "x", &x, 1)?;
    if data.dim() != 2 {
        return Err(Error::arg(
            op,
            "weight_data",
            "be 2-d (out_features, stored in_features)",
            format!("a {}-d tensor", data.dim()),
        ));
    }
    let n = data.sizes()[0];
    let k = *x.sizes().last().unwrap_or(&0);
    let Some((data_dtype, data_cols, scale_dtype, scale_shape)) = layout(recipe, n, k) else {
        return Err(Error::arg(
            op,
            "recipe",
            "be a quantized recipe ('mxfp8', 'nvfp4', 'fp8_block')",
            check::quoted(&recipe_arg),
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
            return Err(Error::arg(op, "weight_global_scale", &format!("be None for {recipe}"), "a tensor"));
        }
        (_, None) => {}
    }
    check_bias(op, bias.as_ref(), n)?;

    let arch = arch_of(op, device, modelled, &recipe_arg)?;
    let m = x.numel() as usize / k as usize;
    let choice = gemm_backend(recipe, arch, Pass::Fprop, GemmShape::linear(Pass::Fprop, m, k as usize, n as usize));
    let (x_form, w_form) = Form::of(choice.backend);
    let mut out_shape = x.sizes().to_vec();
    *out_shape.last_mut().unwrap_or(&mut 0) = n;
    let x2 = aten::contiguous(op, x.share(op)?)?.reshape_contiguous(op, &[m as i64, k])?;
    let xa = quantize::along_k(op, recipe, x_form, Role::Activation, x2, 0)?;
    let contiguous = |t: Tensor| aten::contiguous(op, t);
    let wb = quantize::weight_from_codes(op, recipe, w_form, contiguous(data)?, contiguous(scale)?, global)?;
    let y = gemm::run::run(op, xa, wb, bias, x.dtype())?;
    Ok(vec![aten::contiguous(op, y)?.reshape_contiguous(op, &out_shape)?])
}
