//! After an fp32 GEMM: `out = Out((y * (ga * gb)) + bias)`, each step rounded to fp32 in this order,
//! then once to the output dtype (round to nearest even). `ga`, `gb` are NVFP4's per-tensor decode
//! scales (cuBLASLt's alpha), `bias` is the layer's bias. CUDA: cuda/linear.cuh; CPU: here, the same
//! arithmetic.

use deepwell_gpu::kernels::{LinearEpilogue, Matrix};
use deepwell_gpu::Params;

use crate::aten;
use crate::cuda::{self, float, ptr};
use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::tensor::Tensor;

/// `y` (rows, cols) fp32 contiguous; `alpha` the two 0-d fp32 decode scales; `bias` (cols).
pub fn apply(op: Op, y: Tensor, alpha: Option<(Tensor, Tensor)>, bias: Option<Tensor>, out: DType) -> Result<Tensor> {
    let y = aten::contiguous(op, y)?;
    let alpha = match alpha {
        Some((ga, gb)) => Some((aten::contiguous(op, ga)?, aten::contiguous(op, gb)?)),
        None => None,
    };
    let bias = bias.map(|b| aten::contiguous(op, b)).transpose()?;
    match y.device() {
        Device::Cpu => cpu(op, y, alpha, bias, out),
        device => gpu(op, y, alpha, bias, out, device),
    }
}

fn cpu(op: Op, y: Tensor, alpha: Option<(Tensor, Tensor)>, bias: Option<Tensor>, out: DType) -> Result<Tensor> {
    let cols = y.sizes()[1] as usize;
    let res = Tensor::empty(op, y.sizes(), DType::F32, Device::Cpu)?;
    let bias = bias.map(|b| aten::to_dtype(op, b, DType::F32)).transpose()?;
    // SAFETY: y and res are contiguous fp32 CPU tensors of equal numel (res fresh, ours alone); the
    // scales are one-element fp32 tensors; bias is contiguous fp32 with `cols` elements.
    unsafe {
        let (ys, rs) = (y.as_slice::<f32>(), res.as_mut_slice::<f32>());
        let a = alpha.as_ref().map(|(ga, gb)| ga.as_slice::<f32>()[0] * gb.as_slice::<f32>()[0]);
        let b = bias.as_ref().map(|b| b.as_slice::<f32>());
        for (i, (r, &v)) in rs.iter_mut().zip(ys).enumerate() {
            let mut v = v;
            if let Some(a) = a {
                v *= a;
            }
            if let Some(b) = b {
                v += b[i % cols];
            }
            *r = v;
        }
    }
    aten::to_dtype(op, res, out)
}

fn gpu(
    op: Op,
    y: Tensor,
    alpha: Option<(Tensor, Tensor)>,
    bias: Option<Tensor>,
    out: DType,
    device: Device,
) -> Result<Tensor> {
    let launch = cuda::launch_context(op, device)?;
    let (rows, cols) = (y.sizes()[0], y.sizes()[1]);
    let res = Tensor::empty(op, y.sizes(), out, device)?;
    let null = std::ptr::null();
    let (ga, gb) = alpha.as_ref().map_or((null, null), |(a, b)| (ptr(a), ptr(b)));
    let bias_dtype = bias.as_ref().map_or(DType::F32, Tensor::dtype);
    let p = Params::new()
        .ptr(ptr(&y))
        .ptr(ga)
        .ptr(gb)
        .ptr(bias.as_ref().map_or(null, ptr))
        .ptr(ptr(&res))
        .i64(rows)
        .i64(cols);
    let kernel = LinearEpilogue { out: float(out), bias: float(bias_dtype) };
    // SAFETY: contiguous CUDA tensors on the launch's device (y and res rows x cols, bias cols,
    // scales one float each) or null pointers the kernel tests.
    unsafe { launch.run(op, kernel, Matrix { rows: rows as u64, cols: cols as u64 }, p)? };
    Ok(res)
}
