//! SwiGLU, `silu(gate) * up`, and its gradient as deepwell computes them (docs/NUMERICS.md
//! "SwiGLU"): fp32 on the exactly widened inputs, the sigmoid from [`exp_f32`], every operation
//! rounded once in the order written here (no fused multiply-add), the result rounded once to the
//! element type. cuda/swiglu.cuh performs the same operations, so the GPU gives these bits.
//!
//! Layout (Hugging Face's fused experts, `gate_up_proj`): each row of `gate_up` (rows, 2f) holds
//! the gate's f values, then the up projection's f values; `h` and its gradient are (rows, f).

use rayon::prelude::*;

use crate::element::Element;
use crate::math::exp_f32;

/// sigmoid(g) = 1 / (1 + e^-g).
#[inline(always)]
pub fn sigmoid_f32(g: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-g))
}

/// h = (g · sigmoid(g)) · u.
#[inline(always)]
pub fn swiglu_f32(g: f32, u: f32) -> f32 {
    (g * sigmoid_f32(g)) * u
}

/// (dg, du) of h = silu(g) · u for the incoming gradient dh, with s = sigmoid(g):
/// du = dh · (g · s) and dg = ((dh · u) · s) · (1 + g · (1 − s)) (silu's derivative,
/// s · (1 + g · (1 − s)), as torch's silu_backward writes it).
#[inline(always)]
pub fn swiglu_grad_f32(g: f32, u: f32, dh: f32) -> (f32, f32) {
    let s = sigmoid_f32(g);
    let du = dh * (g * s);
    let dg = ((dh * u) * s) * (1.0 + g * (1.0 - s));
    (dg, du)
}

/// h (rows, f) = swiglu of `gate_up` (rows, 2f).
pub fn swiglu<T: Element>(gate_up: &[T], rows: usize, f: usize, h: &mut [T]) {
    assert!(gate_up.len() == rows * 2 * f && h.len() == rows * f, "swiglu: gate_up / h sizes");
    if f == 0 {
        return;
    }
    h.par_chunks_mut(f).zip(gate_up.par_chunks(2 * f)).for_each(|(out, row)| {
        let (gate, up) = row.split_at(f);
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = T::from_f32(swiglu_f32(g.to_f32(), u.to_f32()));
        }
    });
}

/// d_gate_up (rows, 2f) = [dg | du] of `gate_up` (rows, 2f) for the gradient `dh` (rows, f).
pub fn swiglu_backward<T: Element>(gate_up: &[T], dh: &[T], rows: usize, f: usize, d_gate_up: &mut [T]) {
    let n = rows * 2 * f;
    assert!(gate_up.len() == n && dh.len() == rows * f && d_gate_up.len() == n, "swiglu_backward: sizes");
    if f == 0 {
        return;
    }
    d_gate_up.par_chunks_mut(2 * f).zip(gate_up.par_chunks(2 * f)).zip(dh.par_chunks(f)).for_each(
        |((out, row), dh)| {
            let (gate, up) = row.split_at(f);
            let (dgate, dup) = out.split_at_mut(f);
            for i in 0..f {
                let (dg, du) = swiglu_grad_f32(gate[i].to_f32(), up[i].to_f32(), dh[i].to_f32());
                dgate[i] = T::from_f32(dg);
                dup[i] = T::from_f32(du);
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn forward_is_silu_times_up_to_fp32_rounding() {
        for &(g, u) in &[(0.0f32, 1.0f32), (1.0, 2.0), (-3.5, 0.25), (20.0, -1.0), (-20.0, 3.0)] {
            let want = (g as f64) / (1.0 + (-(g as f64)).exp()) * u as f64;
            let got = swiglu_f32(g, u) as f64;
            assert!((got - want).abs() <= 4e-7 * want.abs().max(1e-30), "swiglu({g}, {u}) = {got}, want {want}");
        }
    }

    #[test]
    fn gradient_matches_a_float64_derivative() {
        for &(g, u, dh) in &[(0.3f32, -1.2f32, 0.7f32), (-2.0, 0.5, 1.5), (6.0, 1.0, -0.25), (-9.0, 2.0, 1.0)] {
            let (g64, u64, dh64) = (g as f64, u as f64, dh as f64);
            let s = 1.0 / (1.0 + (-g64).exp());
            let (dg, du) = swiglu_grad_f32(g, u, dh);
            let (want_dg, want_du) = (dh64 * u64 * s * (1.0 + g64 * (1.0 - s)), dh64 * g64 * s);
            assert!((dg as f64 - want_dg).abs() <= 1e-6 * want_dg.abs().max(1e-6), "dg({g}) = {dg}, want {want_dg}");
            assert!((du as f64 - want_du).abs() <= 1e-6 * want_du.abs().max(1e-6), "du({g}) = {du}, want {want_du}");
        }
    }

    /// docs/NUMERICS.md "SwiGLU" vectors, bit for bit.
    #[test]
    fn numerics_md_vectors() {
        let gu = [(1.0f32, 2.0f32), (-2.0, 0.5), (-100.0, 1.0), (3.0, -1.0)];
        let h = [0x3FBB_26A8u32, 0xBDF4_20A9, 0x8000_0000, 0xC036_E4EC];
        let h_bf16 = [0x3FBBu16, 0xBDF4, 0x8000, 0xC037];
        let dg = [0x3FED_7BD1u32, 0xBD39_ED18, 0x8000_0000, 0xBF8B_46FF];
        let du = [0x3F3B_26A8u32, 0xBE74_20A9, 0x8000_0000, 0x4036_E4EC];
        for (i, &(g, u)) in gu.iter().enumerate() {
            assert_eq!(swiglu_f32(g, u).to_bits(), h[i], "h({g}, {u})");
            assert_eq!(bf16::from_f32(swiglu_f32(g, u)).to_bits(), h_bf16[i], "bf16 h({g}, {u})");
            let (a, b) = swiglu_grad_f32(g, u, 1.0);
            assert_eq!((a.to_bits(), b.to_bits()), (dg[i], du[i]), "grad({g}, {u})");
        }
    }

    #[test]
    fn special_values_follow_the_formula() {
        // e^(-g) overflows to +Inf below g = -88.7: the sigmoid is 0 and silu(g) is -0, as torch's.
        assert_eq!(swiglu_f32(-100.0, 1.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(swiglu_f32(f32::INFINITY, 1.0), f32::INFINITY);
        assert!(swiglu_f32(f32::NEG_INFINITY, 1.0).is_nan()); // -Inf · 0
        assert!(swiglu_f32(f32::NAN, 1.0).is_nan() && swiglu_f32(1.0, f32::NAN).is_nan());
        let (dg, du) = swiglu_grad_f32(0.0, 2.0, 1.0);
        assert_eq!((dg, du), (1.0, 0.0)); // silu'(0) = 1/2, times u = 2
    }

    #[test]
    fn rows_split_gate_then_up() {
        let vals = [1.0f32, -2.0, 0.5, 3.0, /* row 2 */ -1.0, 4.0, 2.0, -0.5];
        let gate_up: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut h = vec![bf16::ZERO; 4];
        swiglu(&gate_up, 2, 2, &mut h);
        assert_eq!(h[1], bf16::from_f32(swiglu_f32(-2.0, 3.0)));
        assert_eq!(h[2], bf16::from_f32(swiglu_f32(-1.0, 2.0)));
        let dh = vec![bf16::ONE; 4];
        let mut d = vec![bf16::ZERO; 8];
        swiglu_backward(&gate_up, &dh, 2, 2, &mut d);
        let (dg, du) = swiglu_grad_f32(4.0, -0.5, 1.0);
        assert_eq!((d[5], d[7]), (bf16::from_f32(dg), bf16::from_f32(du)));
    }
}
