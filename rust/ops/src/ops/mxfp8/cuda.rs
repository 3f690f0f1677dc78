//! CUDA kernels of the MXFP8 ops (cuda/mxfp8.cuh), bit-exact with `cpu.rs`.

use deepwell_core::mxfp8::{Fp8Elem, ScaleMode, MX_BLOCK};
use deepwell_gpu::{Header, KernelSpec, Params};

use super::{elem_dtype, parse_dequantize, parse_quantize, parse_quantize_rowcol};
use crate::check::Backend;
use crate::cuda::{self, float_tag, ptr, THREADS};
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::swizzle::swizzle_on_device;
use crate::stack::Args;
use crate::tensor::Tensor;

fn mode_arg(m: ScaleMode) -> u8 {
    match m {
        ScaleMode::Rceil => 0,
        ScaleMode::Floor => 1,
    }
}

fn elem_arg(e: Fp8Elem) -> u8 {
    match e {
        Fp8Elem::E4M3 => 0,
        Fp8Elem::E5M2 => 1,
    }
}

fn rows_spec(input: DType, mode: ScaleMode, elem: Fp8Elem) -> KernelSpec {
    let name = format!("deepwell::mxfp8_quantize_rows<{}, {}, {}>", float_tag(input), mode_arg(mode), elem_arg(elem));
    KernelSpec::new(Header::Mxfp8, name)
}

fn cols_spec(input: DType, mode: ScaleMode, elem: Fp8Elem) -> KernelSpec {
    let name = format!("deepwell::mxfp8_quantize_cols<{}, {}, {}>", float_tag(input), mode_arg(mode), elem_arg(elem));
    KernelSpec::new(Header::Mxfp8, name)
}

fn rowcol_spec(input: DType, mode: ScaleMode, elem: Fp8Elem, transposed: bool) -> KernelSpec {
    let (t, m, e) = (float_tag(input), mode_arg(mode), elem_arg(elem));
    KernelSpec::new(Header::Mxfp8, format!("deepwell::mxfp8_quantize_rowcol<{t}, {m}, {e}, {}>", transposed as u8))
}

fn dequantize_spec(out: DType, elem: Fp8Elem) -> KernelSpec {
    KernelSpec::new(Header::Mxfp8, format!("deepwell::mxfp8_dequantize<{}, {}>", float_tag(out), elem_arg(elem)))
}

/// Every kernel these ops can launch (for `python -m deepwell.cli.kernels --compile-all`).
pub fn specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for input in [DType::F32, DType::BF16, DType::F16] {
        for mode in [ScaleMode::Rceil, ScaleMode::Floor] {
            for elem in [Fp8Elem::E4M3, Fp8Elem::E5M2] {
                v.push(rows_spec(input, mode, elem));
                v.push(cols_spec(input, mode, elem));
                v.push(rowcol_spec(input, mode, elem, false));
                v.push(rowcol_spec(input, mode, elem, true));
            }
        }
        for elem in [Fp8Elem::E4M3, Fp8Elem::E5M2] {
            v.push(dequantize_spec(input, elem));
        }
    }
    v
}

pub fn quantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_quantize(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, q.device)?;
    let x = cuda::contiguous(op, q.x)?;
    let data = Tensor::empty(op, &q.data_shape, elem_dtype(q.elem), q.device)?;
    let scale = Tensor::empty(op, &q.scale_shape, DType::E8M0, q.device)?;
    let (outer, k, inner) = (q.dims.outer as i64, q.dims.k as i64, q.dims.inner as i64);
    let n_blocks = (q.dims.numel() / MX_BLOCK) as u64;
    // SAFETY: x, data and scale are contiguous CUDA tensors on `dev` with the sizes each kernel
    // indexes (cuda/INTERFACE.md); the launch is ordered on torch's current stream.
    unsafe {
        let launch = if inner == 1 {
            let p = Params::new().ptr(ptr(&x)).ptr(ptr(&data)).ptr(ptr(&scale)).i64(n_blocks as i64);
            dev.launch(
                &rows_spec(q.dtype, q.mode, q.elem),
                cuda::grid(dev, n_blocks, u64::from(THREADS) / 4),
                THREADS,
                0,
                stream,
                p,
            )
        } else {
            let p = Params::new().ptr(ptr(&x)).ptr(ptr(&data)).ptr(ptr(&scale)).i64(outer).i64(k).i64(inner);
            let columns = (outer * (k / MX_BLOCK as i64) * inner) as u64;
            dev.launch(
                &cols_spec(q.dtype, q.mode, q.elem),
                cuda::grid(dev, columns, u64::from(THREADS) * 4),
                THREADS,
                0,
                stream,
                p,
            )
        };
        launch.map_err(cuda::gpu_err(op))?;
    }
    Ok(vec![data, scale])
}

pub fn quantize_rowcol(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_quantize_rowcol(a, Backend::Cuda)?;
    let op = a.op();
    let launch = cuda::launch_context(op, q.device)?;
    let cuda::Launch { dev, stream } = launch;
    let shapes = q.shapes();
    let x = cuda::contiguous(op, q.x)?;
    let elem = elem_dtype(q.elem);
    let rd = Tensor::empty(op, &shapes[0], elem, q.device)?;
    let rs = Tensor::empty(op, &shapes[1], DType::E8M0, q.device)?;
    let cd = Tensor::empty(op, &shapes[2], elem, q.device)?;
    let cs = Tensor::empty(op, &shapes[3], DType::E8M0, q.device)?;
    let tiles = ((q.m / MX_BLOCK) * (q.k / MX_BLOCK)) as u64;
    let p = Params::new()
        .ptr(ptr(&x))
        .i64(q.m as i64)
        .i64(q.k as i64)
        .ptr(ptr(&rd))
        .ptr(ptr(&rs))
        .ptr(ptr(&cd))
        .ptr(ptr(&cs));
    // SAFETY: contiguous CUDA tensors on `dev` of the sizes in cuda/INTERFACE.md; torch's stream.
    unsafe {
        dev.launch(
            &rowcol_spec(q.dtype, q.mode, q.elem, q.col_transposed),
            cuda::grid(dev, tiles, 1),
            THREADS,
            0,
            stream,
            p,
        )
        .map_err(cuda::gpu_err(op))?;
    }
    if !q.swizzle {
        return Ok(vec![rd, rs, cd, cs]);
    }
    // Scales are 1/32 of the data bytes: a second small kernel rearranges them (documented cost).
    let rs = swizzle_on_device(op, &launch, &rs, q.device)?;
    let cs = swizzle_on_device(op, &launch, &cs, q.device)?;
    Ok(vec![rd, rs, cd, cs])
}

pub fn dequantize(a: &mut Args) -> Result<Vec<Tensor>> {
    let q = parse_dequantize(a, Backend::Cuda)?;
    let op = a.op();
    let cuda::Launch { dev, stream } = cuda::launch_context(op, q.device)?;
    let data = cuda::contiguous(op, q.data)?;
    let scale = cuda::contiguous(op, q.scale)?;
    let out = Tensor::empty(op, data.sizes(), q.out_dtype, q.device)?;
    let (outer, k, inner) = (q.dims.outer as i64, q.dims.k as i64, q.dims.inner as i64);
    let p = Params::new().ptr(ptr(&data)).ptr(ptr(&scale)).ptr(ptr(&out)).i64(outer).i64(k).i64(inner);
    let numel = q.dims.numel() as u64;
    // SAFETY: contiguous CUDA tensors on `dev` of the sizes in cuda/INTERFACE.md; torch's stream.
    unsafe {
        dev.launch(
            &dequantize_spec(q.out_dtype, q.elem),
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
