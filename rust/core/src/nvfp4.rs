//! NVFP4: blocks of 16 along k, an E4M3 block scale, an fp32 per-tensor scale, E2M1 elements
//! (arXiv 2509.25149; Transformer Engine's `core_nvfp4.cuh`; docs/NUMERICS.md "NVFP4"). fp32 order:
//!
//! 1. `S_enc = min(448 * 6 / global_amax, FLT_MAX)`; global amax 0, ±Inf or NaN -> `S_enc = 1`.
//!    `S_dec = 1 / S_enc` is the per-tensor scale the quantizer returns.
//! 2. `sb = cast_e4m3_rne_satfinite(block_amax * (S_enc * fp32(1/6)))`.
//! 3. `enc = min(1 / (float(sb) * S_dec), FLT_MAX)`; `q = cast_e2m1_rne_satfinite(x * enc)`, or
//!    [`e2m1_stochastic`] with bits [`sr_bits`]`(seed, r * k + c)` (the flat element index).
//! 4. Dequantize: `x' = (e2m1(q) * float(sb)) * S_dec`.
//! 5. Packing: element 2i in the low nibble, 2i+1 in the high nibble of byte i.
//!
//! Options (the paper's training recipe): `block_2d` takes one scale per 16x16 tile (weights:
//! row- and column-wise copies then agree), written to each of the tile's 16 rows;
//! `stochastic_seed` rounds stochastically (gradients); `hadamard` applies [`hadamard16`] to
//! every 16-element chunk along k before anything else, so amaxes (block and global, see
//! [`nvfp4_global_amax`]) are those of the transformed values.
//!
//! Special values (a project decision): a block (1x16, or the 16x16 tile) holding NaN or ±Inf
//! gets block scale 0x7F (the E4M3 NaN) and data nibbles 0, so it dequantizes to NaN.

use crate::element::Element;
use crate::formats::{abs_bits_max, e2m1_to_f32, e4m3_to_f32, f32_to_e2m1, f32_to_e4m3};
use crate::hadamard::hadamard16;
use crate::rng::{e2m1_stochastic, sr_bits};
use rayon::prelude::*;

/// Elements per NVFP4 block.
pub const NVFP4_BLOCK: usize = 16;

/// Blocks per parallel work item in the 1x16 case.
const BLOCKS_PER_TASK: usize = 1024;

/// The NVFP4 training-recipe switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Nvfp4Options {
    /// One scale per 16x16 tile instead of per 1x16 block (needs rows % 16 == 0).
    pub block_2d: bool,
    /// Stochastic rounding with this seed (deterministic given the seed); None = RNE.
    pub stochastic_seed: Option<u64>,
    /// Random Hadamard transform of each 16-element chunk along k first.
    pub hadamard: bool,
}

/// Loads 16 elements as fp32, transformed when `hadamard`.
#[inline]
fn load16<T: Element>(x: &[T], hadamard: bool) -> [f32; 16] {
    let mut v = [0f32; 16];
    for (d, s) in v.iter_mut().zip(x) {
        *d = s.to_f32();
    }
    if hadamard {
        hadamard16(&mut v);
    }
    v
}

/// NaN-propagating amax of 16 values, as fp32 bits.
#[inline]
fn amax16(v: &[f32; 16], acc: u32) -> u32 {
    v.iter().fold(acc, |m, x| abs_bits_max(m, x.to_bits()))
}

/// Global amax of `x` (rows of `k`), NaN-propagating; of the transformed values when `hadamard`.
///
/// # Panics
/// If `k % 16 != 0` or `x.len()` is not a multiple of `k`.
pub fn nvfp4_global_amax<T: Element>(x: &[T], k: usize, hadamard: bool) -> f32 {
    assert!(k % NVFP4_BLOCK == 0, "nvfp4_global_amax: k = {k} is not a multiple of 16");
    assert!(
        if k == 0 { x.is_empty() } else { x.len() % k == 0 },
        "nvfp4_global_amax: {} elements do not form rows of k = {k}",
        x.len()
    );
    let chunk = NVFP4_BLOCK * BLOCKS_PER_TASK;
    let bits = x
        .par_chunks(chunk)
        .map(|c| {
            if hadamard {
                c.chunks_exact(NVFP4_BLOCK).fold(0, |m, b| amax16(&load16(b, true), m))
            } else {
                c.iter().fold(0, |m, v| abs_bits_max(m, v.to_f32().to_bits()))
            }
        })
        .reduce(|| 0, u32::max);
    f32::from_bits(bits)
}

/// `S_enc = min(448 * 6 / global_amax, FLT_MAX)`; global amax 0, Inf or NaN -> 1.
pub fn nvfp4_encode_scale(global_amax: f32) -> f32 {
    let g = global_amax.abs();
    if g == 0.0 || !g.is_finite() {
        return 1.0;
    }
    (2688.0 / g).min(f32::MAX)
}

/// Per-tensor constants of one quantization.
struct Ctx {
    /// `S_enc * fp32(1/6)`.
    sb_factor: f32,
    /// `enc = min(1 / (float(sb) * S_dec), FLT_MAX)` for every block scale byte `sb`: the same
    /// fp32 values as evaluating it per block, without a division per block.
    enc: [f32; 256],
    seed: Option<u64>,
    hadamard: bool,
}

impl Ctx {
    /// (block scale byte, element encode factor). A non-finite block gets 0x7F and factor NaN,
    /// which both element casts map to code 0.
    #[inline]
    fn block(&self, amax_bits: u32) -> (u8, f32) {
        let amax = f32::from_bits(amax_bits);
        if !amax.is_finite() {
            return (0x7F, f32::NAN);
        }
        let sb = f32_to_e4m3(amax * self.sb_factor);
        (sb, self.enc[usize::from(sb)])
    }

    /// Packs 16 values into 8 bytes; `index` is the flat index of `v[0]`.
    #[inline]
    fn encode(&self, v: &[f32; 16], enc: f32, index: usize, out: &mut [u8]) {
        let mut q = [0u8; 16];
        match self.seed {
            None => {
                for (c, x) in q.iter_mut().zip(v) {
                    *c = f32_to_e2m1(x * enc);
                }
            }
            Some(s) => {
                for (i, (c, x)) in q.iter_mut().zip(v).enumerate() {
                    *c = e2m1_stochastic(x * enc, sr_bits(s, (index + i) as u64));
                }
            }
        }
        for (o, pair) in out.iter_mut().zip(q.chunks_exact(2)) {
            *o = pair[0] | (pair[1] << 4);
        }
    }
}

/// Quantizes `x` (`rows` x `k`, row-major) to NVFP4; returns `S_dec`.
///
/// `data`: `rows * k / 2` bytes; `scale`: `rows * (k/16)` E4M3 bytes, layout (rows, k/16).
///
/// # Panics
/// If `k % 16 != 0`, `block_2d` with `rows % 16 != 0`, or a slice length does not match.
pub fn nvfp4_quantize<T: Element>(
    x: &[T],
    rows: usize,
    k: usize,
    global_amax: f32,
    opts: &Nvfp4Options,
    data: &mut [u8],
    scale: &mut [u8],
) -> f32 {
    check("nvfp4_quantize", rows, k, x.len(), data.len(), scale.len());
    assert!(
        !opts.block_2d || rows % NVFP4_BLOCK == 0,
        "nvfp4_quantize: 16x16 blocks need rows % 16 == 0, got rows = {rows}"
    );
    let s_enc = nvfp4_encode_scale(global_amax);
    let s_dec = 1.0 / s_enc;
    let ctx = Ctx {
        sb_factor: s_enc * (1.0 / 6.0),
        enc: std::array::from_fn(|b| (1.0 / (e4m3_to_f32(b as u8) * s_dec)).min(f32::MAX)),
        seed: opts.stochastic_seed,
        hadamard: opts.hadamard,
    };
    if x.is_empty() {
        return s_dec;
    }
    if opts.block_2d {
        quantize_2d(x, k, &ctx, data, scale);
    } else {
        quantize_1d(x, &ctx, data, scale);
    }
    s_dec
}

/// 1x16 blocks: k % 16 == 0, so the tensor is a flat run of blocks.
fn quantize_1d<T: Element>(x: &[T], ctx: &Ctx, data: &mut [u8], scale: &mut [u8]) {
    let chunk = NVFP4_BLOCK * BLOCKS_PER_TASK;
    x.par_chunks(chunk)
        .zip(data.par_chunks_mut(chunk / 2))
        .zip(scale.par_chunks_mut(BLOCKS_PER_TASK))
        .enumerate()
        .for_each(|(t, ((xc, dc), sc))| {
            let blocks = xc.chunks_exact(NVFP4_BLOCK).zip(dc.chunks_exact_mut(NVFP4_BLOCK / 2));
            for (b, ((xb, db), s)) in blocks.zip(sc.iter_mut()).enumerate() {
                let v = load16(xb, ctx.hadamard);
                let (sb, enc) = ctx.block(amax16(&v, 0));
                *s = sb;
                ctx.encode(&v, enc, t * chunk + b * NVFP4_BLOCK, db);
            }
        });
}

/// 16x16 tiles: one work item per group of 16 rows.
fn quantize_2d<T: Element>(x: &[T], k: usize, ctx: &Ctx, data: &mut [u8], scale: &mut [u8]) {
    let nb = k / NVFP4_BLOCK;
    x.par_chunks(NVFP4_BLOCK * k)
        .zip(data.par_chunks_mut(NVFP4_BLOCK * k / 2))
        .zip(scale.par_chunks_mut(NVFP4_BLOCK * nb))
        .enumerate()
        .for_each(|(g, ((xg, dg), sg))| {
            for cb in 0..nb {
                let c0 = cb * NVFP4_BLOCK;
                let tile: [[f32; 16]; 16] =
                    std::array::from_fn(|r| load16(&xg[r * k + c0..][..NVFP4_BLOCK], ctx.hadamard));
                let (sb, enc) = ctx.block(tile.iter().fold(0, |m, v| amax16(v, m)));
                for (r, v) in tile.iter().enumerate() {
                    sg[r * nb + cb] = sb;
                    let out = &mut dg[(r * k + c0) / 2..][..NVFP4_BLOCK / 2];
                    ctx.encode(v, enc, (g * NVFP4_BLOCK + r) * k + c0, out);
                }
            }
        });
}

/// `x' = (e2m1(q) * float(sb)) * S_dec`, left to right in fp32.
///
/// # Panics
/// If `k % 16 != 0` or a slice length does not match.
pub fn nvfp4_dequantize<O: Element>(data: &[u8], scale: &[u8], s_dec: f32, rows: usize, k: usize, out: &mut [O]) {
    check("nvfp4_dequantize", rows, k, out.len(), data.len(), scale.len());
    let chunk = NVFP4_BLOCK * BLOCKS_PER_TASK;
    out.par_chunks_mut(chunk).zip(data.par_chunks(chunk / 2)).zip(scale.par_chunks(BLOCKS_PER_TASK)).for_each(
        |((oc, dc), sc)| {
            let blocks = oc.chunks_exact_mut(NVFP4_BLOCK).zip(dc.chunks_exact(NVFP4_BLOCK / 2));
            for ((ob, db), &sb) in blocks.zip(sc) {
                let f = e4m3_to_f32(sb);
                for (pair, &byte) in ob.chunks_exact_mut(2).zip(db) {
                    pair[0] = O::from_f32(e2m1_to_f32(byte & 0xF) * f * s_dec);
                    pair[1] = O::from_f32(e2m1_to_f32(byte >> 4) * f * s_dec);
                }
            }
        },
    );
}

fn check(op: &str, rows: usize, k: usize, x_len: usize, data_len: usize, scale_len: usize) {
    let n = rows * k;
    assert!(k % NVFP4_BLOCK == 0, "{op}: k = {k} is not a multiple of 16");
    assert!(x_len == n, "{op}: high-precision tensor has {x_len} elements, {rows}x{k} needs {n}");
    assert!(data_len == n / 2, "{op}: data has {data_len} bytes, {rows}x{k} needs {}", n / 2);
    let ns = n / NVFP4_BLOCK;
    assert!(scale_len == ns, "{op}: scale has {scale_len} bytes, {rows}x{k} needs {ns}");
}
