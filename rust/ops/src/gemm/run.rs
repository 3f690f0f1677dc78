//! One GEMM of a linear layer, `out = A @ B^T (+ bias)`, on the backend its operands were prepared
//! for (`operand.rs`; the choice is deepwell_core::policy::gemm_backend).

use deepwell_core::policy::{GemmBackend, ScalingType};

use super::operand::Operand;
use super::{cublaslt, epilogue, scaled_mm_model};
use crate::aten::{self, Scales};
use crate::check::Backend;
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// torch's `SwizzleType`: NO_SWIZZLE = 0, SWIZZLE_32_4_4 = 1.
const NO_SWIZZLE: i64 = 0;
const SWIZZLE_32_4_4: i64 = 1;
/// torch's `ScalingType.TensorWise` (NVFP4's per-tensor scale).
const TENSOR_WISE: i64 = 0;

/// `A @ B^T (+ bias)` rounded to `out` on `backend`; both operands of the form it reads.
pub fn run(op: Op, backend: GemmBackend, a: Operand, b: Operand, bias: Option<Tensor>, out: DType) -> Result<Tensor> {
    let _time = crate::host_time::span("gemm (incl. its aten call)");
    match (a, b) {
        (
            Operand::Blockwise { data: a, scale: sa, scaling: _ },
            Operand::Blockwise { data: b, scale: sb, scaling: tb },
        ) if matches!(backend, GemmBackend::Fp8BlockGemm { .. }) => {
            // deepwell's kernel (ops/fp8_gemm) reads cuBLASLt's operands: A's scales are the
            // (rows, K/128) view it takes, B's 128x128 tile scales are viewed transposed for
            // cuBLASLt, (K/128, N/128), so seen back as (N/128, K/128). On CPU tensors (a modelled
            // sm_90) its reference computes the same dequantized product.
            let sb = if tb == ScalingType::BlockWise128x128 { sb.t(op)? } else { sb };
            let on = Backend::of(op, a.device())?;
            crate::ops::fp8_gemm::gemm(op, on, (a, sa), (b, sb), bias, Some(out))
        }
        (Operand::Dense(a), Operand::Dense(b)) => dense(op, a, b, None, bias, out),
        (Operand::DenseScaled { values: a, global: ga }, Operand::DenseScaled { values: b, global: gb }) => {
            dense(op, a, b, Some((ga, gb)), bias, out)
        }
        (
            Operand::Blockwise { data: a, scale: sa, scaling: ta },
            Operand::Blockwise { data: b, scale: sb, scaling: tb },
        ) => blockwise(op, a, b, (sa, ta), (sb, tb), bias, out),
        (
            Operand::Mx { data: a, scale: sa, global: ga, scaling: ta },
            Operand::Mx { data: b, scale: sb, global: gb, scaling: tb },
        ) => scaled(op, a, b, mx_scales(sa, ga, ta), mx_scales(sb, gb, tb), bias, out),
        _ => Err(Error::Internal { op, msg: "GEMM operands of different forms".into() }),
    }
}

/// A plain GEMM on dense operands: cuBLAS bf16 with fp32 accumulation (bias fused when the output
/// is bf16), or fp32 on the CPU; NVFP4's alpha and any other output dtype go through the epilogue.
fn dense(
    op: Op,
    a: Tensor,
    b: Tensor,
    alpha: Option<(Tensor, Tensor)>,
    bias: Option<Tensor>,
    out: DType,
) -> Result<Tensor> {
    let on_cpu = a.device() == Device::Cpu;
    if !on_cpu && alpha.is_none() && out == DType::BF16 {
        let bias = bias.map(|t| aten::to_dtype(op, t, DType::BF16)).transpose()?;
        return aten::linear(op, a, b, bias);
    }
    let bt = b.t(op)?;
    let y = if on_cpu { aten::mm(op, a, bt)? } else { aten::mm_dtype(op, a, bt, DType::F32)? };
    epilogue::apply(op, y, alpha, bias, out)
}

/// `aten::_scaled_mm_v2`: a row-major, b as the column-major transpose of B. cuBLASLt adds a bf16
/// bias into a bf16 output itself; other outputs come out fp32 and go through the epilogue.
fn scaled(op: Op, a: Tensor, b: Tensor, sa: Scales, sb: Scales, bias: Option<Tensor>, out: DType) -> Result<Tensor> {
    let bt = b.t(op)?;
    if a.device() == Device::Cpu {
        return scaled_mm_model::scaled_mm(op, a, bt, sa, sb, bias, out);
    }
    if out == DType::BF16 {
        let bias = bias.map(|t| aten::to_dtype(op, t, DType::BF16)).transpose()?;
        return aten::scaled_mm_v2(op, a, bt, sa, sb, bias, DType::BF16);
    }
    let y = aten::scaled_mm_v2(op, a, bt, sa, sb, None, DType::F32)?;
    epilogue::apply(op, y, None, bias, out)
}

/// An FP8 GEMM with tensor-wise or block (1x128, 128x128) scales: on CUDA, cuBLASLt called
/// directly (`cublaslt.rs`, the same call without `_scaled_mm_v2`'s per-call setup) wherever it takes
/// the operands; else `_scaled_mm_v2`, or its CPU model.
fn blockwise(
    op: Op,
    a: Tensor,
    b: Tensor,
    sa: (Tensor, ScalingType),
    sb: (Tensor, ScalingType),
    bias: Option<Tensor>,
    out: DType,
) -> Result<Tensor> {
    let mut bias = bias;
    if a.device() != Device::Cpu {
        // As in `scaled`: a bf16 bias is added into a bf16 output by cuBLASLt; other outputs come
        // out fp32 and go through the epilogue.
        let fused = out == DType::BF16;
        if fused {
            bias = bias.map(|t| aten::to_dtype(op, t, DType::BF16)).transpose()?;
        }
        let (lt_bias, lt_out) = if fused { (bias.as_ref(), DType::BF16) } else { (None, DType::F32) };
        if let Some(y) = cublaslt::scaled_mm(op, &a, &b, (&sa.0, sa.1), (&sb.0, sb.1), lt_bias, lt_out)? {
            return if fused { Ok(y) } else { epilogue::apply(op, y, None, bias, out) };
        }
    }
    let sa = Scales { tensors: vec![sa.0], recipes: vec![sa.1.torch_code()], swizzles: vec![NO_SWIZZLE] };
    let sb = Scales { tensors: vec![sb.0], recipes: vec![sb.1.torch_code()], swizzles: vec![NO_SWIZZLE] };
    scaled(op, a, b, sa, sb, bias, out)
}

/// MX block scales, swizzled; NVFP4 adds its per-tensor decode scale as a second, tensor-wise scale.
fn mx_scales(scale: Tensor, global: Option<Tensor>, scaling: ScalingType) -> Scales {
    match global {
        Some(g) => Scales {
            tensors: vec![scale, g],
            recipes: vec![scaling.torch_code(), TENSOR_WISE],
            swizzles: vec![SWIZZLE_32_4_4, NO_SWIZZLE],
        },
        None => Scales { tensors: vec![scale], recipes: vec![scaling.torch_code()], swizzles: vec![SWIZZLE_32_4_4] },
    }
}
