//! CUDA kernels of the swizzle ops (cuda/swizzle.cuh), bit-exact with `cpu.rs`.

use deepwell_core::swizzle::swizzled_len;
use deepwell_gpu::{Header, KernelSpec, Params};

use super::{parse_swizzle, parse_unswizzle};
use crate::check::Backend;
use crate::cuda::{self, ptr, THREADS};
use crate::dtype::Device;
use crate::error::{Op, Result};
use crate::stack::Args;
use crate::tensor::Tensor;

fn swizzle_spec() -> KernelSpec {
    KernelSpec::new(Header::Swizzle, "deepwell::swizzle_scales<0>")
}

fn unswizzle_spec() -> KernelSpec {
    KernelSpec::new(Header::Swizzle, "deepwell::unswizzle_scales<0>")
}

/// Every kernel these ops can launch (for `python -m deepwell.cli.kernels --compile-all`).
pub fn specs() -> Vec<KernelSpec> {
    vec![swizzle_spec(), unswizzle_spec()]
}

/// The swizzled 1-D copy of a contiguous 2-D CUDA scale tensor (also used by the one-pass quantizers).
pub fn swizzle_on_device(op: Op, launch: &cuda::Launch, src: &Tensor, device: Device) -> Result<Tensor> {
    let cuda::Launch { dev, stream } = *launch;
    let (rows, cols) = (src.sizes()[0], src.sizes()[1]);
    let len = swizzled_len(rows as usize, cols as usize);
    let out = Tensor::empty(op, &[len as i64], src.dtype(), device)?;
    let p = Params::new().ptr(ptr(src)).ptr(ptr(&out)).i64(rows).i64(cols);
    // SAFETY: src is a contiguous (rows, cols) byte tensor and out has swizzled_len bytes, both on `dev`.
    unsafe {
        dev.launch(&swizzle_spec(), cuda::grid(dev, len as u64, u64::from(THREADS)), THREADS, 0, stream, p)
            .map_err(cuda::gpu_err(op))?;
    }
    Ok(out)
}

pub fn swizzle(a: &mut Args) -> Result<Vec<Tensor>> {
    let c = parse_swizzle(a, Backend::Cuda)?;
    let op = a.op();
    let launch = cuda::launch_context(op, c.device)?;
    let src = cuda::contiguous(op, c.src)?;
    Ok(vec![swizzle_on_device(op, &launch, &src, c.device)?])
}

pub fn unswizzle(a: &mut Args) -> Result<Vec<Tensor>> {
    let c = parse_unswizzle(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, c.device)?;
    let src = cuda::contiguous(op, c.src)?;
    let out = Tensor::empty(op, &[c.rows as i64, c.cols as i64], c.dtype, c.device)?;
    let p = Params::new().ptr(ptr(&src)).ptr(ptr(&out)).i64(c.rows as i64).i64(c.cols as i64);
    // SAFETY: src has swizzled_len bytes and out rows*cols bytes, both contiguous on `dev`.
    unsafe {
        dev.launch(
            &unswizzle_spec(),
            cuda::grid(dev, (c.rows * c.cols) as u64, u64::from(THREADS)),
            THREADS,
            0,
            stream,
            p,
        )
        .map_err(cuda::gpu_err(op))?;
    }
    Ok(vec![out])
}
