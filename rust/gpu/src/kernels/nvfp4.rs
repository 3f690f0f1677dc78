//! cuda/nvfp4.cuh: keys and launch geometry.

use super::{Arg, Family, Float, Geometry, Matrix, Wave, T};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Nvfp4 {
    Amax { input: Float, hadamard: bool },
    Quantize { input: Float, block_2d: bool, stochastic: bool, hadamard: bool },
    Dequantize { out: Float },
}

// Per-CTA work, mirrored from cuda/nvfp4.cuh (the tests parse the original).
/// Elements per NVFP4 block and side of a Block2D tile (nvfp4.cuh:26).
pub(super) const BLOCK: u64 = 16;

impl Nvfp4 {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        use Arg::{Float as F, Int as I};
        match self {
            Nvfp4::Amax { input, hadamard } => ("nvfp4_amax", vec![F(input), I(hadamard as u8)]),
            Nvfp4::Quantize { input, block_2d, stochastic, hadamard } => {
                ("nvfp4_quantize", vec![F(input), I(block_2d as u8), I(stochastic as u8), I(hadamard as u8)])
            }
            Nvfp4::Dequantize { out } => ("nvfp4_dequantize", vec![F(out)]),
        }
    }
}

impl Family for Nvfp4 {
    /// x (or the dequantized output) as (rows, k); Amax reads rows * k elements.
    type Sizes = Matrix;

    fn geometry(self, s: Matrix, wave: Wave) -> Geometry {
        let n = s.rows * s.cols;
        match self {
            // One 16-element block per thread per iteration (nvfp4.cuh:333-338, 380-382).
            Nvfp4::Amax { .. } | Nvfp4::Quantize { block_2d: false, .. } => wave.cover(n / BLOCK, T),
            // One unit of 16 rows x 16 tiles (256 columns) per CTA; a strip's last unit may be
            // partial, so units = (rows / 16) * ceil(k / 256) (nvfp4.cuh:389-391).
            Nvfp4::Quantize { block_2d: true, .. } => {
                wave.cover((s.rows / BLOCK) * (s.cols / BLOCK).div_ceil(T / BLOCK), 1)
            }
            // One 16-byte output chunk (16 / sizeof(Out) elements) per thread (nvfp4.cuh:430-435).
            Nvfp4::Dequantize { out } => wave.cover(n / (16 / out.bytes()), T),
        }
    }
}

/// Every specialization the NVFP4 ops launch.
pub fn all() -> Vec<Nvfp4> {
    let mut v = Vec::new();
    for input in Float::ALL {
        for hadamard in [false, true] {
            v.push(Nvfp4::Amax { input, hadamard });
            for block_2d in [false, true] {
                for stochastic in [false, true] {
                    v.push(Nvfp4::Quantize { input, block_2d, stochastic, hadamard });
                }
            }
        }
        v.push(Nvfp4::Dequantize { out: input });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100;
    use super::*;

    fn grid(k: Nvfp4, rows: u64, cols: u64) -> u32 {
        k.geometry(Matrix { rows, cols }, H100).grid
    }

    const Q1D: Nvfp4 = Nvfp4::Quantize { input: Float::BF16, block_2d: false, stochastic: false, hadamard: false };
    const Q2D: Nvfp4 = Nvfp4::Quantize { input: Float::BF16, block_2d: true, stochastic: true, hadamard: false };

    #[test]
    fn amax_and_1d_quantize_cover_256_blocks_per_cta() {
        let amax = Nvfp4::Amax { input: Float::F32, hadamard: true };
        for k in [amax, Q1D] {
            assert_eq!(grid(k, 1, 16), 1);
            assert_eq!(grid(k, 16, 256), 1);
            assert_eq!(grid(k, 17, 256), 2);
            assert_eq!(grid(k, 1024, 1024), 256);
            assert_eq!(grid(k, 16384, 4096), 132 * 8);
        }
    }

    #[test]
    fn block_2d_covers_16_rows_by_256_columns_per_cta() {
        assert_eq!(grid(Q2D, 16, 16), 1);
        assert_eq!(grid(Q2D, 1024, 1024), 64 * 4);
        // k = 48: 3 tiles per strip, still one (partial) unit each: one CTA per 16 rows.
        assert_eq!(grid(Q2D, 1024, 48), 64);
        assert_eq!(grid(Q2D, 64, 4096 + 16), 4 * 17);
        assert_eq!(grid(Q2D, 16384, 4096), 132 * 8);
    }

    #[test]
    fn dequantize_covers_threads_chunks() {
        assert_eq!(grid(Nvfp4::Dequantize { out: Float::BF16 }, 1, 16), 1);
        assert_eq!(grid(Nvfp4::Dequantize { out: Float::BF16 }, 64, 1024), 32); // 2048 per CTA
        assert_eq!(grid(Nvfp4::Dequantize { out: Float::F32 }, 64, 1024), 64); // 1024 per CTA
        assert_eq!(grid(Nvfp4::Dequantize { out: Float::F32 }, 16384, 4096), 132 * 8);
    }
}
