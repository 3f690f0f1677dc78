//! Blackwell block-scale layout: scales in 128x4 tiles, as cuBLASLt / tcgen05 block-scaled GEMMs
//! and `F.scaled_mm` with `SwizzleType.SWIZZLE_32_4_4` read them (docs/NUMERICS.md "Transposes and
//! layouts"; TE `swizzle.cuh`; torchao `to_blocked`).
//!
//! A (rows, cols) scale matrix is padded to (round_up(rows, 128), round_up(cols, 4)) with 0 and
//! stored tile by tile (row-major over tiles); inside a 128x4 tile, row r sits in 32-row band
//! `r % 128 / 32`, interleaved so each 16-byte line holds rows r, r+32, r+64, r+96:
//!
//! `offset(r, c) = ((r / 128) * ceil(C / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4)`

use rayon::prelude::*;

/// Rows per tile.
const TILE_ROWS: usize = 128;
/// Scale columns per tile.
const TILE_COLS: usize = 4;
/// Bytes per tile.
const TILE_BYTES: usize = TILE_ROWS * TILE_COLS;

/// Bytes of the swizzled (padded) layout of a `rows` x `cols` scale matrix.
pub fn swizzled_len(rows: usize, cols: usize) -> usize {
    rows.next_multiple_of(TILE_ROWS) * cols.next_multiple_of(TILE_COLS)
}

/// Offset of scale (r, c) of a matrix with `cols` scale columns in the swizzled layout.
#[inline]
pub fn swizzle_offset(r: usize, c: usize, cols: usize) -> usize {
    ((r / 128) * cols.div_ceil(4) + c / 4) * TILE_BYTES + (r % 32) * 16 + ((r % 128) / 32) * 4 + (c % 4)
}

/// Writes the row-major `rows` x `cols` matrix `src` into `dst` in the swizzled layout; padding
/// bytes are 0.
///
/// # Panics
/// If `src.len() != rows * cols` or `dst.len() != swizzled_len(rows, cols)`.
pub fn swizzle_scales(src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    check("swizzle_scales", src.len(), rows, cols, dst.len());
    if dst.is_empty() {
        return;
    }
    // One work item per band of 128 rows: it owns a contiguous run of whole tiles.
    let band = cols.div_ceil(TILE_COLS) * TILE_BYTES;
    dst.par_chunks_mut(band).enumerate().for_each(|(t, out)| {
        out.fill(0);
        let r0 = t * TILE_ROWS;
        for r in r0..(r0 + TILE_ROWS).min(rows) {
            for (c, &s) in src[r * cols..][..cols].iter().enumerate() {
                out[swizzle_offset(r, c, cols) - t * band] = s;
            }
        }
    });
}

/// Inverse of [`swizzle_scales`]: reads the swizzled `src` back into row-major `dst`.
///
/// # Panics
/// If `dst.len() != rows * cols` or `src.len() != swizzled_len(rows, cols)`.
pub fn unswizzle_scales(src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    check("unswizzle_scales", dst.len(), rows, cols, src.len());
    if dst.is_empty() {
        return;
    }
    dst.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        for (c, d) in row.iter_mut().enumerate() {
            *d = src[swizzle_offset(r, c, cols)];
        }
    });
}

fn check(op: &str, plain: usize, rows: usize, cols: usize, swizzled: usize) {
    assert!(plain == rows * cols, "{op}: plain scales have {plain} bytes, {rows}x{cols} needs {}", rows * cols);
    let need = swizzled_len(rows, cols);
    assert!(swizzled == need, "{op}: swizzled scales have {swizzled} bytes, {rows}x{cols} needs {need}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_tile_interleaves_bands() {
        // TE docs: within a 128x4 tile the order is rows 0, 32, 64, 96, 1, 33, ...
        assert_eq!(swizzle_offset(0, 0, 4), 0);
        assert_eq!(swizzle_offset(32, 0, 4), 4);
        assert_eq!(swizzle_offset(0, 1, 4), 1);
        assert_eq!(swizzle_offset(1, 0, 4), 16);
        assert_eq!(swizzle_offset(127, 3, 4), 511);
        assert_eq!(swizzle_offset(0, 4, 8), 512);
        assert_eq!(swizzle_offset(128, 0, 8), 1024);
        assert_eq!(swizzled_len(1, 1), 512);
        assert_eq!(swizzled_len(129, 5), 256 * 8);
    }
}
