//! MXFP8: blocks of 32 along the quantized dim, one E8M0 scale each, E4M3 (or E5M2) elements
//! (OCP MX v1.0; docs/NUMERICS.md "MXFP8").
//!
//! Scale byte `e` from the block's `amax` (NaN-propagating, NaN wins over Inf):
//! - `rceil` (default; NVIDIA's MXFP8 recipe, arXiv 2506.08027, cuBLAS, Transformer Engine):
//!   `d = amax * fp32(1/448)` (a multiply by the fp32 reciprocal, not a division);
//!   `e` = biased exponent of `d`, +1 if its mantissa is non-zero (fp32-subnormal `d`: +1 only if
//!   mantissa > 0x400000, i.e. d > 2^-127); `d == 0 -> 0`; capped at 254. So
//!   `|x| * 2^(127-e) <= 448`: elements never saturate.
//! - `floor` (OCP v1.0): `e = clamp(floor(log2(amax)) - 8, -127, 127) + 127`, floor(log2) being
//!   the unbiased exponent (computed from the leading mantissa bit for fp32-subnormal amax);
//!   amax 0 -> 0. Elements may exceed 448 and saturate.
//! - E5M2 elements: 57344 for 448 and 15 for 8.
//!
//! Elements: `q = cast_rne_satfinite(x * 2^(127-e))`, the power of two built from bits
//! (e = 254 gives the fp32 subnormal 2^-127, e = 0 gives 2^127). Dequantize:
//! `x' = float(q) * 2^(e-127)` in fp32.
//!
//! Special values (a project decision, docs/NUMERICS.md MXFP8 step 5): a block holding NaN or ±Inf
//! gets scale byte 0xFF and every element byte the element format's NaN (0x7F for both E4M3 and
//! E5M2), so the whole block dequantizes to NaN and the guardrails see it. Transformer Engine
//! instead saturates Inf and lets a NaN element pass without poisoning its block.

use crate::element::Element;
use crate::error::CoreError;
use crate::formats::{e4m3_to_f32, e5m2_to_f32, e8m0_to_f32, exp2i, f32_to_e4m3, f32_to_e5m2};
use crate::formats::{E4M3_MAX, E5M2_MAX};
use crate::shape::Dims3;
use crate::tiles::{encode_groups, group_amax, par_tiles};
use rayon::prelude::*;
use std::str::FromStr;

/// Elements per MXFP8 block.
pub const MX_BLOCK: usize = 32;

/// How the E8M0 block exponent is chosen from the block amax.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScaleMode {
    /// Ceil of log2(amax / max): no element saturates (NVIDIA recipe, the default).
    #[default]
    Rceil,
    /// OCP v1.0 floor rule: floor(log2(amax)) - emax_elem; elements may saturate.
    Floor,
}

impl FromStr for ScaleMode {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "rceil" => Ok(ScaleMode::Rceil),
            "floor" => Ok(ScaleMode::Floor),
            _ => Err(CoreError::UnknownMode { what: "MXFP8 scale mode", got: s.to_owned(), choices: "rceil, floor" }),
        }
    }
}

/// The FP8 element format of an MXFP8 tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fp8Elem {
    /// float8_e4m3fn: max 448, no Inf.
    #[default]
    E4M3,
    /// float8_e5m2: max 57344, has Inf.
    E5M2,
}

impl FromStr for Fp8Elem {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "e4m3" => Ok(Fp8Elem::E4M3),
            "e5m2" => Ok(Fp8Elem::E5M2),
            _ => Err(CoreError::UnknownMode { what: "FP8 element format", got: s.to_owned(), choices: "e4m3, e5m2" }),
        }
    }
}

impl Fp8Elem {
    /// Largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Elem::E4M3 => E4M3_MAX,
            Fp8Elem::E5M2 => E5M2_MAX,
        }
    }
    /// RNE satfinite cast from fp32 (see [`crate::formats`]).
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Elem::E4M3 => f32_to_e4m3(x),
            Fp8Elem::E5M2 => f32_to_e5m2(x),
        }
    }
    /// Exact decode to fp32.
    #[inline]
    pub fn decode(self, b: u8) -> f32 {
        match self {
            Fp8Elem::E4M3 => e4m3_to_f32(b),
            Fp8Elem::E5M2 => e5m2_to_f32(b),
        }
    }
    /// The NaN byte written for a non-finite block (also what `encode(NaN)` gives).
    pub fn nan(self) -> u8 {
        0x7F
    }
    /// fp32(1 / max): the rceil rule multiplies by this rounded reciprocal.
    fn max_rcp(self) -> f32 {
        match self {
            Fp8Elem::E4M3 => 1.0 / E4M3_MAX,
            Fp8Elem::E5M2 => 1.0 / E5M2_MAX,
        }
    }
    /// floor(log2(max)): the OCP floor rule's emax_elem.
    fn emax(self) -> i32 {
        match self {
            Fp8Elem::E4M3 => 8,
            Fp8Elem::E5M2 => 15,
        }
    }
}

/// E8M0 scale byte for a block with this amax; non-finite amax -> 0xFF.
pub fn mxfp8_scale_byte(amax: f32, mode: ScaleMode, elem: Fp8Elem) -> u8 {
    let amax = amax.abs();
    if !amax.is_finite() {
        return 0xFF;
    }
    match mode {
        ScaleMode::Rceil => {
            let d = (amax * elem.max_rcp()).to_bits();
            let (exp, mant) = (d >> 23, d & 0x7F_FFFF);
            let e = if exp == 0 {
                // d == 0 -> 0; fp32-subnormal d rounds up to byte 1 (2^-126) only above 2^-127.
                u32::from(mant > 0x40_0000)
            } else {
                exp + u32::from(mant != 0)
            };
            e.min(254) as u8
        }
        ScaleMode::Floor => {
            if amax == 0.0 {
                return 0;
            }
            let e = (floor_log2(amax) - elem.emax()).clamp(-127, 127) + 127;
            e as u8
        }
    }
}

/// floor(log2(a)) for finite a > 0, exact for fp32 subnormals too.
fn floor_log2(a: f32) -> i32 {
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32;
    if exp != 0 {
        exp - 127
    } else {
        // Subnormal: value = mant * 2^-149, so floor(log2) = index of the leading bit - 149.
        (31 - (bits & 0x7F_FFFF).leading_zeros()) as i32 - 149
    }
}

/// The element multiplier 2^(127-e); NaN for byte 0xFF, so that `encode(x * NaN)` yields the
/// format's NaN byte for every element of a non-finite block without a branch per element.
#[inline]
fn element_factor(e: u8) -> f32 {
    if e == 0xFF {
        f32::NAN
    } else {
        exp2i(127 - i32::from(e))
    }
}

/// Quantizes `x` (viewed as `dims`, blocks of 32 along `k`) to MXFP8.
///
/// `data`: `dims.numel()` bytes, same layout as `x`; `scale`: `outer * (k/32) * inner` bytes,
/// layout (outer, k/32, inner).
///
/// # Panics
/// If `dims.k % 32 != 0` or a slice length does not match `dims` (FFI-validated preconditions).
pub fn mxfp8_quantize<T: Element>(
    x: &[T],
    dims: Dims3,
    mode: ScaleMode,
    elem: Fp8Elem,
    data: &mut [u8],
    scale: &mut [u8],
) {
    let n = check_dims("mxfp8_quantize", dims, x.len(), data.len(), scale.len());
    // Flat blocks of 32 when contiguous; else 32 rows of `inner` with a scale per column.
    let (unit_rows, width, group) = if dims.inner == 1 { (1, n, MX_BLOCK) } else { (MX_BLOCK, dims.inner, 1) };
    match elem {
        Fp8Elem::E4M3 => run(x, data, scale, (unit_rows, width, group), mode, elem, f32_to_e4m3),
        Fp8Elem::E5M2 => run(x, data, scale, (unit_rows, width, group), mode, elem, f32_to_e5m2),
    }
}

/// Monomorphized per element format so the cast inlines into the inner loop.
fn run<T: Element, E: Fn(f32) -> u8 + Sync + Copy>(
    x: &[T],
    data: &mut [u8],
    scale: &mut [u8],
    (unit_rows, width, group): (usize, usize, usize),
    mode: ScaleMode,
    elem: Fp8Elem,
    enc: E,
) {
    par_tiles(x, data, scale, unit_rows, width, group, |tile, rows, st| {
        let amax = group_amax(tile, rows.len(), group);
        let factor: Vec<f32> = amax
            .iter()
            .zip(st.iter_mut())
            .map(|(&a, s)| {
                *s = mxfp8_scale_byte(f32::from_bits(a), mode, elem);
                element_factor(*s)
            })
            .collect();
        encode_groups(tile, rows, group, &factor, enc);
    });
}

/// `out = O::from_f32(decode(q) * e8m0_to_f32(s))`, the product in fp32.
///
/// # Panics
/// As [`mxfp8_quantize`].
pub fn mxfp8_dequantize<O: Element>(data: &[u8], scale: &[u8], dims: Dims3, elem: Fp8Elem, out: &mut [O]) {
    let n = check_dims("mxfp8_dequantize", dims, out.len(), data.len(), scale.len());
    if n == 0 {
        return;
    }
    let dec = |q: u8, f: f32| O::from_f32(elem.decode(q) * f);
    if dims.inner == 1 {
        // Contiguous blocks: work items of 1024 blocks.
        let chunk = MX_BLOCK * 1024;
        out.par_chunks_mut(chunk).zip(data.par_chunks(chunk)).zip(scale.par_chunks(1024)).for_each(|((o, d), s)| {
            let blocks = o.chunks_mut(MX_BLOCK).zip(d.chunks(MX_BLOCK));
            for ((ob, db), &b) in blocks.zip(s) {
                let f = e8m0_to_f32(b);
                for (y, &q) in ob.iter_mut().zip(db) {
                    *y = dec(q, f);
                }
            }
        });
        return;
    }
    let unit = MX_BLOCK * dims.inner;
    out.par_chunks_mut(unit).zip(data.par_chunks(unit)).zip(scale.par_chunks(dims.inner)).for_each(|((o, d), s)| {
        let sf: Vec<f32> = s.iter().map(|&b| e8m0_to_f32(b)).collect();
        for (orow, drow) in o.chunks_mut(dims.inner).zip(d.chunks(dims.inner)) {
            for ((y, &q), &f) in orow.iter_mut().zip(drow).zip(&sf) {
                *y = dec(q, f);
            }
        }
    });
}

/// Checks the shared preconditions; returns numel.
fn check_dims(op: &str, dims: Dims3, x_len: usize, data_len: usize, scale_len: usize) -> usize {
    let n = dims.numel();
    assert!(dims.k % MX_BLOCK == 0, "{op}: quantized dim {} is not a multiple of 32", dims.k);
    assert!(x_len == n, "{op}: high-precision tensor has {x_len} elements, {dims:?} needs {n}");
    assert!(data_len == n, "{op}: data has {data_len} bytes, {dims:?} needs {n}");
    let ns = n / MX_BLOCK;
    assert!(scale_len == ns, "{op}: scale has {scale_len} bytes, {dims:?} needs {ns}");
    n
}
