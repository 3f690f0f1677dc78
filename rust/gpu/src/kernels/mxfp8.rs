//! cuda/mxfp8.cuh: keys and launch geometry.

use super::{Arg, Family, Float, Geometry, Wave, T};

/// The scale rule (template `Mode`: 0 = rceil, 1 = floor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    Rceil = 0,
    Floor = 1,
}

/// The FP8 element (template `Elem`: 0 = e4m3, 1 = e5m2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8 {
    E4M3 = 0,
    E5M2 = 1,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mxfp8 {
    Rows { input: Float, mode: Mode, elem: Fp8 },
    Cols { input: Float, mode: Mode, elem: Fp8 },
    Rowcol { input: Float, mode: Mode, elem: Fp8, transposed: bool },
    Dequantize { out: Float, elem: Fp8 },
}

/// x (or the dequantized output) viewed as (outer, k, inner), blocks of 32 along k. Rows needs
/// inner == 1; Rowcol takes x (m, k) as (m, k, 1). `aligned`: every pointer argument is 16-byte
/// aligned, so the kernels take their vector paths wherever the shape allows (when false the
/// geometry assumes the scalar path: a few CTAs too many if the kernel vectorizes after all).
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub outer: u64,
    pub k: u64,
    pub inner: u64,
    pub aligned: bool,
}

// Per-CTA work, mirrored from cuda/mxfp8.cuh (the tests parse the originals).
/// Unroll steps of rows_body, each of THREADS / 4 blocks of 32 (mxfp8.cuh:114, 119-123).
pub(super) const ROWS_UNROLL: u64 = 4;
/// Inner positions per cols_body item on the vector path (mxfp8.cuh:172, 181).
pub(super) const MX_COLS_V: u64 = 4;
/// Side of rowcol_body's tile, one per CTA per iteration (mxfp8.cuh:294, 336).
pub(super) const RC_TILE: u64 = 128;

impl Mxfp8 {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        use Arg::{Float as F, Int as I};
        match self {
            Mxfp8::Rows { input, mode, elem } => ("mxfp8_quantize_rows", vec![F(input), I(mode as u8), I(elem as u8)]),
            Mxfp8::Cols { input, mode, elem } => ("mxfp8_quantize_cols", vec![F(input), I(mode as u8), I(elem as u8)]),
            Mxfp8::Rowcol { input, mode, elem, transposed } => {
                ("mxfp8_quantize_rowcol", vec![F(input), I(mode as u8), I(elem as u8), I(transposed as u8)])
            }
            Mxfp8::Dequantize { out, elem } => ("mxfp8_dequantize", vec![F(out), I(elem as u8)]),
        }
    }
}

impl Family for Mxfp8 {
    type Sizes = Sizes;

    fn geometry(self, s: Sizes, wave: Wave) -> Geometry {
        let n = s.outer * s.k * s.inner;
        match self {
            // Blocks of 32; a CTA covers THREADS / 4 * ROWS_UNROLL = 256 of them per iteration.
            Mxfp8::Rows { .. } => wave.cover(n / 32, T / 4 * ROWS_UNROLL),
            // One thread per item (32 rows x V inner positions), THREADS items per CTA.
            Mxfp8::Cols { .. } => {
                let v = if s.aligned && s.inner % MX_COLS_V == 0 { MX_COLS_V } else { 1 };
                wave.cover(s.outer * (s.k / 32) * (s.inner / v), T)
            }
            // One RC_TILE x RC_TILE tile per CTA; partial edge tiles count (mxfp8.cuh:306, 336).
            Mxfp8::Rowcol { .. } => wave.cover(s.outer.div_ceil(RC_TILE) * s.k.div_ceil(RC_TILE), 1),
            // The vector path needs inner == 1 or inner % (16 / sizeof(Out)) == 0 (mxfp8.cuh `mxfp8_dequantize`).
            Mxfp8::Dequantize { out, .. } => {
                wave.dequantize(out, n, s.aligned && (s.inner == 1 || s.inner % (16 / out.bytes()) == 0))
            }
        }
    }
}

/// Every specialization the MXFP8 ops launch.
pub fn all() -> Vec<Mxfp8> {
    let mut v = Vec::new();
    for input in Float::ALL {
        for mode in [Mode::Rceil, Mode::Floor] {
            for elem in [Fp8::E4M3, Fp8::E5M2] {
                v.push(Mxfp8::Rows { input, mode, elem });
                v.push(Mxfp8::Cols { input, mode, elem });
                v.push(Mxfp8::Rowcol { input, mode, elem, transposed: false });
                v.push(Mxfp8::Rowcol { input, mode, elem, transposed: true });
            }
        }
        for elem in [Fp8::E4M3, Fp8::E5M2] {
            v.push(Mxfp8::Dequantize { out: input, elem });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100;
    use super::*;

    const BF16: Float = Float::BF16;
    const ROWS: Mxfp8 = Mxfp8::Rows { input: BF16, mode: Mode::Rceil, elem: Fp8::E4M3 };
    const COLS: Mxfp8 = Mxfp8::Cols { input: BF16, mode: Mode::Rceil, elem: Fp8::E4M3 };
    const ROWCOL: Mxfp8 = Mxfp8::Rowcol { input: BF16, mode: Mode::Rceil, elem: Fp8::E4M3, transposed: true };

    fn grid(k: Mxfp8, outer: u64, kk: u64, inner: u64) -> u32 {
        k.geometry(Sizes { outer, k: kk, inner, aligned: true }, H100).grid
    }

    #[test]
    fn rows_cover_256_blocks_per_cta() {
        assert_eq!(grid(ROWS, 1, 32, 1), 1); // one block: less than a CTA's work
        assert_eq!(grid(ROWS, 256, 32, 1), 1);
        assert_eq!(grid(ROWS, 257, 32, 1), 2);
        assert_eq!(grid(ROWS, 64, 4096, 1), 32); // 8192 blocks
        assert_eq!(grid(ROWS, 16384, 4096, 1), 132 * 8); // 2M blocks: one wave
    }

    #[test]
    fn cols_cover_threads_items() {
        // (outer, k, inner) = (1, 4096, 4096): 128 slabs x 1024 vector items = 512 CTAs.
        assert_eq!(grid(COLS, 1, 4096, 4096), 512);
        // inner % 4 != 0 or unaligned: one inner position per item, 4x the CTAs.
        assert_eq!(grid(COLS, 1, 4096, 1026), (128 * 1026u64).div_ceil(256) as u32);
        let unaligned = COLS.geometry(Sizes { outer: 1, k: 1024, inner: 512, aligned: false }, H100);
        assert_eq!(unaligned.grid, 32 * 512 / 256);
        assert_eq!(grid(COLS, 1, 32, 4), 1);
        assert_eq!(grid(COLS, 64, 4096, 4096), 132 * 8);
    }

    #[test]
    fn rowcol_covers_one_128_tile_per_cta() {
        assert_eq!(grid(ROWCOL, 32, 32, 1), 1); // a partial tile
        assert_eq!(grid(ROWCOL, 160, 4096, 1), 2 * 32); // 2 tile rows (the second partial)
        assert_eq!(grid(ROWCOL, 1024, 1024, 1), 64);
        assert_eq!(grid(ROWCOL, 16384, 4096, 1), 132 * 8); // 4096 tiles: one wave
    }

    #[test]
    fn dequantize_pieces() {
        let bf16 = Mxfp8::Dequantize { out: BF16, elem: Fp8::E4M3 };
        let f32 = Mxfp8::Dequantize { out: Float::F32, elem: Fp8::E4M3 };
        assert_eq!(grid(bf16, 1, 32, 1), 1);
        assert_eq!(grid(bf16, 64, 4096, 1), 32); // 8192 elements per CTA
        assert_eq!(grid(f32, 64, 4096, 1), 64); // 4096 elements per CTA
        assert_eq!(grid(bf16, 2, 64, 8), 1); // inner % 8 == 0: vector, 1024 elements
        assert_eq!(grid(bf16, 2, 64, 6), 3); // scalar: 768 elements, 256 per CTA
        assert_eq!(grid(f32, 1 << 20, 4096, 1), 132 * 8);
    }
}
