//! CPU reference kernels of the FP8-block ops (maths: deepwell_core::fp8_block).

use deepwell_core::fp8_block;

use super::{parse_dequantize, parse_quantize, parse_quantize_rowcol, BLOCK};
use crate::check::Backend;
use crate::dtype::{DType, Device};
use crate::error::Result;
use crate::host::{self, with_floats, with_floats_mut};
use crate::stack::Args;
use crate::tensor::Tensor;

pub fn quantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_quantize(a, Backend::Cpu)?;
    let op = a.op();
    let data = Tensor::empty(op, q.x.sizes(), DType::E4M3, Device::Cpu)?;
    let scale_inv = Tensor::empty(op, &q.g.scale_shape, DType::F32, Device::Cpu)?;
    let g = &q.g;
    // SAFETY: validated non-empty CPU float input; outputs fresh, contiguous, of the written sizes.
    unsafe {
        let (d, s) = (data.as_mut_slice::<u8>(), scale_inv.as_mut_slice::<f32>());
        with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => fp8_block::fp8_block_quantize(xs, g.batch, g.rows, g.cols, g.br, g.bc, q.pow2, d, s));
    }
    Ok(vec![data, scale_inv])
}

/// By definition: `fp8_block_quantize(x, 1, 128)` and `fp8_block_quantize(x.t().contiguous(), 1, 128)`.
pub fn quantize_rowcol(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_quantize_rowcol(a, Backend::Cpu)?;
    let op = a.op();
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
            let xt = host::transpose(a.op(), xs, m, k)?;
            fp8_block::fp8_block_quantize(&xt, 1, k, m, 1, b, q.pow2, cd, cs);
        });
    }
    Ok(outs.into())
}

pub fn dequantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_dequantize(a, Backend::Cpu)?;
    let out = Tensor::empty(a.op(), q.data.sizes(), q.out_dtype, Device::Cpu)?;
    let g = &q.g;
    // SAFETY: validated CPU inputs; `out` fresh and contiguous with data's numel.
    unsafe {
        let (d, s) = (host::row_major::<u8>(a.op(), &q.data)?, host::row_major::<f32>(a.op(), &q.scale_inv)?);
        with_floats_mut!(host::float_slice_mut(&out, q.out_dtype), o => fp8_block::fp8_block_dequantize(&d, &s, g.batch, g.rows, g.cols, g.br, g.bc, o));
    }
    Ok(vec![out])
}
