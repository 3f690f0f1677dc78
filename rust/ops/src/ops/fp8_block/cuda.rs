//! CUDA kernels of the FP8-block ops (cuda/fp8_block.cuh), bit-exact with `cpu.rs`.

use deepwell_gpu::kernels::fp8_block::{Block, Sizes};
use deepwell_gpu::kernels::Fp8Block;
use deepwell_gpu::Params;

use super::{Dequantize, Quantize, QuantizeRowCol, QuantizeTransposed, ScaleLayout};
use crate::cuda::{self, float, ptr};
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::tensor::Tensor;

/// The kernel's block shape (the parsers accept only these three).
fn block(br: usize, bc: usize) -> Block {
    match (br, bc) {
        (1, _) => Block::Row,
        (_, 1) => Block::Col,
        _ => Block::Tile,
    }
}

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let x = cuda::contiguous(op, q.x)?;
    let data = Tensor::empty(op, x.sizes(), DType::E4M3, q.device)?;
    let scale_inv = Tensor::empty(op, &q.g.scale_shape, DType::F32, q.device)?;
    let g = &q.g;
    let p = Params::new().ptr(ptr(&x)).ptr(ptr(&data)).ptr(ptr(&scale_inv));
    let p = p.i64(g.batch as i64).i64(g.rows as i64).i64(g.cols as i64).i32(q.pow2 as i32);
    let m_major = q.scales == ScaleLayout::MMajor;
    let kernel = Fp8Block::Quantize { input: float(q.dtype), block: block(g.br, g.bc), m_major };
    let sizes =
        Sizes { batch: g.batch as u64, rows: g.rows as u64, cols: g.cols as u64, aligned: cuda::aligned(&[&x]) };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, sizes, p)? };
    Ok(vec![data, scale_inv])
}

pub(super) fn quantize_rowcol(op: Op, q: QuantizeRowCol) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let shapes = q.shapes();
    let x = cuda::contiguous(op, q.x)?;
    let rd = Tensor::empty(op, &shapes[0], DType::E4M3, q.device)?;
    let rs = Tensor::empty(op, &shapes[1], DType::F32, q.device)?;
    let cd = Tensor::empty(op, &shapes[2], DType::E4M3, q.device)?;
    let cs = Tensor::empty(op, &shapes[3], DType::F32, q.device)?;
    let p = Params::new().ptr(ptr(&x)).i64(q.m).i64(q.k).i32(q.pow2 as i32);
    let p = p.ptr(ptr(&rd)).ptr(ptr(&rs)).ptr(ptr(&cd)).ptr(ptr(&cs));
    let sizes = Sizes { batch: 1, rows: q.m as u64, cols: q.k as u64, aligned: cuda::aligned(&[&x]) };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    let kernel = Fp8Block::Rowcol { input: float(q.dtype), m_major: q.scales == ScaleLayout::MMajor };
    unsafe { launch.run(op, kernel, sizes, p)? };
    Ok(vec![rd, rs, cd, cs])
}

pub(super) fn quantize_transposed(op: Op, t: QuantizeTransposed) -> Result<Vec<Tensor>> {
    let q = &t.q;
    let launch = cuda::launch_context(op, q.device)?;
    let shapes = t.shapes();
    let x = cuda::contiguous(op, q.x.share(op)?)?;
    let data = Tensor::empty(op, &shapes[0], DType::E4M3, q.device)?;
    let scale_inv = Tensor::empty(op, &shapes[1], DType::F32, q.device)?;
    let p = Params::new().ptr(ptr(&x)).i64(q.m).i64(q.k).i32(q.pow2 as i32);
    let p = p.ptr(ptr(&data)).ptr(ptr(&scale_inv));
    let sizes = Sizes { batch: 1, rows: q.m as u64, cols: q.k as u64, aligned: cuda::aligned(&[&x]) };
    let kernel = Fp8Block::Transposed { input: float(q.dtype), out: t.out };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, sizes, p)? };
    Ok(vec![data, scale_inv])
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let data = cuda::contiguous(op, q.data)?;
    let scale_inv = cuda::contiguous(op, q.scale_inv)?;
    let out = Tensor::empty(op, data.sizes(), q.out_dtype, q.device)?;
    let g = &q.g;
    let p = Params::new().ptr(ptr(&data)).ptr(ptr(&scale_inv)).ptr(ptr(&out));
    let p = p.i64(g.batch as i64).i64(g.rows as i64).i64(g.cols as i64);
    let kernel = Fp8Block::Dequantize { out: float(q.out_dtype), block: block(g.br, g.bc) };
    let aligned = cuda::aligned(&[&data, &scale_inv]);
    let sizes = Sizes { batch: g.batch as u64, rows: g.rows as u64, cols: g.cols as u64, aligned };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, sizes, p)? };
    Ok(vec![out])
}
