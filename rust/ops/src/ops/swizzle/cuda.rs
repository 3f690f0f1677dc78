//! CUDA kernels of the swizzle ops (cuda/swizzle.cuh), bit-exact with `cpu.rs`.

use deepwell_core::swizzle::swizzled_len;
use deepwell_gpu::kernels::{Matrix, Swizzle};
use deepwell_gpu::Params;

use super::Call;
use crate::cuda::{self, ptr};
use crate::dtype::Device;
use crate::error::{Op, Result};
use crate::tensor::Tensor;

/// The swizzled 1-D copy of a contiguous 2-D CUDA scale tensor (also used by the one-pass quantizers).
pub fn swizzle_on_device(op: Op, launch: &cuda::Launch, src: &Tensor, device: Device) -> Result<Tensor> {
    let (rows, cols) = (src.sizes()[0], src.sizes()[1]);
    let len = swizzled_len(rows as usize, cols as usize);
    let out = Tensor::empty(op, &[len as i64], src.dtype(), device)?;
    let p = Params::new().ptr(ptr(src)).ptr(ptr(&out)).i64(rows).i64(cols);
    let sizes = Matrix { rows: rows as u64, cols: cols as u64 };
    // SAFETY: src is a contiguous (rows, cols) byte tensor and out has swizzled_len bytes, both on
    // the launch's device.
    unsafe { launch.run(op, Swizzle::Swizzle, sizes, p)? };
    Ok(out)
}

pub(super) fn swizzle(op: Op, c: Call) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, c.device)?;
    let src = cuda::contiguous(op, c.src)?;
    Ok(vec![swizzle_on_device(op, &launch, &src, c.device)?])
}

pub(super) fn unswizzle(op: Op, c: Call) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, c.device)?;
    let src = cuda::contiguous(op, c.src)?;
    let out = Tensor::empty(op, &[c.rows as i64, c.cols as i64], c.dtype, c.device)?;
    let p = Params::new().ptr(ptr(&src)).ptr(ptr(&out)).i64(c.rows as i64).i64(c.cols as i64);
    let sizes = Matrix { rows: c.rows as u64, cols: c.cols as u64 };
    // SAFETY: src has swizzled_len bytes and out rows*cols bytes, both contiguous on the launch's device.
    unsafe { launch.run(op, Swizzle::Unswizzle, sizes, p)? };
    Ok(vec![out])
}
