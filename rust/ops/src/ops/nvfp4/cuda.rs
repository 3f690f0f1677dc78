//! CUDA kernels of the NVFP4 ops (cuda/nvfp4.cuh), bit-exact with `cpu.rs`. The global amax is a
//! device-side reduction feeding the quantize kernel directly: no host synchronisation.

use deepwell_core::nvfp4::NVFP4_BLOCK;
use deepwell_gpu::{Header, KernelSpec, Params};

use super::{parse_dequantize, parse_quantize};
use crate::check::Backend;
use crate::cuda::{self, float_tag, ptr, THREADS};
use crate::dtype::DType;
use crate::error::Result;
use crate::stack::Args;
use crate::tensor::Tensor;

fn amax_spec(input: DType, hadamard: bool) -> KernelSpec {
    KernelSpec::new(Header::Nvfp4, format!("deepwell::nvfp4_amax<{}, {}>", float_tag(input), hadamard as u8))
}

fn quantize_spec(input: DType, block_2d: bool, stochastic: bool, hadamard: bool) -> KernelSpec {
    let (t, b, s, h) = (float_tag(input), block_2d as u8, stochastic as u8, hadamard as u8);
    KernelSpec::new(Header::Nvfp4, format!("deepwell::nvfp4_quantize<{t}, {b}, {s}, {h}>"))
}

fn dequantize_spec(out: DType) -> KernelSpec {
    KernelSpec::new(Header::Nvfp4, format!("deepwell::nvfp4_dequantize<{}>", float_tag(out)))
}

/// Every kernel these ops can launch (for `python -m deepwell.cli.kernels --compile-all`).
pub fn specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for h in [false, true] {
            v.push(amax_spec(dtype, h));
            for b in [false, true] {
                for s in [false, true] {
                    v.push(quantize_spec(dtype, b, s, h));
                }
            }
        }
        v.push(dequantize_spec(dtype));
    }
    v
}

pub fn quantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_quantize(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, q.device)?;
    let x = cuda::contiguous(op, q.x)?;
    let numel = (q.rows * q.k) as i64;
    // The global amax as fp32 bits: given by the caller, or reduced on the device (atomicMax of
    // |x| bits into a zeroed word; integer order of non-negative floats is float order).
    let amax = match q.global_amax {
        Some(g) => cuda::contiguous(op, g)?,
        None => {
            let bits = Tensor::empty(op, &[1], DType::I32, q.device)?;
            let p = Params::new().ptr(ptr(&x)).i64(numel).ptr(ptr(&bits));
            // SAFETY: `bits` is a fresh 4-byte CUDA tensor; x is contiguous with `numel` elements.
            unsafe {
                dev.memset_zero(bits.data_ptr(), 4, stream).map_err(cuda::gpu_err(op))?;
                dev.launch(
                    &amax_spec(q.dtype, q.hadamard),
                    cuda::grid(dev, numel as u64, u64::from(THREADS) * 16),
                    THREADS,
                    0,
                    stream,
                    p,
                )
                .map_err(cuda::gpu_err(op))?;
            }
            bits
        }
    };
    let data = Tensor::empty(op, &q.data_shape, DType::U8, q.device)?;
    let scale = Tensor::empty(op, &q.scale_shape, DType::E4M3, q.device)?;
    let global_scale = Tensor::empty(op, &[], DType::F32, q.device)?;
    let blocks = (q.rows * q.k / NVFP4_BLOCK) as u64;
    let p = Params::new()
        .ptr(ptr(&x))
        .ptr(ptr(&amax))
        .ptr(ptr(&data))
        .ptr(ptr(&scale))
        .ptr(ptr(&global_scale))
        .i64(q.rows as i64)
        .i64(q.k as i64)
        .u64(q.seed.unwrap_or(0));
    let spec = quantize_spec(q.dtype, q.block_2d, q.seed.is_some(), q.hadamard);
    // SAFETY: contiguous CUDA tensors on `dev` of the sizes in cuda/INTERFACE.md; torch's stream.
    unsafe {
        dev.launch(&spec, cuda::grid(dev, blocks, u64::from(THREADS)), THREADS, 0, stream, p)
            .map_err(cuda::gpu_err(op))?;
    }
    Ok(vec![data, scale, global_scale])
}

pub fn dequantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_dequantize(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, q.device)?;
    let data = cuda::contiguous(op, q.data)?;
    let scale = cuda::contiguous(op, q.scale)?;
    let global_scale = cuda::contiguous(op, q.global_scale)?;
    let out = Tensor::empty(op, &q.out_shape, q.out_dtype, q.device)?;
    let p = Params::new()
        .ptr(ptr(&data))
        .ptr(ptr(&scale))
        .ptr(ptr(&global_scale))
        .ptr(ptr(&out))
        .i64(q.rows as i64)
        .i64(q.k as i64);
    let numel = (q.rows * q.k) as u64;
    // SAFETY: contiguous CUDA tensors on `dev` of the sizes in cuda/INTERFACE.md; torch's stream.
    unsafe {
        dev.launch(
            &dequantize_spec(q.out_dtype),
            cuda::grid(dev, numel, u64::from(THREADS) * 16),
            THREADS,
            0,
            stream,
            p,
        )
        .map_err(cuda::gpu_err(op))?;
    }
    Ok(vec![out])
}
