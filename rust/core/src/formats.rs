//! Scalar codecs for every element and scale format: the ground truth the quantizers, the
//! CUDA kernels and the tests are checked against (docs/NUMERICS.md "Element formats").
//!
//! Encoders work on the fp32 bit pattern directly, never through f16 or f64, so there is one
//! rounding only: round-to-nearest-even with saturation to the finite range (`satfinite`),
//! signed zero preserved, target subnormals kept. This is exactly what PTX
//! `cvt.rn.satfinite.{e4m3x2,e5m2x2,e2m1x2}.f32` produces: NaN -> the format's NaN (E4M3 and
//! E5M2: 0x7F; E2M1 has none, we return 0), ±Inf and |x| beyond the maximum -> ±max finite.
//!
//! | format | bias | max | min normal | min subnormal |
//! |---|---|---|---|---|
//! | E4M3 | 7 | 448 | 2^-6 | 2^-9 |
//! | E5M2 | 15 | 57344 | 2^-14 | 2^-16 |
//! | E2M1 | 1 | 6 | 1 | 0.5 |
//! | E8M0 | 127 | 2^127 | (byte 0 = 2^-127) | 0xFF = NaN |

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;
/// Largest E2M1 value.
pub const E2M1_MAX: f32 = 6.0;

/// Exact `2^e` built from bits, fp32 subnormals included (e in -149..=127).
///
/// Outside that range the exponent is clamped (so `exp2i(-200) == 2^-149` and
/// `exp2i(200) == 2^127`): callers only pass in-range exponents, and clamping keeps the
/// function total without a panic path.
#[inline]
pub fn exp2i(e: i32) -> f32 {
    let e = e.clamp(-149, 127);
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// NaN-propagating `max(acc, |x|)`: the amax rule of every format (NaN wins, then Inf).
///
/// Works on magnitudes' bit patterns: for non-negative floats integer order equals float
/// order, and every NaN pattern (> 0x7F800000) orders above Inf. Branch-free, so loops over
/// it vectorize.
#[inline(always)]
pub fn abs_max(acc: f32, x: f32) -> f32 {
    f32::from_bits(abs_bits_max(acc.to_bits(), x.to_bits()))
}

/// [`abs_max`] on raw fp32 bit patterns (crate-internal, for vectorized amax loops).
#[inline(always)]
pub(crate) fn abs_bits_max(acc: u32, x: u32) -> u32 {
    (acc & 0x7FFF_FFFF).max(x & 0x7FFF_FFFF)
}

/// Unsaturated magnitude code of `|x|` (bits `a`) in a minifloat with `M` mantissa bits and
/// exponent bias `BIAS`, rounded to nearest even. The caller saturates, and replaces the
/// meaningless result for NaN by its NaN code.
///
/// Both candidate codes are computed and one is selected, so that loops over the casts have no
/// data-dependent branch and vectorize.
#[inline(always)]
fn minifloat_magnitude<const M: u32, const BIAS: i32>(a: u32) -> u32 {
    // Target subnormal (|x| < 2^(1-BIAS)): the code is the number of quanta 2^(1-BIAS-M).
    // Scaling by a power of two is exact and gives v < 2^M; adding 2^23 rounds v to an integer
    // with the FPU's round-to-nearest-even, leaving it in the low mantissa bits. A result of
    // 2^M is the code of the smallest normal, so the carry is right too.
    let v = f32::from_bits(a) * exp2i(M as i32 + BIAS - 1);
    let sub = (v + 8_388_608.0).to_bits().wrapping_sub(0x4B00_0000);
    // Target normal: round the fp32 exponent+mantissa field to M mantissa bits (RNE: add
    // half - 1 plus the kept LSB; a carry correctly bumps the exponent), then rebias.
    // No overflow: a <= 0x7FFFFFFF and the addend is below 2^22.
    let shift = 23 - M;
    let rounded = (a + (1 << (shift - 1)) - 1 + ((a >> shift) & 1)) >> shift;
    let norm = rounded.wrapping_sub(((127 - BIAS) as u32) << M);
    // Bits of the smallest normal 2^(1-BIAS).
    if a < ((128 - BIAS) as u32) << 23 {
        sub
    } else {
        norm
    }
}

/// fp32 -> E4M3 (float8_e4m3fn): RNE, satfinite (|x| > 448 and ±Inf -> ±448), NaN -> 0x7F,
/// -0.0 -> 0x80, subnormals kept. Bit-exact with `cvt.rn.satfinite.e4m3x2.f32`.
#[inline(always)]
pub fn f32_to_e4m3(x: f32) -> u8 {
    // 0x7E = 448 is the largest finite code; 0x7F is NaN.
    f32_to_fp8::<3, 7, 0x7E>(x)
}

/// fp32 -> E5M2: RNE, satfinite (±Inf and overflow -> ±57344 = 0x7B), NaN -> 0x7F.
#[inline(always)]
pub fn f32_to_e5m2(x: f32) -> u8 {
    // 0x7B = 57344 is the largest finite code; 0x7C is Inf, which satfinite never produces.
    f32_to_fp8::<2, 15, 0x7B>(x)
}

/// fp32 -> the FP8 code with `M` mantissa bits and exponent bias `BIAS`: RNE, the magnitude
/// clamped to `MAX_CODE` (satfinite), the sign kept (-0.0 too), NaN -> 0x7F.
#[inline(always)]
fn f32_to_fp8<const M: u32, const BIAS: i32, const MAX_CODE: u32>(x: f32) -> u8 {
    let bits = x.to_bits();
    let a = bits & 0x7FFF_FFFF;
    let sign = ((bits >> 24) & 0x80) as u8;
    let q = sign | minifloat_magnitude::<M, BIAS>(a).min(MAX_CODE) as u8;
    if a > 0x7F80_0000 {
        0x7F
    } else {
        q
    }
}

/// fp32 -> E2M1 4-bit code (bit 3 = sign): RNE with the grid {0, .5, 1, 1.5, 2, 3, 4, 6}, so the
/// ties go 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; above 5 -> 6 (satfinite).
/// NaN -> 0 (E2M1 has no NaN; the quantizers never pass one). -0.0 -> 0x8.
#[inline(always)]
pub fn f32_to_e2m1(x: f32) -> u8 {
    // With only seven decision points, RNE is a count of thresholds passed: `>` where the tie
    // goes down (to an even code), `>=` where it goes up. NaN passes none (code 0), Inf all.
    let a = x.abs();
    let code = u8::from(a > 0.25)
        + u8::from(a >= 0.75)
        + u8::from(a > 1.25)
        + u8::from(a >= 1.75)
        + u8::from(a > 2.5)
        + u8::from(a >= 3.5)
        + u8::from(a > 5.0);
    let q = (((x.to_bits() >> 28) & 0x8) as u8) | code;
    if a.is_nan() {
        0
    } else {
        q
    }
}

/// fp32 bits of the minifloat code `c` (`M` mantissa bits, `BIAS`), ignoring NaN/Inf codes.
const fn minifloat_bits(c: u32, sign_bit: u32, m: u32, bias: i32) -> u32 {
    let sign = ((c >> sign_bit) & 1) << 31;
    let mag = c & ((1 << sign_bit) - 1);
    let exp = (mag >> m) as i32;
    let mant = mag & ((1 << m) - 1);
    if exp != 0 {
        return sign | (((exp - bias + 127) as u32) << 23) | (mant << (23 - m));
    }
    if mant == 0 {
        return sign;
    }
    // Target subnormal mant * 2^(1-bias-m): normal in fp32; normalize on the leading bit p.
    let p = 31 - mant.leading_zeros();
    let e = 1 - bias - m as i32 + p as i32;
    sign | (((e + 127) as u32) << 23) | ((mant ^ (1 << p)) << (23 - p))
}

const fn e4m3_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = if c & 0x7F == 0x7F { 0x7FC0_0000 } else { minifloat_bits(c as u32, 7, 3, 7) };
        c += 1;
    }
    t
}

const fn e5m2_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut c = 0;
    while c < 256 {
        let sign = ((c as u32) >> 7) << 31;
        t[c] = match c & 0x7F {
            0x7C => sign | 0x7F80_0000,
            0x7D..=0x7F => 0x7FC0_0000,
            _ => minifloat_bits(c as u32, 7, 2, 15),
        };
        c += 1;
    }
    t
}

const fn e2m1_table() -> [u32; 16] {
    let mut t = [0u32; 16];
    let mut c = 0;
    while c < 16 {
        t[c] = minifloat_bits(c as u32, 3, 1, 1);
        c += 1;
    }
    t
}

/// fp32 bit patterns of every code, built at compile time (bits, not floats, keep it
/// `const` on the crate's MSRV).
static E4M3_BITS: [u32; 256] = e4m3_table();
static E5M2_BITS: [u32; 256] = e5m2_table();
static E2M1_BITS: [u32; 16] = e2m1_table();

/// E4M3 code -> fp32 (exact); 0x7F and 0xFF -> NaN.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    f32::from_bits(E4M3_BITS[b as usize])
}

/// E5M2 code -> fp32 (exact); 0x7C/0xFC -> ±Inf, 0x7D..0x7F (and negatives) -> NaN.
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    f32::from_bits(E5M2_BITS[b as usize])
}

/// E2M1 code (low 4 bits used, bit 3 = sign) -> fp32 (exact).
#[inline(always)]
pub fn e2m1_to_f32(c: u8) -> f32 {
    f32::from_bits(E2M1_BITS[(c & 0xF) as usize])
}

/// E8M0 scale byte -> fp32: `2^(b-127)`; byte 0 is the fp32 subnormal 2^-127 (0x00400000), 0xFF
/// is NaN (OCP MX v1.0 §5.4; docs/NUMERICS.md MXFP8 step 4).
#[inline(always)]
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(0x0040_0000),
        0xFF => f32::NAN,
        _ => f32::from_bits(u32::from(b) << 23),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2i_covers_subnormals_and_clamps() {
        assert_eq!(exp2i(0), 1.0);
        assert_eq!(exp2i(-127).to_bits(), 0x0040_0000);
        assert_eq!(exp2i(-149).to_bits(), 1);
        assert_eq!(exp2i(-500).to_bits(), 1);
        assert_eq!(exp2i(127), 2f32.powi(127));
        assert_eq!(exp2i(999), 2f32.powi(127));
    }

    #[test]
    fn abs_max_propagates_nan_over_inf() {
        assert_eq!(abs_max(0.0, -3.0), 3.0);
        assert!(abs_max(f32::INFINITY, f32::NAN).is_nan());
        assert!(abs_max(f32::NAN, f32::INFINITY).is_nan());
        assert_eq!(abs_max(1.0, f32::NEG_INFINITY), f32::INFINITY);
    }

    #[test]
    fn e8m0_decodes_extremes() {
        assert_eq!(e8m0_to_f32(0).to_bits(), 0x0040_0000);
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert!(e8m0_to_f32(255).is_nan());
    }
}
