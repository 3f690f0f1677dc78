//! docs/NUMERICS.md MXFP8 test vectors (the further ones included), every one in both scale
//! modes, for fp32 and bf16 inputs.

use deepwell_core::*;
use half::bf16;

/// Quantizes one block of 32 (fp32 or bf16-rounded input) and returns (scale byte, data).
fn q32(x: &[f32; 32], mode: ScaleMode, elem: Fp8Elem, as_bf16: bool) -> (u8, Vec<u8>) {
    let dims = Dims3 { outer: 1, k: 32, inner: 1 };
    let (mut data, mut scale) = (vec![0u8; 32], vec![0u8; 1]);
    if as_bf16 {
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        mxfp8_quantize(&xb, dims, mode, elem, &mut data, &mut scale);
    } else {
        mxfp8_quantize(x, dims, mode, elem, &mut data, &mut scale);
    }
    (scale[0], data)
}

/// Checks a block of 32 equal values: expected (scale, element byte) per mode.
fn check_uniform(v: f32, bf16_in: bool, rceil: (u8, u8), floor: (u8, u8)) {
    for (mode, (s, e)) in [(ScaleMode::Rceil, rceil), (ScaleMode::Floor, floor)] {
        let (scale, data) = q32(&[v; 32], mode, Fp8Elem::E4M3, bf16_in);
        assert_eq!((scale, data[0]), (s, e), "{v:e} (bf16 input: {bf16_in}) {mode:?}");
        assert!(data.iter().all(|&d| d == e));
    }
}

#[test]
fn numerics_table() {
    let both = |v: f32, r, f| {
        check_uniform(v, false, r, f);
        check_uniform(v, true, r, f);
    };
    both(0.0, (0, 0x00), (0, 0x00));
    both(2f32.powi(-126), (0, 0x40), (0, 0x40));
    both(448.0, (127, 0x7E), (127, 0x7E));
    both(-448.0, (127, 0xFE), (127, 0xFE));
    both(480.0, (128, 0x77), (127, 0x7E));
    both(-480.0, (128, 0xF7), (127, 0xFE));
    both(1.0, (119, 0x78), (119, 0x78));
    check_uniform(f32::MAX, false, (247, 0x78), (246, 0x7E));
    check_uniform(bf16::MAX.to_f32(), true, (247, 0x78), (246, 0x7E));
    // bf16 pre-rounding traps: the bf16 input is rounded first.
    let v = f32::from_bits(0x4060_0001);
    check_uniform(v, false, (121, 0x76), (120, 0x7E));
    check_uniform(v, true, (120, 0x7E), (120, 0x7E));
    let v = f32::from_bits(0x43FF_FFFF);
    check_uniform(v, false, (128, 0x78), (127, 0x7E));
    check_uniform(v, true, (128, 0x78), (128, 0x78));
}

#[test]
fn signed_zero_and_mixed_blocks() {
    for mode in [ScaleMode::Rceil, ScaleMode::Floor] {
        // -0.0 among 1.0s stays 0x80.
        let mut x = [1.0f32; 32];
        x[5] = -0.0;
        let (s, d) = q32(&x, mode, Fp8Elem::E4M3, false);
        assert_eq!((s, d[5], d[0]), (119, 0x80, 0x78));
        // Mixed underflow: the smallest subnormal among 1.0s flushes to a signed zero.
        for (v, want) in [(f32::from_bits(1), 0x00), (-f32::from_bits(1), 0x80)] {
            x[0] = v;
            let (s, d) = q32(&x, mode, Fp8Elem::E4M3, false);
            assert_eq!((s, d[0]), (119, want), "{mode:?} {v:e}");
        }
        // Mixed saturation + underflow: dtype max with 1.0s.
        let mut x = [1.0f32; 32];
        x[0] = f32::MAX;
        let (s, d) = q32(&x, mode, Fp8Elem::E4M3, false);
        let (ws, wd) = if mode == ScaleMode::Rceil { (247, 0x78) } else { (246, 0x7E) };
        assert_eq!((s, d[0]), (ws, wd));
        assert!(d[1..].iter().all(|&b| b == 0));
    }
}

#[test]
fn smallest_subnormals_are_not_flushed() {
    for mode in [ScaleMode::Rceil, ScaleMode::Floor] {
        for (v, bf, want) in [
            (f32::from_bits(1), false, 0x00),
            (-f32::from_bits(1), false, 0x80),
            (exp2i(-133), true, 0x08),
            (-exp2i(-133), true, 0x88),
        ] {
            let (s, d) = q32(&[v; 32], mode, Fp8Elem::E4M3, bf);
            assert_eq!((s, d[0]), (0, want), "{mode:?} {v:e}");
        }
    }
}

#[test]
fn non_finite_blocks_are_nan() {
    for elem in [Fp8Elem::E4M3, Fp8Elem::E5M2] {
        for mode in [ScaleMode::Rceil, ScaleMode::Floor] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut x = [1.0f32; 32];
                x[7] = bad;
                let (s, d) = q32(&x, mode, elem, false);
                assert_eq!(s, 0xFF, "{elem:?} {mode:?} {bad}");
                assert!(d.iter().all(|&b| b == elem.nan()));
                let mut out = [0f32; 32];
                mxfp8_dequantize(&d, &[s], Dims3 { outer: 1, k: 32, inner: 1 }, elem, &mut out);
                assert!(out.iter().all(|v| v.is_nan()));
            }
            let (s, _) = q32(&[f32::NAN; 32], mode, elem, true);
            assert_eq!(s, 0xFF);
        }
    }
}

#[test]
fn scale_byte_rules() {
    use ScaleMode::*;
    let e4 = Fp8Elem::E4M3;
    assert_eq!(mxfp8_scale_byte(f32::INFINITY, Rceil, e4), 0xFF);
    assert_eq!(mxfp8_scale_byte(f32::NAN, Floor, e4), 0xFF);
    // fp32-subnormal d: +1 only above 2^-127. d = amax * fp32(1/448).
    let d_just_above = f32::from_bits(0x0040_0001);
    assert_eq!(mxfp8_scale_byte(2f32.powi(-127) * 448.0, Rceil, e4), 0);
    assert_eq!(mxfp8_scale_byte(d_just_above * 448.0 * 1.01, Rceil, e4), 1);
    // floor: subnormal amax clamps to byte 0; E5M2 uses 15.
    assert_eq!(mxfp8_scale_byte(f32::from_bits(0x0040_0000), Floor, e4), 0);
    assert_eq!(mxfp8_scale_byte(1.0, Floor, Fp8Elem::E5M2), 112);
    assert_eq!(mxfp8_scale_byte(57344.0, Rceil, Fp8Elem::E5M2), 127);
    assert_eq!(mxfp8_scale_byte(57345.0 * 1.01, Rceil, Fp8Elem::E5M2), 128);
    assert_eq!(mxfp8_scale_byte(f32::MAX, Floor, Fp8Elem::E5M2), 239);
    assert_eq!(mxfp8_scale_byte(f32::MAX, Floor, e4), 246);
}

#[test]
fn e8m0_extreme_scales_dequantize() {
    // TE test_mxfp8_dequantize_extreme_scales: bytes 0, 127, 254, 255.
    let dims = Dims3 { outer: 1, k: 32, inner: 1 };
    let data = [0x38u8; 32]; // 1.0
    for (s, want) in [(0u8, 2f32.powi(-127)), (127, 1.0), (254, 2f32.powi(127))] {
        let mut out = [0f32; 32];
        mxfp8_dequantize(&data, &[s], dims, Fp8Elem::E4M3, &mut out);
        assert_eq!(out[0].to_bits(), want.to_bits(), "scale byte {s}");
    }
}

#[test]
fn non_last_dim_layout() {
    // (outer=2, k=32, inner=3): block (o, 0, i) is x[o][0..32][i]; scale layout (2, 1, 3).
    let dims = Dims3 { outer: 2, k: 32, inner: 3 };
    let x: Vec<f32> = (0..dims.numel()).map(|i| if i % 3 == 1 { 1.0 } else { 448.0 }).collect();
    let (mut data, mut scale) = (vec![0u8; dims.numel()], vec![0u8; 6]);
    mxfp8_quantize(&x, dims, ScaleMode::Rceil, Fp8Elem::E4M3, &mut data, &mut scale);
    assert_eq!(scale, [127, 119, 127, 127, 119, 127]);
    assert!(data.iter().enumerate().all(|(i, &b)| b == if i % 3 == 1 { 0x78 } else { 0x7E }));
}

#[test]
fn parse_modes() {
    assert_eq!("rceil".parse::<ScaleMode>(), Ok(ScaleMode::Rceil));
    assert_eq!("floor".parse::<ScaleMode>(), Ok(ScaleMode::Floor));
    assert_eq!("e5m2".parse::<Fp8Elem>(), Ok(Fp8Elem::E5M2));
    let err = "ceil".parse::<ScaleMode>().unwrap_err().to_string();
    assert!(err.contains("\"ceil\"") && err.contains("rceil, floor"), "{err}");
    let err = "e4m3fn".parse::<Fp8Elem>().unwrap_err().to_string();
    assert!(err.contains("e4m3, e5m2"), "{err}");
}
