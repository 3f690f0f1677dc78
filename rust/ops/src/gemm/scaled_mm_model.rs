//! A CPU model of `aten::_scaled_mm_v2` for exactly the argument layouts deepwell builds (sm_90
//! blockwise and per-tensor FP8, Blackwell MXFP8 / NVFP4 with swizzled scales), which torch runs only on CUDA. It
//! decodes each operand from those arguments (undoing the M-major and transposed scale views and
//! the 128x4 swizzle, reading float4_e2m1fn_x2 data as packed bytes) and multiplies in fp32.
//!
//! Its purpose: the native paths of GPUs we do not have (Blackwell) are exercised on any machine.
//! With a recipe like `"mxfp8@sm_100"` on CPU tensors the linear ops dispatch as that GPU would,
//! build the native arguments, and run them here; tests compare the result with the emulation and
//! with the float64 model. What this cannot check is cuBLASLt's own reading of the arguments.

use super::epilogue;
use super::quantizers as k;
use crate::aten::{self, Scales};
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// `A @ B^T (+ bias)` from `_scaled_mm_v2`'s arguments (`bt` = B's column-major transpose).
pub fn scaled_mm(
    op: Op,
    a: Tensor,
    bt: Tensor,
    sa: Scales,
    sb: Scales,
    bias: Option<Tensor>,
    out: DType,
) -> Result<Tensor> {
    let av = decode(op, a, sa)?;
    let bv = decode(op, bt.t(op)?, sb)?;
    let y = aten::mm(op, av, bv.t(op)?)?;
    epilogue::apply(op, y, None, bias, out)
}

/// One operand (rows, K) as fp32 values, from its data and scales as `_scaled_mm_v2` receives them.
fn decode(op: Op, data: Tensor, scales: Scales) -> Result<Tensor> {
    let (rows, cols) = (data.sizes()[0], data.sizes()[1]);
    let mut tensors = scales.tensors.into_iter();
    let scale = tensors.next().ok_or(Error::Internal { op, msg: "no scale".into() })?;
    match scales.recipes.first().copied() {
        // TensorWise: one fp32 scale (fp8_tensor; E4M3 or E5M2 data).
        Some(0) => k::fp8_tensor_dequantize(op, data, scale, DType::F32),
        // BlockWise1x128: (rows, K/128), M-major.
        Some(4) => k::fp8_block_dequantize(op, data, aten::contiguous(op, scale)?, (1, 128), DType::F32),
        // BlockWise128x128 (as operand B): a (K/128, rows/128) view of the (rows/128, K/128) tiles.
        Some(5) => k::fp8_block_dequantize(op, data, aten::contiguous(op, scale.t(op)?)?, (128, 128), DType::F32),
        // BlockWise1x32: E8M0, swizzled.
        Some(3) => {
            let natural = k::unswizzle_scales(op, scale, rows, cols / 32)?;
            k::mxfp8_dequantize(op, data, natural, -1, DType::F32)
        }
        // BlockWise1x16 + TensorWise: float4 pairs, swizzled E4M3 scales, the fp32 decode scale.
        Some(2) => {
            let packed = aten::view_dtype(op, data, DType::U8)?;
            let natural = k::unswizzle_scales(op, scale, rows, cols * 2 / 16)?;
            let global = tensors.next().ok_or(Error::Internal { op, msg: "NVFP4 without its global scale".into() })?;
            k::nvfp4_dequantize(op, packed, natural, global, DType::F32)
        }
        other => Err(Error::Internal { op, msg: format!("no CPU model for scaling {other:?}") }),
    }
}
