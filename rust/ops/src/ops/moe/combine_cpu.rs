//! CPU reference of the MoE value moves (`combine.rs`): the definitions cuda/moe.cuh's
//! `moe_gather_rows`, `moe_sum_slots` and `moe_slot_dots` reproduce bit for bit. Each product and
//! each sum is rounded to fp32 on its own (Rust never contracts `a * b + c` into an fma; the kernels
//! use `__fmul_rn` / `__fadd_rn`). Unlike the kernels, an index outside its range is an error here.

use deepwell_core::Element;
use half::{bf16, f16};

use super::combine::{GatherRows, Slots};
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::host;
use crate::tensor::Tensor;

/// Elements per lane step of the dots (cuda/moe.cuh `MOE_DOT_CHUNK`) and lanes of a warp.
const DOT_CHUNK: usize = 8;
const LANES: usize = 32;

/// Runs `$f::<T>` for the float element type `T` of `$dtype` (validated: fp32, bf16 or fp16).
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($a:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($a),*),
            DType::BF16 => $f::<bf16>($($a),*),
            _ => $f::<f16>($($a),*),
        }
    };
}

/// The row an index names, None for -1 (dropped / padding); anything else outside [0, limit) is an
/// error naming the argument and position.
fn row(op: Op, arg: &'static str, v: i32, limit: usize, at: usize, what: &str) -> Result<Option<usize>> {
    match v {
        -1 => Ok(None),
        v if v >= 0 && (v as usize) < limit => Ok(Some(v as usize)),
        v => Err(Error::arg(op, arg, format!("hold -1 or {what} in [0, {limit})"), format!("{v} at [{at}]"))),
    }
}

/// The fp32 weights, if any.
///
/// # Safety
/// `w` must be a validated non-empty fp32 CPU tensor.
unsafe fn weights(op: Op, w: &Option<Tensor>) -> Result<Option<std::borrow::Cow<'_, [f32]>>> {
    // SAFETY: guaranteed by the caller.
    w.as_ref().map(|w| unsafe { host::row_major::<f32>(op, w) }).transpose()
}

pub(super) fn gather_rows(op: Op, g: GatherRows) -> Result<Vec<Tensor>> {
    let out = g.output(op)?;
    by_dtype!(g.dtype, gather_typed(op, &g, &out))?;
    Ok(vec![out])
}

fn gather_typed<T: Element>(op: Op, g: &GatherRows, out: &Tensor) -> Result<()> {
    // SAFETY: validated non-empty CPU tensors of these element types.
    let (src, index, w) =
        unsafe { (host::row_major::<T>(op, &g.src)?, host::row_major::<i32>(op, &g.index)?, weights(op, &g.weights)?) };
    // SAFETY: `out` is the fresh contiguous (rows, d) output of element type T.
    let o = unsafe { out.as_mut_slice::<T>() };
    let d = g.d;
    for (r, &s) in index.iter().enumerate() {
        let dst = &mut o[r * d..(r + 1) * d];
        match row(op, "index", s, g.tokens * g.top_k, r, "slots")? {
            None => dst.fill(T::from_f32(0.0)),
            Some(s) => {
                let x = &src[s / g.top_k * d..(s / g.top_k + 1) * d];
                match &w {
                    None => dst.copy_from_slice(x), // the kernel copies bits too
                    Some(w) => {
                        for (o, &x) in dst.iter_mut().zip(x) {
                            *o = T::from_f32(w[s] * x.to_f32());
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

pub(super) fn sum_slots(op: Op, s: Slots) -> Result<Vec<Tensor>> {
    let out = s.output(op)?;
    by_dtype!(s.dtype, sum_typed(op, &s, &out))?;
    Ok(vec![out])
}

/// out[t] = T(Σ_k term_k): the fp32 sum starts at -0.0 (the identity: one term passes unchanged)
/// and adds, in k order, fp32(x) · fp32(w) (x alone without weights), or +0.0 for a dropped slot.
fn sum_typed<T: Element>(op: Op, s: &Slots, out: &Tensor) -> Result<()> {
    // SAFETY: validated non-empty CPU tensors of these element types.
    let (rows, ros, w) = unsafe {
        (host::row_major::<T>(op, &s.rows)?, host::row_major::<i32>(op, &s.row_of_slot)?, weights(op, &s.weights)?)
    };
    // SAFETY: `out` is the fresh contiguous (tokens, d) output of element type T.
    let o = unsafe { out.as_mut_slice::<T>() };
    let (d, k) = (s.d, s.top_k);
    let mut acc = host::buffer::<f32>(op, d, "one fp32 output row")?;
    for t in 0..s.tokens {
        acc.clear();
        acc.resize(d, -0.0);
        for j in 0..k {
            let slot = t * k + j;
            match row(op, "row_of_slot", ros[slot], s.n_rows, slot, "rows")? {
                None => acc.iter_mut().for_each(|a| *a += 0.0),
                Some(r) => {
                    let x = &rows[r * d..(r + 1) * d];
                    match &w {
                        None => acc.iter_mut().zip(x).for_each(|(a, x)| *a += x.to_f32()),
                        Some(w) => acc.iter_mut().zip(x).for_each(|(a, x)| *a += x.to_f32() * w[slot]),
                    }
                }
            }
        }
        for (o, &a) in o[t * d..(t + 1) * d].iter_mut().zip(&acc) {
            *o = T::from_f32(a);
        }
    }
    Ok(())
}

pub(super) fn slot_dots(op: Op, s: Slots) -> Result<Vec<Tensor>> {
    let out = s.output(op)?;
    by_dtype!(s.dtype, dots_typed(op, &s, &out))?;
    Ok(vec![out])
}

fn dots_typed<T: Element>(op: Op, s: &Slots, out: &Tensor) -> Result<()> {
    let grad = s.grad.as_ref().ok_or(Error::Internal { op, msg: "moe_slot_dots without grad".into() })?;
    // SAFETY: validated non-empty CPU tensors of these element types.
    let (rows, ros, g) = unsafe {
        (
            host::row_major::<T>(op, &s.rows)?,
            host::row_major::<i32>(op, &s.row_of_slot)?,
            host::row_major::<T>(op, grad)?,
        )
    };
    // SAFETY: `out` is the fresh contiguous fp32 (tokens, top_k) output.
    let o = unsafe { out.as_mut_slice::<f32>() };
    let d = s.d;
    for (slot, o) in o.iter_mut().enumerate() {
        let t = slot / s.top_k;
        *o = match row(op, "row_of_slot", ros[slot], s.n_rows, slot, "rows")? {
            None => 0.0,
            Some(r) => slot_dot(&rows[r * d..(r + 1) * d], &g[t * d..(t + 1) * d]),
        };
    }
    Ok(())
}

/// cuda/moe.cuh `moe_slot_dots`' order: lane l sums the products of chunks l, l + 32, ... of
/// DOT_CHUNK elements from +0.0, then the shuffle-down tree p[l] += p[l + off], off = 16 .. 1.
fn slot_dot<T: Element>(x: &[T], g: &[T]) -> f32 {
    let mut p = [0.0f32; LANES];
    for (c, (xc, gc)) in x.chunks(DOT_CHUNK).zip(g.chunks(DOT_CHUNK)).enumerate() {
        let lane = &mut p[c % LANES];
        for (a, b) in xc.iter().zip(gc) {
            *lane += a.to_f32() * b.to_f32();
        }
    }
    let mut off = LANES / 2;
    while off > 0 {
        for l in 0..off {
            p[l] += p[l + off];
        }
        off /= 2;
    }
    p[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_order_is_lanes_then_tree() {
        // 40 ones: lanes 0..4 hold 8 each (chunks 0..4), the tree adds them: exact 40.
        let x = vec![1.0f32; 40];
        assert_eq!(slot_dot(&x, &x), 40.0);
        // Lane 0 (chunk 0): 2^24 + 1 rounds to 2^24; lane 1 (chunk 1): 1 + 1 = 2; the tree gives
        // 2^24 + 2 exactly, where a left-to-right sum rounds each + 1 away (2^24).
        let mut a = vec![0.0f32; 16];
        a[0] = 16777216.0;
        a[1] = 1.0;
        a[8] = 1.0;
        a[9] = 1.0;
        let ones = vec![1.0f32; 16];
        assert_eq!(slot_dot(&a, &ones), 16777218.0);
    }
}
