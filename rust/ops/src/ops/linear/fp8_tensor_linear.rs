//! `deepwell.fp8_tensor_linear` and `deepwell.fp8_tensor_linear_backward`: `scaled_linear` in the
//! fp8_tensor recipe, with x's FP8 codes saved for the backward instead of x. Schemas, fake kernels
//! and the autograd formula: torch_ops/deepwell/ops/fp8_tensor_linear.py.
//!
//! With one scale per tensor (docs/NUMERICS.md "FP8 tensor"), x's wgrad operand (x along the
//! tokens) is its fprop codes transposed. So the forward quantizes x once into both copies
//! (`fp8_tensor_quantize_rowcol`: one amax pass, one cast pass), runs fprop on the row codes and
//! returns the transposed codes and the scale; the backward reads them for wgrad. Against
//! `scaled_linear` + `scaled_linear_backward` this saves, per layer and step, the backward's two
//! passes over x (amax, cast: 5 bytes per element) for 1 more byte written in the forward, and
//! autograd keeps 1 byte per element of x instead of 2. The codes travel as uint8 (their E4M3
//! bytes): autograd and opcheck treat every output of a differentiable op as a tensor they can add
//! and sum, which float8 tensors are not. Every output is bit-identical to
//! `scaled_linear(x, w, b, "fp8_tensor")` and its backward (tests/ops/test_fp8_tensor_linear.py).
//!
//! x's operands arrive as the optional arguments say (`Given`): none (quantized here, as above),
//! both copies and the scale, made beforehand by `fp8_tensor_quantize_rowcol(x)` (layers that read
//! one x, q/k/v or gate/up, share one quantization and one saved copy: compiler/backend.py groups
//! them; outputs 1-2 empty), or the row codes alone (`copies="rows"`: the autograd formula makes
//! the transposed codes in the backward, from x and `x_amax`, the forward's amax so the forward's
//! scale, for a forward that writes half the bytes and saves none of x's codes, the backend's
//! `recompute_codes`; outputs 1-2 empty). `x_amax` is x's amax wherever x is quantized (here, or
//! in that backward); `weight_amax` is W's, reduced once per step in the backend's graph: W's fprop
//! cast and its dgrad transposing cast read it, so W is read twice per step, not four times.
//!
//! The backward's optional `grad_amax` is dy's amax, reduced by the autograd formula as a torch op
//! so that Inductor fuses it into dy's producer; dy's one rowcol pass reads it instead of reducing
//! dy itself (`gemm::quantize::gradient_pair`).

use deepwell_core::policy::{Pass, Recipe};

use super::weight_cache::Want;
use super::{forward_outputs, given_layer, run_backward, Given, Saved};
use crate::aten;
use crate::check;
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::gemm::quantize::{fp8_tensor_elem, Role};
use crate::gemm::quantizers::{self, Copies, Fp8Elem};
use crate::gemm::{self, quantize, Form};
use crate::kernel::{one_body, Kernel};
use crate::ops::fp8_tensor::check_amax;
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static FORWARD: OpSpec = OpSpec {
    name: "fp8_tensor_linear",
    args: &[
        ("x", Kind::Tensor),
        ("weight", Kind::Tensor),
        ("bias", Kind::OptTensor),
        ("recipe", Kind::Str),
        ("x_codes", Kind::OptTensor),
        ("x_scale_inv", Kind::OptTensor),
        ("x_codes_t", Kind::OptTensor),
        ("weight_amax", Kind::OptTensor),
        ("x_amax", Kind::OptTensor),
    ],
    returns: 3,
};

/// The optional arguments of x's row copy (codes, and the scale both copies share) and of its
/// transposed codes.
const ROWS: [&str; 2] = ["x_codes", "x_scale_inv"];
const COLS: [&str; 1] = ["x_codes_t"];

pub static BACKWARD: OpSpec = OpSpec {
    name: "fp8_tensor_linear_backward",
    args: &[
        ("grad_out", Kind::Tensor),
        ("x_codes_t", Kind::Tensor),
        ("x_scale_inv", Kind::Tensor),
        ("weight", Kind::Tensor),
        ("recipe", Kind::Str),
        ("need_input", Kind::Bool),
        ("need_weight", Kind::Bool),
        ("grad_amax", Kind::OptTensor),
        ("weight_amax", Kind::OptTensor),
    ],
    returns: 2,
};

pub fn kernels() -> Vec<Kernel> {
    [one_body!(FORWARD, forward), one_body!(BACKWARD, backward)].concat()
}

/// y from fprop on x's row codes (given, or made here with the transposed codes), after checking x
/// against the weight and bias, and the codes given (and the amaxes) against x. Returns (y, the
/// transposed codes made here as uint8 and the scale, or two empty tensors where x's codes were
/// given).
fn forward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (w_amax, x_amax) = (a.opt_tensor("weight_amax")?, a.opt_tensor("x_amax")?);
    let (layer, bias, given) = given_layer(a, Recipe::Fp8Tensor, ROWS, COLS)?;
    let p = &layer.p;
    let (m, k) = (p.m as i64, p.k as i64);
    let on = check::Backend::of(op, p.device)?;
    if let Some(amax) = &w_amax {
        check_amax(op, "weight_amax", amax, on, ("weight", &layer.weight), fp8_tensor_elem(Role::Weight))?;
    }
    if let Some(amax) = &x_amax {
        check_amax(op, "x_amax", amax, on, ("x", &p.x), fp8_tensor_elem(Role::Activation))?;
    }
    let (codes, scale, made) = match given {
        Given::Nothing => {
            let [rows, cols, scale] =
                quantizers::fp8_tensor_quantize_rowcol(op, p.x_2d(op)?, Fp8Elem::E4M3, Copies::Both, x_amax)?;
            (rows, scale.share(op)?, Some([aten::view_dtype(op, cols, DType::U8)?, scale]))
        }
        Given::Rows([codes, scale]) => {
            check_rows(op, m, k, &codes, &scale)?;
            (codes, scale, None)
        }
        Given::Both([codes, scale], [codes_t]) => {
            check_rows(op, m, k, &codes, &scale)?;
            check::dtype_in(op, "x_codes_t", &codes_t, &[DType::E4M3, DType::U8])?;
            check::shape_eq(op, "x_codes_t", &codes_t, &[k, m])?;
            (codes, scale, None)
        }
    };
    let backend = p.choice(Pass::Fprop).backend;
    let xa = quantize::fp8_tensor_from_codes(op, Form::of(backend).0, aten::contiguous(op, codes)?, scale)?;
    let wb = layer.weight_operand_from(op, Want::Fprop, w_amax)?;
    let y = gemm::run::run(op, backend, xa, wb, bias, p.x.dtype())?;
    forward_outputs(op, p, y, made)
}

/// x's row codes (m, k) E4M3 and the scale, 0-d fp32.
fn check_rows(op: Op, m: i64, k: i64, codes: &Tensor, scale: &Tensor) -> Result<()> {
    check::dtype_in(op, "x_codes", codes, &[DType::E4M3])?;
    check::shape_eq(op, "x_codes", codes, &[m, k])?;
    check::dtype_in(op, "x_scale_inv", scale, &[DType::F32])?;
    check::shape_eq(op, "x_scale_inv", scale, &[])
}

fn backward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (dy_amax, w_amax) = (a.opt_tensor("grad_amax")?, a.opt_tensor("weight_amax")?);
    let Saved { layer, dy, scale, grads } = Saved::parse(a, "x_scale_inv", Recipe::Fp8Tensor, |_, _| vec![])?;
    let p = &layer.p;
    let on = check::Backend::of(op, dy.device())?;
    if let Some(amax) = &dy_amax {
        check_amax(op, "grad_amax", amax, on, ("grad_out", &dy), fp8_tensor_elem(Role::Gradient))?;
    }
    if let Some(amax) = &w_amax {
        check_amax(op, "weight_amax", amax, on, ("weight", &layer.weight), fp8_tensor_elem(Role::Weight))?;
    }
    let dtypes = (dy.dtype(), layer.weight.dtype());
    let codes = aten::view_dtype(op, aten::contiguous(op, p.x.share(op)?)?, DType::E4M3)?;
    let dgrad_weight = || layer.weight_operand_from(op, Want::Dgrad, w_amax);
    let x_wgrad = |form| quantize::fp8_tensor_cols_from_codes(op, form, codes, scale);
    // fp8_tensor rounds gradients to nearest: no stochastic-rounding seed.
    run_backward(op, p, (dy, dy_amax), 0, grads, dtypes, dgrad_weight, x_wgrad)
}
