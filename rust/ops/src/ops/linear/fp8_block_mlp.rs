//! `deepwell.fp8_block_swiglu_mlp` and `deepwell.fp8_block_swiglu_mlp_backward`: a LLaMA MLP,
//! `w_down(silu(w_gate(x)) * w_up(x))`, in the fp8_block recipe, with SwiGLU fused into the FP8
//! quantizers on both sides of it. Schemas, fake kernels and the autograd formula:
//! torch_ops/deepwell/ops/fp8_block_mlp.py; with its option `fused_mlp` (off by default: measured no
//! faster, docs/BASELINES.md "deepwell on the H100") the backend rewrites the three linear
//! layers into it (compiler/fuse_mlp.py).
//!
//! Three `fp8_block_linear` layers on x's codes around a SwiGLU write and re-read the activation in
//! bf16 four times a step: SwiGLU writes h, the down projection's rowcol pass reads it; SwiGLU's
//! backward writes d_gate and d_up, and each of gate's and up's backwards reads its own to quantize
//! it. Here:
//!
//! | pass | what runs |
//! |---|---|
//! | forward | one GEMM for gate and up (their weights' operands side by side, (2F, K)); `fp8_block_swiglu_quantize_rowcol(gate_up)` writes h's FP8 operands; the down GEMM |
//! | backward | down's dgrad and wgrad (`run_backward`); `fp8_block_swiglu_backward_quantize_rowcol(gate_up, dh)` writes d_gate_up's FP8 operands; one dgrad GEMM over K = 2F (dx summed in fp32, not two bf16 dx added) and one wgrad GEMM for both weights |
//!
//! Saved for the backward: x's column copy (shared with the other layers reading x), gate_up (what
//! SwiGLU's gradient reads, as the unfused graph saves it), h's column copy. Every quantization is
//! the one the unfused layers make (the fused kernels give `fp8_block_quantize_rowcol`'s codes of
//! `swiglu`'s and `swiglu_backward`'s outputs bit for bit, tests/ops/test_swiglu.py); what differs is
//! SwiGLU itself (deepwell's exact fp32, docs/NUMERICS.md "SwiGLU", where Inductor computes it its
//! own way) and dx, one rounding instead of two plus an add.

use deepwell_core::policy::{Pass, Recipe, ScalingType};

use super::fp8_block_linear::{check_codes, check_cols, check_tokens, cols_scale_shape, saved_cols};
use super::weight_cache::Want;
use super::{backward_passes, expect_recipe, parse_recipe, run_backward, saved_layer, unused, Layer, Passes};
use crate::aten;
use crate::check::{self, Backend};
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::gemm::{self, quantize, Form, Operand};
use crate::kernel::{one_body, Kernel};
use crate::ops::fp8_block::ScaleLayout;
use crate::ops::swiglu;
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static FORWARD: OpSpec = OpSpec {
    name: "fp8_block_swiglu_mlp",
    args: &[
        ("x", Kind::Tensor),
        ("x_codes", Kind::Tensor),
        ("x_scale_inv", Kind::Tensor),
        ("x_codes_t", Kind::Tensor),
        ("x_scale_inv_t", Kind::Tensor),
        ("w_gate", Kind::Tensor),
        ("w_up", Kind::Tensor),
        ("w_down", Kind::Tensor),
        ("recipe", Kind::Str),
    ],
    returns: 4,
};

pub static BACKWARD: OpSpec = OpSpec {
    name: "fp8_block_swiglu_mlp_backward",
    args: &[
        ("grad_out", Kind::Tensor),
        ("x_codes_t", Kind::Tensor),
        ("x_scale_inv_t", Kind::Tensor),
        ("gate_up", Kind::Tensor),
        ("h_codes_t", Kind::Tensor),
        ("h_scale_inv_t", Kind::Tensor),
        ("w_gate", Kind::Tensor),
        ("w_up", Kind::Tensor),
        ("w_down", Kind::Tensor),
        ("recipe", Kind::Str),
        ("need_input", Kind::Bool),
        ("need_weight", Kind::Bool),
    ],
    returns: 3,
};

pub fn kernels() -> Vec<Kernel> {
    [one_body!(FORWARD, forward), one_body!(BACKWARD, backward)].concat()
}

/// fp8_block rounds scales to powers of two (docs/NUMERICS.md "FP8 block"), as every quantizer of
/// the linear layers does.
const POW2: bool = true;

/// w_up has w_gate's shape (f, k), and w_down (d, f) takes f inputs; d a multiple of 128 (w_down^T
/// is quantized along it for dgrad; f and k are checked with w_gate).
fn check_weights(op: Op, w_gate: &Tensor, w_up: &Tensor, w_down: &Tensor) -> Result<()> {
    for (arg, w) in [("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)] {
        check::dtype_in(op, arg, w, &check::FLOAT_INPUTS)?;
        check::ndim(op, arg, w, 2, "(out_features, in_features)")?;
        check::non_empty(op, arg, w, 2)?;
    }
    if w_up.sizes() != w_gate.sizes() {
        return Err(Error::Mismatch {
            op,
            msg: format!(
                "w_up has shape {} but w_gate has {}: gate and up project x to the same width",
                check::shape_str(w_up.sizes()),
                check::shape_str(w_gate.sizes())
            ),
        });
    }
    if w_down.sizes()[1] != w_gate.sizes()[0] {
        return Err(Error::Mismatch {
            op,
            msg: format!(
                "w_down has in_features {} (shape {}) but w_gate has out_features {} (shape {})",
                w_down.sizes()[1],
                check::shape_str(w_down.sizes()),
                w_gate.sizes()[0],
                check::shape_str(w_gate.sizes())
            ),
        });
    }
    let why = "fp8_block quantizes W along in_features and W^T along out_features in 128x128 tiles";
    check::divisible(op, "w_gate", w_gate, 0, 128, why)?;
    check::divisible(op, "w_gate", w_gate, 1, 128, why)?;
    check::divisible(op, "w_down", w_down, 0, 128, why)
}

/// x (..., k) feeds w_gate (f, k) (checked here so the error names w_gate, not Layer's "weight").
fn check_x(op: Op, x: &Tensor, w_gate: &Tensor) -> Result<()> {
    let (x_k, k) = (x.sizes().last().copied().unwrap_or(0), w_gate.sizes()[1]);
    if x_k == k {
        return Ok(());
    }
    Err(Error::Mismatch {
        op,
        msg: format!(
            "x has {x_k} features (shape {}) but w_gate has in_features {k} (shape {})",
            check::shape_str(x.sizes()),
            check::shape_str(w_gate.sizes())
        ),
    })
}

/// A layer over `like`'s m tokens (its recipe, device and arch) with `weight` (n, k); `x` stands for
/// its input where only its dtype is read. `lead`: the output's leading dims.
fn layer_like(like: &Passes, x: Tensor, weight: Tensor, lead: &[i64]) -> Layer {
    let (n, k) = (weight.sizes()[0] as usize, weight.sizes()[1] as usize);
    let mut out_shape = lead.to_vec();
    out_shape.push(n as i64);
    let p = Passes { x, recipe: like.recipe, device: like.device, arch: like.arch, m: like.m, k, n, out_shape };
    Layer { p, weight }
}

/// gate's passes (m, k) -> f widened to [w_gate; w_up]'s 2f: the one GEMM per pass of both.
fn joined(op: Op, gate: &Passes) -> Result<Passes> {
    let mut out_shape = gate.out_shape.clone();
    *out_shape.last_mut().unwrap_or(&mut 0) *= 2;
    let (x, n) = (gate.x.share(op)?, 2 * gate.n);
    Ok(Passes { x, recipe: gate.recipe, device: gate.device, arch: gate.arch, m: gate.m, k: gate.k, n, out_shape })
}

/// Gate's and up's operands of one pass side by side, as the operand of the weight (2f, k) =
/// [w_gate; w_up] would be: fprop's along the rows, dgrad's (W^T: rows k, K = f) along K. Each
/// weight's own operand comes through the weight cache, so a reuse scope keeps serving them.
fn side_by_side(op: Op, gate: Operand, up: Operand, want: Want) -> Result<Operand> {
    let dim = match want {
        Want::Fprop => 0,
        Want::Dgrad => 1,
    };
    match (gate, up) {
        (Operand::Dense(g), Operand::Dense(u)) => Ok(Operand::Dense(aten::cat(op, vec![g, u], dim)?)),
        (
            Operand::Blockwise { data: g, scale: gs, scaling: ScalingType::BlockWise128x128 },
            Operand::Blockwise { data: u, scale: us, scaling: ScalingType::BlockWise128x128 },
        ) => {
            // The tile scales are (K/128, rows/128) views of (rows/128, K/128) storage (operand.rs):
            // joined in storage, along the same dim as the codes.
            let data = aten::cat(op, vec![g, u], dim)?;
            let scale = aten::cat(op, vec![gs.t(op)?, us.t(op)?], dim)?.t(op)?;
            Ok(Operand::Blockwise { data, scale, scaling: ScalingType::BlockWise128x128 })
        }
        _ => Err(Error::Internal { op, msg: "gate and up weight operands of other than one fp8_block form".into() }),
    }
}

/// `[w_gate; w_up]`'s operand for `want`, read by the joined GEMM in `form`. Each weight's operand
/// takes the form its own GEMM (f columns) would read: the same recipe's, checked.
fn gate_up_weight(op: Op, gate: &Layer, up: &Layer, want: Want, form: Form) -> Result<Operand> {
    let pass = match want {
        Want::Fprop => Pass::Fprop,
        Want::Dgrad => Pass::Dgrad,
    };
    if Form::of(gate.p.choice(pass).backend).1 != form {
        return Err(Error::Internal { op, msg: format!("gate_up's {pass:?} GEMM reads {form:?} weights") });
    }
    side_by_side(op, gate.weight_operand(op, want)?, up.weight_operand(op, want)?, want)
}

/// (y, gate_up, h's column codes as uint8, their scales) for x's rowcol codes (`fp8_block_linear`'
/// layouts: rows (m, k), scales (k/128, m); columns (k, m), scales (m/128, k)).
fn forward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (x, codes, scale) = (a.tensor("x")?, a.tensor("x_codes")?, a.tensor("x_scale_inv")?);
    let (codes_t, scale_t) = (a.tensor("x_codes_t")?, a.tensor("x_scale_inv_t")?);
    let (w_gate, w_up, w_down) = (a.tensor("w_gate")?, a.tensor("w_up")?, a.tensor("w_down")?);
    let recipe_arg = a.str("recipe")?;
    expect_recipe(op, parse_recipe(op, &recipe_arg)?.0, Recipe::Fp8Block, &recipe_arg)?;
    check_weights(op, &w_gate, &w_up, &w_down)?;
    check_x(op, &x, &w_gate)?;
    let others = [
        ("x_codes", &codes),
        ("x_scale_inv", &scale),
        ("x_codes_t", &codes_t),
        ("x_scale_inv_t", &scale_t),
        ("w_up", &w_up),
        ("w_down", &w_down),
    ];
    // Layer::new checks x against w_gate (and, through the same device, everything else).
    let gate = Layer::new(op, x, w_gate, &others, &recipe_arg)?;
    let p = &gate.p;
    check_tokens(op, "x", p.m)?;
    check_codes(op, p.m as i64, p.k as i64, [&codes, &scale, &codes_t, &scale_t])?;
    let (lead, dtype) = (&p.out_shape[..p.out_shape.len() - 1], p.x.dtype());
    let up = layer_like(p, p.x.share(op)?, w_up, lead);

    // gate and up: one GEMM.
    let both = joined(op, p)?;
    let backend = both.choice(Pass::Fprop).backend;
    let (x_form, w_form) = Form::of(backend);
    let xa =
        quantize::fp8_block_rows_from_codes(op, x_form, aten::contiguous(op, codes)?, aten::contiguous(op, scale)?)?;
    let wb = gate_up_weight(op, &gate, &up, Want::Fprop, w_form)?;
    let gate_up = aten::contiguous(op, gemm::run::run(op, backend, xa, wb, None, dtype)?)?;

    // SwiGLU straight into h's two FP8 copies, then the down projection on the row copy.
    let on = Backend::of(op, p.device)?;
    let [h, h_scale, h_t, h_scale_t] =
        swiglu::quantize_rowcol(op, on, gate_up.share(op)?, None, POW2, ScaleLayout::MMajor)?;
    let down = layer_like(p, gate_up.share(op)?, w_down, lead);
    let backend = down.p.choice(Pass::Fprop).backend;
    let ha = quantize::fp8_block_rows_from_codes(op, Form::of(backend).0, h, h_scale)?;
    let y = gemm::run::run(op, backend, ha, down.weight_operand(op, Want::Fprop)?, None, dtype)?;
    let y = aten::contiguous(op, y)?.reshape_contiguous(op, &down.p.out_shape)?;
    // h's column codes as their bytes (uint8), as the backward takes them: no float output but y,
    // so nothing differentiates or sums the codes as numbers.
    let h_t = aten::view_dtype(op, h_t, DType::U8)?;
    Ok(vec![y, gate_up.reshape_contiguous(op, &both.out_shape)?, h_t, h_scale_t])
}

/// (dx, d[w_gate; w_up] (2f, k), dw_down) from what the forward saved.
fn backward(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let dy = a.tensor("grad_out")?;
    let (x_t, x_scale_t) = (a.tensor("x_codes_t")?, a.tensor("x_scale_inv_t")?);
    let gate_up = a.tensor("gate_up")?;
    let (h_t, h_scale_t) = (a.tensor("h_codes_t")?, a.tensor("h_scale_inv_t")?);
    let (w_gate, w_up, w_down) = (a.tensor("w_gate")?, a.tensor("w_up")?, a.tensor("w_down")?);
    let recipe_arg = a.str("recipe")?;
    let (need_x, need_w) = (a.bool("need_input")?, a.bool("need_weight")?);
    check_weights(op, &w_gate, &w_up, &w_down)?;

    // The down projection (from h's saved column copy), checked against dy: dh and dW_down.
    let recipe = (recipe_arg.as_str(), Recipe::Fp8Block);
    let down = saved_layer(
        op,
        &dy,
        ("h_codes_t", h_t),
        ("h_scale_inv_t", &h_scale_t),
        ("w_down", w_down),
        recipe,
        cols_scale_shape,
    )?;
    let p = &down.p;
    check_tokens(op, "grad_out", p.m)?;
    let others = [
        ("x_codes_t", &x_t),
        ("x_scale_inv_t", &x_scale_t),
        ("gate_up", &gate_up),
        ("w_gate", &w_gate),
        ("w_up", &w_up),
    ];
    check::same_device(op, Backend::of(op, p.device)?, &others)?;
    let (lead, f) = (p.out_shape[..p.out_shape.len() - 1].to_vec(), p.k);
    let gate_up_shape: Vec<i64> = lead.iter().copied().chain([2 * f as i64]).collect();
    check::dtype_in(op, "gate_up", &gate_up, &check::FLOAT_INPUTS)?;
    check::shape_eq(op, "gate_up", &gate_up, &gate_up_shape)?;
    check_cols(op, p.m as i64, w_gate.sizes()[1], &x_t, &x_scale_t)?;
    let dtype = gate_up.dtype();
    let need_dh = need_x || need_w;
    let h_wgrad = saved_cols(op, &p.x, h_scale_t)?;
    let dtypes = (dtype, down.weight.dtype());
    let grads = run_backward(
        op,
        p,
        (dy, None),
        0,
        (need_dh, need_w),
        dtypes,
        || down.weight_operand(op, Want::Dgrad),
        h_wgrad,
    )?;
    let [dh, dw_down]: [Tensor; 2] =
        grads.try_into().map_err(|_| Error::Internal { op, msg: "a backward of other than (dx, dW)".into() })?;
    if !need_dh {
        return Ok(vec![unused(op, dtype, p.device)?, unused(op, w_gate.dtype(), p.device)?, dw_down]);
    }

    // Gate and up as one layer (m, k) -> 2f over x's saved column copy; SwiGLU's gradient goes
    // straight into the FP8 operands of its dgrad and wgrad.
    let gate = layer_like(p, x_t.share(op)?, w_gate, &lead);
    let up = layer_like(p, x_t.share(op)?, w_up, &lead);
    let both = joined(op, &gate.p)?;
    let on = Backend::of(op, p.device)?;
    let (m, f) = (p.m as i64, f as i64);
    let dh = dh.reshape_contiguous(op, &[m, f])?;
    let gate_up = aten::contiguous(op, gate_up)?.reshape_contiguous(op, &[m, 2 * f])?;
    let d_gate_up = |dgrad: Option<Form>, wgrad: Option<Form>| {
        let [rows, rows_s, cols, cols_s] =
            swiglu::quantize_rowcol(op, on, gate_up, Some(dh), POW2, ScaleLayout::MMajor)?;
        let rows = dgrad.map(|form| quantize::fp8_block_rows_from_codes(op, form, rows, rows_s)).transpose()?;
        let cols = wgrad.map(|form| quantize::fp8_block_cols_from_codes(op, form, cols, cols_s)).transpose()?;
        Ok((rows, cols))
    };
    let w_form = Form::of(both.choice(Pass::Dgrad).backend).1;
    let dgrad_weight = || gate_up_weight(op, &gate, &up, Want::Dgrad, w_form);
    let x_wgrad = saved_cols(op, &x_t, x_scale_t)?;
    let dtypes = (dtype, gate.weight.dtype());
    let mut grads = backward_passes(op, &both, d_gate_up, (need_x, need_w), dtypes, dgrad_weight, x_wgrad)?;
    grads.push(dw_down);
    Ok(grads)
}
