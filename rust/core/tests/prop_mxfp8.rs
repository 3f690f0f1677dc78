//! MXFP8 properties: dequantize(quantize(x)) within the element format's bound, quantizing
//! along any dim equals quantizing the transposed tensor along its last dim, and the tiled
//! parallel paths agree with a per-block scalar model.
//!
//! Error bound. With block scale s = 2^(e-127) and y = x / s, RNE gives |q - y| <= half an ulp
//! of the element format at y: at most 2^-(m+1) |y| for normal y (m mantissa bits) and half the
//! smallest subnormal (2^-10 for E4M3, 2^-17 for E5M2) below. Dequantizing multiplies by s
//! exactly (fp32 underflow adds at most 2^-150). Hence
//!     |x' - x| <= max(2^-(m+1) |x|, half_min_sub * s) + 2^-149,
//! except under the floor rule where |y| > max + half an ulp at max (464 / 61440): those elements
//! saturate to ±max * s. rceil keeps every |y| <= max and, whenever e >= 2, amax / s > max / 2.

mod common;

use common::block;
use deepwell_core::*;
use proptest::prelude::*;

fn bound_params(elem: Fp8Elem) -> (f64, f64, f64) {
    match elem {
        // (relative half-ulp, half the smallest subnormal, largest value before saturation)
        Fp8Elem::E4M3 => (2f64.powi(-4), 2f64.powi(-10), 464.0),
        Fp8Elem::E5M2 => (2f64.powi(-3), 2f64.powi(-17), 61440.0),
    }
}

fn check_round_trip(x: &[f32], mode: ScaleMode, elem: Fp8Elem) -> std::result::Result<(), TestCaseError> {
    let dims = Dims3 { outer: 1, k: x.len(), inner: 1 };
    let (mut data, mut scale) = (vec![0u8; x.len()], vec![0u8; x.len() / 32]);
    mxfp8_quantize(x, dims, mode, elem, &mut data, &mut scale);
    let mut out = vec![0f32; x.len()];
    mxfp8_dequantize(&data, &scale, dims, elem, &mut out);
    let (rel, sub, sat) = bound_params(elem);
    for (b, &sbyte) in scale.iter().enumerate() {
        let xb = &x[b * 32..][..32];
        let amax = xb.iter().fold(0f32, |m, &v| abs_max(m, v));
        prop_assert_eq!(sbyte, mxfp8_scale_byte(amax, mode, elem));
        let s = f64::from(e8m0_to_f32(sbyte));
        let max = f64::from(elem.max());
        if mode == ScaleMode::Rceil {
            prop_assert!(f64::from(amax) / s <= max, "rceil saturates: amax {:e} s {:e}", amax, s);
            if sbyte >= 2 {
                prop_assert!(f64::from(amax) / s > max / 2.0, "rceil not tight: amax {:e}", amax);
            }
        }
        for (i, &v) in xb.iter().enumerate() {
            let (v, y) = (f64::from(v), f64::from(out[b * 32 + i]));
            if (v / s).abs() > sat {
                prop_assert_eq!(y, max * s * v.signum());
            } else {
                let tol = (rel * v.abs()).max(sub * s) + 2f64.powi(-149);
                prop_assert!((y - v).abs() <= tol, "block {} elem {}: {:e} -> {:e} (s {:e})", b, i, v, y, s);
                prop_assert_eq!(y.is_sign_negative(), v.is_sign_negative(), "sign of {:e}", v);
            }
        }
    }
    Ok(())
}

fn mode_elem() -> impl Strategy<Value = (ScaleMode, Fp8Elem)> {
    (prop_oneof![Just(ScaleMode::Rceil), Just(ScaleMode::Floor)], prop_oneof![Just(Fp8Elem::E4M3), Just(Fp8Elem::E5M2)])
}

proptest! {
    #[test]
    fn round_trip_within_bound(x in block(128, 3.0), (mode, elem) in mode_elem()) {
        check_round_trip(&x, mode, elem)?;
    }

    #[test]
    fn round_trip_wide_blocks(x in block(64, 40.0), (mode, elem) in mode_elem()) {
        check_round_trip(&x, mode, elem)?;
    }

    #[test]
    fn any_dim_equals_transposed_last_dim(
        (outer, kb, inner) in (1usize..4, 1usize..4, 1usize..7),
        seed in any::<u64>(),
        (mode, elem) in mode_elem(),
    ) {
        let k = 32 * kb;
        let n = outer * k * inner;
        let x = &common::wide_values(seed, n, true);
        let (mut d, mut s) = (vec![0u8; n], vec![0u8; n / 32]);
        mxfp8_quantize(x, Dims3 { outer, k, inner }, mode, elem, &mut d, &mut s);
        // xt[o][i][j] = x[o][j][i], quantized along its (contiguous) last dim.
        let idx = |o: usize, j: usize, i: usize| (o * k + j) * inner + i;
        let xt: Vec<f32> = (0..n).map(|t| { let (o, i, j) = (t / (inner * k), (t / k) % inner, t % k); x[idx(o, j, i)] }).collect();
        let (mut dt, mut st) = (vec![0u8; n], vec![0u8; n / 32]);
        mxfp8_quantize(&xt, Dims3 { outer: outer * inner, k, inner: 1 }, mode, elem, &mut dt, &mut st);
        for o in 0..outer { for i in 0..inner {
            for j in 0..k { prop_assert_eq!(d[idx(o, j, i)], dt[(o * inner + i) * k + j]); }
            for b in 0..kb { prop_assert_eq!(s[(o * kb + b) * inner + i], st[(o * inner + i) * kb + b]); }
        } }
    }
}

/// Per-block scalar model of the quantizer (no tiling, no threads).
fn scalar_model(x: &[f32], dims: Dims3, mode: ScaleMode, elem: Fp8Elem) -> (Vec<u8>, Vec<u8>) {
    let (mut d, mut s) = (vec![0u8; x.len()], vec![0u8; x.len() / 32]);
    let kb = dims.k / 32;
    for o in 0..dims.outer {
        for b in 0..kb {
            for i in 0..dims.inner {
                let at = |j: usize| (o * dims.k + b * 32 + j) * dims.inner + i;
                let amax = (0..32).fold(0f32, |m, j| abs_max(m, x[at(j)]));
                let e = mxfp8_scale_byte(amax, mode, elem);
                s[(o * kb + b) * dims.inner + i] = e;
                for j in 0..32 {
                    d[at(j)] = if e == 0xFF { elem.nan() } else { elem.encode(x[at(j)] * exp2i(127 - i32::from(e))) };
                }
            }
        }
    }
    (d, s)
}

#[test]
fn tiled_paths_match_scalar_model() {
    // Shapes that split into several tiles (inner > 1024; flat > 32K elements) and ragged tails.
    let mut state = 1u64;
    for dims in [
        Dims3 { outer: 1, k: 64, inner: 2500 },
        Dims3 { outer: 3, k: 96, inner: 7 },
        Dims3 { outer: 700, k: 96, inner: 1 },
    ] {
        let x = common::lcg_floats(&mut state, dims.numel(), 40, (997, f32::NAN));
        for (mode, elem) in [(ScaleMode::Rceil, Fp8Elem::E4M3), (ScaleMode::Floor, Fp8Elem::E5M2)] {
            let (mut d, mut s) = (vec![0u8; x.len()], vec![0u8; x.len() / 32]);
            mxfp8_quantize(&x, dims, mode, elem, &mut d, &mut s);
            let (wd, ws) = scalar_model(&x, dims, mode, elem);
            assert!(s == ws, "{dims:?} {mode:?} scales differ");
            assert!(d == wd, "{dims:?} {mode:?} data differ");
            // bf16 / f16 inputs equal the widened fp32 input.
            let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let xw: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            let (mut d1, mut s1, mut d2, mut s2) = (d.clone(), s.clone(), d, s);
            mxfp8_quantize(&xb, dims, mode, elem, &mut d1, &mut s1);
            mxfp8_quantize(&xw, dims, mode, elem, &mut d2, &mut s2);
            assert!(d1 == d2 && s1 == s2);
        }
    }
}
