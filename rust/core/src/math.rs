//! Transcendental functions deepwell computes the same way on the CPU and the GPU: built from IEEE
//! multiplies, adds and fmas only, each mirrored operation for operation by cuda/common.cuh, so the
//! kernels that use them (the MoE router's scores, SwiGLU) are bit-exact twins of the references.

/// e^x in fp32 from IEEE multiplies, adds and fmas only (Cody-Waite reduction x = n·ln2 + r, a
/// degree-7 Taylor polynomial on |r| <= ln2/2, then an exact scaling by 2^n), so that
/// `exp_f32` in cuda/common.cuh, which performs the same operations, gives the same bits: the
/// router's scores and SwiGLU match this reference exactly on the GPU (libm's and CUDA's expf differ
/// by an ulp now and then, enough to flip a routing near-tie). Error below 2 ulp (`exp_f32_is_accurate`).
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E; // 0x3fb8aa3b
    let ln2_hi = f32::from_bits(0x3f31_7200); // 0.693145751953125: n · ln2_hi is exact for |n| < 2^11
    let ln2_lo = f32::from_bits(0x35bf_be8e); // ln 2 - ln2_hi, rounded
    const C: [f32; 8] = [1.0, 1.0, 0.5, 0.166_666_67, 0.041_666_668, 0.008_333_334, 0.001_388_888_9, 0.000_198_412_7];
    if x.is_nan() {
        return x;
    }
    if x > 88.722_84 {
        return f32::INFINITY; // above ln(FLT_MAX)
    }
    if x < -103.972_08 {
        return 0.0; // below half the smallest subnormal
    }
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(ln2_lo, (-n).mul_add(ln2_hi, x));
    let p = C[..7].iter().rev().fold(C[7], |p, &c| p.mul_add(r, c));
    // p · 2^n as p · 2^a · 2^b with a = n / 2, b = n - a (both in [-75, 64], normal powers of two):
    // the first multiply is exact, the second rounds once (to a subnormal when it must).
    let n = n as i32;
    let (a, b) = (n / 2, n - n / 2);
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    p * pow2(a) * pow2(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_accurate() {
        let ulps =
            |a: f32, b: f64| ((a as f64 - b) / (b as f32).abs().max(f32::MIN_POSITIVE) as f64 * 2f64.powi(23)).abs();
        let mut x = -103.9f32;
        while x < 88.7 {
            let e = exp_f32(x);
            let want = (x as f64).exp();
            if want > f32::MIN_POSITIVE as f64 {
                assert!(ulps(e, want) <= 2.0, "exp({x}) = {e}, want {want}");
            } else {
                assert!((e as f64 - want).abs() <= 1.5e-45, "exp({x}) = {e}, want {want}");
            }
            x += 0.0137;
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    }
}
