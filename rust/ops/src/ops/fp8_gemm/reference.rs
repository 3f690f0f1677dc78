//! What the FP8 GEMMs compute, on any device: both operands dequantized exactly to fp32 (every
//! E4M3 code times a power-of-two scale is an fp32), multiplied in fp32, + bias, rounded once to
//! the output dtype. The CPU kernel, and the CUDA fallback off sm_90 or for shapes the kernel does
//! not take (dense only: grouped calls need the offsets, which a GPU fallback would read with a
//! host sync).

use deepwell_gpu::kernels::fp8_gemm::{BScales, Grouping};

use super::{BGroups, Call};
use crate::aten;
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::gemm::{epilogue, quantizers as k};
use crate::tensor::Tensor;

/// Codes `data` with scales `scale` (natural layout, any strides) dequantized to fp32.
fn dequant(op: Op, data: Tensor, scale: Tensor, block: (i64, i64)) -> Result<Tensor> {
    let scale = aten::contiguous(op, scale)?;
    k::fp8_block_dequantize(op, data, scale, block, DType::F32)
}

/// (rows, K) x (cols, K)^T in fp32.
fn mm(op: Op, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    aten::mm(op, a.share(op)?, b.t(op)?)
}

pub(super) fn run(op: Op, c: Call) -> Result<Vec<Tensor>> {
    // A grouped call's offsets first: refused on a GPU (and checked) before any work.
    let bounds = match (c.grouping, &c.offsets) {
        (Grouping::Dense, _) => Vec::new(),
        (_, None) => return Err(Error::Internal { op, msg: "grouped GEMM without offsets".into() }),
        (_, Some(offsets)) => {
            let bounds = host_offsets(op, offsets, c.device)?;
            check_offsets(op, &bounds, if c.grouping == Grouping::K { c.k } else { c.rows }, c.grouping)?;
            bounds
        }
    };
    let a = dequant(op, c.a, c.a_scale, (1, 128))?;
    let b_block = if c.b_scales == BScales::Tile128 { (128, 128) } else { (1, 128) };
    let b = dequant(op, c.b, c.b_scale, b_block)?;
    let y = match c.grouping {
        Grouping::Dense => mm(op, &a, &b)?,
        Grouping::Rows | Grouping::K => {
            let mut parts = Vec::with_capacity(c.groups as usize);
            for g in 0..c.groups as usize {
                let (lo, len) = (bounds[g] as i64, (bounds[g + 1] - bounds[g]) as i64);
                parts.push(if c.grouping == Grouping::Rows {
                    let bg = match c.b_groups {
                        BGroups::Stacked => {
                            aten::narrow(op, &b, 0, g as i64, 1)?.reshape_contiguous(op, &[c.cols, c.k])?
                        }
                        BGroups::SideBySide => aten::narrow(op, &b, 1, g as i64 * c.k, c.k)?,
                    };
                    mm(op, &aten::narrow(op, &a, 0, lo, len)?, &bg)?
                } else {
                    mm(op, &aten::narrow(op, &a, 1, lo, len)?, &aten::narrow(op, &b, 1, lo, len)?)?
                });
            }
            if c.grouping == Grouping::Rows {
                aten::cat(op, parts, 0)?
            } else {
                let y = aten::stack(op, parts, 0)?;
                return Ok(vec![aten::to_dtype(op, y, c.out)?]);
            }
        }
    };
    Ok(vec![epilogue::apply(op, y, None, c.bias, c.out)?])
}

/// The offsets as host integers (CPU tensors only: reading device offsets would sync).
fn host_offsets(op: Op, offsets: &Tensor, device: Device) -> Result<Vec<i32>> {
    if device != Device::Cpu {
        return Err(Error::Unsupported {
            op,
            what: "grouped FP8 GEMMs on this GPU: deepwell's kernel needs an sm_90 GPU (H100/H200); the reference runs on CPU tensors".into(),
        });
    }
    let t = aten::contiguous(op, offsets.share(op)?)?;
    // SAFETY: a contiguous int32 CPU tensor, read only.
    Ok(unsafe { t.as_slice::<i32>() }.to_vec())
}

/// Offsets from 0 to `total`, non-decreasing; the wgrad's whole 128-blocks.
fn check_offsets(op: Op, o: &[i32], total: i64, grouping: Grouping) -> Result<()> {
    let monotone = o.windows(2).all(|w| w[0] <= w[1]);
    let aligned = grouping != Grouping::K || o.iter().all(|v| v % 128 == 0);
    if o[0] != 0 || *o.last().unwrap_or(&0) as i64 != total || !monotone || !aligned {
        let what = if grouping == Grouping::K {
            format!("run from 0 to K = {total} without decreasing, in multiples of 128")
        } else {
            format!("run from 0 to the rows of a ({total}) without decreasing")
        };
        return Err(Error::arg(op, "offsets", what, format!("{o:?}")));
    }
    Ok(())
}
