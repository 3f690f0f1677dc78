//! CUDA kernels of the fp8_tensor ops (cuda/fp8_tensor.cuh), bit-exact with `cpu.rs`. The amax is
//! nvfp4.cuh's device-side reduction into a zeroed word, read by the cast kernels on the device:
//! no host synchronisation; or the caller's amax tensor, read in place.

use deepwell_core::Fp8Elem;
use deepwell_gpu::kernels::{Fp8Tensor, Matrix, Nvfp4};
use deepwell_gpu::Params;

use super::{Copies, Dequantize, Quantize, RowCol};
use crate::cuda::{self, float, ptr, Launch};
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::tensor::Tensor;

fn e5m2(elem: Fp8Elem) -> bool {
    elem == Fp8Elem::E5M2
}

/// x's NaN-propagating amax as fp32 bits: the caller's amax tensor, read in place (its fp32 bits
/// are what the amax kernel would have written), or a fresh 4-byte tensor the kernel reduces into
/// (x contiguous).
fn amax(op: Op, launch: &Launch, q: &Quantize, x: &Tensor) -> Result<Tensor> {
    if let Some(a) = &q.amax {
        return a.share(op);
    }
    let bits = Tensor::empty(op, &[1], DType::I32, q.device)?;
    let n = x.numel() as u64;
    let p = Params::new().ptr(ptr(x)).i64(n as i64).ptr(ptr(&bits));
    let kernel = Nvfp4::Amax { input: float(q.dtype), hadamard: false };
    // SAFETY: `bits` is a fresh 4-byte CUDA tensor; x is contiguous with n elements.
    unsafe {
        launch.dev.memset_zero(bits.data_ptr(), 4, launch.stream).map_err(cuda::gpu_err(op))?;
        launch.run(op, kernel, Matrix { rows: 1, cols: n }, p)?;
    }
    Ok(bits)
}

pub(super) fn quantize(op: Op, q: Quantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let x = cuda::contiguous(op, q.x.share(op)?)?;
    let bits = amax(op, &launch, &q, &x)?;
    let data = Tensor::empty(op, x.sizes(), DType::of_fp8(q.elem), q.device)?;
    let scale_inv = Tensor::empty(op, &[], DType::F32, q.device)?;
    let n = x.numel() as u64;
    let p = Params::new().ptr(ptr(&x)).i64(n as i64).ptr(ptr(&bits)).ptr(ptr(&data)).ptr(ptr(&scale_inv));
    let kernel = Fp8Tensor::Cast { input: float(q.dtype), e5m2: e5m2(q.elem) };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, Matrix { rows: 1, cols: n }, p)? };
    Ok(vec![data, scale_inv])
}

pub(super) fn quantize_rowcol(op: Op, rc: RowCol) -> Result<Vec<Tensor>> {
    let q = &rc.q;
    let launch = cuda::launch_context(op, q.device)?;
    let (m, k) = q.matrix();
    let x = cuda::contiguous(op, q.x.share(op)?)?;
    let bits = amax(op, &launch, q, &x)?;
    let both = rc.copies == Copies::Both;
    let row_shape: Vec<i64> = if both { vec![m, k] } else { vec![0] };
    let rows = Tensor::empty(op, &row_shape, DType::of_fp8(q.elem), q.device)?;
    let cols = Tensor::empty(op, &[k, m], DType::of_fp8(q.elem), q.device)?;
    let scale_inv = Tensor::empty(op, &[], DType::F32, q.device)?;
    let row_ptr = if both { ptr(&rows) } else { std::ptr::null() };
    let p = Params::new().ptr(ptr(&x)).i64(m).i64(k).ptr(ptr(&bits));
    let p = p.ptr(row_ptr).ptr(ptr(&cols)).ptr(ptr(&scale_inv));
    let kernel = Fp8Tensor::CastTransposed { input: float(q.dtype), e5m2: e5m2(q.elem), rows: both };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md;
    // the kernel writes row codes only when `rows`.
    unsafe { launch.run(op, kernel, Matrix { rows: m as u64, cols: k as u64 }, p)? };
    Ok(vec![rows, cols, scale_inv])
}

pub(super) fn dequantize(op: Op, q: Dequantize) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, q.device)?;
    let data = cuda::contiguous(op, q.data)?;
    let scale_inv = cuda::contiguous(op, q.scale_inv)?;
    let out = Tensor::empty(op, data.sizes(), q.out_dtype, q.device)?;
    let n = data.numel() as u64;
    let p = Params::new().ptr(ptr(&data)).i64(n as i64).ptr(ptr(&scale_inv)).ptr(ptr(&out));
    let kernel = Fp8Tensor::Dequantize { out: float(q.out_dtype), e5m2: e5m2(q.elem) };
    // SAFETY: contiguous CUDA tensors on the launch's device of the sizes in cuda/INTERFACE.md.
    unsafe { launch.run(op, kernel, Matrix { rows: 1, cols: n }, p)? };
    Ok(vec![out])
}
