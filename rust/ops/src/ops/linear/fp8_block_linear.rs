//! `deepwell.fp8_block_linear` and `deepwell.fp8_block_linear_backward`: `scaled_linear` in the
//! fp8_block recipe with x's wgrad operand saved for the backward instead of x. Schemas, fake
//! kernels and the autograd formula: torch_ops/deepwell/ops/fp8_block_linear.py.
//!
//! fp8_block quantizes x twice per step: along K in 1x128 blocks for fprop, and along the tokens
//! (x^T in 1x128 blocks) for wgrad (docs/NUMERICS.md "FP8 block"; the two copies differ, a 1x128
//! block's scale depending on its orientation). `fp8_block_quantize_rowcol(x, m_major_scales=True)`
//! writes both from one read of x; the forward runs fprop on the row copy and autograd keeps the
//! column copy (1 byte per element and a scale per 128) for the backward, which then never reads x.
//!
//! x's operands arrive as the optional arguments say (`Given`): none (the forward makes both copies
//! itself and returns the column copy, its codes as uint8, for autograd to keep), both (made once
//! for the layers that read one x, q/k/v or gate/up: compiler/backend.py groups them; outputs 1-2
//! empty), or the row copy alone (`copies="rows"`: the autograd formula makes the column copy in
//! the backward from x, for a forward that writes half the bytes and saves none of x's codes, the
//! backend's `recompute_codes`; outputs 1-2 empty). Every output is bit-identical to
//! `scaled_linear(x, w, b, "fp8_block")` and its backward (tests/ops/test_fp8_block_linear.py): the
//! same operands reach the same GEMMs (`quantize::fp8_block_rows_from_codes`,
//! `fp8_block_cols_from_codes`), and the weight's through the same weight cache.

use deepwell_core::policy::{Pass, Recipe};

use super::weight_cache::Want;
use super::{forward_outputs, given_layer, run_backward, Given, Saved};
use crate::aten;
use crate::check;
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::gemm::quantizers::{self, ScaleLayout};
use crate::gemm::{self, quantize, Form, Operand};
use crate::kernel::{one_body, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

/// fp8_block's 1x128 block.
const BLOCK: i64 = 128;

pub static FORWARD: OpSpec = OpSpec {
    name: "fp8_block_linear",
    args: &[
        ("x", Kind::Tensor),
        ("weight", Kind::Tensor),
        ("bias", Kind::OptTensor),
        ("recipe", Kind::Str),
        ("x_codes", Kind::OptTensor),
        ("x_scale_inv", Kind::OptTensor),
        ("x_codes_t", Kind::OptTensor),
        ("x_scale_inv_t", Kind::OptTensor),
    ],
    returns: 3,
};

/// The optional arguments of x's row copy and of its column copy.
const ROWS: [&str; 2] = ["x_codes", "x_scale_inv"];
const COLS: [&str; 2] = ["x_codes_t", "x_scale_inv_t"];

pub static BACKWARD: OpSpec = OpSpec {
    name: "fp8_block_linear_backward",
    args: &[
        ("grad_out", Kind::Tensor),
        ("x_codes_t", Kind::Tensor),
        ("x_scale_inv_t", Kind::Tensor),
        ("weight", Kind::Tensor),
        ("recipe", Kind::Str),
        ("need_input", Kind::Bool),
        ("need_weight", Kind::Bool),
    ],
    returns: 2,
};

pub fn kernels() -> Vec<Kernel> {
    [one_body!(FORWARD, forward), one_body!(BACKWARD, backward)].concat()
}

/// The scales of x^T's codes (k, m) as rowcol stores them M-major: (m/128, k).
pub(super) fn cols_scale_shape(m: i64, k: i64) -> Vec<i64> {
    vec![m / BLOCK, k]
}

/// x's token count `m` is a multiple of the block (x^T's 1x128 blocks run along it).
pub(super) fn check_tokens(op: Op, arg: &'static str, m: usize) -> Result<()> {
    if m as i64 % BLOCK == 0 {
        return Ok(());
    }
    Err(Error::arg(op, arg, format!("have a token count that is a multiple of {BLOCK} (x^T's 1x128 blocks)"), m))
}

/// x's rowcol codes for x seen as (m, k): rows (m, k) E4M3 with scales (k/128, m), and columns
/// (k, m) (E4M3, or its bytes as uint8) with scales (m/128, k), the scales fp32 stored M-major.
pub(super) fn check_codes(op: Op, m: i64, k: i64, [codes, scale, codes_t, scale_t]: [&Tensor; 4]) -> Result<()> {
    check_rows(op, m, k, codes, scale)?;
    check_cols(op, m, k, codes_t, scale_t)
}

/// x's row codes (m, k) E4M3 and their scales (k/128, m), as `check_codes` checks them.
fn check_rows(op: Op, m: i64, k: i64, codes: &Tensor, scale: &Tensor) -> Result<()> {
    check::dtype_in(op, "x_codes", codes, &[DType::E4M3])?;
    check::shape_eq(op, "x_codes", codes, &[m, k])?;
    check::dtype_in(op, "x_scale_inv", scale, &[DType::F32])?;
    check::shape_eq(op, "x_scale_inv", scale, &[k / BLOCK, m])
}

/// x^T's codes (k, m) and their scales (m/128, k), as `check_codes` checks them.
pub(super) fn check_cols(op: Op, m: i64, k: i64, codes_t: &Tensor, scale_t: &Tensor) -> Result<()> {
    check::dtype_in(op, "x_codes_t", codes_t, &[DType::E4M3, DType::U8])?;
    check::shape_eq(op, "x_codes_t", codes_t, &[k, m])?;
    check::dtype_in(op, "x_scale_inv_t", scale_t, &[DType::F32])?;
    check::shape_eq(op, "x_scale_inv_t", scale_t, &cols_scale_shape(m, k))
}

/// The wgrad operand, in the form its GEMM asks for, from a tensor's saved column codes (k, m) (E4M3
/// or its bytes as uint8) and their scales stored M-major (m/128, k), as rowcol made them.
pub(super) fn saved_cols(op: Op, codes: &Tensor, scale: Tensor) -> Result<impl FnOnce(Form) -> Result<Operand>> {
    let codes = aten::view_dtype(op, aten::contiguous(op, codes.share(op)?)?, DType::E4M3)?;
    let scale = aten::contiguous(op, scale)?;
    Ok(move |form| quantize::fp8_block_cols_from_codes(op, form, codes, scale))
}

/// y from fprop on x's row copy (given, or made here with the column copy), after checking x
/// against the weight and bias, and the copies given against x (the column copy is only checked: it
/// is for the backward). Returns (y, the column copy made here as uint8 codes and scales, or two
/// empty tensors where x's codes were given).
fn forward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (layer, bias, given) = given_layer(a, Recipe::Fp8Block, ROWS, COLS)?;
    let p = &layer.p;
    check_tokens(op, "x", p.m)?;
    let (m, k) = (p.m as i64, p.k as i64);
    let ([codes, scale], made) = match given {
        Given::Nothing => {
            let [codes, scale, codes_t, scale_t] =
                quantizers::fp8_block_quantize_rowcol(op, p.x_2d(op)?, ScaleLayout::MMajor)?;
            ([codes, scale], Some([aten::view_dtype(op, codes_t, DType::U8)?, scale_t]))
        }
        Given::Rows([codes, scale]) => {
            check_rows(op, m, k, &codes, &scale)?;
            ([codes, scale], None)
        }
        Given::Both([codes, scale], [codes_t, scale_t]) => {
            check_codes(op, m, k, [&codes, &scale, &codes_t, &scale_t])?;
            ([codes, scale], None)
        }
    };
    let backend = p.choice(Pass::Fprop).backend;
    let (codes, scale) = (aten::contiguous(op, codes)?, aten::contiguous(op, scale)?);
    let xa = quantize::fp8_block_rows_from_codes(op, Form::of(backend).0, codes, scale)?;
    let y = gemm::run::run(op, backend, xa, layer.weight_operand(op, Want::Fprop)?, bias, p.x.dtype())?;
    forward_outputs(op, p, y, made)
}

fn backward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let Saved { layer, dy, scale, grads } = Saved::parse(a, "x_scale_inv_t", Recipe::Fp8Block, cols_scale_shape)?;
    let p = &layer.p;
    check_tokens(op, "grad_out", p.m)?;
    let dtypes = (dy.dtype(), layer.weight.dtype());
    let dgrad_weight = || layer.weight_operand(op, Want::Dgrad);
    let x_wgrad = saved_cols(op, &p.x, scale)?;
    // fp8_block rounds gradients to nearest: no stochastic-rounding seed.
    run_backward(op, p, (dy, None), 0, grads, dtypes, dgrad_weight, x_wgrad)
}
