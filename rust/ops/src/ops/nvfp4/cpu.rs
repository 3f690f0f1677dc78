//! CPU reference kernels of the NVFP4 ops (maths: deepwell_core::nvfp4).

use deepwell_core::nvfp4::{self, Nvfp4Options};

use super::{Dequantize, Quantize};
use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::host::{self, with_floats, with_floats_mut};
use crate::tensor::Tensor;

/// The value of a validated one-element float32 CPU tensor.
fn scalar(t: &Tensor) -> f32 {
    // SAFETY: validated one-element float32 CPU tensor; data_ptr addresses that element.
    unsafe { *(t.data_ptr() as *const f32) }
}

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let opts = Nvfp4Options { block_2d: q.block_2d, stochastic_seed: q.seed, hadamard: q.hadamard };
    let amax = q.global_amax.as_ref().map(scalar);
    let data = Tensor::empty(op, &q.data_shape, DType::U8, Device::Cpu)?;
    let scale = Tensor::empty(op, &q.scale_shape, DType::E4M3, Device::Cpu)?;
    let global_scale = Tensor::empty(op, &[], DType::F32, Device::Cpu)?;
    // SAFETY: x is a validated non-empty CPU float tensor; the outputs are fresh contiguous tensors
    // of the sizes nvfp4_quantize writes.
    unsafe {
        let (d, s) = (data.as_mut_slice::<u8>(), scale.as_mut_slice::<u8>());
        let s_dec = with_floats!(host::float_slice(op, &q.x, q.dtype)?, xs => {
            let g = amax.unwrap_or_else(|| nvfp4::nvfp4_global_amax(xs, q.k, q.hadamard));
            nvfp4::nvfp4_quantize(xs, q.rows, q.k, g, &opts, d, s)
        });
        global_scale.as_mut_slice::<f32>()[0] = s_dec;
    }
    Ok(vec![data, scale, global_scale])
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let s_dec = scalar(&q.global_scale);
    let out = Tensor::empty(op, &q.out_shape, q.out_dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU inputs; `out` is fresh and contiguous with rows*k elements.
    unsafe {
        let (d, s) = (host::row_major::<u8>(op, &q.data)?, host::row_major::<u8>(op, &q.scale)?);
        with_floats_mut!(host::float_slice_mut(&out, q.out_dtype), o => nvfp4::nvfp4_dequantize(&d, &s, s_dec, q.rows, q.k, o));
    }
    Ok(vec![out])
}
