//! Exhaustive and property checks of the scalar casts (docs/NUMERICS.md "Element formats").

mod common;

use common::{ref_e2m1, ref_e4m3, ref_e5m2};
use deepwell_core::*;
use proptest::prelude::*;

#[test]
fn every_e4m3_code_round_trips() {
    for b in 0..=255u8 {
        let v = e4m3_to_f32(b);
        if b & 0x7F == 0x7F {
            assert!(v.is_nan());
            assert_eq!(f32_to_e4m3(v), 0x7F, "NaN code {b:#x} -> canonical NaN");
        } else {
            assert_eq!(f32_to_e4m3(v), b, "code {b:#x} = {v}");
        }
    }
    assert_eq!(e4m3_to_f32(0x7E), 448.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    assert_eq!(e4m3_to_f32(0x80).to_bits(), 0x8000_0000);
}

#[test]
fn every_e5m2_code_round_trips() {
    for b in 0..=255u8 {
        let v = e5m2_to_f32(b);
        match b & 0x7F {
            0x7C => {
                assert!(v.is_infinite());
                // satfinite: Inf saturates to the largest finite value of its sign.
                assert_eq!(f32_to_e5m2(v), (b & 0x80) | 0x7B);
            }
            0x7D..=0x7F => {
                assert!(v.is_nan());
                assert_eq!(f32_to_e5m2(v), 0x7F);
            }
            _ => assert_eq!(f32_to_e5m2(v), b, "code {b:#x} = {v}"),
        }
    }
    assert_eq!(e5m2_to_f32(0x7B), 57344.0);
    assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
    assert_eq!(e5m2_to_f32(0x04), 2f32.powi(-14));
}

#[test]
fn e2m1_grid_and_ties() {
    let grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    for (c, &g) in grid.iter().enumerate() {
        assert_eq!(e2m1_to_f32(c as u8), g);
        assert_eq!(e2m1_to_f32(c as u8 | 8), -g);
        assert_eq!(f32_to_e2m1(g), c as u8);
        assert_eq!(f32_to_e2m1(-g), c as u8 | 8);
    }
    // docs/NUMERICS.md NVFP4 step 3 ties.
    for (x, want) in [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)] {
        assert_eq!(e2m1_to_f32(f32_to_e2m1(x)), want, "tie {x}");
        assert_eq!(e2m1_to_f32(f32_to_e2m1(-x)), -want, "tie -{x}");
    }
    for x in [5.0001, 6.5, 1e30, f32::INFINITY] {
        assert_eq!(f32_to_e2m1(x), 7, "{x} saturates to 6");
    }
    assert_eq!(f32_to_e2m1(f32::NEG_INFINITY), 0xF);
    assert_eq!(f32_to_e2m1(f32::NAN), 0);
    assert_eq!(f32_to_e2m1(-0.0), 0x8);
    assert_eq!(f32_to_e2m1(-0.1), 0x8);
}

/// Every midpoint between adjacent finite values rounds to the even code, and the fp32
/// neighbours of the midpoint round to the nearer value.
fn check_midpoints(name: &str, max_code: u8, decode: fn(u8) -> f32, encode: fn(f32) -> u8, sign: u8) {
    for c in 0..max_code {
        let (lo, hi) = (decode(c), decode(c + 1));
        let mid = ((f64::from(lo) + f64::from(hi)) / 2.0) as f32;
        assert_eq!(f64::from(mid), (f64::from(lo) + f64::from(hi)) / 2.0, "{name}: midpoint exact");
        let even = if c % 2 == 0 { c } else { c + 1 };
        for (v, s) in [(mid, 0u8), (-mid, sign)] {
            assert_eq!(encode(v), s | even, "{name}: midpoint {v} of codes {c:#x},{:#x}", c + 1);
        }
        let (below, above) = (f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1));
        assert_eq!(encode(below), c, "{name}: just below midpoint {mid}");
        assert_eq!(encode(above), c + 1, "{name}: just above midpoint {mid}");
        assert_eq!(encode(-above), sign | (c + 1), "{name}: -(just above midpoint {mid})");
    }
    // Past the largest value: the tie with the next (virtual) value goes to the largest; all
    // beyond saturates (satfinite).
    let max = decode(max_code);
    for v in [max, max * 1.03, max * 2.0, f32::MAX, f32::INFINITY] {
        assert_eq!(encode(v), max_code, "{name}: {v} saturates");
        assert_eq!(encode(-v), sign | max_code, "{name}: -{v} saturates");
    }
}

#[test]
fn midpoints_round_to_even() {
    check_midpoints("e4m3", 0x7E, e4m3_to_f32, f32_to_e4m3, 0x80);
    check_midpoints("e5m2", 0x7B, e5m2_to_f32, f32_to_e5m2, 0x80);
    check_midpoints("e2m1", 7, e2m1_to_f32, f32_to_e2m1, 0x8);
}

#[test]
fn specials() {
    assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
    assert_eq!(f32_to_e4m3(-f32::NAN), 0x7F);
    assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
    assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
    assert_eq!(f32_to_e4m3(-0.0), 0x80);
    assert_eq!(f32_to_e4m3(2f32.powi(-10)), 0x00, "half the min subnormal ties to 0");
    assert_eq!(f32_to_e4m3(f32::from_bits(1)), 0x00);
    assert_eq!(f32_to_e4m3(-f32::from_bits(1)), 0x80);
    assert_eq!(f32_to_e5m2(f32::NAN), 0x7F);
    assert_eq!(f32_to_e5m2(f32::INFINITY), 0x7B);
    assert_eq!(f32_to_e5m2(f32::NEG_INFINITY), 0xFB);
    assert_eq!(f32_to_e5m2(-0.0), 0x80);
}

/// Sparse sweep of all fp32 bit patterns against the brute-force reference.
#[test]
fn strided_sweep_matches_reference() {
    let mut bits = 0u32;
    while let Some(next) = bits.checked_add(0x0000_3FF7) {
        let x = f32::from_bits(bits);
        assert_eq!(f32_to_e4m3(x), ref_e4m3(x), "e4m3 of {x:e} ({bits:#010x})");
        assert_eq!(f32_to_e5m2(x), ref_e5m2(x), "e5m2 of {x:e} ({bits:#010x})");
        assert_eq!(f32_to_e2m1(x), ref_e2m1(x), "e2m1 of {x:e} ({bits:#010x})");
        bits = next;
    }
}

proptest! {
    #[test]
    fn casts_match_reference(bits in any::<u32>(), scale in -20i32..20) {
        // Random patterns, and ones pulled into the formats' ranges.
        let x = f32::from_bits(bits);
        let y = (f32::from_bits(bits & 0x807F_FFFF | 0x3F80_0000)) * exp2i(scale);
        for v in [x, y] {
            prop_assert_eq!(f32_to_e4m3(v), ref_e4m3(v), "e4m3 of {:e}", v);
            prop_assert_eq!(f32_to_e5m2(v), ref_e5m2(v), "e5m2 of {:e}", v);
            prop_assert_eq!(f32_to_e2m1(v), ref_e2m1(v), "e2m1 of {:e}", v);
        }
    }
}
