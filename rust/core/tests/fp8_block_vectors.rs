//! docs/NUMERICS.md FP8-block rules: scale specials, power-of-two rounding, layouts.

use deepwell_core::*;

#[test]
fn scale_rules() {
    for (amax, pow2, want) in [
        (0.0, false, 1.0),
        (0.0, true, 1.0),
        (f32::INFINITY, false, 1.0),
        (f32::NAN, true, 1.0),
        (448.0, false, 1.0),
        (1.0, false, 448.0),
        (1.0, true, 256.0),
        (3.0, false, 448.0 / 3.0),
        (3.0, true, 128.0),
        (0.1, true, 4096.0),
        (f32::from_bits(1), false, f32::MAX), // 448 / 2^-149 = Inf -> FLT_MAX
        (f32::from_bits(1), true, 2f32.powi(127)),
    ] {
        assert_eq!(fp8_block_scale(amax, pow2), want, "amax {amax:e} pow2 {pow2}");
    }
}

#[test]
fn non_finite_block_keeps_scale_one() {
    let mut x = vec![0.5f32; 256];
    x[0] = f32::NAN;
    x[1] = f32::INFINITY;
    x[2] = -1e6;
    x[3] = f32::NEG_INFINITY;
    let (mut data, mut si) = (vec![0u8; 256], vec![0f32; 2]);
    fp8_block_quantize(&x, 1, 1, 256, 1, 128, true, &mut data, &mut si);
    assert_eq!(si[0], 1.0);
    assert_eq!(&data[..5], &[0x7F, 0x7E, 0xFE, 0xFE, f32_to_e4m3(0.5)]);
    // Block 2 has amax 0.5: scale 896 -> pow2 512.
    assert_eq!(si[1], 1.0 / 512.0);
    assert_eq!(data[128], f32_to_e4m3(256.0));
}

#[test]
fn layouts_1x128_and_128x128() {
    // batch 2 of (256, 256); value encodes (b, row block, col block) in its magnitude.
    let (b, r, c) = (2, 256, 256);
    let amax_of = |bi: usize, ri: usize, ci: usize| ((bi * 4 + ri * 2 + ci) + 1) as f32;
    let x: Vec<f32> = (0..b * r * c)
        .map(|i| {
            let (bi, ri, ci) = (i / (r * c), (i / c) % r, i % c);
            let a = amax_of(bi, ri / 128, ci / 128);
            if (ri % 128, ci % 128) == (5, 7) {
                -a
            } else {
                a / 3.0
            }
        })
        .collect();
    let mut data = vec![0u8; x.len()];
    let mut si = vec![0f32; 8];
    fp8_block_quantize(&x, b, r, c, 128, 128, false, &mut data, &mut si);
    for (i, &s) in si.iter().enumerate() {
        let (bi, ri, ci) = (i / 4, (i / 2) % 2, i % 2);
        assert_eq!(s, 1.0 / (448.0 / amax_of(bi, ri, ci)), "scale {i}");
    }
    let mut out = vec![0f32; x.len()];
    fp8_block_dequantize(&data, &si, b, r, c, 128, 128, &mut out);
    for (i, (&y, &v)) in out.iter().zip(&x).enumerate() {
        assert!((y - v).abs() <= v.abs() / 16.0, "element {i}: {y} vs {v}");
    }
    // 1x128: one scale per (batch, row, col block); row 5 of each tile holds the block amax.
    let mut si = vec![0f32; b * r * 2];
    fp8_block_quantize(&x, b, r, c, 1, 128, false, &mut data, &mut si);
    let row5 = 5 * 2;
    assert_eq!(si[row5], 1.0 / (448.0 / amax_of(0, 0, 0)));
    assert_eq!(si[row5 + 1], 1.0 / (448.0 / amax_of(0, 0, 1)));
    assert_eq!(si[0], 1.0 / (448.0 / (amax_of(0, 0, 0) / 3.0)));
    fp8_block_dequantize(&data, &si, b, r, c, 1, 128, &mut out);
    assert!(out.iter().zip(&x).all(|(&y, &v)| (y - v).abs() <= v.abs() / 16.0));
}

#[test]
#[should_panic(expected = "whole number of 128x128 blocks")]
fn rejects_partial_blocks() {
    let x = vec![0f32; 100 * 128];
    let (mut d, mut s) = (vec![0u8; x.len()], vec![0f32; 1]);
    fp8_block_quantize(&x, 1, 100, 128, 128, 128, true, &mut d, &mut s);
}

/// Per-block scalar model (no tiling, no threads) against the quantizer, on shapes whose
/// column tiles are ragged, and on column-wise 128x1 blocks.
#[test]
fn quantizer_matches_scalar_model() {
    let (b, r, c) = (2, 256, 640);
    let mut st = 3u32;
    let x: Vec<f32> = (0..b * r * c)
        .map(|_| {
            st ^= st << 13;
            st ^= st >> 17;
            st ^= st << 5;
            if st % 4099 == 0 {
                f32::NAN
            } else {
                (st as f32 / 4e9 - 0.5) * exp2i((st % 36) as i32 - 18)
            }
        })
        .collect();
    for (br, bc) in [(1, 128), (128, 128), (128, 1), (2, 64)] {
        for pow2 in [false, true] {
            let (mut d, mut s) = (vec![0u8; x.len()], vec![0f32; x.len() / br / bc]);
            fp8_block_quantize(&x, b, r, c, br, bc, pow2, &mut d, &mut s);
            let (nr, nc) = (r / br, c / bc);
            let block_of = |i: usize| {
                let (bi, ri, ci) = (i / (r * c), (i / c) % r, i % c);
                (bi * nr + ri / br) * nc + ci / bc
            };
            let mut amax = vec![0f32; s.len()];
            for (i, &v) in x.iter().enumerate() {
                amax[block_of(i)] = abs_max(amax[block_of(i)], v);
            }
            for (i, (&q, &v)) in d.iter().zip(&x).enumerate() {
                let scale = fp8_block_scale(amax[block_of(i)], pow2);
                assert_eq!(s[block_of(i)].to_bits(), (1.0 / scale).to_bits(), "{br}x{bc} element {i}");
                assert_eq!(q, f32_to_e4m3(v * scale), "{br}x{bc} element {i}");
            }
        }
    }
}
