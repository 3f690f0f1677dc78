//! FP8 with one fp32 scale per tensor from the tensor's own amax ("current scaling": torchao's
//! `tensorwise` float8 recipe, Transformer Engine's `Float8CurrentScaling`; docs/NUMERICS.md
//! "FP8 tensor"). Activations and weights are E4M3, gradients E5M2 (the "hybrid" format of TE and
//! torchao: gradients need range more than precision).
//!
//! `amax` = NaN-propagating max |x| over the whole tensor; `scale` = `max / amax` under
//! fp8_block's rule ([`fp8_scale`]: amax 0, Inf or NaN -> 1, Inf -> FLT_MAX), always rounded down to
//! a power of two, so `x * scale` is exact and `scale_inv = 1 / scale` too. Elements:
//! `q = cast_rne_satfinite(x * scale)`; dequantize `x' = decode(q) * scale_inv`.
//!
//! With one scale the transposed copy a wgrad or dgrad GEMM needs is exactly the codes transposed
//! (docs/NUMERICS.md "Transposes and layouts"): no second quantization, no second amax.

use crate::element::Element;
use crate::formats::abs_bits_max;
use crate::fp8_block::fp8_scale;
use crate::mxfp8::Fp8Elem;
use rayon::prelude::*;

/// Elements per rayon task of the amax and the casts (large enough to amortise the task).
const CHUNK: usize = 1 << 16;

/// The power-of-two scale for a tensor with this amax, in `elem`.
pub fn fp8_tensor_scale(amax: f32, elem: Fp8Elem) -> f32 {
    fp8_scale(amax, elem.max(), true)
}

/// NaN-propagating max |x| (NaN wins over Inf; 0 for an empty tensor).
pub fn fp8_tensor_amax<T: Element>(x: &[T]) -> f32 {
    let bits = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().fold(0, |m, v| abs_bits_max(m, v.to_f32().to_bits())))
        .reduce(|| 0, |a, b| a.max(b));
    f32::from_bits(bits)
}

/// Quantizes `x` with one scale; returns `scale_inv`.
///
/// # Panics
/// If `data.len() != x.len()`.
pub fn fp8_tensor_quantize<T: Element>(x: &[T], elem: Fp8Elem, data: &mut [u8]) -> f32 {
    fp8_tensor_quantize_with_amax(x, elem, fp8_tensor_amax(x), data)
}

/// [`fp8_tensor_quantize`] with x's amax computed beforehand (by whoever produced x: the deepwell
/// backend lets Inductor fuse the reduction into x's producer). The codes are those of
/// `fp8_tensor_quantize(x)` exactly when `amax == fp8_tensor_amax(x)` (any NaN for a NaN amax:
/// the scale rule maps every NaN to 1); returns `scale_inv`.
///
/// # Panics
/// If `data.len() != x.len()`.
pub fn fp8_tensor_quantize_with_amax<T: Element>(x: &[T], elem: Fp8Elem, amax: f32, data: &mut [u8]) -> f32 {
    assert_eq!(data.len(), x.len(), "fp8_tensor_quantize: data has {} bytes, expected {}", data.len(), x.len());
    let scale = fp8_tensor_scale(amax, elem);
    data.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(d, c)| {
        for (q, v) in d.iter_mut().zip(c) {
            *q = elem.encode(v.to_f32() * scale);
        }
    });
    1.0 / scale
}

/// `x' = O::from_f32(decode(q) * scale_inv)`.
///
/// # Panics
/// If `out.len() != data.len()`.
pub fn fp8_tensor_dequantize<O: Element>(data: &[u8], elem: Fp8Elem, scale_inv: f32, out: &mut [O]) {
    assert_eq!(out.len(), data.len(), "fp8_tensor_dequantize: out has {} elements, expected {}", out.len(), data.len());
    out.par_chunks_mut(CHUNK).zip(data.par_chunks(CHUNK)).for_each(|(o, d)| {
        for (y, &q) in o.iter_mut().zip(d) {
            *y = O::from_f32(elem.decode(q) * scale_inv);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_is_a_power_of_two_at_or_below_max_over_amax() {
        // 448 / 3 = 149.33 -> 128; 57344 / 3 = 19114.67 -> 16384.
        assert_eq!(fp8_tensor_scale(3.0, Fp8Elem::E4M3), 128.0);
        assert_eq!(fp8_tensor_scale(3.0, Fp8Elem::E5M2), 16384.0);
        assert_eq!(fp8_tensor_scale(448.0, Fp8Elem::E4M3), 1.0);
        for bad in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(fp8_tensor_scale(bad, Fp8Elem::E4M3), 1.0);
        }
        // A subnormal amax: 448 / 2^-149 overflows to Inf -> FLT_MAX -> 2^127.
        assert_eq!(fp8_tensor_scale(f32::from_bits(1), Fp8Elem::E4M3), 2f32.powi(127));
    }

    #[test]
    fn a_given_amax_is_the_reduced_one() {
        // The codes depend on x and its amax only: any NaN amax stands for "x has a NaN".
        let x = [1.0f32, -3.0, 0.0, 1e-30, 2.5, -7.0];
        for elem in [Fp8Elem::E4M3, Fp8Elem::E5M2] {
            let (mut own, mut given) = ([0u8; 6], [0u8; 6]);
            let s = fp8_tensor_quantize(&x, elem, &mut own);
            assert_eq!(fp8_tensor_quantize_with_amax(&x, elem, fp8_tensor_amax(&x), &mut given), s);
            assert_eq!(own, given);
            assert_eq!(fp8_tensor_quantize_with_amax(&x, elem, f32::from_bits(0x7FC0_0001), &mut given), 1.0);
        }
    }

    #[test]
    fn round_trip_and_specials() {
        let x = [1.0f32, -3.0, 0.0, -0.0, 1e-30, 2.5];
        let mut d = [0u8; 6];
        let s_inv = fp8_tensor_quantize(&x, Fp8Elem::E4M3, &mut d);
        assert_eq!(s_inv, 1.0 / 128.0);
        assert_eq!(d[0], 0x70); // 128 = 2^7: exponent 14, mantissa 0
        assert_eq!(d[1], 0xFC); // -384 = -1.5 * 2^8: exponent 8 + 7 = 15, mantissa 0b100
        assert_eq!((d[2], d[3], d[4]), (0x00, 0x80, 0x00));
        let mut y = [0f32; 6];
        fp8_tensor_dequantize(&d, Fp8Elem::E4M3, s_inv, &mut y);
        assert_eq!(y, [1.0, -3.0, 0.0, -0.0, 0.0, 2.5]);
        // NaN anywhere: scale 1, NaN stays visible as 0x7F, Inf saturates.
        let x = [f32::NAN, f32::INFINITY, 1.0];
        let mut d = [0u8; 3];
        assert_eq!(fp8_tensor_quantize(&x, Fp8Elem::E5M2, &mut d), 1.0);
        assert_eq!(d, [0x7F, 0x7B, 0x3C]);
    }
}
