//! docs/NUMERICS.md NVFP4 vectors and special values.

use deepwell_core::*;

fn quantize(x: &[f32], rows: usize, k: usize, gamax: f32, opts: Nvfp4Options) -> (Vec<u8>, Vec<u8>, f32) {
    let (mut data, mut scale) = (vec![0u8; rows * k / 2], vec![0u8; rows * k / 16]);
    let s_dec = nvfp4_quantize(x, rows, k, gamax, &opts, &mut data, &mut scale);
    (data, scale, s_dec)
}

#[test]
fn global_amax_10_vector() {
    let s_enc = nvfp4_encode_scale(10.0);
    assert_eq!(s_enc, 268.8f32);
    // Blocks with amax 10, 0.5 and 0.
    let mut x = vec![0f32; 48];
    x[0] = 10.0;
    x[1] = -10.0;
    x[16] = 0.5;
    x[17] = 0.25;
    let (data, scale, s_dec) = quantize(&x, 1, 48, 10.0, Nvfp4Options::default());
    assert_eq!(s_dec, 1.0 / 268.8f32);
    assert_eq!(scale, [0x7E, 0x5B, 0x00]);
    assert_eq!(e4m3_to_f32(0x5B), 22.0);
    assert_eq!(data[0], 0x7 | 0xF << 4, "10 -> 6, -10 -> -6");
    // Block 2: enc = 1 / (22 * S_dec) ~ 12.218: 0.5 -> 6.109 -> 6; 0.25 -> 3.05 -> 3.
    let enc = (1.0 / (22.0 * s_dec)).min(f32::MAX);
    assert!((enc - 12.218).abs() < 1e-3, "{enc}");
    assert_eq!(data[8], 0x7 | 0x5 << 4);
    assert!(data[1..8].iter().chain(&data[9..]).all(|&b| b == 0));
    // Dequantize: (e2m1 * sb) * S_dec.
    let mut out = vec![0f32; 48];
    nvfp4_dequantize(&data, &scale, s_dec, 1, 48, &mut out);
    assert_eq!(out[0], 6.0 * 448.0 * s_dec);
    assert_eq!(out[1], -6.0 * 448.0 * s_dec);
    assert_eq!(out[16], 6.0 * 22.0 * s_dec);
    assert_eq!(out[17], 3.0 * 22.0 * s_dec);
    assert!((out[0] - 10.0).abs() < 1e-5);
}

#[test]
fn encode_scale_specials() {
    for g in [0.0, f32::INFINITY, f32::NAN, -0.0] {
        assert_eq!(nvfp4_encode_scale(g), 1.0, "{g}");
    }
    assert_eq!(nvfp4_encode_scale(f32::from_bits(1)), f32::MAX, "tiny amax saturates");
    assert_eq!(nvfp4_encode_scale(2688.0), 1.0);
    let (_, _, s_dec) = quantize(&[1.0; 16], 1, 16, f32::NAN, Nvfp4Options::default());
    assert_eq!(s_dec, 1.0);
}

#[test]
fn packing_and_rne_grid() {
    // global amax 2688 -> S_enc = 1; block amax 6 -> sb = 1.0 (0x38), enc = 1: the grid maps
    // to itself, ties go to even.
    let x = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0];
    let (data, scale, s_dec) = quantize(&x, 1, 16, 2688.0, Nvfp4Options::default());
    assert_eq!((scale[0], s_dec), (0x38, 1.0));
    let codes: Vec<u8> = data.iter().flat_map(|&b| [b & 0xF, b >> 4]).collect();
    assert_eq!(codes, [1, 2, 3, 4, 5, 6, 7, 9, 0, 2, 2, 4, 4, 6, 6, 8]);
}

#[test]
fn non_finite_blocks() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for opts in [
            Nvfp4Options::default(),
            Nvfp4Options { block_2d: true, ..Default::default() },
            Nvfp4Options { stochastic_seed: Some(3), hadamard: true, ..Default::default() },
        ] {
            let mut x = vec![1.0f32; 16 * 32];
            x[17] = bad; // row 0, block 1
            let (data, scale, s_dec) = quantize(&x, 16, 32, 1.0, opts);
            assert_eq!(scale[1], 0x7F, "{bad} {opts:?}");
            assert_eq!(&data[8..16], &[0; 8]);
            if opts.block_2d {
                assert!((0..16).all(|r| scale[2 * r + 1] == 0x7F && scale[2 * r] != 0x7F));
            } else {
                assert_eq!(scale[0], scale[2]);
            }
            let mut out = vec![0f32; 16 * 32];
            nvfp4_dequantize(&data, &scale, s_dec, 16, 32, &mut out);
            assert!(out[16..32].iter().all(|v| v.is_nan()));
            assert!(out[..16].iter().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn global_amax_is_nan_propagating_and_post_hadamard() {
    let mut x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.37).collect();
    assert_eq!(nvfp4_global_amax(&x, 32, false), 43.0 * 0.37);
    let mut manual = 0f32;
    for c in x.chunks_exact(16) {
        let mut v: [f32; 16] = c.try_into().unwrap();
        hadamard16(&mut v);
        manual = v.iter().fold(manual, |m, y| abs_max(m, *y));
    }
    assert_eq!(nvfp4_global_amax(&x, 32, true), manual);
    x[40] = f32::INFINITY;
    assert_eq!(nvfp4_global_amax(&x, 32, false), f32::INFINITY);
    x[3] = f32::NAN;
    assert!(nvfp4_global_amax(&x, 32, false).is_nan());
    assert!(nvfp4_global_amax(&x, 32, true).is_nan());
}

#[test]
fn zero_block_gives_zero_scale_and_data() {
    let (data, scale, _) = quantize(&[0.0; 32], 1, 32, 10.0, Nvfp4Options::default());
    assert_eq!(scale, [0, 0]);
    assert!(data.iter().all(|&b| b == 0));
}
