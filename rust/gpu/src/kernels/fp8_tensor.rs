//! cuda/fp8_tensor.cuh: keys and launch geometry. The tensor amax runs nvfp4.cuh's
//! `nvfp4_amax<In, 0>` (`Nvfp4::Amax { hadamard: false }`).

use super::{Arg, Family, Float, Geometry, Matrix, Wave, T};

/// Side of the square tile of `fp8_tensor_cast_transposed` (fp8_tensor.cuh:22).
pub(super) const TILE: u64 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Tensor {
    /// x -> codes, same layout.
    Cast {
        input: Float,
        e5m2: bool,
    },
    /// x (m, k) -> the codes transposed (k, m), and the row codes (m, k) when `rows`.
    CastTransposed {
        input: Float,
        e5m2: bool,
        rows: bool,
    },
    Dequantize {
        out: Float,
        e5m2: bool,
    },
}

impl Fp8Tensor {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        use Arg::{Float as F, Int as I};
        match self {
            Fp8Tensor::Cast { input, e5m2 } => ("fp8_tensor_cast", vec![F(input), I(e5m2 as u8)]),
            Fp8Tensor::CastTransposed { input, e5m2, rows } => {
                ("fp8_tensor_cast_transposed", vec![F(input), I(e5m2 as u8), I(rows as u8)])
            }
            Fp8Tensor::Dequantize { out, e5m2 } => ("fp8_tensor_dequantize", vec![F(out), I(e5m2 as u8)]),
        }
    }
}

impl Family for Fp8Tensor {
    /// The tensor as (rows, cols); Cast and Dequantize read rows * cols elements.
    type Sizes = Matrix;

    fn geometry(self, s: Matrix, wave: Wave) -> Geometry {
        let n = s.rows * s.cols;
        match self {
            // One 16-byte chunk of input per thread per iteration (fp8_tensor.cuh:68-70).
            Fp8Tensor::Cast { input, .. } => wave.cover(n / (16 / input.bytes()), T),
            // One 64 x 64 tile per CTA per iteration, edge tiles partial (fp8_tensor.cuh:104).
            Fp8Tensor::CastTransposed { .. } => wave.cover(s.rows.div_ceil(TILE) * s.cols.div_ceil(TILE), 1),
            // One element per thread (fp8_tensor.cuh:146-147).
            Fp8Tensor::Dequantize { .. } => wave.cover(n, T),
        }
    }
}

/// Every specialization the fp8_tensor ops launch.
pub fn all() -> Vec<Fp8Tensor> {
    let mut v = Vec::new();
    for input in Float::ALL {
        for e5m2 in [false, true] {
            v.push(Fp8Tensor::Cast { input, e5m2 });
            for rows in [false, true] {
                v.push(Fp8Tensor::CastTransposed { input, e5m2, rows });
            }
            v.push(Fp8Tensor::Dequantize { out: input, e5m2 });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100;
    use super::*;

    #[test]
    fn cast_covers_a_chunk_per_thread_and_transposed_a_tile_per_cta() {
        let m = |rows, cols| Matrix { rows, cols };
        let cast = |input| Fp8Tensor::Cast { input, e5m2: false };
        assert_eq!(cast(Float::BF16).geometry(m(1, 8 * 256 * 3), H100).grid, 3);
        assert_eq!(cast(Float::F32).geometry(m(1, 4 * 256 * 3), H100).grid, 3);
        let t = Fp8Tensor::CastTransposed { input: Float::BF16, e5m2: true, rows: true };
        assert_eq!(t.geometry(m(65, 129), H100).grid, 2 * 3);
        assert_eq!(t.geometry(m(1 << 20, 4096), H100).grid, 132 * 8);
        let d = Fp8Tensor::Dequantize { out: Float::F32, e5m2: false };
        assert_eq!(d.geometry(m(3, 300), H100).grid, 4);
    }
}
