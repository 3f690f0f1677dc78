//! cuda/swiglu.cuh: keys and launch geometry.

use super::{Arg, Family, Float, Geometry, Matrix, Wave, T};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Swiglu {
    /// `swiglu_forward<In>`: h (rows, f) from gate_up (rows, 2f).
    Forward { input: Float },
    /// `swiglu_backward<In>`: d_gate_up (rows, 2f) from gate_up and dh (rows, f).
    Backward { input: Float },
}

impl Swiglu {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        match self {
            Swiglu::Forward { input } => ("swiglu_forward", vec![Arg::Float(input)]),
            Swiglu::Backward { input } => ("swiglu_backward", vec![Arg::Float(input)]),
        }
    }

    fn input(self) -> Float {
        match self {
            Swiglu::Forward { input } | Swiglu::Backward { input } => input,
        }
    }
}

/// h's (rows, f) and whether every pointer is 16-byte aligned.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub h: Matrix,
    pub aligned: bool,
}

impl Family for Swiglu {
    type Sizes = Sizes;

    /// Both kernels walk h's elements: THREADS chunks of 16 / sizeof(In) per CTA and iteration on
    /// the vector path (f a multiple of the chunk, aligned pointers), else THREADS elements
    /// (swiglu.cuh's header).
    fn geometry(self, s: Sizes, wave: Wave) -> Geometry {
        let chunk = 16 / self.input().bytes();
        let n = s.h.rows * s.h.cols;
        if s.aligned && s.h.cols % chunk == 0 {
            wave.cover(n / chunk, T)
        } else {
            wave.cover(n, T)
        }
    }
}

pub fn all() -> Vec<Swiglu> {
    Float::ALL.iter().flat_map(|&input| [Swiglu::Forward { input }, Swiglu::Backward { input }]).collect()
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
}
