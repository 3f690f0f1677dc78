//! cuda/swizzle.cuh: keys and launch geometry.

use super::{Arg, Family, Geometry, Matrix, Wave, T};

/// `template <int Unused = 0>` (a plain kernel's name expression is ambiguous to NVRTC).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Swizzle {
    Swizzle,
    Unswizzle,
}

impl Swizzle {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        match self {
            Swizzle::Swizzle => ("swizzle_scales", vec![Arg::Int(0)]),
            Swizzle::Unswizzle => ("unswizzle_scales", vec![Arg::Int(0)]),
        }
    }
}

impl Family for Swizzle {
    /// The (rows, cols) scale matrix (the unswizzled side of both kernels).
    type Sizes = Matrix;

    /// One thread per destination byte (swizzle.cuh:31-33, 47-50): the padded 128 x 4 tiles for
    /// swizzle, rows * cols for unswizzle.
    fn geometry(self, s: Matrix, wave: Wave) -> Geometry {
        match self {
            Swizzle::Swizzle => wave.cover(s.rows.next_multiple_of(128) * s.cols.next_multiple_of(4), T),
            Swizzle::Unswizzle => wave.cover(s.rows * s.cols, T),
        }
    }
}

pub fn all() -> Vec<Swizzle> {
    vec![Swizzle::Swizzle, Swizzle::Unswizzle]
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100;
    use super::*;

    #[test]
    fn one_thread_per_destination_byte() {
        let g = |k: Swizzle, rows, cols| k.geometry(Matrix { rows, cols }, H100).grid;
        assert_eq!(g(Swizzle::Swizzle, 1, 1), 2); // one padded 128 x 4 tile: 512 bytes
        assert_eq!(g(Swizzle::Unswizzle, 1, 1), 1);
        assert_eq!(g(Swizzle::Swizzle, 1000, 62), 1024 * 64 / 256); // padded to (1024, 64)
        assert_eq!(g(Swizzle::Unswizzle, 1000, 62), 243); // ceil(62000 / 256)
        assert_eq!(g(Swizzle::Swizzle, 1 << 20, 128), 132 * 8);
    }
}
