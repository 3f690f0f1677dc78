//! High-precision element types a quantizer reads and a dequantizer writes.
//!
//! docs/NUMERICS.md preamble: "All arithmetic is in fp32 on the fp32 value of the input (bf16/fp16
//! inputs are widened exactly)". `to_f32` is therefore exact for every implementor, and
//! `from_f32` rounds to nearest even (NaN stays NaN), matching `__float2bfloat16_rn` /
//! `__float2half_rn` on the device.

use half::{bf16, f16};

/// A floating-point storage type that widens exactly to fp32.
pub trait Element: Copy + Send + Sync + 'static {
    /// Exact widening to fp32.
    fn to_f32(self) -> f32;
    /// Round-to-nearest-even narrowing from fp32; NaN stays NaN, overflow goes to ±Inf.
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // A bf16 is the top half of an fp32: widening is a shift, exact by construction.
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        // half's conversion rounds to nearest even and keeps NaN quiet.
        bf16::from_f32(v)
    }
}

impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_widening_is_exact_and_narrowing_is_rne() {
        let x = bf16::from_bits(0x4060); // 3.5
        assert_eq!(x.to_f32(), 3.5);
        // fp32 0x40600001 (3.5 + 1 ulp) rounds to 3.5 in bf16 (docs/NUMERICS.md's bf16 trap row).
        assert_eq!(<bf16 as Element>::from_f32(f32::from_bits(0x4060_0001)).to_bits(), 0x4060);
        // 0x43FFFFFF (just below 512) rounds up to 512.
        assert_eq!(<bf16 as Element>::from_f32(f32::from_bits(0x43FF_FFFF)).to_f32(), 512.0);
        assert!(<bf16 as Element>::from_f32(f32::NAN).to_f32().is_nan());
        assert!(<f16 as Element>::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(<f16 as Element>::from_f32(1.5).to_f32(), 1.5);
    }
}
