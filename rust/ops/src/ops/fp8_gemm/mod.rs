//! `deepwell.fp8_block_gemm`, `fp8_block_grouped_gemm` and `fp8_block_grouped_wgrad`: GEMMs of
//! fp8_block operands (E4M3 codes with fp32 scales per 128 elements along K, docs/NUMERICS.md "FP8
//! block"), the product of the dequantized operands in fp32. Schemas and fake kernels:
//! torch_ops/deepwell/ops/fp8_gemm.py. Checks here; the CPU reference (`reference.rs`: dequantize,
//! fp32 matmul) and CUDA (`cuda.rs`: deepwell's sm_90a kernel, cuda/fp8_gemm.cuh).
//!
//! | op | A | B | out |
//! |---|---|---|---|
//! | `fp8_block_gemm` | (M, K), scales (M, K/128) | (N, K), scales (N/128, K/128) tiles or (N, K/128) rows | (M, N) `= A B^T + bias` |
//! | `fp8_block_grouped_gemm` | (R, K), scales (R, K/128), rows cut by offsets | (G, N, K), scales (G, N/128, K/128); or side by side (N, G*K), scales (N/128, G*K/128) | (R, N): rows of group g times B[g]^T |
//! | `fp8_block_grouped_wgrad` | (M, R), scales (M, R/128) | (N, R), scales (N, R/128) | (G, M, N): out[g] sums K in [offsets[g], offsets[g+1]) |
//!
//! Scales may have any strides (the kernel reads them M-major; other layouts are copied once).
//! Offsets are (G + 1) int32, non-decreasing, from 0 to R (what `moe_permute_index` returns);
//! the wgrad's are multiples of 128. The CPU checks them and raises; CUDA cannot without a host
//! sync: there a misaligned wgrad group comes out NaN, and row-group offsets that do not run from
//! 0 to R leave the rows outside every group unwritten (the kernel clamps them into A, so nothing
//! outside the tensors is touched).

mod cuda;
mod reference;

use deepwell_gpu::kernels::fp8_gemm::{BScales, Grouping};

pub use crate::gemm::fp8_gemm::BGroups;

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::run_one;
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static GEMM: OpSpec = OpSpec {
    name: "fp8_block_gemm",
    args: &[
        ("a", Kind::Tensor),
        ("a_scale", Kind::Tensor),
        ("b", Kind::Tensor),
        ("b_scale", Kind::Tensor),
        ("bias", Kind::OptTensor),
        ("out_dtype", Kind::OptScalarType),
    ],
    returns: 1,
};

pub static GROUPED: OpSpec = OpSpec {
    name: "fp8_block_grouped_gemm",
    args: &[
        ("a", Kind::Tensor),
        ("a_scale", Kind::Tensor),
        ("b", Kind::Tensor),
        ("b_scale", Kind::Tensor),
        ("offsets", Kind::Tensor),
        ("out_dtype", Kind::OptScalarType),
    ],
    returns: 1,
};

pub static GROUPED_WGRAD: OpSpec = OpSpec { name: "fp8_block_grouped_wgrad", args: GROUPED.args, returns: 1 };

pub fn kernels() -> Vec<Kernel> {
    [cpu_and_cuda!(GEMM, gemm_boxed), cpu_and_cuda!(GROUPED, grouped_boxed), cpu_and_cuda!(GROUPED_WGRAD, wgrad_boxed)]
        .concat()
}

/// A validated call: codes, their scales (as given), the layout of B's scales and the sizes.
pub(crate) struct Call {
    pub a: Tensor,
    pub a_scale: Tensor,
    pub b: Tensor,
    pub b_scale: Tensor,
    pub b_scales: BScales,
    pub grouping: Grouping,
    pub b_groups: BGroups,
    pub bias: Option<Tensor>,
    pub offsets: Option<Tensor>,
    pub device: Device,
    /// A's rows, the output's columns, K (the whole length for the wgrad), groups (1 when dense).
    pub rows: i64,
    pub cols: i64,
    pub k: i64,
    pub groups: i64,
    pub out: DType,
}

// ---------------------------------------------------------------------------------------------
// The typed API

/// `fp8_block_gemm`: (M, N) = dequant(A) dequant(B)^T + bias, in `out` (bf16 when None).
pub fn gemm(
    op: Op,
    on: Backend,
    (a, a_scale): (Tensor, Tensor),
    (b, b_scale): (Tensor, Tensor),
    bias: Option<Tensor>,
    out: Option<DType>,
) -> Result<Tensor> {
    let c = Call::new(op, on, Grouping::Dense, (a, a_scale), (b, b_scale), bias, None, out)?;
    run_one(op, on, c, reference::run, cuda::run)
}

/// `fp8_block_grouped_gemm` (`Grouping::Rows`) or `fp8_block_grouped_wgrad` (`Grouping::K`).
pub fn grouped(
    op: Op,
    on: Backend,
    grouping: Grouping,
    (a, a_scale): (Tensor, Tensor),
    (b, b_scale): (Tensor, Tensor),
    offsets: Tensor,
    out: Option<DType>,
) -> Result<Tensor> {
    let c = Call::new(op, on, grouping, (a, a_scale), (b, b_scale), None, Some(offsets), out)?;
    run_one(op, on, c, reference::run, cuda::run)
}

fn gemm_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, sx, w, sw) = (a.tensor("a")?, a.tensor("a_scale")?, a.tensor("b")?, a.tensor("b_scale")?);
    let (bias, out) = (a.opt_tensor("bias")?, a.opt_scalar_type("out_dtype")?);
    Ok(vec![gemm(a.op(), on, (x, sx), (w, sw), bias, out)?])
}

fn grouped_with(a: &mut Args, on: Backend, grouping: Grouping) -> Result<Vec<Tensor>> {
    let (x, sx, w, sw) = (a.tensor("a")?, a.tensor("a_scale")?, a.tensor("b")?, a.tensor("b_scale")?);
    let (offsets, out) = (a.tensor("offsets")?, a.opt_scalar_type("out_dtype")?);
    Ok(vec![grouped(a.op(), on, grouping, (x, sx), (w, sw), offsets, out)?])
}

fn grouped_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    grouped_with(a, on, Grouping::Rows)
}

fn wgrad_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    grouped_with(a, on, Grouping::K)
}

// ---------------------------------------------------------------------------------------------
// Validation

impl Call {
    #[allow(clippy::too_many_arguments)] // the op's arguments, each checked here
    fn new(
        op: Op,
        on: Backend,
        grouping: Grouping,
        (a, a_scale): (Tensor, Tensor),
        (b, b_scale): (Tensor, Tensor),
        bias: Option<Tensor>,
        offsets: Option<Tensor>,
        out: Option<DType>,
    ) -> Result<Call> {
        let out = check::out_dtype(op, out)?;
        check::dtype_in(op, "a", &a, &[DType::E4M3])?;
        check::dtype_in(op, "b", &b, &[DType::E4M3])?;
        check::dtype_in(op, "a_scale", &a_scale, &[DType::F32])?;
        check::dtype_in(op, "b_scale", &b_scale, &[DType::F32])?;
        let mut tensors = vec![("a", &a), ("a_scale", &a_scale), ("b", &b), ("b_scale", &b_scale)];
        if let Some(t) = &bias {
            check::dtype_in(op, "bias", t, &check::FLOAT_INPUTS)?;
            tensors.push(("bias", t));
        }
        if let Some(t) = &offsets {
            check::dtype_in(op, "offsets", t, &[DType::I32])?;
            tensors.push(("offsets", t));
        }
        let device = check::same_device(op, on, &tensors)?;
        if a.dim() != 2 {
            return Err(Error::arg(op, "a", "be 2-d (rows, K)", format!("a {}-d tensor", a.dim())));
        }
        check::non_empty(op, "a", &a, 2)?;
        check::divisible(op, "a", &a, 1, 128, "fp8_block scales every 128 elements along K")?;
        let (rows, k) = (a.sizes()[0], a.sizes()[1]);
        let kb = k / 128;
        check::shape_eq(op, "a_scale", &a_scale, &[rows, kb])?;
        // Row groups take stacked weights (G, N, K) or, 2-d, the groups side by side (N, G * K).
        let offset_groups = offsets.as_ref().map_or(1, |t| t.numel() as i64 - 1);
        let b_groups = if grouping == Grouping::Rows && b.dim() == 2 { BGroups::SideBySide } else { BGroups::Stacked };
        let want_b_dim = if grouping == Grouping::Rows && b_groups == BGroups::Stacked { 3 } else { 2 };
        if b.dim() != want_b_dim {
            let what = match grouping {
                Grouping::Rows => "be 3-d (groups, N, K) or 2-d (N, groups * K)",
                _ => "be 2-d (N, K)",
            };
            return Err(Error::arg(op, "b", what, format!("a {}-d tensor", b.dim())));
        }
        check::non_empty(op, "b", &b, want_b_dim)?;
        let cols = b.sizes()[want_b_dim - 2];
        let b_k = if b_groups == BGroups::SideBySide { k * offset_groups.max(1) } else { k };
        if b.sizes()[want_b_dim - 1] != b_k {
            return Err(Error::Mismatch {
                op,
                msg: format!(
                    "a has K = {k} (shape {}) but b has {} (shape {}){}",
                    check::shape_str(a.sizes()),
                    b.sizes()[want_b_dim - 1],
                    check::shape_str(b.sizes()),
                    if b_groups == BGroups::SideBySide {
                        format!(", expected {offset_groups} groups x K")
                    } else {
                        String::new()
                    }
                ),
            });
        }
        let (b_scales, groups) = match grouping {
            Grouping::Dense => {
                let tiles = [cols / 128, kb];
                if cols % 128 == 0 && b_scale.sizes() == tiles {
                    (BScales::Tile128, 1)
                } else {
                    check::shape_eq(op, "b_scale", &b_scale, &[cols, kb]).map_err(|_| {
                        Error::arg(
                            op,
                            "b_scale",
                            format!("have shape [{}, {kb}] (128x128 tiles) or [{cols}, {kb}] (1x128 rows)", cols / 128),
                            format!("shape {}", check::shape_str(b_scale.sizes())),
                        )
                    })?;
                    (BScales::Row1x128, 1)
                }
            }
            Grouping::Rows => {
                let dim = if b_groups == BGroups::Stacked { 1 } else { 0 };
                check::divisible(op, "b", &b, dim, 128, "B's scales are 128x128 tiles")?;
                match b_groups {
                    BGroups::Stacked => check::shape_eq(op, "b_scale", &b_scale, &[b.sizes()[0], cols / 128, kb])?,
                    BGroups::SideBySide => check::shape_eq(op, "b_scale", &b_scale, &[cols / 128, offset_groups * kb])?,
                }
                (BScales::Tile128, if b_groups == BGroups::Stacked { b.sizes()[0] } else { offset_groups })
            }
            Grouping::K => {
                check::shape_eq(op, "b_scale", &b_scale, &[cols, kb])?;
                (BScales::Row1x128, offset_groups)
            }
        };
        if let Some(t) = &bias {
            check::shape_eq(op, "bias", t, &[cols])?;
        }
        if let Some(t) = &offsets {
            if t.dim() != 1 || t.numel() < 2 {
                return Err(Error::arg(
                    op,
                    "offsets",
                    "be 1-d with groups + 1 >= 2 entries",
                    format!("shape {}", check::shape_str(t.sizes())),
                ));
            }
            if grouping == Grouping::Rows && t.numel() as i64 != groups + 1 {
                return Err(Error::Mismatch {
                    op,
                    msg: format!("b has {groups} groups but offsets has {} entries (expected groups + 1)", t.numel()),
                });
            }
        }
        Ok(Call {
            a,
            a_scale,
            b,
            b_scale,
            b_scales,
            grouping,
            b_groups,
            bias,
            offsets,
            device,
            rows,
            cols,
            k,
            groups,
            out,
        })
    }
}
