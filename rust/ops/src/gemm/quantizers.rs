//! The quantizers the linear layers use: the op families' typed functions (`mxfp8::quantize`, ...)
//! with the options training uses, run on the tensor's own device, errors under the linear op's
//! name. No strings, no second parse: the same validation and kernels as `torch.ops.deepwell.*`.

use crate::check::Backend;
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::ops::mxfp8::MxOptions;
use crate::ops::{fp8_block, fp8_tensor, mxfp8, nvfp4, swizzle};
use crate::tensor::Tensor;

pub use crate::ops::fp8_block::{ScaleLayout, Transposed};
pub use crate::ops::nvfp4::Nvfp4Options;
pub use crate::ops::Copies;
pub use deepwell_core::Fp8Elem;

fn on(op: Op, t: &Tensor) -> Result<Backend> {
    Backend::of(op, t.device())
}

/// MXFP8 along `dim` (rceil scales, E4M3): (data, scale).
pub fn mxfp8_quantize(op: Op, x: Tensor, dim: i64) -> Result<(Tensor, Tensor)> {
    let [data, scale] = mxfp8::quantize(op, on(op, &x)?, x, dim, MxOptions::TRAINING)?;
    Ok((data, scale))
}

/// MXFP8 of x (m, k) along k and along m in one pass: [row data, row scale, col data (m, k),
/// col scale (m/32, k)].
pub fn mxfp8_quantize_rowcol(op: Op, x: Tensor) -> Result<[Tensor; 4]> {
    mxfp8::quantize_rowcol(op, on(op, &x)?, x, MxOptions::TRAINING, false, false)
}

pub fn mxfp8_dequantize(op: Op, data: Tensor, scale: Tensor, dim: i64, out: DType) -> Result<Tensor> {
    mxfp8::dequantize(op, on(op, &data)?, data, scale, dim, Some(out))
}

/// FP8 with fp32 power-of-two block scales: (data, scale_inv), the scales stored as `scales` says.
pub fn fp8_block_quantize(op: Op, x: Tensor, block: (i64, i64), scales: ScaleLayout) -> Result<(Tensor, Tensor)> {
    let [data, scale] = fp8_block::quantize(op, on(op, &x)?, x, block, true, scales)?;
    Ok((data, scale))
}

/// x (m, k) in 1x128 blocks along k and, transposed, along m: [data (m, k), scale (m, k/128),
/// data (k, m), scale (k, m/128)], the scales stored as `scales` says.
pub fn fp8_block_quantize_rowcol(op: Op, x: Tensor, scales: ScaleLayout) -> Result<[Tensor; 4]> {
    fp8_block::quantize_rowcol(op, on(op, &x)?, x, true, scales)
}

/// x (m, k) transposed and quantized in one pass, without a row copy: (data (k, m), scale_inv) in
/// 1x128 blocks along m (`Cols`, scales stored M-major) or 128x128 blocks (`TileT`).
pub fn fp8_block_quantize_transposed(op: Op, x: Tensor, out: Transposed) -> Result<(Tensor, Tensor)> {
    let [data, scale] = fp8_block::quantize_transposed(op, on(op, &x)?, x, out, true)?;
    Ok((data, scale))
}

pub fn fp8_block_dequantize(op: Op, data: Tensor, scale: Tensor, block: (i64, i64), out: DType) -> Result<Tensor> {
    fp8_block::dequantize(op, on(op, &data)?, data, scale, block, Some(out))
}

/// FP8 with one power-of-two scale for the whole tensor: (codes in x's layout, 0-d scale_inv).
pub fn fp8_tensor_quantize(op: Op, x: Tensor, elem: Fp8Elem, amax: Option<Tensor>) -> Result<(Tensor, Tensor)> {
    let [data, scale] = fp8_tensor::quantize(op, on(op, &x)?, x, elem, amax)?;
    Ok((data, scale))
}

/// x (m, k) quantized once: [row codes (m, k), codes transposed (k, m) (each empty where `copies` leaves it out),
/// scale_inv]; `amax`: x's, where its producer computed it (else reduced here).
pub fn fp8_tensor_quantize_rowcol(
    op: Op,
    x: Tensor,
    elem: Fp8Elem,
    copies: Copies,
    amax: Option<Tensor>,
) -> Result<[Tensor; 3]> {
    fp8_tensor::quantize_rowcol(op, on(op, &x)?, x, elem, copies, amax)
}

pub fn fp8_tensor_dequantize(op: Op, data: Tensor, scale: Tensor, out: DType) -> Result<Tensor> {
    fp8_tensor::dequantize(op, on(op, &data)?, data, scale, Some(out))
}

/// NVFP4 along the last dim, global amax reduced on the device: (data, scale, global S_dec).
pub fn nvfp4_quantize(op: Op, x: Tensor, o: Nvfp4Options) -> Result<[Tensor; 3]> {
    nvfp4::quantize(op, on(op, &x)?, x, None, o)
}

pub fn nvfp4_dequantize(op: Op, data: Tensor, scale: Tensor, global: Tensor, out: DType) -> Result<Tensor> {
    nvfp4::dequantize(op, on(op, &data)?, data, scale, global, Some(out))
}

/// Blackwell's 128x4 tiled layout of a 2-D scale tensor (1-D result).
pub fn swizzle_scales(op: Op, scale: Tensor) -> Result<Tensor> {
    swizzle::swizzle(op, on(op, &scale)?, scale)
}

/// Inverse of `swizzle_scales`: the (rows, cols) scales back from the 1-D tiled layout.
pub fn unswizzle_scales(op: Op, swizzled: Tensor, rows: i64, cols: i64) -> Result<Tensor> {
    swizzle::unswizzle(op, on(op, &swizzled)?, swizzled, rows, cols)
}
