//! cuda/linear.cuh: key and launch geometry of the linear layers' GEMM epilogue.

use super::{Arg, Family, Float, Geometry, Matrix, Wave, T};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinearEpilogue {
    pub out: Float,
    pub bias: Float,
}

impl LinearEpilogue {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        ("linear_epilogue", vec![Arg::Float(self.out), Arg::Float(self.bias)])
    }
}

impl Family for LinearEpilogue {
    /// y and out (rows, cols).
    type Sizes = Matrix;

    /// One thread per element (linear.cuh:18-19).
    fn geometry(self, s: Matrix, wave: Wave) -> Geometry {
        wave.cover(s.rows * s.cols, T)
    }
}

pub fn all() -> Vec<LinearEpilogue> {
    Float::ALL.iter().flat_map(|&out| Float::ALL.iter().map(move |&bias| LinearEpilogue { out, bias })).collect()
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100;
    use super::*;

    #[test]
    fn one_thread_per_element() {
        let k = LinearEpilogue { out: Float::BF16, bias: Float::F32 };
        assert_eq!(k.geometry(Matrix { rows: 1, cols: 1 }, H100).grid, 1);
        assert_eq!(k.geometry(Matrix { rows: 16, cols: 4096 }, H100).grid, 256);
        assert_eq!(k.geometry(Matrix { rows: 16384, cols: 4096 }, H100).grid, 132 * 8);
    }
}
