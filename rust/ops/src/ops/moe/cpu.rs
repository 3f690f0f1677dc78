//! CPU reference kernels of the MoE ops (maths: deepwell_core::moe).

use deepwell_core::moe::{group_offsets, place, route as core_route, Routing};

use super::{PermuteIndex, Route};
use crate::error::{Error, Op, Result};
use crate::host::{self, with_floats};
use crate::tensor::Tensor;

/// Reads a validated float tensor as fp32 (exact widening; `f32::from` is the identity on the
/// fp32 arm of `with_floats!`).
///
/// # Safety
/// `t` must be a non-empty CPU tensor of dtype `dtype` (one of the float inputs).
#[allow(clippy::useless_conversion)]
unsafe fn f32s(op: Op, t: &Tensor, dtype: crate::dtype::DType) -> Result<Vec<f32>> {
    let mut out = host::buffer(op, t.numel(), "fp32 router logits")?;
    // SAFETY: guaranteed by the caller.
    unsafe { with_floats!(host::float_slice(op, t, dtype)?, xs => out.extend(xs.iter().map(|&v| f32::from(v)))) };
    Ok(out)
}

fn to_i32(op: Op, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Internal { op, msg: format!("{v} does not fit an int32 output") })
}

pub(super) fn route(op: Op, r: Route) -> Result<Vec<Tensor>> {
    // SAFETY: validated non-empty CPU float tensors.
    let logits = unsafe { f32s(op, &r.logits, r.dtype)? };
    let bias = match &r.bias {
        // SAFETY: as above (the bias was checked to be a float (E) tensor on the CPU).
        Some(b) => Some(unsafe { f32s(op, b, b.dtype())? }),
        None => None,
    };
    let routing: Routing = core_route(&logits, bias.as_deref(), &r.cfg)
        .map_err(|e| Error::Internal { op, msg: format!("validated arguments refused: {e}") })?;
    let outs = r.outputs(op)?;
    // SAFETY: fresh contiguous CPU outputs of the sizes `outputs` gave: (T, K) int32 and bool, (E)
    // int32 twice; the routing has T·K assignments and E counts.
    unsafe {
        let [experts, dropped, counts, lb] = &outs;
        for (o, &e) in experts.as_mut_slice::<i32>().iter_mut().zip(&routing.experts) {
            *o = to_i32(op, e)?;
        }
        for (o, &d) in dropped.as_mut_slice::<bool>().iter_mut().zip(&routing.dropped) {
            *o = d;
        }
        for (o, &c) in counts.as_mut_slice::<i32>().iter_mut().zip(&routing.counts) {
            *o = to_i32(op, c)?;
        }
        for (o, &c) in lb.as_mut_slice::<i32>().iter_mut().zip(&routing.lb_counts) {
            *o = to_i32(op, c)?;
        }
    }
    Ok(outs.into())
}

pub(super) fn permute_index(op: Op, p: PermuteIndex) -> Result<Vec<Tensor>> {
    // Every host buffer is fallible (`host::buffer`) and proportional to T·K or E, which
    // `PermuteIndex::new` bounds; the R-row output is torch's allocation: a huge call is an
    // `Error::Alloc`, never an abort.
    // SAFETY: validated non-empty CPU tensors of dtype int32 and bool (read as bytes: a bool
    // tensor's byte that is not 0 or 1 is true, as torch and the CUDA kernel read it).
    let (ids, flags) = unsafe { (host::row_major::<i32>(op, &p.experts)?, host::row_major::<u8>(op, &p.dropped)?) };
    let mut experts = host::buffer(op, ids.len(), "expert indices")?;
    for (i, &e) in ids.iter().enumerate() {
        if e < 0 || e as usize >= p.num_experts {
            let (t, k) = (i / p.top_k, i % p.top_k);
            let want = format!("hold expert indices in [0, {})", p.num_experts);
            return Err(Error::arg(op, "experts", want, format!("{e} at [{t}, {k}]")));
        }
        experts.push(e as usize);
    }
    let mut dropped = host::buffer(op, flags.len(), "dropped flags")?;
    dropped.extend(flags.iter().map(|&b| b != 0));
    let mut group_sizes = host::filled(op, p.num_experts, 0usize, "group sizes")?;
    let mut offsets = host::filled(op, p.num_experts + 1, 0usize, "group offsets")?;
    let mut next = host::filled(op, p.num_experts, 0usize, "group cursors")?;
    let total = group_offsets(&experts, &dropped, p.align, &mut group_sizes, &mut offsets);
    if total > p.rows {
        return Err(Error::Internal { op, msg: format!("{total} rows exceed the static {}", p.rows) });
    }
    // The spare rows of the static buffer pad the last group (`Permutation::padded_to`).
    offsets[p.num_experts] = p.rows;
    let outs = p.outputs(op)?;
    // SAFETY: fresh contiguous CPU int32 outputs of T·K, R and E + 1 elements; `place` gives slots
    // < T·K and rows < total <= R, all < 2^31 (`PermuteIndex::new`), so the casts are exact.
    unsafe {
        let [row_of_slot, slot_of_row, offsets_out] = &outs;
        let (ros, sor) = (row_of_slot.as_mut_slice::<i32>(), slot_of_row.as_mut_slice::<i32>());
        ros.fill(-1);
        sor.fill(-1);
        place(&experts, &dropped, &offsets, &mut next, |slot, row| {
            ros[slot] = row as i32;
            sor[row] = slot as i32;
        });
        for (o, &v) in offsets_out.as_mut_slice::<i32>().iter_mut().zip(&offsets) {
            *o = to_i32(op, v)?;
        }
    }
    Ok(outs.into())
}
