//! CPU reference of the SwiGLU ops (maths: deepwell_core::swiglu). The fused quantizers are, by
//! definition, the FP8-block rowcol reference of the SwiGLU output.

use deepwell_core::swiglu as maths;

use super::{Swiglu, SwigluQuantize};
use crate::check::Backend;
use crate::dtype::Device;
use crate::error::{Error, Op, Result};
use crate::host::{self, FloatSlice, FloatSliceMut};
use crate::ops::fp8_block;
use crate::tensor::Tensor;

pub(super) fn swiglu(op: Op, s: Swiglu) -> Result<Vec<Tensor>> {
    let h = Tensor::empty(op, &[s.rows as i64, s.f as i64], s.dtype, Device::Cpu)?;
    // SAFETY: validated (rows, 2f) CPU float input; h fresh and contiguous, (rows, f) of its dtype.
    unsafe {
        match (host::float_slice(op, &s.gate_up, s.dtype)?, host::float_slice_mut(&h, s.dtype)) {
            (FloatSlice::F32(g), FloatSliceMut::F32(o)) => maths::swiglu(&g, s.rows, s.f, o),
            (FloatSlice::BF16(g), FloatSliceMut::BF16(o)) => maths::swiglu(&g, s.rows, s.f, o),
            (FloatSlice::F16(g), FloatSliceMut::F16(o)) => maths::swiglu(&g, s.rows, s.f, o),
            _ => return Err(mismatch(op)),
        }
    }
    Ok(vec![h])
}

pub(super) fn swiglu_backward(op: Op, s: Swiglu) -> Result<Vec<Tensor>> {
    let grad = s.grad.as_ref().ok_or_else(|| mismatch(op))?;
    let d = Tensor::empty(op, s.gate_up.sizes(), s.dtype, Device::Cpu)?;
    // SAFETY: validated CPU inputs of one float dtype; d fresh and contiguous, gate_up's shape.
    unsafe {
        let (g, dh) = (host::float_slice(op, &s.gate_up, s.dtype)?, host::float_slice(op, grad, s.dtype)?);
        match (g, dh, host::float_slice_mut(&d, s.dtype)) {
            (FloatSlice::F32(g), FloatSlice::F32(dh), FloatSliceMut::F32(o)) => {
                maths::swiglu_backward(&g, &dh, s.rows, s.f, o)
            }
            (FloatSlice::BF16(g), FloatSlice::BF16(dh), FloatSliceMut::BF16(o)) => {
                maths::swiglu_backward(&g, &dh, s.rows, s.f, o)
            }
            (FloatSlice::F16(g), FloatSlice::F16(dh), FloatSliceMut::F16(o)) => {
                maths::swiglu_backward(&g, &dh, s.rows, s.f, o)
            }
            _ => return Err(mismatch(op)),
        }
    }
    Ok(vec![d])
}

/// By definition: `fp8_block_quantize_rowcol(swiglu(gate_up))` or of `swiglu_backward(gate_up, grad)`.
pub(super) fn quantize_rowcol(op: Op, q: SwigluQuantize) -> Result<Vec<Tensor>> {
    let x = match q.s.grad {
        None => swiglu(op, q.s)?,
        Some(_) => swiglu_backward(op, q.s)?,
    };
    let [x] = <[Tensor; 1]>::try_from(x).map_err(|_| mismatch(op))?;
    Ok(fp8_block::quantize_rowcol(op, Backend::Cpu, x, q.pow2, q.scales)?.into())
}

fn mismatch(op: Op) -> Error {
    Error::Internal { op, msg: "validated SwiGLU inputs of different dtypes".into() }
}
