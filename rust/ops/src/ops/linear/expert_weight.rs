//! The MoE experts' weight operands for the grouped GEMMs, through the weight cache as a dense
//! layer's are (`weight_cache.rs`): outside a reuse scope the operand is made for the call, exactly
//! as before the cache; inside `deepwell.microbatches()` the first pass that needs one makes both,
//! and later micro-batches reuse them until the next optimizer step, under the cache's rules (same
//! storage, same version counter, no step since).
//!
//! weight (E, N, K), the experts' stacked nn.Linear weights, N and K multiples of 128:
//!
//! `deepwell.fp8_block_expert_weight(weight, want)`, for deepwell's FP8 grouped GEMMs
//! (torch_ops/deepwell/ops/grouped_linear.py `_GroupedFp8Block`):
//! - `want = "fprop"`: each expert's 128x128 tiles, data (E, N, K) E4M3 and scales (E, N/128,
//!   K/128): `fp8_block_quantize(weight, 128, 128)`.
//! - `want = "dgrad"`: every expert's W^T side by side along K, data (K, E·N) and scales (K/128,
//!   E·N/128): `fp8_block_quantize_transposed(weight.reshape(E·N, K))`. A tile's codes and scale
//!   do not depend on its orientation (docs/NUMERICS.md "Transposes and layouts").
//!
//! `deepwell.mxfp8_expert_weight(weight, want)`, for torch's MXFP8 grouped GEMM
//! (torch_ops/deepwell/ops/mxfp8_grouped.py `GroupedMxfp8`):
//! - `want = "fprop"`: data (E, N, K) = `mxfp8_quantize(weight, -1)` (rceil, E4M3), and its E8M0
//!   scales in the 128x4 tiled layout of each expert on its own, (E, N·K/32): `swizzle_scales` of
//!   the (E·N, K/32) scales (N a multiple of 128: no tile spans two experts).
//! - `want = "dgrad"`: the same of each expert's W^T, data (E, K, N) = `mxfp8_quantize(weight
//!   .transpose(1, 2), -1)` (codes of the transposed view, written contiguous), scales (E, K·N/32).
//!
//! Both ops give the torch ops' results bit for bit.

use deepwell_core::policy::{Recipe, ScalingType};

use super::weight_cache::{self, Want, WeightOperands};
use crate::aten;
use crate::check;
use crate::error::{Error, Op, Result};
use crate::gemm::quantizers::{self as k, ScaleLayout, Transposed};
use crate::gemm::{Form, Operand};
use crate::kernel::{one_body, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static EXPERT_WEIGHT: OpSpec =
    OpSpec { name: "fp8_block_expert_weight", args: &[("weight", Kind::Tensor), ("want", Kind::Str)], returns: 2 };

pub static MXFP8_EXPERT_WEIGHT: OpSpec =
    OpSpec { name: "mxfp8_expert_weight", args: &[("weight", Kind::Tensor), ("want", Kind::Str)], returns: 2 };

pub fn kernels() -> Vec<Kernel> {
    [one_body!(EXPERT_WEIGHT, expert_weight), one_body!(MXFP8_EXPERT_WEIGHT, mxfp8_expert_weight)].concat()
}

const TILE: ScalingType = ScalingType::BlockWise128x128;

/// The weight and the pass it is for, checked: (E, N, K) floats, N and K multiples of 128 (`why`:
/// what needs them).
fn weight_and_want(a: &mut Args, why: [&str; 2]) -> Result<(Tensor, Want)> {
    let op = a.op();
    let (weight, want) = (a.tensor("weight")?, a.str("want")?);
    let want = match want.as_str() {
        "fprop" => Want::Fprop,
        "dgrad" => Want::Dgrad,
        _ => return Err(Error::arg(op, "want", "be \"fprop\" or \"dgrad\"", check::quoted(&want))),
    };
    check::ndim(op, "weight", &weight, 3, "(experts, out_features, in_features)")?;
    check::dtype_in(op, "weight", &weight, &check::FLOAT_INPUTS)?;
    check::non_empty(op, "weight", &weight, 3)?;
    check::divisible(op, "weight", &weight, 1, 128, why[0])?;
    check::divisible(op, "weight", &weight, 2, 128, why[1])?;
    Ok((weight, want))
}

/// `want`'s operand of `weight` through the weight cache: `make(want)` outside a reuse scope, both
/// passes' operands on a miss inside one (both GEMM operands of the recipe's grouped GEMMs take
/// `form`, the cache's key with the recipe).
fn through_cache(
    op: Op,
    weight: &Tensor,
    want: Want,
    recipe: Recipe,
    form: Form,
    make: impl Fn(Want) -> Result<Operand>,
) -> Result<Operand> {
    let pair = || Ok(WeightOperands { fprop: make(Want::Fprop)?, dgrad: make(Want::Dgrad)? });
    weight_cache::operand(op, weight, recipe, (form, form), want, || make(want), pair)
}

fn expert_weight(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (weight, want) = weight_and_want(
        a,
        [
            "fp8_block quantizes W^T along out_features in 128x128 tiles",
            "fp8_block quantizes W along in_features in 128x128 tiles",
        ],
    )?;
    let make = |want: Want| -> Result<Operand> {
        let w = aten::contiguous(op, weight.share(op)?)?;
        let (data, scale) = match want {
            Want::Fprop => k::fp8_block_quantize(op, w, (128, 128), ScaleLayout::RowMajor)?,
            Want::Dgrad => {
                let s = w.sizes().to_vec();
                k::fp8_block_quantize_transposed(
                    op,
                    w.reshape_contiguous(op, &[s[0] * s[1], s[2]])?,
                    Transposed::TileT,
                )?
            }
        };
        Ok(Operand::Blockwise { data, scale, scaling: TILE })
    };
    match through_cache(op, &weight, want, Recipe::Fp8Block, Form::Blockwise(TILE), make)? {
        Operand::Blockwise { data, scale, .. } => Ok(vec![data, scale]),
        _ => Err(Error::Internal { op, msg: "an expert weight operand that is not blockwise".into() }),
    }
}

const MX: ScalingType = ScalingType::BlockWise1x32;

fn mxfp8_expert_weight(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let (weight, want) = weight_and_want(
        a,
        [
            "an expert's MXFP8 scales tile 128 rows (W) and W^T quantizes along out_features in 128x4 tiles",
            "W's MXFP8 scales tile 4 blocks of 32 along in_features, 128 rows of W^T",
        ],
    )?;
    let make = |want: Want| -> Result<Operand> {
        let (s, st) = (weight.sizes().to_vec(), weight.strides().to_vec());
        // W (E, N, K) along K, or each expert's W^T (E, K, N) along N, read through a view.
        let (w, rows, cols) = match want {
            Want::Fprop => (weight.share(op)?, s[1], s[2]),
            Want::Dgrad => (weight.view(op, &[s[0], s[2], s[1]], &[st[0], st[2], st[1]])?, s[2], s[1]),
        };
        let (data, scale) = k::mxfp8_quantize(op, w, -1)?;
        let tiled = k::swizzle_scales(op, scale.reshape_contiguous(op, &[s[0] * rows, cols / 32])?)?;
        Ok(Operand::Mx {
            data,
            scale: tiled.reshape_contiguous(op, &[s[0], rows * cols / 32])?,
            global: None,
            scaling: MX,
        })
    };
    match through_cache(op, &weight, want, Recipe::Mxfp8, Form::Mx(MX), make)? {
        Operand::Mx { data, scale, .. } => Ok(vec![data, scale]),
        _ => Err(Error::Internal { op, msg: "an MXFP8 expert weight operand that is not MX".into() }),
    }
}
