//! `deepwell.fp8_block_expert_weight(weight, want)`: the MoE experts' weight operands for
//! deepwell's FP8 grouped GEMMs (torch_ops/deepwell/ops/grouped_linear.py `_GroupedFp8Block`),
//! through the weight cache as a dense layer's are (`weight_cache.rs`): outside a reuse scope the
//! operand is made for the call, exactly as before the cache; inside `deepwell.microbatches()` the
//! first pass that needs one makes both, and later micro-batches reuse them until the next
//! optimizer step, under the cache's rules (same storage, same version counter, no step since).
//!
//! weight (E, N, K), the experts' stacked nn.Linear weights, N and K multiples of 128:
//! - `want = "fprop"`: each expert's 128x128 tiles, data (E, N, K) E4M3 and scales (E, N/128,
//!   K/128): `fp8_block_quantize(weight, 128, 128)`.
//! - `want = "dgrad"`: every expert's W^T side by side along K, data (K, E·N) and scales (K/128,
//!   E·N/128): `fp8_block_quantize_transposed(weight.reshape(E·N, K))`. A tile's codes and scale
//!   do not depend on its orientation (docs/NUMERICS.md "Transposes and layouts").
//!
//! Both are the torch ops' results bit for bit (power-of-two scales, the recipe's).

use deepwell_core::policy::{Recipe, ScalingType};

use super::weight_cache::{self, Want, WeightOperands};
use crate::aten;
use crate::check;
use crate::error::{Error, Result};
use crate::gemm::quantizers::{self as k, ScaleLayout, Transposed};
use crate::gemm::{Form, Operand};
use crate::kernel::{boxed_kernel, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static EXPERT_WEIGHT: OpSpec =
    OpSpec { name: "fp8_block_expert_weight", args: &[("weight", Kind::Tensor), ("want", Kind::Str)], returns: 2 };

pub fn kernels() -> Vec<Kernel> {
    ["CPU", "CUDA"]
        .into_iter()
        .map(|key| Kernel {
            spec: &EXPERT_WEIGHT,
            dispatch_key: key,
            boxed: boxed_kernel!(EXPERT_WEIGHT, expert_weight),
        })
        .collect()
}

const TILE: ScalingType = ScalingType::BlockWise128x128;

fn expert_weight(a: &mut Args) -> Result<Vec<Tensor>> {
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
    check::divisible(op, "weight", &weight, 1, 128, "fp8_block quantizes W^T along out_features in 128x128 tiles")?;
    check::divisible(op, "weight", &weight, 2, 128, "fp8_block quantizes W along in_features in 128x128 tiles")?;
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
    let forms = (Form::Blockwise(TILE), Form::Blockwise(TILE));
    let pair = || Ok(WeightOperands { fprop: make(Want::Fprop)?, dgrad: make(Want::Dgrad)? });
    match weight_cache::operand(op, &weight, Recipe::Fp8Block, forms, want, || make(want), pair)? {
        Operand::Blockwise { data, scale, .. } => Ok(vec![data, scale]),
        _ => Err(Error::Internal { op, msg: "an expert weight operand that is not blockwise".into() }),
    }
}
