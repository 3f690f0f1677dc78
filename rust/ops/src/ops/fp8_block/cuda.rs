//! CUDA kernels of the FP8-block ops (cuda/fp8_block.cuh), bit-exact with `cpu.rs`.

use deepwell_gpu::{Header, KernelSpec, Params};

use super::{parse_dequantize, parse_quantize, parse_quantize_rowcol, BLOCK, BLOCKS};
use crate::check::Backend;
use crate::cuda::{self, float_tag, ptr, THREADS};
use crate::dtype::DType;
use crate::error::Result;
use crate::stack::Args;
use crate::tensor::Tensor;

fn quantize_spec(input: DType, br: usize, bc: usize) -> KernelSpec {
    KernelSpec::new(Header::Fp8Block, format!("deepwell::fp8_block_quantize<{}, {br}, {bc}>", float_tag(input)))
}

fn rowcol_spec(input: DType) -> KernelSpec {
    KernelSpec::new(Header::Fp8Block, format!("deepwell::fp8_block_quantize_rowcol<{}>", float_tag(input)))
}

fn dequantize_spec(out: DType, br: usize, bc: usize) -> KernelSpec {
    KernelSpec::new(Header::Fp8Block, format!("deepwell::fp8_block_dequantize<{}, {br}, {bc}>", float_tag(out)))
}

/// Every kernel these ops can launch (for `python -m deepwell.cli.kernels --compile-all`).
pub fn specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (br, bc) in BLOCKS {
            v.push(quantize_spec(dtype, br as usize, bc as usize));
            v.push(dequantize_spec(dtype, br as usize, bc as usize));
        }
        v.push(rowcol_spec(dtype));
    }
    v
}

pub fn quantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_quantize(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, q.device)?;
    let x = cuda::contiguous(op, q.x)?;
    let data = Tensor::empty(op, x.sizes(), DType::E4M3, q.device)?;
    let scale_inv = Tensor::empty(op, &q.g.scale_shape, DType::F32, q.device)?;
    let g = &q.g;
    let blocks = (g.batch * g.rows * g.cols / (g.br * g.bc)) as u64;
    // 1-D blocks: a warp per block, 8 per CTA; 128x128 tiles: a CTA per tile.
    let per_cta = if g.br * g.bc == 128 { u64::from(THREADS / 32) } else { 1 };
    let p = Params::new()
        .ptr(ptr(&x))
        .ptr(ptr(&data))
        .ptr(ptr(&scale_inv))
        .i64(g.batch as i64)
        .i64(g.rows as i64)
        .i64(g.cols as i64)
        .i32(q.pow2 as i32);
    // SAFETY: contiguous CUDA tensors on `dev` of the sizes in cuda/INTERFACE.md; torch's stream.
    unsafe {
        dev.launch(&quantize_spec(q.dtype, g.br, g.bc), cuda::grid(dev, blocks, per_cta), THREADS, 0, stream, p)
            .map_err(cuda::gpu_err(op))?;
    }
    Ok(vec![data, scale_inv])
}

pub fn quantize_rowcol(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_quantize_rowcol(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, q.device)?;
    let shapes = q.shapes();
    let x = cuda::contiguous(op, q.x)?;
    let rd = Tensor::empty(op, &shapes[0], DType::E4M3, q.device)?;
    let rs = Tensor::empty(op, &shapes[1], DType::F32, q.device)?;
    let cd = Tensor::empty(op, &shapes[2], DType::E4M3, q.device)?;
    let cs = Tensor::empty(op, &shapes[3], DType::F32, q.device)?;
    let tiles = ((q.m / BLOCK) * (q.k / BLOCK)) as u64;
    let p = Params::new()
        .ptr(ptr(&x))
        .i64(q.m)
        .i64(q.k)
        .i32(q.pow2 as i32)
        .ptr(ptr(&rd))
        .ptr(ptr(&rs))
        .ptr(ptr(&cd))
        .ptr(ptr(&cs));
    // SAFETY: contiguous CUDA tensors on `dev` of the sizes in cuda/INTERFACE.md; torch's stream.
    unsafe {
        dev.launch(&rowcol_spec(q.dtype), cuda::grid(dev, tiles, 1), THREADS, 0, stream, p)
            .map_err(cuda::gpu_err(op))?;
    }
    Ok(vec![rd, rs, cd, cs])
}

pub fn dequantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_dequantize(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, q.device)?;
    let data = cuda::contiguous(op, q.data)?;
    let scale_inv = cuda::contiguous(op, q.scale_inv)?;
    let out = Tensor::empty(op, data.sizes(), q.out_dtype, q.device)?;
    let g = &q.g;
    let p = Params::new()
        .ptr(ptr(&data))
        .ptr(ptr(&scale_inv))
        .ptr(ptr(&out))
        .i64(g.batch as i64)
        .i64(g.rows as i64)
        .i64(g.cols as i64);
    let numel = (g.batch * g.rows * g.cols) as u64;
    // SAFETY: contiguous CUDA tensors on `dev` of the sizes in cuda/INTERFACE.md; torch's stream.
    unsafe {
        dev.launch(
            &dequantize_spec(q.out_dtype, g.br, g.bc),
            cuda::grid(dev, numel, u64::from(THREADS) * 8),
            THREADS,
            0,
            stream,
            p,
        )
        .map_err(cuda::gpu_err(op))?;
    }
    Ok(vec![out])
}
