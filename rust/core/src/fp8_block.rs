//! FP8 block scaling (DeepSeek-V3 style; Hopper's native block-scaled GEMM): fp32 scales per
//! 1x128 block (activations, gradients) or 128x128 block (weights), E4M3 elements
//! (Transformer Engine `recipe_common.cuh`; docs/NUMERICS.md "FP8 block").
//!
//! `scale = 448 / amax` (correctly rounded fp32 division); amax 0, Inf or NaN -> scale 1; an Inf
//! scale (tiny amax) -> FLT_MAX; with `pow2` the scale is rounded down to a power of two by
//! zeroing its mantissa (`bits & 0xFF800000`), so `scale_inv` rounds up and nothing saturates.
//! Stored: `scale_inv = 1 / scale`; elements `q = cast_e4m3_rne_satfinite(x * scale)`.
//! Dequantize: `x' = e4m3(q) * scale_inv`.
//!
//! Special values (a project decision, as in TE): a block whose amax is NaN or Inf keeps scale
//! 1, so NaN elements cast to 0x7F and ±Inf saturate to ±448 while finite elements are cast
//! unscaled.

use crate::element::Element;
use crate::formats::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};
use crate::tiles::{encode_groups, group_amax, par_tiles};
use rayon::prelude::*;

/// The quantization scale for a block with this amax (see the module docs).
pub fn fp8_block_scale(amax: f32, pow2: bool) -> f32 {
    fp8_scale(amax, E4M3_MAX, pow2)
}

/// `max / amax` under the rules of the module docs, for an element format whose largest finite
/// value is `max` (E4M3 here; fp8_tensor's gradients use E5M2's 57344).
pub fn fp8_scale(amax: f32, max: f32, pow2: bool) -> f32 {
    let amax = amax.abs();
    if amax == 0.0 || !amax.is_finite() {
        return 1.0;
    }
    let mut scale = max / amax;
    if scale.is_infinite() {
        scale = f32::MAX;
    }
    if pow2 {
        scale = f32::from_bits(scale.to_bits() & 0xFF80_0000);
    }
    scale
}

/// Quantizes `x`, viewed as (batch, rows, cols), in `block_rows` x `block_cols` blocks.
///
/// `data`: same layout as `x`; `scale_inv`: layout (batch, rows/br, cols/bc).
///
/// # Panics
/// If a block dim is 0 or does not divide its tensor dim, or a slice length does not match.
#[allow(clippy::too_many_arguments)] // the signature is the FFI contract (API.md)
pub fn fp8_block_quantize<T: Element>(
    x: &[T],
    batch: usize,
    rows: usize,
    cols: usize,
    block_rows: usize,
    block_cols: usize,
    pow2: bool,
    data: &mut [u8],
    scale_inv: &mut [f32],
) {
    let g = Geometry::new("fp8_block_quantize", batch, rows, cols, block_rows, block_cols);
    g.check("fp8_block_quantize", x.len(), data.len(), scale_inv.len());
    // 1 x bc blocks tile the flat tensor; br x bc blocks are units of br rows.
    let (unit_rows, width) = if block_rows == 1 { (1, x.len()) } else { (block_rows, cols) };
    par_tiles(x, data, scale_inv, unit_rows, width, block_cols, |tile, out, st| {
        let amax = group_amax(tile, out.len(), block_cols);
        let factor: Vec<f32> = amax
            .iter()
            .zip(st.iter_mut())
            .map(|(&a, s)| {
                let scale = fp8_block_scale(f32::from_bits(a), pow2);
                *s = 1.0 / scale;
                scale
            })
            .collect();
        encode_groups(tile, out, block_cols, &factor, f32_to_e4m3);
    });
}

/// `x' = O::from_f32(e4m3(q) * scale_inv)`.
///
/// # Panics
/// As [`fp8_block_quantize`].
#[allow(clippy::too_many_arguments)] // the signature is the FFI contract (API.md)
pub fn fp8_block_dequantize<O: Element>(
    data: &[u8],
    scale_inv: &[f32],
    batch: usize,
    rows: usize,
    cols: usize,
    block_rows: usize,
    block_cols: usize,
    out: &mut [O],
) {
    let g = Geometry::new("fp8_block_dequantize", batch, rows, cols, block_rows, block_cols);
    g.check("fp8_block_dequantize", out.len(), data.len(), scale_inv.len());
    if out.is_empty() {
        return;
    }
    let spr = cols / block_cols;
    // One work item per row; its scales are row (r / br) of its batch's scale matrix.
    out.par_chunks_mut(cols).zip(data.par_chunks(cols)).enumerate().for_each(|(i, (o, d))| {
        let (b, r) = (i / rows, i % rows);
        let srow = &scale_inv[(b * (rows / block_rows) + r / block_rows) * spr..][..spr];
        let blocks = o.chunks_exact_mut(block_cols).zip(d.chunks_exact(block_cols));
        for ((ob, db), &s) in blocks.zip(srow) {
            for (y, &q) in ob.iter_mut().zip(db) {
                *y = O::from_f32(e4m3_to_f32(q) * s);
            }
        }
    });
}

/// The validated (batch, rows, cols) / block geometry.
struct Geometry {
    numel: usize,
    scales: usize,
}

impl Geometry {
    fn new(op: &str, batch: usize, rows: usize, cols: usize, br: usize, bc: usize) -> Geometry {
        assert!(br > 0 && bc > 0, "{op}: block {br}x{bc} has a zero dim");
        assert!(rows % br == 0 && cols % bc == 0, "{op}: ({rows}, {cols}) is not a whole number of {br}x{bc} blocks");
        Geometry { numel: batch * rows * cols, scales: batch * (rows / br) * (cols / bc) }
    }

    fn check(&self, op: &str, x_len: usize, data_len: usize, scale_len: usize) {
        let (n, ns) = (self.numel, self.scales);
        assert!(x_len == n, "{op}: high-precision tensor has {x_len} elements, expected {n}");
        assert!(data_len == n, "{op}: data has {data_len} bytes, expected {n}");
        assert!(scale_len == ns, "{op}: scale_inv has {scale_len} entries, expected {ns}");
    }
}
