//! Parallel tiling shared by the MXFP8 and FP8-block quantizers (crate-internal).
//!
//! Both formats quantize "units" of `unit_rows` consecutive rows of `width` elements, taking one
//! scale per `group` columns over all the unit's rows:
//!
//! | case | unit_rows | width | group |
//! |---|---|---|---|
//! | MXFP8 along the last dim (inner == 1) | 1 | numel | 32 |
//! | MXFP8 along another dim | 32 | inner | 1 |
//! | FP8 block 1 x bc | 1 | numel | bc |
//! | FP8 block br x bc | br | cols | bc |
//!
//! Each unit is cut into column tiles (a multiple of `group` wide, about [`TILE_ELEMS`]
//! elements), and rayon runs the tiles. A tile is read twice (amax pass, encode pass) while it
//! is still in cache, and always row by row, so a quantized dim that is not the last one is
//! walked with unit stride: per (outer, block) the amax of all inner positions is built at once.

use crate::element::Element;
use crate::formats::abs_bits_max;
use rayon::prelude::*;

/// Elements per work item: large enough to amortize scheduling, small enough that a tile stays
/// in L2 between its two passes.
const TILE_ELEMS: usize = 32 * 1024;

/// Columns `c0 .. c0 + w` of every row of one unit.
pub(crate) struct Tile<'a, T> {
    unit: &'a [T],
    width: usize,
    c0: usize,
    w: usize,
}

impl<'a, T> Tile<'a, T> {
    /// Row `r` of the tile.
    #[inline]
    pub(crate) fn row(&self, r: usize) -> &'a [T] {
        &self.unit[r * self.width + self.c0..][..self.w]
    }
}

/// Runs `f(tile, output rows, scales of the tile)` over every tile in parallel.
///
/// Preconditions (checked by the callers): `x.len() == data.len()`, a multiple of
/// `unit_rows * width`; `width % group == 0`; `scale.len() == x.len() / group / unit_rows`.
pub(crate) fn par_tiles<T, S, F>(
    x: &[T],
    data: &mut [u8],
    scale: &mut [S],
    unit_rows: usize,
    width: usize,
    group: usize,
    f: F,
) where
    T: Sync,
    S: Send,
    F: Fn(&Tile<'_, T>, &mut [&mut [u8]], &mut [S]) + Sync,
{
    let unit_len = unit_rows * width;
    if x.is_empty() || unit_len == 0 || group == 0 {
        return;
    }
    let tile = ((TILE_ELEMS / unit_rows / group).max(1) * group).min(width);
    data.par_chunks_mut(unit_len).zip(scale.par_chunks_mut(width / group)).zip(x.par_chunks(unit_len)).for_each(
        |((d, s), unit)| {
            // Regroup the unit's rows by column tile: safe disjoint borrows of strided data.
            let mut tiles: Vec<Vec<&mut [u8]>> =
                (0..width.div_ceil(tile)).map(|_| Vec::with_capacity(unit_rows)).collect();
            for row in d.chunks_mut(width) {
                for (slot, seg) in tiles.iter_mut().zip(row.chunks_mut(tile)) {
                    slot.push(seg);
                }
            }
            tiles.into_par_iter().zip(s.par_chunks_mut(tile / group)).enumerate().for_each(|(t, (mut rows, st))| {
                let w = rows.first().map_or(0, |r| r.len());
                let view = Tile { unit, width, c0: t * tile, w };
                f(&view, &mut rows, st);
            });
        },
    );
}

/// NaN-propagating amax (fp32 bits) of each `group`-wide column group over `rows` rows.
#[inline]
pub(crate) fn group_amax<T: Element>(tile: &Tile<'_, T>, rows: usize, group: usize) -> Vec<u32> {
    let mut amax = vec![0u32; tile.w / group];
    for r in 0..rows {
        let xr = tile.row(r);
        if group == 1 {
            for (a, v) in amax.iter_mut().zip(xr) {
                *a = abs_bits_max(*a, v.to_f32().to_bits());
            }
        } else {
            for (a, seg) in amax.iter_mut().zip(xr.chunks_exact(group)) {
                *a = seg.iter().fold(*a, |m, v| abs_bits_max(m, v.to_f32().to_bits()));
            }
        }
    }
    amax
}

/// `out = enc(x * factor[group])` for every element of the tile.
#[inline]
pub(crate) fn encode_groups<T: Element, E: Fn(f32) -> u8>(
    tile: &Tile<'_, T>,
    rows: &mut [&mut [u8]],
    group: usize,
    factor: &[f32],
    enc: E,
) {
    for (r, out) in rows.iter_mut().enumerate() {
        let xr = tile.row(r);
        if group == 1 {
            for ((o, v), f) in out.iter_mut().zip(xr).zip(factor) {
                *o = enc(v.to_f32() * *f);
            }
        } else {
            let chunks = out.chunks_exact_mut(group).zip(xr.chunks_exact(group));
            for ((os, xs), f) in chunks.zip(factor) {
                for (o, v) in os.iter_mut().zip(xs) {
                    *o = enc(v.to_f32() * *f);
                }
            }
        }
    }
}
