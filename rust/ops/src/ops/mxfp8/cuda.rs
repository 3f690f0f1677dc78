//! CUDA kernels of the MXFP8 ops (cuda/mxfp8.cuh), bit-exact with `cpu.rs`.

use deepwell_core::mxfp8::{Fp8Elem, ScaleMode, MX_BLOCK};
use deepwell_gpu::kernels::mxfp8::{Fp8, Mode, Sizes};
use deepwell_gpu::kernels::Mxfp8;
use deepwell_gpu::Params;

use super::{Dequantize, Quantize, QuantizeRowCol};
use crate::cuda::{self, float, ptr};
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::ops::swizzle::swizzle_on_device;
use crate::tensor::Tensor;

fn mode(m: ScaleMode) -> Mode {
    match m {
        ScaleMode::Rceil => Mode::Rceil,
        ScaleMode::Floor => Mode::Floor,
    }
}

fn fp8(e: Fp8Elem) -> Fp8 {
    match e {
        Fp8Elem::E4M3 => Fp8::E4M3,
        Fp8Elem::E5M2 => Fp8::E5M2,
    }
}

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let x = cuda::contiguous(op, q.x)?;
    let data = Tensor::empty(op, &q.data_shape, DType::of_fp8(q.elem), q.device)?;
    let scale = Tensor::empty(op, &q.scale_shape, DType::E8M0, q.device)?;
    let d = &q.dims;
    let (input, mode, elem) = (float(q.dtype), mode(q.mode), fp8(q.elem));
    let sizes = Sizes { outer: d.outer as u64, k: d.k as u64, inner: d.inner as u64, aligned: cuda::aligned(&[&x]) };
    let p = Params::new().ptr(ptr(&x)).ptr(ptr(&data)).ptr(ptr(&scale));
    // SAFETY: x, data and scale are contiguous CUDA tensors on the launch's device with the sizes
    // each kernel indexes (cuda/INTERFACE.md).
    unsafe {
        if d.inner == 1 {
            let n_blocks = (d.numel() / MX_BLOCK) as i64;
            launch.run(op, Mxfp8::Rows { input, mode, elem }, sizes, p.i64(n_blocks))?;
        } else {
            let p = p.i64(d.outer as i64).i64(d.k as i64).i64(d.inner as i64);
            launch.run(op, Mxfp8::Cols { input, mode, elem }, sizes, p)?;
        }
    }
    Ok(vec![data, scale])
}

pub(super) fn quantize_rowcol(op: Op, q: QuantizeRowCol) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let shapes = q.shapes();
    let x = cuda::contiguous(op, q.x)?;
    let elem = DType::of_fp8(q.elem);
    let rd = Tensor::empty(op, &shapes[0], elem, q.device)?;
    let rs = Tensor::empty(op, &shapes[1], DType::E8M0, q.device)?;
    let cd = Tensor::empty(op, &shapes[2], elem, q.device)?;
    let cs = Tensor::empty(op, &shapes[3], DType::E8M0, q.device)?;
    let (m, k) = (q.m as i64, q.k as i64);
    let p = Params::new().ptr(ptr(&x)).i64(m).i64(k).ptr(ptr(&rd)).ptr(ptr(&rs)).ptr(ptr(&cd)).ptr(ptr(&cs));
    let kernel =
        Mxfp8::Rowcol { input: float(q.dtype), mode: mode(q.mode), elem: fp8(q.elem), transposed: q.col_transposed };
    let sizes = Sizes { outer: q.m as u64, k: q.k as u64, inner: 1, aligned: cuda::aligned(&[&x]) };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, sizes, p)? };
    if !q.swizzle {
        return Ok(vec![rd, rs, cd, cs]);
    }
    // Scales are 1/32 of the data bytes: a second small kernel rearranges them (documented cost).
    let rs = swizzle_on_device(op, &launch, &rs, q.device)?;
    let cs = swizzle_on_device(op, &launch, &cs, q.device)?;
    Ok(vec![rd, rs, cd, cs])
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let data = cuda::contiguous(op, q.data)?;
    let scale = cuda::contiguous(op, q.scale)?;
    let out = Tensor::empty(op, data.sizes(), q.out_dtype, q.device)?;
    let (outer, k, inner) = (q.dims.outer as u64, q.dims.k as u64, q.dims.inner as u64);
    let p = Params::new().ptr(ptr(&data)).ptr(ptr(&scale)).ptr(ptr(&out));
    let p = p.i64(outer as i64).i64(k as i64).i64(inner as i64);
    let kernel = Mxfp8::Dequantize { out: float(q.out_dtype), elem: fp8(q.elem) };
    let sizes = Sizes { outer, k, inner, aligned: cuda::aligned(&[&data, &scale]) };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, sizes, p)? };
    Ok(vec![out])
}
