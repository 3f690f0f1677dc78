//! The FP8 GEMMs on CUDA: deepwell's kernel (cuda/fp8_gemm.cuh) on sm_90 for the shapes it takes
//! (`gemm::fp8_gemm::fits`), else the reference (`reference.rs`).

use deepwell_gpu::kernels::fp8_gemm::BScales;

use super::{reference, Call};
use crate::aten;
use crate::cuda;
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::gemm::fp8_gemm::{self, Gemm};
use crate::tensor::Tensor;

/// A's 1x128 scales (rows, K/128), any strides, as the (K/128, rows) M-major tensor the kernel
/// reads: a view when they are stored so already (what the quantizers' M-major layout gives).
fn m_major(op: Op, scale: &Tensor) -> Result<Tensor> {
    let (s, st) = (scale.sizes(), scale.strides());
    let t = scale.t(op)?;
    if st[0] == 1 && st[1] == s[0] {
        return Ok(t);
    }
    aten::contiguous(op, t)
}

pub(super) fn run(op: Op, c: Call) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, c.device)?;
    let hopper = launch.dev.capability() == (9, 0);
    if !hopper || !fp8_gemm::fits(c.rows, c.cols, c.k, c.b_scales) {
        return reference::run(op, c);
    }
    let a = cuda::contiguous(op, c.a.share(op)?)?;
    let b = cuda::contiguous(op, c.b.share(op)?)?;
    let sa = m_major(op, &c.a_scale)?;
    let sb = match c.b_scales {
        BScales::Tile128 => aten::contiguous(op, c.b_scale.share(op)?)?,
        BScales::Row1x128 => m_major(op, &c.b_scale)?,
    };
    let bias = c.bias.map(|t| aten::contiguous(op, aten::to_dtype(op, t, DType::F32)?)).transpose()?;
    let offsets = c.offsets.map(|t| aten::contiguous(op, t)).transpose()?;
    let g = Gemm {
        a: &a,
        sa: &sa,
        b: &b,
        sb: &sb,
        b_scales: c.b_scales,
        grouping: c.grouping,
        b_groups: c.b_groups,
        bias: bias.as_ref(),
        offsets: offsets.as_ref(),
        rows: c.rows,
        cols: c.cols,
        k: c.k,
        groups: c.groups,
        out: c.out,
    };
    Ok(vec![fp8_gemm::run(op, &launch, &g)?])
}
