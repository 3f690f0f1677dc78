//! CPU reference kernels of the MXFP8 ops (maths: deepwell_core::mxfp8).

use deepwell_core::mxfp8;
use deepwell_core::shape::Dims3;
use deepwell_core::swizzle;

use super::{Dequantize, Quantize, QuantizeRowCol};
use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::host::{self, with_floats, with_floats_mut};
use crate::tensor::Tensor;

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let data = Tensor::empty(op, &q.data_shape, DType::of_fp8(q.elem), Device::Cpu)?;
    let scale = Tensor::empty(op, &q.scale_shape, DType::E8M0, Device::Cpu)?;
    // SAFETY: x is a validated non-empty CPU float tensor; data/scale are fresh contiguous 1-byte
    // tensors of the sizes mxfp8_quantize writes.
    unsafe {
        let (d, s) = (data.as_mut_slice::<u8>(), scale.as_mut_slice::<u8>());
        with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => mxfp8::mxfp8_quantize(xs, q.dims, q.mode, q.elem, d, s));
    }
    Ok(vec![data, scale])
}

/// The one-pass op's semantics, by definition: the row-wise quantization along k and the
/// column-wise quantization along m (of x^T when transposed), from the same high-precision x.
pub(super) fn quantize_rowcol(op: Op, q: QuantizeRowCol) -> Result<Vec<Tensor>> {
    let shapes = q.shapes();
    let (m, k) = (q.m, q.k);
    let elem = DType::of_fp8(q.elem);
    let outs = [
        Tensor::empty(op, &shapes[0], elem, Device::Cpu)?,
        Tensor::empty(op, &shapes[1], DType::E8M0, Device::Cpu)?,
        Tensor::empty(op, &shapes[2], elem, Device::Cpu)?,
        Tensor::empty(op, &shapes[3], DType::E8M0, Device::Cpu)?,
    ];
    // SAFETY: validated (m, k) CPU float input; the outputs are fresh contiguous 1-byte tensors
    // of the sizes each quantize call writes.
    unsafe {
        let [rd, rs, cd, cs] = &outs;
        let (rd, rs, cd, cs) = (rd.as_mut_slice(), rs.as_mut_slice(), cd.as_mut_slice(), cs.as_mut_slice());
        with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => {
            mxfp8::mxfp8_quantize(xs, Dims3 { outer: m, k, inner: 1 }, q.mode, q.elem, rd, rs);
            if q.col_transposed {
                let xt = host::transpose(op, xs, m, k)?;
                mxfp8::mxfp8_quantize(&xt, Dims3 { outer: k, k: m, inner: 1 }, q.mode, q.elem, cd, cs);
            } else {
                mxfp8::mxfp8_quantize(xs, Dims3 { outer: 1, k: m, inner: k }, q.mode, q.elem, cd, cs);
            }
        });
    }
    if !q.swizzle {
        return Ok(outs.into());
    }
    let [rd, rs, cd, cs] = outs;
    let (rs, cs) = (swizzled(op, &rs)?, swizzled(op, &cs)?);
    Ok(vec![rd, rs, cd, cs])
}

/// The 1-D swizzled copy of a 2-D CPU scale tensor.
fn swizzled(op: crate::error::Op, scale: &Tensor) -> Result<Tensor> {
    let (rows, cols) = (scale.sizes()[0] as usize, scale.sizes()[1] as usize);
    let out = Tensor::empty(op, &[swizzle::swizzled_len(rows, cols) as i64], DType::E8M0, Device::Cpu)?;
    // SAFETY: both are contiguous CPU byte tensors of the sizes swizzle_scales expects.
    unsafe { swizzle::swizzle_scales(scale.as_slice::<u8>(), rows, cols, out.as_mut_slice::<u8>()) };
    Ok(out)
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let out = Tensor::empty(op, q.data.sizes(), q.out_dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU inputs; `out` is fresh and contiguous with data's numel.
    unsafe {
        let (d, s) = (host::row_major::<u8>(op, &q.data)?, host::row_major::<u8>(op, &q.scale)?);
        with_floats_mut!(host::float_slice_mut(&out, q.out_dtype), o => mxfp8::mxfp8_dequantize(&d, &s, q.dims, q.elem, o));
    }
    Ok(vec![out])
}
