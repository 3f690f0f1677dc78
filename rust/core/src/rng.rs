//! Counter-based random bits and E2M1 stochastic rounding (NVFP4 gradients; arXiv 2509.25149
//! §4.3; docs/NUMERICS.md NVFP4 step 6).
//!
//! The bits for an element depend only on (seed, flat element index), never on thread
//! scheduling, so a quantization is deterministic for a seed and the CUDA kernel can reproduce
//! it: splitmix64 (Steele et al., "Fast splittable pseudorandom number generators", 2014)
//! evaluated at state `seed + (index + 1) * 0x9E3779B97F4A7C15`, i.e. the `index`-th output of
//! a splitmix64 stream seeded with `seed`, upper 32 bits kept.

/// The splitmix64 increment (2^64 / golden ratio).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// 32 random bits for element `index` under `seed`.
#[inline]
pub fn sr_bits(seed: u64, index: u64) -> u32 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 32) as u32
}

/// Magnitudes of the E2M1 codes 0..=7.
const GRID: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Stochastically rounds `v` (already multiplied by the block's encode factor) to an E2M1 code.
///
/// `|v| >= 6 -> 6` (satfinite); otherwise with `lo <= |v| < hi` adjacent on the grid,
/// `t = (|v| - lo) / (hi - lo)` (exact: Sterbenz subtraction, power-of-two divisor),
/// `u = (bits >> 8) * 2^-24` uniform on [0, 1), and the result is `hi` if `u < t` else `lo`:
/// `P(hi) = ceil(t * 2^24) / 2^24`, unbiased to within 2^-24. The sign is kept (-0.0 -> 0x8);
/// NaN -> 0, like [`crate::formats::f32_to_e2m1`] (the quantizers never pass one).
#[inline]
pub fn e2m1_stochastic(v: f32, bits: u32) -> u8 {
    let sign = ((v.to_bits() >> 28) & 0x8) as u8;
    let a = v.abs();
    if a.is_nan() {
        return 0;
    }
    if a >= 6.0 {
        return sign | 7;
    }
    // lo = index of the largest grid point <= a (a < 6, so at most 6); branch-free count.
    let lo = usize::from(a >= 0.5)
        + usize::from(a >= 1.0)
        + usize::from(a >= 1.5)
        + usize::from(a >= 2.0)
        + usize::from(a >= 3.0)
        + usize::from(a >= 4.0);
    let (l, h) = (GRID[lo], GRID[lo + 1]);
    let t = (a - l) / (h - l);
    let u = (bits >> 8) as f32 * (1.0 / 16_777_216.0);
    sign | (lo as u8 + u8::from(u < t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_stream() {
        // splitmix64 seeded with 0: first outputs 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4.
        assert_eq!(sr_bits(0, 0), 0xE220_A839);
        assert_eq!(sr_bits(0, 1), 0x6E78_9E6A);
    }

    #[test]
    fn grid_points_are_fixed_and_extremes_saturate() {
        for (c, &g) in GRID.iter().enumerate() {
            for bits in [0, u32::MAX, 0x8000_0000] {
                assert_eq!(e2m1_stochastic(g, bits), c as u8);
                assert_eq!(e2m1_stochastic(-g, bits), 0x8 | c as u8);
            }
        }
        assert_eq!(e2m1_stochastic(100.0, 0), 7);
        assert_eq!(e2m1_stochastic(f32::NAN, 0), 0);
        // Halfway between 2 and 3: low bits decide.
        assert_eq!(e2m1_stochastic(2.5, 0), 5);
        assert_eq!(e2m1_stochastic(2.5, u32::MAX), 4);
    }
}
