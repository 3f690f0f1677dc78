//! Glue between torch tensors and the CUDA runtime (`deepwell-gpu`): torch's current stream, the
//! per-device runtime, contiguous inputs, the template tags naming element types in kernels, and
//! launches sized by each kernel family's geometry (deepwell_gpu::kernels).

use std::ffi::c_void;

use deepwell_gpu::kernels::Float;
use deepwell_gpu::{Device, Family, GpuError, Params};

use crate::abi::cuda_api;
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

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
    let _time = crate::host_time::span("launch context (device, stream)");
    let index = match device {
        crate::dtype::Device::Cuda(i) => i,
        other => return Err(Error::arg(op, "device", "be a CUDA device", other)),
    };
    Ok(Launch { dev: self::device(op, index)?, stream: current_stream(op, index)? })
}

impl Launch {
    /// Launches `kernel` on torch's current stream with the grid its family computes for `sizes`.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list (cuda/INTERFACE.md), every pointer in it must be
    /// device memory on this device of the sizes the kernel accesses for `sizes`.
    pub unsafe fn run<K: Family>(&self, op: Op, kernel: K, sizes: K::Sizes, params: Params) -> Result<()> {
        let _time = crate::host_time::span("launch (deepwell kernel)");
        let g = kernel.geometry(sizes, self.dev.wave());
        // SAFETY: guaranteed by the caller.
        unsafe { self.dev.launch(kernel.into(), g, self.stream, params) }.map_err(gpu_err(op))
    }

    /// `run` for a persistent kernel (one CTA per SM it may hold, looping over its work): its grid
    /// leaves the collectives' SMs free (`deepwell_gpu::leave_sms_to_collectives`), as torch's SM
    /// carveout does for cuBLASLt's GEMMs, so an all-gather launched beside it finds its SMs.
    ///
    /// # Safety
    /// As for `run`.
    pub unsafe fn run_persistent<K: Family>(&self, op: Op, kernel: K, sizes: K::Sizes, params: Params) -> Result<()> {
        let _time = crate::host_time::span("launch (deepwell kernel)");
        let g = kernel.geometry(sizes, self.dev.persistent_wave());
        // SAFETY: guaranteed by the caller.
        unsafe { self.dev.launch(kernel.into(), g, self.stream, params) }.map_err(gpu_err(op))
    }
}

/// The C API's `sm_carveout` entry: `{sms?}` -> the SMs deepwell's persistent GEMMs leave to
/// collectives in this process, after setting them when `sms` is given (distributed/shard.py sets them
/// with torch's carveout).
pub fn sm_carveout_entry(req: &serde_json::Value) -> crate::entry::Answer {
    if let Some(given) = req.get("sms") {
        let sms = given.as_u64().filter(|&n| n <= 1024).ok_or_else(|| {
            format!("sm_carveout: 'sms' must be an integer from 0 to 1024 (SMs left to collectives), got {given}")
        })?;
        deepwell_gpu::leave_sms_to_collectives(sms as u32);
    }
    Ok(serde_json::json!(deepwell_gpu::sms_left_to_collectives()))
}

/// True when every tensor's data is 16-byte aligned: then each kernel takes its vector path
/// wherever the shape allows, which the geometry needs to know (views may start anywhere).
pub fn aligned(tensors: &[&Tensor]) -> bool {
    tensors.iter().all(|t| t.data_ptr() as usize % 16 == 0)
}

/// `t` itself when contiguous, else `aten::contiguous(t)` (a copy made by torch, on t's stream).
pub fn contiguous(op: Op, t: Tensor) -> Result<Tensor> {
    crate::aten::contiguous(op, t)
}

/// The template tag of a float element type (cuda/common.cuh).
pub fn float(d: DType) -> Float {
    match d {
        DType::F32 => Float::F32,
        DType::F16 => Float::F16,
        _ => Float::BF16,
    }
}

/// The device pointer of a tensor, as a kernel argument.
pub fn ptr(t: &Tensor) -> *const c_void {
    t.data_ptr() as *const c_void
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: crate::entry::Entries = &[(
    "sm_carveout",
    sm_carveout_entry,
    "{sms?} -> sms (SMs deepwell's persistent GEMMs leave to collectives; sets them when given)",
)];
