//! cuda/swiglu.cuh: keys and launch geometry.

use super::{Arg, Family, Float, Geometry, Matrix, Wave, T};

/// Side of the quantized matrix's tiles in the fused quantizers (fp8_block.cuh `TILE`).
const TILE: u64 = super::fp8_block::TILE;

/// The fused quantizers' rings of async copies (swiglu.cuh `SwigluSrc` / `SwigluBackSrc`: `STAGES`
/// step slots of `CHUNKS` 16-byte chunks per thread): (stages, chunks) forward and backward.
const FORWARD_RING: (u64, u64) = (4, 2);
const BACKWARD_RING: (u64, u64) = (4, 3);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Swiglu {
    /// `swiglu_forward<In>`: h (rows, f) from gate_up (rows, 2f).
    Forward { input: Float },
    /// `swiglu_backward<In>`: d_gate_up (rows, 2f) from gate_up and dh (rows, f).
    Backward { input: Float },
    /// `fp8_block_swiglu_quantize_rowcol<In, MM, BACKWARD>`: rowcol of swiglu(gate_up) (`backward`
    /// false) or of swiglu_backward(gate_up, dh), its scales M-major when `m_major`.
    Rowcol { input: Float, backward: bool, m_major: bool },
}

impl Swiglu {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        match self {
            Swiglu::Forward { input } => ("swiglu_forward", vec![Arg::Float(input)]),
            Swiglu::Backward { input } => ("swiglu_backward", vec![Arg::Float(input)]),
            Swiglu::Rowcol { input, backward, m_major } => (
                "fp8_block_swiglu_quantize_rowcol",
                vec![Arg::Float(input), Arg::Int(m_major as u8), Arg::Int(backward as u8)],
            ),
        }
    }

    /// Whether the backward quantizer makes a gate tile and an up tile per walk step (swiglu.cuh
    /// `SwigluBackSrc::PAIRED`: 16-bit inputs), the up tile in dynamic shared memory.
    fn paired(self) -> bool {
        matches!(self, Swiglu::Rowcol { input, backward: true, .. } if input.bytes() == 2)
    }

    /// The fused quantizers' dynamic shared memory: the pair's up tile (paired), then the ring.
    fn smem(self) -> u64 {
        let Swiglu::Rowcol { input, backward, .. } = self else { return 0 };
        let (stages, chunks) = if backward { BACKWARD_RING } else { FORWARD_RING };
        let second = if self.paired() { TILE * TILE * input.bytes() } else { 0 };
        second + stages * chunks * T * 16
    }
}

/// The elementwise kernels: h's (rows, f); the fused quantizers: the quantized matrix's (h (m, f) or
/// d_gate_up (m, 2f)). `aligned`: every pointer is 16-byte aligned.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub h: Matrix,
    pub aligned: bool,
}

impl Family for Swiglu {
    type Sizes = Sizes;

    /// The elementwise kernels walk h's elements: THREADS chunks of 16 / sizeof(In) per CTA and
    /// iteration on the vector path (f a multiple of the chunk, aligned pointers), else THREADS
    /// elements. The fused quantizers walk 128 x 128 tiles of the quantized matrix, whole tiles
    /// only, one per CTA and iteration, or (paired) one gate + up pair, with `smem` bytes of
    /// dynamic shared memory (swiglu.cuh's header).
    fn geometry(self, s: Sizes, wave: Wave) -> Geometry {
        let (rows, cols) = (s.h.rows, s.h.cols);
        match self {
            Swiglu::Forward { input } | Swiglu::Backward { input } => {
                let chunk = 16 / input.bytes();
                if s.aligned && cols % chunk == 0 {
                    wave.cover(rows * cols / chunk, T)
                } else {
                    wave.cover(rows * cols, T)
                }
            }
            Swiglu::Rowcol { .. } => {
                let tiles = (rows / TILE) * (cols / TILE);
                let walk = if self.paired() { tiles / 2 } else { tiles };
                Geometry { smem: self.smem() as u32, ..wave.cover(walk, 1) }
            }
        }
    }
}

pub fn all() -> Vec<Swiglu> {
    let mut v = Vec::new();
    for input in Float::ALL {
        v.extend([Swiglu::Forward { input }, Swiglu::Backward { input }]);
        for backward in [false, true] {
            for m_major in [false, true] {
                v.push(Swiglu::Rowcol { input, backward, m_major });
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100;
    use super::*;

    #[test]
    fn one_chunk_or_element_of_h_per_thread() {
        let g = |k: Swiglu, rows, cols, aligned| k.geometry(Sizes { h: Matrix { rows, cols }, aligned }, H100).grid;
        let (bf, f32) = (Swiglu::Forward { input: Float::BF16 }, Swiglu::Backward { input: Float::F32 });
        assert_eq!(g(bf, 16, 1024, true), 8); // 16384 elements in chunks of 8
        assert_eq!(g(f32, 16, 1024, true), 16); // chunks of 4
        assert_eq!(g(bf, 16, 1024, false), 64); // scalar
        assert_eq!(g(bf, 3, 12, true), 1); // 12 % 8 != 0: scalar, 36 elements
        assert_eq!(g(bf, 1 << 20, 4096, true), 132 * 8);
    }

    #[test]
    fn the_backward_quantizer_walks_column_pairs() {
        let k = |input, backward| Swiglu::Rowcol { input, backward, m_major: false };
        let g = |key: Swiglu, rows, cols| key.geometry(Sizes { h: Matrix { rows, cols }, aligned: true }, H100);
        // Rings: 4 stages of 2 chunks (forward) or 3 (backward), 16 bytes each, for 256 threads.
        assert_eq!((g(k(Float::BF16, false), 256, 256).grid, g(k(Float::BF16, false), 256, 256).smem), (4, 32768));
        let paired = g(k(Float::BF16, true), 256, 512);
        assert_eq!((paired.grid, paired.smem), (4, 32768 + 49152));
        let f32 = g(k(Float::F32, true), 256, 512);
        assert_eq!((f32.grid, f32.smem), (8, 49152));
    }
}
