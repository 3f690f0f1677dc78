//! CUDA launches of the MoE value moves (cuda/moe.cuh `moe_gather_rows`, `moe_sum_slots`,
//! `moe_slot_dots`), bit-identical to `combine_cpu.rs`. Inputs are made contiguous; no host sync.

use deepwell_gpu::kernels::moe::MoeSizes;
use deepwell_gpu::kernels::Moe;
use deepwell_gpu::Params;

use super::combine::{GatherRows, Slots};
use crate::cuda::{self, float, ptr};
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

const NULL: *const std::ffi::c_void = std::ptr::null();

/// Elements per chunk of the gather / sums vector path (moe.cuh `MoeVec`).
fn vector_elems(t: &Tensor) -> usize {
    16 / t.dtype().size().unwrap_or(16)
}

fn contiguous(op: Op, t: &Tensor) -> Result<Tensor> {
    cuda::contiguous(op, t.share(op)?)
}

pub(super) fn gather_rows(op: Op, g: GatherRows) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, g.device)?;
    let (src, index) = (contiguous(op, &g.src)?, contiguous(op, &g.index)?);
    let weights = g.weights.as_ref().map(|w| contiguous(op, w)).transpose()?;
    let out = g.output(op)?;
    let vector = g.d % vector_elems(&src) == 0 && cuda::aligned(&[&src, &out]);
    let sizes = MoeSizes::items(float(g.dtype), g.rows as u64, g.d as u64, vector);
    let p = Params::new()
        .ptr(ptr(&src))
        .ptr(ptr(&index))
        .ptr(weights.as_ref().map_or(NULL, ptr))
        .ptr(ptr(&out))
        .i64(g.rows as i64)
        .i64(g.d as i64)
        .i64(g.tokens as i64)
        .i64(g.top_k as i64);
    // SAFETY: contiguous tensors on the launch's device: src (tokens, d) of the template's dtype,
    // index int32 (rows), weights fp32 (tokens · top_k) or null, out (rows, d); the kernel reads
    // only indices in [0, tokens · top_k).
    unsafe { launch.run(op, Moe::GatherRows { input: float(g.dtype) }, sizes, p)? };
    Ok(vec![out])
}

pub(super) fn sum_slots(op: Op, s: Slots) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, s.device)?;
    let (rows, ros) = (contiguous(op, &s.rows)?, contiguous(op, &s.row_of_slot)?);
    let weights = s.weights.as_ref().map(|w| contiguous(op, w)).transpose()?;
    let out = s.output(op)?;
    let vector = s.d % vector_elems(&rows) == 0 && cuda::aligned(&[&rows, &out]);
    let sizes = MoeSizes::items(float(s.dtype), s.tokens as u64, s.d as u64, vector);
    let p = Params::new()
        .ptr(ptr(&rows))
        .ptr(ptr(&ros))
        .ptr(weights.as_ref().map_or(NULL, ptr))
        .ptr(ptr(&out))
        .i64(s.tokens as i64)
        .i32(top_k(op, &s)?)
        .i64(s.d as i64)
        .i64(s.n_rows as i64);
    // SAFETY: contiguous tensors on the launch's device: rows (n_rows, d) of the template's dtype,
    // row_of_slot int32 and weights fp32 (or null) (tokens, top_k), out (tokens, d); the kernel
    // reads only rows in [0, n_rows).
    unsafe { launch.run(op, Moe::SumSlots { input: float(s.dtype) }, sizes, p)? };
    Ok(vec![out])
}

pub(super) fn slot_dots(op: Op, s: Slots) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, s.device)?;
    let grad = s.grad.as_ref().ok_or(Error::Internal { op, msg: "moe_slot_dots without grad".into() })?;
    let (rows, ros, grad) = (contiguous(op, &s.rows)?, contiguous(op, &s.row_of_slot)?, contiguous(op, grad)?);
    let out = s.output(op)?;
    let slots = (s.tokens * s.top_k) as i64;
    let p = Params::new()
        .ptr(ptr(&rows))
        .ptr(ptr(&ros))
        .ptr(ptr(&grad))
        .ptr(ptr(&out))
        .i64(slots)
        .i32(top_k(op, &s)?)
        .i64(s.d as i64)
        .i64(s.n_rows as i64);
    // One warp per slot on either path (the kernel picks its path from d and the alignment).
    let sizes = MoeSizes { tokens: slots as u64, experts: 0 };
    // SAFETY: contiguous tensors on the launch's device: rows (n_rows, d) and grad (tokens, d) of
    // the template's dtype, row_of_slot int32 (tokens, top_k), out fp32 (tokens, top_k).
    unsafe { launch.run(op, Moe::SlotDots { input: float(s.dtype) }, sizes, p)? };
    Ok(vec![out])
}

/// top_k as the kernels' `int` (slots < 2^31 were checked, so top_k fits too).
fn top_k(op: Op, s: &Slots) -> Result<i32> {
    i32::try_from(s.top_k).map_err(|_| Error::Internal { op, msg: format!("top_k {} does not fit an int", s.top_k) })
}
