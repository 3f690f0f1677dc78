//! CPU reference kernels of the fp8_tensor ops (maths: deepwell_core::fp8_tensor).

use deepwell_core::fp8_tensor;

use super::{Copies, Dequantize, Quantize, RowCol};
use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::host::{self, with_floats, with_floats_mut};
use crate::tensor::Tensor;

/// The codes of x in x's layout, into `data`; returns scale_inv.
///
/// # Safety
/// `data` is a fresh contiguous CPU tensor of x's numel, of a 1-byte dtype.
unsafe fn codes(op: Op, q: &Quantize, data: &Tensor) -> Result<f32> {
    // SAFETY: as documented; x is a validated non-empty CPU float tensor.
    unsafe {
        let d = data.as_mut_slice::<u8>();
        let amax = match &q.amax {
            Some(a) => Some(host::row_major::<f32>(op, a)?[0]),
            None => None,
        };
        Ok(with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => match amax {
            Some(a) => fp8_tensor::fp8_tensor_quantize_with_amax(xs, q.elem, a, d),
            None => fp8_tensor::fp8_tensor_quantize(xs, q.elem, d),
        }))
    }
}

fn scalar(op: Op, v: f32) -> Result<Tensor> {
    let t = Tensor::empty(op, &[], DType::F32, Device::Cpu)?;
    // SAFETY: a fresh one-element fp32 CPU tensor.
    unsafe { t.as_mut_slice::<f32>()[0] = v };
    Ok(t)
}

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let data = Tensor::empty(op, q.x.sizes(), DType::of_fp8(q.elem), Device::Cpu)?;
    // SAFETY: `data` is fresh, contiguous, x's numel of 1-byte codes.
    let s_inv = unsafe { codes(op, &q, &data)? };
    Ok(vec![data, scalar(op, s_inv)?])
}

/// By definition: the row codes, and the same codes transposed.
pub(super) fn quantize_rowcol(op: Op, rc: RowCol) -> Result<Vec<Tensor>> {
    let q = &rc.q;
    let (m, k) = q.matrix();
    let rows = Tensor::empty(op, &[m, k], DType::of_fp8(q.elem), Device::Cpu)?;
    let cols = Tensor::empty(op, &[k, m], DType::of_fp8(q.elem), Device::Cpu)?;
    // SAFETY: fresh contiguous 1-byte outputs of m * k elements.
    let s_inv = unsafe {
        let s_inv = codes(op, q, &rows)?;
        let t = host::transpose(op, rows.as_slice::<u8>(), m as usize, k as usize)?;
        cols.as_mut_slice::<u8>().copy_from_slice(&t);
        s_inv
    };
    let rows = match rc.copies {
        Copies::Both | Copies::Rows => rows,
        Copies::Cols => Tensor::empty(op, &[0], DType::of_fp8(q.elem), Device::Cpu)?,
    };
    Ok(vec![rows, cols, scalar(op, s_inv)?])
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let out = Tensor::empty(op, q.data.sizes(), q.out_dtype, Device::Cpu)?;
    // SAFETY: validated CPU inputs (scale_inv holds one fp32); `out` fresh with data's numel.
    unsafe {
        let (d, s) = (host::row_major::<u8>(op, &q.data)?, host::row_major::<f32>(op, &q.scale_inv)?);
        with_floats_mut!(host::float_slice_mut(&out, q.out_dtype), o => fp8_tensor::fp8_tensor_dequantize(&d, q.elem, s[0], o));
    }
    Ok(vec![out])
}
