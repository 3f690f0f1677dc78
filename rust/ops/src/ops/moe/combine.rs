//! `deepwell.moe_gather_rows`, `moe_sum_slots`, `moe_slot_dots`: the value moves of a
//! Mixture-of-Experts layer between token order and the expert-grouped buffer, fused so that each
//! output element is read and written once (torch_ops/deepwell/ops/moe.py `moe_dispatch` /
//! `moe_combine` build their forward and backward from them; autograd stays in Python). The
//! numerics are those the pure-torch version documented: sums over k in k order in fp32, one cast
//! to the output dtype, dropped slots (index -1) contribute 0, padding rows are zero, no atomics.
//! CPU reference: `combine_cpu.rs`; CUDA: `combine_cuda.rs` (cuda/moe.cuh), bit-identical to it.
//!
//! - `moe_gather_rows(src (T, D), index int32 (R), weights fp32 (T, K)?, top_k) -> (R, D)`:
//!   row r = src[index[r] / top_k], times weights.flat[index[r]] in fp32 when given (rounded once),
//!   zeros where index[r] == -1. Dispatch's forward (index = slot_of_row) and combine's d_rows.
//! - `moe_sum_slots(rows (N, D), row_of_slot int32 (T, K), weights fp32 (T, K)?) -> (T, D)`:
//!   out[t] = Σ_k w[t, k] · rows[row_of_slot[t, k]]. Combine's forward, dispatch's backward.
//! - `moe_slot_dots(rows (N, D), row_of_slot int32 (T, K), grad (T, D)) -> fp32 (T, K)`:
//!   dot(rows[row_of_slot[t, k]], grad[t]) in a fixed order (cuda/moe.cuh `moe_slot_dots`).
//!   Combine's d_weights.
//!
//! Floats are fp32, bf16 or fp16 (float64 stays on the Python path); every output has the dtype of
//! the float input except the dots (fp32). The weights are fp32: the sums read them as fp32 anyway.

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::ops::run_one;
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

use super::{combine_cpu as cpu, combine_cuda as cuda};

pub static GATHER_ROWS: OpSpec = OpSpec {
    name: "moe_gather_rows",
    args: &[("src", Kind::Tensor), ("index", Kind::Tensor), ("weights", Kind::OptTensor), ("top_k", Kind::Int)],
    returns: 1,
};

pub static SUM_SLOTS: OpSpec = OpSpec {
    name: "moe_sum_slots",
    args: &[("rows", Kind::Tensor), ("row_of_slot", Kind::Tensor), ("weights", Kind::OptTensor)],
    returns: 1,
};

pub static SLOT_DOTS: OpSpec = OpSpec {
    name: "moe_slot_dots",
    args: &[("rows", Kind::Tensor), ("row_of_slot", Kind::Tensor), ("grad", Kind::Tensor)],
    returns: 1,
};

/// `moe_gather_rows`.
pub fn gather_rows(
    op: Op,
    on: Backend,
    src: Tensor,
    index: Tensor,
    weights: Option<Tensor>,
    top_k: i64,
) -> Result<Tensor> {
    let g = GatherRows::new(op, on, src, index, weights, top_k)?;
    run_one(op, on, g, cpu::gather_rows, cuda::gather_rows)
}

/// `moe_sum_slots`.
pub fn sum_slots(op: Op, on: Backend, rows: Tensor, row_of_slot: Tensor, weights: Option<Tensor>) -> Result<Tensor> {
    let s = Slots::new(op, on, rows, row_of_slot, weights, None)?;
    run_one(op, on, s, cpu::sum_slots, cuda::sum_slots)
}

/// `moe_slot_dots`.
pub fn slot_dots(op: Op, on: Backend, rows: Tensor, row_of_slot: Tensor, grad: Tensor) -> Result<Tensor> {
    let s = Slots::new(op, on, rows, row_of_slot, None, Some(grad))?;
    run_one(op, on, s, cpu::slot_dots, cuda::slot_dots)
}

pub(super) fn gather_rows_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (src, index, weights, top_k) =
        (a.tensor("src")?, a.tensor("index")?, a.opt_tensor("weights")?, a.int("top_k")?);
    Ok(vec![gather_rows(a.op(), on, src, index, weights, top_k)?])
}

pub(super) fn sum_slots_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (rows, row_of_slot, weights) = (a.tensor("rows")?, a.tensor("row_of_slot")?, a.opt_tensor("weights")?);
    Ok(vec![sum_slots(a.op(), on, rows, row_of_slot, weights)?])
}

pub(super) fn slot_dots_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (rows, row_of_slot, grad) = (a.tensor("rows")?, a.tensor("row_of_slot")?, a.tensor("grad")?);
    Ok(vec![slot_dots(a.op(), on, rows, row_of_slot, grad)?])
}

// ---------------------------------------------------------------------------------------------
// Validation (mirrored by torch_ops/deepwell/ops/moe.py `_check_gather` / `_check_slots`)

fn two_d(op: Op, arg: &'static str, t: &Tensor, what: &str) -> Result<(usize, usize)> {
    if t.dim() != 2 {
        return Err(Error::arg(op, arg, format!("be 2-d {what}"), format!("a {}-d tensor", t.dim())));
    }
    check::non_empty(op, arg, t, 2)?;
    Ok((t.sizes()[0] as usize, t.sizes()[1] as usize))
}

/// The optional fp32 (T, K) routing weights.
fn check_weights(op: Op, weights: Option<&Tensor>, t: usize, k: usize) -> Result<()> {
    if let Some(w) = weights {
        check::dtype_in(op, "weights", w, &[DType::F32])?;
        check::shape_eq(op, "weights", w, &[t as i64, k as i64])?;
    }
    Ok(())
}

/// Index arithmetic stays in int64 on the device; the int32 indices bound the row counts.
fn fits_int32(op: Op, arg: &'static str, n: usize, what: &str) -> Result<()> {
    if n > i32::MAX as usize {
        return Err(Error::arg(op, arg, "give fewer than 2^31 slots (int32 indices)", format!("{n} {what}")));
    }
    Ok(())
}

/// A validated `moe_gather_rows` call.
pub(super) struct GatherRows {
    pub src: Tensor,
    pub index: Tensor,
    pub weights: Option<Tensor>,
    pub dtype: DType,
    pub device: Device,
    /// src is (tokens, d); the index holds slots t·top_k + k, so tokens · top_k of them.
    pub tokens: usize,
    pub d: usize,
    pub top_k: usize,
    pub rows: usize,
}

impl GatherRows {
    fn new(op: Op, on: Backend, src: Tensor, index: Tensor, weights: Option<Tensor>, top_k: i64) -> Result<GatherRows> {
        let dtype = check::dtype_in(op, "src", &src, &check::FLOAT_INPUTS)?;
        check::dtype_in(op, "index", &index, &[DType::I32])?;
        let mut tensors = vec![("src", &src), ("index", &index)];
        if let Some(w) = &weights {
            tensors.push(("weights", w));
        }
        let device = check::same_device(op, on, &tensors)?;
        let (tokens, d) = two_d(op, "src", &src, "(tokens, hidden)")?;
        if index.dim() != 1 {
            return Err(Error::arg(op, "index", "be 1-d (rows)", format!("a {}-d tensor", index.dim())));
        }
        check::non_empty(op, "index", &index, 1)?;
        if top_k < 1 {
            return Err(Error::arg(op, "top_k", "be positive", top_k));
        }
        let top_k = top_k as usize;
        fits_int32(op, "src", tokens.saturating_mul(top_k), "slots")?;
        check_weights(op, weights.as_ref(), tokens, top_k)?;
        let rows = index.sizes()[0] as usize;
        Ok(GatherRows { src, index, weights, dtype, device, tokens, d, top_k, rows })
    }

    pub fn output(&self, op: Op) -> Result<Tensor> {
        Tensor::empty(op, &[self.rows as i64, self.d as i64], self.dtype, self.device)
    }
}

/// A validated `moe_sum_slots` (weights, no grad) or `moe_slot_dots` (grad) call.
pub(super) struct Slots {
    pub rows: Tensor,
    pub row_of_slot: Tensor,
    pub weights: Option<Tensor>,
    pub grad: Option<Tensor>,
    pub dtype: DType,
    pub device: Device,
    /// rows is (n_rows, d); row_of_slot is (tokens, top_k).
    pub n_rows: usize,
    pub d: usize,
    pub tokens: usize,
    pub top_k: usize,
}

impl Slots {
    fn new(
        op: Op,
        on: Backend,
        rows: Tensor,
        row_of_slot: Tensor,
        weights: Option<Tensor>,
        grad: Option<Tensor>,
    ) -> Result<Slots> {
        let dtype = check::dtype_in(op, "rows", &rows, &check::FLOAT_INPUTS)?;
        check::dtype_in(op, "row_of_slot", &row_of_slot, &[DType::I32])?;
        let mut tensors = vec![("rows", &rows), ("row_of_slot", &row_of_slot)];
        for (name, t) in [("weights", &weights), ("grad", &grad)] {
            if let Some(t) = t {
                tensors.push((name, t));
            }
        }
        let device = check::same_device(op, on, &tensors)?;
        let (n_rows, d) = two_d(op, "rows", &rows, "(rows, hidden)")?;
        let (tokens, top_k) = two_d(op, "row_of_slot", &row_of_slot, "(tokens, top_k)")?;
        fits_int32(op, "row_of_slot", tokens * top_k, "slots")?;
        check_weights(op, weights.as_ref(), tokens, top_k)?;
        if let Some(g) = &grad {
            check::dtype_in(op, "grad", g, &[dtype])?;
            check::shape_eq(op, "grad", g, &[tokens as i64, d as i64])?;
        }
        Ok(Slots { rows, row_of_slot, weights, grad, dtype, device, n_rows, d, tokens, top_k })
    }

    /// (T, D) of the rows' dtype (sums) or fp32 (T, K) (dots).
    pub fn output(&self, op: Op) -> Result<Tensor> {
        let (t, k, d) = (self.tokens as i64, self.top_k as i64, self.d as i64);
        match self.grad {
            None => Tensor::empty(op, &[t, d], self.dtype, self.device),
            Some(_) => Tensor::empty(op, &[t, k], DType::F32, self.device),
        }
    }
}
