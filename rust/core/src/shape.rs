//! The (outer, k, inner) view every block quantizer works on.
//!
//! Quantizing a contiguous row-major tensor along any dim `d` needs no transpose: with
//! `outer = prod(shape[..d])`, `k = shape[d]`, `inner = prod(shape[d+1..])`, element
//! `(o, j, i)` sits at `(o * k + j) * inner + i`. Blocks run along `k`; `inner == 1` is the
//! common, contiguous last-dim case (docs/NUMERICS.md "Transposes and layouts": scales come out in
//! the natural layout, the shape of x with the quantized dim divided by the block).

/// A contiguous row-major tensor viewed as (outer, k, inner), `k` being the quantized dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims3 {
    /// Product of the dims before the quantized one.
    pub outer: usize,
    /// The quantized dim.
    pub k: usize,
    /// Product of the dims after the quantized one (1 for the last dim).
    pub inner: usize,
}

impl Dims3 {
    /// The view of `shape` quantized along `dim`.
    ///
    /// # Panics
    /// If `dim >= shape.len()` (a precondition the FFI layer checks first).
    pub fn from_shape(shape: &[usize], dim: usize) -> Dims3 {
        assert!(dim < shape.len(), "Dims3::from_shape: dim {dim} out of range for a {}-d shape {shape:?}", shape.len());
        Dims3 { outer: shape[..dim].iter().product(), k: shape[dim], inner: shape[dim + 1..].iter().product() }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.outer * self.k * self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_each_dim() {
        let s = [2, 3, 64, 5];
        assert_eq!(Dims3::from_shape(&s, 0), Dims3 { outer: 1, k: 2, inner: 960 });
        assert_eq!(Dims3::from_shape(&s, 2), Dims3 { outer: 6, k: 64, inner: 5 });
        assert_eq!(Dims3::from_shape(&s, 3), Dims3 { outer: 384, k: 5, inner: 1 });
        assert_eq!(Dims3::from_shape(&s, 1).numel(), 1920);
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn rejects_bad_dim() {
        Dims3::from_shape(&[4, 4], 2);
    }
}
