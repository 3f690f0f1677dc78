//! A GEMM operand in the form its backend reads (deepwell_core::policy::GemmBackend):
//!
//! | form | backend | what the operand holds |
//! |---|---|---|
//! | `Dense` | cuBLAS bf16 / CPU matmul | plain values: bf16 on CUDA, fp32 on the CPU |
//! | `Emulated` | the same GEMMs | the recipe's quantized values, dequantized exactly |
//! | `Blockwise` | `_scaled_mm_v2` on sm_90 (per-tensor: sm_89+), deepwell's FP8 GEMM (sm_90a) | FP8 data + fp32 scales in cuBLASLt's layout |
//! | `Mx` | `_scaled_mm_v2` on Blackwell | MX/NV data + swizzled scales (+ NVFP4 global scale) |
//!
//! Every operand is `(rows, K)`: the GEMM computes `A @ B^T` over the shared last dim K.

use deepwell_core::policy::{GemmBackend, ScalingType};

use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::tensor::Tensor;

/// The operand form a backend reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Form {
    Dense,
    Emulated,
    Blockwise(ScalingType),
    Mx(ScalingType),
}

impl Form {
    /// The forms of operands A and B of `backend`.
    pub fn of(backend: GemmBackend) -> (Form, Form) {
        match backend {
            GemmBackend::CublasBf16 | GemmBackend::CpuMatmul => (Form::Dense, Form::Dense),
            GemmBackend::Emulated { .. } => (Form::Emulated, Form::Emulated),
            GemmBackend::ScaledMmBlockwise { a, b } => (Form::Blockwise(a), Form::Blockwise(b)),
            // deepwell's kernel reads the same operands as cuBLASLt's blockwise mode.
            GemmBackend::Fp8BlockGemm { b } => (Form::Blockwise(ScalingType::BlockWise1x128), Form::Blockwise(b)),
            GemmBackend::ScaledMmTensorwise => {
                (Form::Blockwise(ScalingType::TensorWise), Form::Blockwise(ScalingType::TensorWise))
            }
            GemmBackend::ScaledMmMx { block } => (Form::Mx(block), Form::Mx(block)),
        }
    }
}

/// The element type of dense GEMM operands on `device`: bf16 on CUDA (cuBLAS, fp32 accumulation),
/// fp32 on the CPU (every dequantized value is exact in fp32; bf16 values widen exactly).
pub fn dense_dtype(device: Device) -> DType {
    if device == Device::Cpu {
        DType::F32
    } else {
        DType::BF16
    }
}

pub enum Operand {
    /// Values the GEMM reads as they are (possibly a transposed view).
    Dense(Tensor),
    /// Dequantized NVFP4 values without their per-tensor decode scale `global` (a 0-d fp32 tensor),
    /// which the GEMM applies after accumulation, as cuBLASLt applies NVFP4's alpha.
    DenseScaled { values: Tensor, global: Tensor },
    /// FP8 data (rows, K) and fp32 scales laid out as `_scaled_mm_v2` wants them on sm_90 (docs/BASELINES.md):
    /// 1x128: shape (rows, K/128), strides (1, rows); 128x128: shape (K/128, rows/128), strides
    /// (1, K/128); `TensorWise` (fp8_tensor): a 0-d scale, E4M3 or (gradients) E5M2 data.
    Blockwise { data: Tensor, scale: Tensor, scaling: ScalingType },
    /// MXFP8 (E4M3) or NVFP4 (float4_e2m1fn_x2) data (rows, K) with its scales swizzled into
    /// 128x4 tiles, and NVFP4's global decode scale.
    Mx { data: Tensor, scale: Tensor, global: Option<Tensor>, scaling: ScalingType },
}

impl Operand {
    /// The transpose of a dense operand, as a view (dense GEMMs read either layout).
    pub fn transposed_view(&self, op: Op) -> Result<Option<Operand>> {
        Ok(match self {
            Operand::Dense(t) => Some(Operand::Dense(t.t(op)?)),
            Operand::DenseScaled { values, global } => {
                Some(Operand::DenseScaled { values: values.t(op)?, global: global.share(op)? })
            }
            _ => None,
        })
    }

    /// A second operand holding new handles to the same tensors (the cache hands these out).
    pub fn share(&self, op: Op) -> Result<Operand> {
        Ok(match self {
            Operand::Dense(t) => Operand::Dense(t.share(op)?),
            Operand::DenseScaled { values, global } => {
                Operand::DenseScaled { values: values.share(op)?, global: global.share(op)? }
            }
            Operand::Blockwise { data, scale, scaling } => {
                Operand::Blockwise { data: data.share(op)?, scale: scale.share(op)?, scaling: *scaling }
            }
            Operand::Mx { data, scale, global, scaling } => Operand::Mx {
                data: data.share(op)?,
                scale: scale.share(op)?,
                global: global.as_ref().map(|g| g.share(op)).transpose()?,
                scaling: *scaling,
            },
        })
    }
}
