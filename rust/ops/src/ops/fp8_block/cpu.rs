//! CPU reference kernels of the FP8-block ops (maths: deepwell_core::fp8_block).

use deepwell_core::fp8_block;

use super::{Dequantize, Quantize, QuantizeRowCol, QuantizeTransposed, ScaleLayout, Transposed, BLOCK};
use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::host::{self, with_floats, with_floats_mut};
use crate::tensor::Tensor;

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let data = Tensor::empty(op, q.x.sizes(), DType::E4M3, Device::Cpu)?;
    let scale_inv = Tensor::empty(op, &q.g.scale_shape, DType::F32, Device::Cpu)?;
    let g = &q.g;
    // SAFETY: validated non-empty CPU float input; outputs fresh, contiguous, of the written sizes.
    unsafe {
        let (d, s) = (data.as_mut_slice::<u8>(), scale_inv.as_mut_slice::<f32>());
        with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => fp8_block::fp8_block_quantize(xs, g.batch, g.rows, g.cols, g.br, g.bc, q.pow2, d, s));
        if q.scales == ScaleLayout::MMajor {
            store_transposed(op, s, g.batch * g.rows, g.cols / g.bc)?;
        }
    }
    Ok(vec![data, scale_inv])
}

/// By definition: `fp8_block_quantize(x, 1, 128)` and `fp8_block_quantize(x.t().contiguous(), 1, 128)`.
pub(super) fn quantize_rowcol(op: Op, q: QuantizeRowCol) -> Result<Vec<Tensor>> {
    let shapes = q.shapes();
    let (m, k, b) = (q.m as usize, q.k as usize, BLOCK as usize);
    let outs = [
        Tensor::empty(op, &shapes[0], DType::E4M3, Device::Cpu)?,
        Tensor::empty(op, &shapes[1], DType::F32, Device::Cpu)?,
        Tensor::empty(op, &shapes[2], DType::E4M3, Device::Cpu)?,
        Tensor::empty(op, &shapes[3], DType::F32, Device::Cpu)?,
    ];
    // SAFETY: validated (m, k) CPU float input; outputs fresh and contiguous of the written sizes.
    unsafe {
        let [rd, rs, cd, cs] = &outs;
        let (rd, rs, cd, cs) = (rd.as_mut_slice(), rs.as_mut_slice(), cd.as_mut_slice(), cs.as_mut_slice());
        with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => {
            fp8_block::fp8_block_quantize(xs, 1, m, k, 1, b, q.pow2, rd, rs);
            let xt = host::transpose(op, xs, m, k)?;
            fp8_block::fp8_block_quantize(&xt, 1, k, m, 1, b, q.pow2, cd, cs);
        });
        if q.scales == ScaleLayout::MMajor {
            store_transposed(op, rs, m, k / b)?;
            store_transposed(op, cs, k, m / b)?;
        }
    }
    Ok(outs.into())
}

/// By definition: `fp8_block_quantize(x.t().contiguous(), 1, 128)` (Cols) or `(128, 128)` (TileT).
pub(super) fn quantize_transposed(op: Op, t: QuantizeTransposed) -> Result<Vec<Tensor>> {
    let shapes = t.shapes();
    let (q, b) = (&t.q, BLOCK as usize);
    let (m, k) = (q.m as usize, q.k as usize);
    let br = if t.out == Transposed::TileT { b } else { 1 };
    let outs = [
        Tensor::empty(op, &shapes[0], DType::E4M3, Device::Cpu)?,
        Tensor::empty(op, &shapes[1], DType::F32, Device::Cpu)?,
    ];
    // SAFETY: validated (m, k) CPU float input; outputs fresh and contiguous of the written sizes.
    unsafe {
        let [d, s] = &outs;
        let (d, s) = (d.as_mut_slice(), s.as_mut_slice());
        with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => {
            let xt = host::transpose(op, xs, m, k)?;
            fp8_block::fp8_block_quantize(&xt, 1, k, m, br, b, q.pow2, d, s);
        });
        if t.out == Transposed::Cols {
            store_transposed(op, s, k, m / b)?; // M-major, as rowcol's ScaleLayout::MMajor
        }
    }
    Ok(outs.into())
}

/// `s`, a row-major (rows, cols) matrix, rewritten in place as its (cols, rows) transpose.
fn store_transposed(op: Op, s: &mut [f32], rows: usize, cols: usize) -> Result<()> {
    let t = host::transpose(op, s, rows, cols)?;
    s.copy_from_slice(&t);
    Ok(())
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let out = Tensor::empty(op, q.data.sizes(), q.out_dtype, Device::Cpu)?;
    let g = &q.g;
    // SAFETY: validated CPU inputs; `out` fresh and contiguous with data's numel.
    unsafe {
        let (d, s) = (host::row_major::<u8>(op, &q.data)?, host::row_major::<f32>(op, &q.scale_inv)?);
        with_floats_mut!(host::float_slice_mut(&out, q.out_dtype), o => fp8_block::fp8_block_dequantize(&d, &s, g.batch, g.rows, g.cols, g.br, g.bc, o));
    }
    Ok(vec![out])
}
