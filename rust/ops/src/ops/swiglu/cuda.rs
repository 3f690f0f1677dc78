//! CUDA launches of the SwiGLU ops (cuda/swiglu.cuh, whose fused quantizers run the transposing pass of
//! cuda/fp8_block_transpose.cuh), bit-identical to `cpu.rs`. Inputs are made contiguous.

use deepwell_gpu::kernels::swiglu::Sizes;
use deepwell_gpu::kernels::{Matrix, Swiglu as Kernel};
use deepwell_gpu::Params;

use super::{Swiglu, SwigluQuantize};
use crate::cuda::{self, float, ptr};
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::ops::fp8_block::{rowcol_shapes, ScaleLayout};
use crate::tensor::Tensor;

const NULL: *const std::ffi::c_void = std::ptr::null();

/// gate_up and grad, contiguous.
fn inputs(op: Op, s: &Swiglu) -> Result<(Tensor, Option<Tensor>)> {
    let gate_up = cuda::contiguous(op, s.gate_up.share(op)?)?;
    let grad = s.grad.as_ref().map(|g| cuda::contiguous(op, g.share(op)?)).transpose()?;
    Ok((gate_up, grad))
}

pub(super) fn swiglu(op: Op, s: Swiglu) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, s.device)?;
    let (gate_up, _) = inputs(op, &s)?;
    let h = Tensor::empty(op, &[s.rows as i64, s.f as i64], s.dtype, s.device)?;
    if s.rows * s.f == 0 {
        return Ok(vec![h]);
    }
    let sizes = Sizes { h: Matrix { rows: s.rows as u64, cols: s.f as u64 }, aligned: cuda::aligned(&[&gate_up, &h]) };
    let p = Params::new().ptr(ptr(&gate_up)).ptr(ptr(&h)).i64(s.rows as i64).i64(s.f as i64);
    // SAFETY: contiguous tensors of the template's dtype on the launch's device: gate_up (rows, 2f),
    // h (rows, f).
    unsafe { launch.run(op, Kernel::Forward { input: float(s.dtype) }, sizes, p)? };
    Ok(vec![h])
}

pub(super) fn swiglu_backward(op: Op, s: Swiglu) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, s.device)?;
    let (gate_up, grad) = inputs(op, &s)?;
    let d = Tensor::empty(op, gate_up.sizes(), s.dtype, s.device)?;
    if s.rows * s.f == 0 {
        return Ok(vec![d]);
    }
    let grad_ptr = grad.as_ref().map_or(NULL, ptr);
    let aligned = cuda::aligned(&[&gate_up, &d]) && grad.as_ref().is_some_and(|g| cuda::aligned(&[g]));
    let sizes = Sizes { h: Matrix { rows: s.rows as u64, cols: s.f as u64 }, aligned };
    let p = Params::new().ptr(ptr(&gate_up)).ptr(grad_ptr).ptr(ptr(&d)).i64(s.rows as i64).i64(s.f as i64);
    // SAFETY: contiguous tensors of the template's dtype on the launch's device: gate_up and d
    // (rows, 2f), grad (rows, f) (validated present for this op).
    unsafe { launch.run(op, Kernel::Backward { input: float(s.dtype) }, sizes, p)? };
    Ok(vec![d])
}

pub(super) fn quantize_rowcol(op: Op, q: SwigluQuantize) -> Result<Vec<Tensor>> {
    let s = &q.s;
    let launch = cuda::launch_context(op, s.device)?;
    let (gate_up, grad) = inputs(op, s)?;
    let (m, k) = (s.rows as i64, s.quantized_cols() as i64);
    let shapes = rowcol_shapes(m, k, q.scales);
    let rd = Tensor::empty(op, &shapes[0], DType::E4M3, s.device)?;
    let rs = Tensor::empty(op, &shapes[1], DType::F32, s.device)?;
    let cd = Tensor::empty(op, &shapes[2], DType::E4M3, s.device)?;
    let cs = Tensor::empty(op, &shapes[3], DType::F32, s.device)?;
    let p = Params::new().ptr(ptr(&gate_up)).ptr(grad.as_ref().map_or(NULL, ptr)).i64(m).i64(s.f as i64);
    let p = p.i32(q.pow2 as i32).ptr(ptr(&rd)).ptr(ptr(&rs)).ptr(ptr(&cd)).ptr(ptr(&cs));
    let kernel =
        Kernel::Rowcol { input: float(s.dtype), backward: grad.is_some(), m_major: q.scales == ScaleLayout::MMajor };
    let sizes = Sizes { h: Matrix { rows: m as u64, cols: k as u64 }, aligned: cuda::aligned(&[&gate_up]) };
    // SAFETY: contiguous CUDA tensors on the launch's device: gate_up (m, 2f), grad (m, f) or null
    // for the forward, outputs of rowcol's shapes for the (m, k) matrix; m, f multiples of 128.
    unsafe { launch.run(op, kernel, sizes, p)? };
    Ok(vec![rd, rs, cd, cs])
}
