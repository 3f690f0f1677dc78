//! Layout properties: the 128x4 swizzle is a bijection with zero padding and round-trips on
//! shapes that are not multiples of 128/4; 2D blocks (NVFP4 16x16, FP8 128x128) give one scale
//! per tile and identical row- and column-wise copies after a transpose.

mod common;

use deepwell_core::*;
use proptest::prelude::*;

fn transpose<T: Copy>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..rows * cols).map(|t| x[(t % rows) * cols + t / rows]).collect()
}

proptest! {
    #[test]
    fn swizzle_round_trip(rows in 0usize..300, cols in 0usize..14, fill in any::<u8>()) {
        let src: Vec<u8> = (0..rows * cols).map(|i| (i as u8).wrapping_mul(31).wrapping_add(fill) | 1).collect();
        let mut sw = vec![0xAAu8; swizzled_len(rows, cols)];
        swizzle_scales(&src, rows, cols, &mut sw);
        // Bijection onto the valid offsets; every other byte is padding = 0.
        let mut seen = vec![false; sw.len()];
        for r in 0..rows { for c in 0..cols {
            let off = swizzle_offset(r, c, cols);
            prop_assert!(!seen[off], "offset {} used twice", off);
            seen[off] = true;
            prop_assert_eq!(sw[off], src[r * cols + c]);
        } }
        prop_assert!(sw.iter().zip(&seen).all(|(&b, &used)| used || b == 0));
        let mut back = vec![0u8; rows * cols];
        unswizzle_scales(&sw, rows, cols, &mut back);
        prop_assert_eq!(back, src);
    }

    #[test]
    fn nvfp4_2d_tiles_share_scales_and_transpose(
        (rb, kb) in (1usize..4, 1usize..4),
        seed in any::<u64>(),
    ) {
        let (rows, k) = (16 * rb, 16 * kb);
        let x = &common::wide_values(seed, rows * k, false);
        let gamax = nvfp4_global_amax(x, k, false);
        let opts = Nvfp4Options { block_2d: true, ..Default::default() };
        let (mut d, mut s) = (vec![0u8; rows * k / 2], vec![0u8; rows * k / 16]);
        let s_dec = nvfp4_quantize(x, rows, k, gamax, &opts, &mut d, &mut s);
        for r in 0..rows { for b in 0..kb {
            prop_assert_eq!(s[r * kb + b], s[(r / 16 * 16) * kb + b], "row {} block {}", r, b);
        } }
        // The column-wise copy: quantize x^T with the same global amax.
        let xt = transpose(x, rows, k);
        let (mut dt, mut st) = (vec![0u8; rows * k / 2], vec![0u8; rows * k / 16]);
        prop_assert_eq!(nvfp4_quantize(&xt, k, rows, gamax, &opts, &mut dt, &mut st), s_dec);
        let nib = |d: &[u8], i: usize| (d[i / 2] >> (4 * (i % 2))) & 0xF;
        for r in 0..rows { for c in 0..k {
            prop_assert_eq!(nib(&d, r * k + c), nib(&dt, c * rows + r));
            prop_assert_eq!(s[r * kb + c / 16], st[c * rb + r / 16]);
        } }
    }

    #[test]
    fn fp8_128x128_transpose_is_identical(
        (rb, cb, pow2) in (1usize..3, 1usize..3, any::<bool>()),
        seed in any::<u32>(),
    ) {
        let (rows, cols) = (128 * rb, 128 * cb);
        let mut st = seed | 1;
        let x: Vec<f32> = (0..rows * cols).map(|_| {
            st ^= st << 13; st ^= st >> 17; st ^= st << 5;
            (st as f32 / 4e9 - 0.5) * exp2i((st % 30) as i32 - 15)
        }).collect();
        let (mut d, mut s) = (vec![0u8; x.len()], vec![0f32; rb * cb]);
        fp8_block_quantize(&x, 1, rows, cols, 128, 128, pow2, &mut d, &mut s);
        let xt = transpose(&x, rows, cols);
        let (mut dt, mut s2) = (vec![0u8; x.len()], vec![0f32; rb * cb]);
        fp8_block_quantize(&xt, 1, cols, rows, 128, 128, pow2, &mut dt, &mut s2);
        prop_assert_eq!(transpose(&d, rows, cols), dt);
        prop_assert_eq!(transpose(&s, rb, cb), s2);
    }
}
