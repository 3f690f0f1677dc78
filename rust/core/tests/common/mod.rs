//! Shared helpers for the integration tests: slow, obviously-correct reference casts and input
//! generators.
#![allow(dead_code)] // each test binary uses a subset

use deepwell_core::{e2m1_to_f32, e4m3_to_f32, e5m2_to_f32, exp2i};
use proptest::prelude::*;

/// Reference RNE satfinite cast by brute force: nearest finite grid value in f64, ties to the
/// even code, beyond the grid -> the largest code. `max_code` is the largest finite magnitude
/// code, `sign` the sign bit, `nan` the NaN result.
pub fn ref_cast(x: f32, decode: fn(u8) -> f32, max_code: u8, sign: u8, nan: u8) -> u8 {
    if x.is_nan() {
        return nan;
    }
    let s = if x.is_sign_negative() { sign } else { 0 };
    let a = f64::from(x.abs());
    if a >= f64::from(decode(max_code)) {
        // satfinite (and f64 distances would lose precision this far out).
        return s | max_code;
    }
    let mut best = 0u8;
    for c in 1..=max_code {
        let (dc, db) = ((f64::from(decode(c)) - a).abs(), (f64::from(decode(best)) - a).abs());
        if dc < db || (dc == db && c % 2 == 0) {
            best = c;
        }
    }
    s | best
}

pub fn ref_e4m3(x: f32) -> u8 {
    ref_cast(x, e4m3_to_f32, 0x7E, 0x80, 0x7F)
}
pub fn ref_e5m2(x: f32) -> u8 {
    ref_cast(x, e5m2_to_f32, 0x7B, 0x80, 0x7F)
}
pub fn ref_e2m1(x: f32) -> u8 {
    ref_cast(x, e2m1_to_f32, 7, 0x8, 0)
}

/// A float across magnitudes 1e-30..1e30 with either sign, plus zeros, fp32 subnormals and
/// exact powers of two.
pub fn wide_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => (-30.0f64..30.0, any::<bool>()).prop_map(|(p, neg)| {
            let v = 10f64.powf(p) as f32;
            if neg { -v } else { v }
        }),
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => (1u32..0x80_0000, any::<bool>()).prop_map(|(m, neg)| f32::from_bits(m | (u32::from(neg) << 31))),
        1 => (-126i32..127).prop_map(|e| 2f32.powi(e)),
    ]
}

/// A block of `n` values around a random base magnitude, spread over `spread` decades.
pub fn block(n: usize, spread: f64) -> impl Strategy<Value = Vec<f32>> {
    (-30.0f64..30.0).prop_flat_map(move |base| {
        proptest::collection::vec(
            prop_oneof![
                8 => (-spread..0.0f64, any::<bool>()).prop_map(move |(d, neg)| {
                    let v = 10f64.powf(base + d) as f32;
                    if neg { -v } else { v }
                }),
                1 => wide_f32(),
            ],
            n,
        )
    })
}

/// `n` values from `seed` (cheap to generate in bulk, unlike a proptest vec of `wide_f32`):
/// magnitudes 1e-30..1e30, random signs, with zeros, fp32 subnormals and, if `specials`,
/// the occasional NaN or -Inf.
pub fn wide_values(seed: u64, n: usize, specials: bool) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = (s ^ (s >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let sign = if z & 1 == 1 { -1.0 } else { 1.0 };
            match (z >> 1) % 64 {
                0 => 0.0 * sign,
                1 => f32::from_bits(((z >> 8) as u32) & 0x7F_FFFF) * sign,
                2 if specials => f32::NAN,
                3 if specials => f32::NEG_INFINITY,
                _ => {
                    let p = ((z >> 16) % 60_000) as f64 / 1000.0 - 30.0;
                    (10f64.powf(p) as f32) * sign
                }
            }
        })
        .collect()
}

/// The archs the policy tests name, one per family the planner tells apart.
pub mod archs {
    use deepwell_core::policy::Arch;

    pub const HOPPER: Arch = Arch::sm(9, 0);
    pub const B200: Arch = Arch::sm(10, 0);
    pub const B300: Arch = Arch::sm(10, 3);
    pub const RTX5090: Arch = Arch::sm(12, 0);
    pub const SPARK: Arch = Arch::sm(12, 1);
    pub const ADA: Arch = Arch::sm(8, 9);
    pub const A100: Arch = Arch::sm(8, 0);
    pub const THOR: Arch = Arch::sm(11, 0);
    pub const CPU: Arch = Arch::CPU;
}

/// `n` reproducible floats from a 64-bit LCG (Knuth's MMIX constants) advanced in `state`: each
/// uniform in [-0.5, 0.5] times 2^e with e in [-spread/2, spread/2), or `special` (a NaN or an
/// infinity) where the draw's bits are a multiple of `every`.
pub fn lcg_floats(state: &mut u64, n: usize, spread: u32, (every, special): (u32, f32)) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let r = (*state >> 33) as u32;
            if r % every == 0 {
                special
            } else {
                (r as f32 / 2f32.powi(31) - 0.5) * exp2i((r % spread) as i32 - (spread / 2) as i32)
            }
        })
        .collect()
}
