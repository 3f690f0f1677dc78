//! CUDA kernels of the NVFP4 ops (cuda/nvfp4.cuh), bit-exact with `cpu.rs`. The global amax is a
//! device-side reduction feeding the quantize kernel directly: no host synchronisation.

use deepwell_gpu::kernels::{Matrix, Nvfp4};
use deepwell_gpu::Params;

use super::{Dequantize, Quantize};
use crate::cuda::{self, float, ptr};
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::tensor::Tensor;

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let x = cuda::contiguous(op, q.x)?;
    let (input, hadamard) = (float(q.dtype), q.hadamard);
    let sizes = Matrix { rows: q.rows as u64, cols: q.k as u64 };
    // The global amax as fp32 bits: given by the caller, or reduced on the device (atomicMax of
    // |x| bits into a zeroed word; integer order of non-negative floats is float order).
    let amax = match q.global_amax {
        Some(g) => cuda::contiguous(op, g)?,
        None => {
            let bits = Tensor::empty(op, &[1], DType::I32, q.device)?;
            let p = Params::new().ptr(ptr(&x)).i64((q.rows * q.k) as i64).ptr(ptr(&bits));
            // SAFETY: `bits` is a fresh 4-byte CUDA tensor; x is contiguous with rows * k elements.
            unsafe {
                launch.dev.memset_zero(bits.data_ptr(), 4, launch.stream).map_err(cuda::gpu_err(op))?;
                launch.run(op, Nvfp4::Amax { input, hadamard }, sizes, p)?;
            }
            bits
        }
    };
    let data = Tensor::empty(op, &q.data_shape, DType::U8, q.device)?;
    let scale = Tensor::empty(op, &q.scale_shape, DType::E4M3, q.device)?;
    let global_scale = Tensor::empty(op, &[], DType::F32, q.device)?;
    let p = Params::new().ptr(ptr(&x)).ptr(ptr(&amax)).ptr(ptr(&data)).ptr(ptr(&scale)).ptr(ptr(&global_scale));
    let p = p.i64(q.rows as i64).i64(q.k as i64).u64(q.seed.unwrap_or(0));
    let kernel = Nvfp4::Quantize { input, block_2d: q.block_2d, stochastic: q.seed.is_some(), hadamard };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, sizes, p)? };
    Ok(vec![data, scale, global_scale])
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let data = cuda::contiguous(op, q.data)?;
    let scale = cuda::contiguous(op, q.scale)?;
    let global_scale = cuda::contiguous(op, q.global_scale)?;
    let out = Tensor::empty(op, &q.out_shape, q.out_dtype, q.device)?;
    let p = Params::new().ptr(ptr(&data)).ptr(ptr(&scale)).ptr(ptr(&global_scale)).ptr(ptr(&out));
    let p = p.i64(q.rows as i64).i64(q.k as i64);
    let sizes = Matrix { rows: q.rows as u64, cols: q.k as u64 };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, Nvfp4::Dequantize { out: float(q.out_dtype) }, sizes, p)? };
    Ok(vec![out])
}
