//! Token permutation for grouped expert GEMMs, CPU reference: which (token, slot) assignment lands
//! on which row of the expert-grouped buffer, and back.
//!
//! The assignments of a [`super::Routing`] are flat slots `t·K + k`. The permuted buffer holds each
//! expert's kept assignments contiguously, experts in index order, and within an expert in
//! ascending slot order (a stable order: the result depends on nothing but the routing, so the
//! permutation and the combine are deterministic). Each expert's group is padded with empty rows to
//! a multiple of `align` (what a block-scaled grouped GEMM needs along M, e.g. 128 for fp8_block,
//! 32 for MXFP8; 1 for none). Experts with no tokens have empty groups; dropped assignments have no
//! row.
//!
//! The combine of expert outputs `y` (rows of the buffer) back to tokens is
//! `out[t] = Σ_k w[t, k] · y[row(t·K + k)]`, summed in k order, skipping dropped slots: no atomics,
//! the same bits every run.

use super::Routing;

/// Where every assignment goes in the expert-grouped buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permutation {
    /// For each buffer row, the flat slot it holds, or None for a padding row.
    pub rows: Vec<Option<usize>>,
    /// For each flat slot, its buffer row, or None when the assignment was dropped.
    pub row_of_slot: Vec<Option<usize>>,
    /// Kept assignments per expert (the grouped GEMM's true group sizes).
    pub group_sizes: Vec<usize>,
    /// Start row of each expert's (padded) group, plus the total: E + 1 entries.
    pub offsets: Vec<usize>,
}

/// The permutation of a routing's kept assignments, groups padded to multiples of `align` (>= 1).
pub fn permutation(r: &Routing, align: usize) -> Permutation {
    let num_experts = r.counts.len();
    let (mut group_sizes, mut offsets) = (vec![0usize; num_experts], vec![0usize; num_experts + 1]);
    let total = group_offsets(&r.experts, &r.dropped, align, &mut group_sizes, &mut offsets);
    let mut rows = vec![None; total];
    let mut row_of_slot = vec![None; r.experts.len()];
    place(&r.experts, &r.dropped, &offsets, &mut vec![0; num_experts], |slot, row| {
        rows[row] = Some(slot);
        row_of_slot[slot] = Some(row);
    });
    Permutation { rows, row_of_slot, group_sizes, offsets }
}

/// The groups of [`permutation`] in memory the caller owns (the op's CPU kernel allocates it
/// fallibly, so a huge E or T·K is an error, not an abort): fills `group_sizes` (E, the kept
/// assignments per expert) and `offsets` (E + 1, each group's start row, then the total) and
/// returns the total rows, every group padded to a multiple of `align` (>= 1).
///
/// # Panics
/// If an expert index is >= E, or `offsets.len() != group_sizes.len() + 1`.
pub fn group_offsets(
    experts: &[usize],
    dropped: &[bool],
    align: usize,
    group_sizes: &mut [usize],
    offsets: &mut [usize],
) -> usize {
    assert_eq!(offsets.len(), group_sizes.len() + 1, "group_offsets: offsets must have E + 1 entries");
    let align = align.max(1);
    group_sizes.fill(0);
    for (&e, &d) in experts.iter().zip(dropped) {
        if !d {
            group_sizes[e] += 1;
        }
    }
    let mut total = 0;
    for (o, &n) in offsets.iter_mut().zip(group_sizes.iter()) {
        *o = total;
        total += n.div_ceil(align) * align;
    }
    offsets[group_sizes.len()] = total;
    total
}

/// Calls `put(slot, row)` for every kept assignment, in slot order, `row` the next free row of its
/// expert's group (so each group holds its slots in ascending order): the rows of
/// [`permutation`], given the `offsets` of [`group_offsets`]. `next` (E entries) is scratch.
///
/// # Panics
/// If an expert index is >= E, or `next.len() + 1 != offsets.len()`.
pub fn place(
    experts: &[usize],
    dropped: &[bool],
    offsets: &[usize],
    next: &mut [usize],
    mut put: impl FnMut(usize, usize),
) {
    next.copy_from_slice(&offsets[..offsets.len() - 1]);
    for (slot, (&e, &d)) in experts.iter().zip(dropped).enumerate() {
        if !d {
            put(slot, next[e]);
            next[e] += 1;
        }
    }
}

/// Rows of the expert-grouped buffer that any routing of `assignments` (T·K) among `experts` fits
/// in once every group is padded to `align`: at most T·K + E·(align − 1), rounded up to `align`.
/// A buffer of this fixed size keeps every shape static (no host sync, torch.compile without
/// data-dependent shapes, CUDA graphs); [`Permutation::padded_to`] gives the spare rows to the last
/// group, as zero rows, so each group stays a multiple of `align`.
pub fn static_rows(assignments: usize, experts: usize, align: usize) -> usize {
    let align = align.max(1);
    (assignments + experts * (align - 1)).div_ceil(align) * align
}

impl Permutation {
    /// The same permutation in a buffer of `rows` (>= the current total) rows: the extra rows are
    /// padding appended to the last expert's group, so the offsets end at `rows`.
    pub fn padded_to(mut self, rows: usize) -> Permutation {
        let total = self.rows.len();
        assert!(rows >= total, "padded_to: {rows} rows cannot hold {total}");
        self.rows.resize(rows, None);
        if let Some(last) = self.offsets.last_mut() {
            *last = rows;
        }
        self
    }
}

/// `out[t] = Σ_k w[t·K + k] · y[row(t·K + k)]` for y (rows, d) row-major; out (T, d), in k order.
pub fn combine(p: &Permutation, r: &Routing, y: &[f32], d: usize) -> Vec<f32> {
    let (weights, top_k) = (&r.weights, r.top_k);
    let tokens = p.row_of_slot.len() / top_k;
    let mut out = vec![0f32; tokens * d];
    for (t, out_row) in out.chunks_mut(d).enumerate() {
        for k in 0..top_k {
            let slot = t * top_k + k;
            if let Some(r) = p.row_of_slot[slot] {
                let w = weights[slot];
                out_row.iter_mut().zip(&y[r * d..(r + 1) * d]).for_each(|(o, &v)| *o += w * v);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(top_k: usize, experts: &[usize], dropped: &[bool], num_experts: usize, weights: &[f32]) -> Routing {
        let mut counts = vec![0; num_experts];
        experts.iter().zip(dropped).filter(|(_, &d)| !d).for_each(|(&e, _)| counts[e] += 1);
        Routing {
            top_k,
            experts: experts.to_vec(),
            weights: weights.to_vec(),
            dropped: dropped.to_vec(),
            lb_counts: counts.clone(),
            counts,
            aux_loss: 0.0,
            z_loss: 0.0,
        }
    }

    #[test]
    fn groups_are_contiguous_stable_and_padded() {
        // 3 tokens, top-2, 3 experts: slots 0..6 -> experts [2, 0, 0, 2, 2, 0].
        let p = permutation(&routing(2, &[2, 0, 0, 2, 2, 0], &[false; 6], 3, &[1.0; 6]), 4);
        assert_eq!(p.group_sizes, vec![3, 0, 3]);
        assert_eq!(p.offsets, vec![0, 4, 4, 8]); // expert 1 has an empty group
        assert_eq!(&p.rows[0..4], &[Some(1), Some(2), Some(5), None]);
        assert_eq!(&p.rows[4..8], &[Some(0), Some(3), Some(4), None]);
        for (slot, row) in p.row_of_slot.iter().enumerate() {
            assert_eq!(p.rows[row.unwrap()], Some(slot));
        }
    }

    #[test]
    fn dropped_slots_get_no_row_and_all_to_one_expert_works() {
        let p = permutation(&routing(2, &[1, 1, 1, 1], &[false, true, false, false], 2, &[1.0; 4]), 1);
        assert_eq!(p.group_sizes, vec![0, 3]);
        assert_eq!(p.offsets, vec![0, 0, 3]);
        assert_eq!(p.row_of_slot, vec![Some(0), None, Some(1), Some(2)]);
    }

    #[test]
    fn the_static_buffer_fits_every_routing_and_keeps_groups_aligned() {
        // 3 tokens, top-2, 3 experts, align 4: at most 6 + 3 * 3 = 15 rows, rounded to 16.
        assert_eq!(static_rows(6, 3, 4), 16);
        assert_eq!(static_rows(6, 3, 1), 6);
        for experts in [[0, 0, 0, 0, 0, 0], [0, 1, 2, 0, 1, 2], [2, 2, 1, 2, 0, 2]] {
            let p = permutation(&routing(2, &experts, &[false; 6], 3, &[1.0; 6]), 4);
            assert!(p.rows.len() <= 16);
            let p = p.padded_to(16);
            assert_eq!((p.rows.len(), p.offsets[3]), (16, 16));
            assert!(p.offsets.iter().all(|o| o % 4 == 0));
        }
    }

    #[test]
    fn combine_weights_the_expert_rows_back_into_tokens() {
        // 2 tokens, top-2, d = 2; experts [0, 1, 1, 0].
        let r = routing(2, &[0, 1, 1, 0], &[false, false, false, true], 2, &[0.5, 0.25, 1.0, 9.0]);
        let p = permutation(&r, 1);
        // Buffer rows: expert 0: slot 0; expert 1: slots 1, 2.
        let y = [1.0, 2.0, 10.0, 20.0, 100.0, 200.0];
        let out = combine(&p, &r, &y, 2);
        assert_eq!(out, vec![0.5 * 1.0 + 0.25 * 10.0, 0.5 * 2.0 + 0.25 * 20.0, 100.0, 200.0]);
    }
}
