//! Glue between torch tensors and the CUDA runtime (`deepwell-gpu`): torch's current stream, the
//! per-device runtime, contiguous inputs, and the template tags naming element types in kernels.

use std::ffi::c_void;

use deepwell_gpu::{arch::grid_blocks, Device, GpuError};

use crate::abi::cuda_api;
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// Threads per block of every deepwell kernel (cuda/common.cuh `THREADS`).
pub const THREADS: u32 = 256;

pub fn gpu_err(op: Op) -> impl Fn(GpuError) -> Error {
    move |source| Error::Gpu { op, source }
}

/// The runtime of CUDA device `index`.
pub fn device(op: Op, index: i32) -> Result<&'static Device> {
    deepwell_gpu::device(index).map_err(gpu_err(op))
}

/// torch's current CUDA stream of device `index` (borrowed; every kernel launches on it).
pub fn current_stream(op: Op, index: i32) -> Result<*mut c_void> {
    let cuda = cuda_api().ok_or(Error::Unsupported { op, what: "this torch build has no CUDA".into() })?;
    let mut stream: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out pointer; the stream is borrowed from torch.
    let code = unsafe { (cuda.aoti_torch_get_current_cuda_stream)(index, &mut stream) };
    if code != 0 {
        return Err(Error::Torch { op, call: "aoti_torch_get_current_cuda_stream" });
    }
    Ok(stream)
}

/// What a kernel launch needs: the device's runtime and torch's current stream on it.
#[derive(Clone, Copy)]
pub struct Launch {
    pub dev: &'static Device,
    pub stream: *mut c_void,
}

/// The launch context of a (validated) CUDA device.
pub fn launch_context(op: Op, device: crate::dtype::Device) -> Result<Launch> {
    let index = match device {
        crate::dtype::Device::Cuda(i) => i,
        other => return Err(Error::arg(op, "device", "be a CUDA device", other)),
    };
    Ok(Launch { dev: self::device(op, index)?, stream: current_stream(op, index)? })
}

/// Blocks for a grid-stride launch over `work` items, `per_block` items per block: at most one
/// wave of resident blocks (the grid-stride loops cover the rest).
pub fn grid(dev: &Device, work: u64, per_block: u64) -> u32 {
    grid_blocks(work, per_block, dev.sms(), dev.resident_blocks_per_sm(THREADS))
}

/// `t` itself when contiguous, else `aten::contiguous(t)` (a copy made by torch, on t's stream).
pub fn contiguous(op: Op, t: Tensor) -> Result<Tensor> {
    crate::aten::contiguous(op, t)
}

/// The template tag of a float element type (cuda/common.cuh).
pub fn float_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "deepwell::F32",
        DType::F16 => "deepwell::F16",
        _ => "deepwell::BF16",
    }
}

/// The device pointer of a tensor, as a kernel argument.
pub fn ptr(t: &Tensor) -> *const c_void {
    t.data_ptr() as *const c_void
}
