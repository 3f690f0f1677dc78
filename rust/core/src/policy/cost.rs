//! The step-time cost model behind `deepwell.dryrun`: each pass of each GEMM site priced at the rate
//! of the kernel the dispatch table ([`gemm_backend`]) picks for it on the device, plus the
//! quantizers' bytes at copy bandwidth. Pure and coarse: it ranks plans and predicts speedups; it
//! does not model launch overheads, attention, norms or the optimizer (the caller adds those as
//! memory traffic).
//!
//! Rates come from the device's [`ArchFamily`]: measured on an H100 for Hopper (docs/BASELINES.md:
//! cuBLAS bf16 ~690 TFLOP/s, cuBLASLt FP8 1x128 x 128x128 ~1150, 1x128 x 1x128 ~900, per-tensor ~1250, copy ~3.0
//! TB/s); the B200 datasheet's dense peaks for sm_100/103, labelled as such (no Blackwell GPU has
//! run deepwell). Other devices get Hopper's numbers, and the answer says so.

use super::arch::{Arch, ArchFamily};
use super::dispatch::{gemm_backend, GemmBackend};
use super::gemm::{GemmShape, Pass, ScalingType};
use super::recipe::Recipe;

/// Throughputs of one device: TFLOP/s per GEMM kind, TB/s for memory-bound kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub bf16: f64,
    /// cuBLASLt FP8, 1x128 activations x 128x128 weights (fprop, dgrad).
    pub fp8_block_weight: f64,
    /// cuBLASLt FP8, 1x128 x 1x128 (wgrad: both operands along the tokens).
    pub fp8_block_both: f64,
    /// deepwell's sm_90a block-scaled FP8 GEMM (the shapes cuBLASLt refuses).
    pub fp8_block_deepwell: f64,
    /// cuBLASLt FP8 with per-tensor scales.
    pub fp8_tensor: f64,
    /// Block-scaled MXFP8 (1x32).
    pub mxfp8: f64,
    /// Block-scaled NVFP4 (1x16).
    pub nvfp4: f64,
    pub copy_tbps: f64,
    /// Where the numbers come from, for the estimate's printout.
    pub source: &'static str,
}

const HOPPER: Rates = Rates {
    bf16: 690.0,
    fp8_block_weight: 1150.0,
    fp8_block_both: 900.0,
    fp8_block_deepwell: 900.0, // bench_gemm on the H100, 2026-11-26: 704-1067 dense
    fp8_tensor: 1250.0,
    mxfp8: 1150.0, // never used: MX GEMMs do not run on sm_90
    nvfp4: 1150.0,
    copy_tbps: 3.0,
    source: "H100 rates measured by deepwell's benchmarks",
};

const B200_DATASHEET: Rates = Rates {
    bf16: 2250.0,
    fp8_block_weight: 4500.0,
    fp8_block_both: 4500.0,
    fp8_block_deepwell: 4500.0, // never used: the kernel is sm_90a only
    fp8_tensor: 4500.0,
    mxfp8: 4500.0,
    nvfp4: 9000.0,
    copy_tbps: 8.0,
    source: "B200 datasheet dense peaks (not measured: no Blackwell GPU has run deepwell)",
};

/// The rates of `arch`, and whether they are the device's own (false: Hopper's, borrowed).
pub fn rates(arch: Arch) -> (Rates, bool) {
    match arch.family() {
        ArchFamily::Hopper => (HOPPER, true),
        ArchFamily::Blackwell => (B200_DATASHEET, true),
        _ => (HOPPER, false),
    }
}

/// One GEMM site of the estimate: a linear layer `in_features -> out_features` over `tokens` rows
/// in `recipe`.
#[derive(Debug, Clone, Copy)]
pub struct SiteCost {
    pub tokens: usize,
    pub in_features: usize,
    pub out_features: usize,
    pub recipe: Recipe,
}

fn gemm_ms(shape: GemmShape, tflops: f64) -> f64 {
    2.0 * shape.m as f64 * shape.n as f64 * shape.k as f64 / (tflops * 1e12) * 1e3
}

/// The rate of the kernel `backend` (emulated GEMMs are bf16 GEMMs).
fn rate(r: &Rates, backend: GemmBackend) -> f64 {
    match backend {
        GemmBackend::CublasBf16 | GemmBackend::CpuMatmul | GemmBackend::Emulated { .. } => r.bf16,
        GemmBackend::ScaledMmBlockwise { b: ScalingType::BlockWise128x128, .. } => r.fp8_block_weight,
        GemmBackend::ScaledMmBlockwise { .. } => r.fp8_block_both,
        GemmBackend::Fp8BlockGemm { .. } => r.fp8_block_deepwell,
        GemmBackend::ScaledMmTensorwise => r.fp8_tensor,
        GemmBackend::ScaledMmMx { block: ScalingType::BlockWise1x16 } => r.nvfp4,
        GemmBackend::ScaledMmMx { .. } => r.mxfp8,
    }
}

/// Bytes the site's quantizers move per training step: x for fprop and again (rows and columns) for
/// wgrad, dy (rows and columns), and the weight quantized by the forward and again by the backward;
/// an emulated pass also writes and reads its dequantized operands.
fn quantizer_bytes(s: &SiteCost, emulated: bool) -> f64 {
    let (m, k, n) = (s.tokens as f64, s.in_features as f64, s.out_features as f64);
    match s.recipe {
        Recipe::Bf16 => 0.0,
        // fp8_tensor reads each tensor twice (its amax, then the cast): x for fprop and again,
        // transposed, for wgrad (2 + 2 + 1 each), dy once into both copies (2 + 2 + 2), W into
        // both copies in the forward (2 + 2 + 2) and into W^T again in the backward (2 + 2 + 1).
        Recipe::Fp8Tensor if !emulated => m * k * 10.0 + m * n * 6.0 + n * k * 11.0,
        // bf16 read + 1-byte write per copy; rowcol kernels write two copies.
        _ if !emulated => m * k * 3.0 + m * k * 4.0 + m * n * 4.0 + n * k * (3.0 + 3.0 + 2.0),
        // quantize (2 -> 1 byte) then dequantize (1 -> 2 bytes) of x twice, dy twice, W twice.
        _ => (2.0 * (m * k + m * n) + 2.0 * n * k) * 6.0,
    }
}

/// Predicted milliseconds of the sites' GEMMs and quantizers per training step on `arch`, and the
/// same sites all in bf16.
pub fn step_ms(sites: &[SiteCost], arch: Arch) -> (f64, f64) {
    let (r, _) = rates(arch);
    let (mut ms, mut bf16) = (0.0, 0.0);
    for s in sites {
        let mut emulated = false;
        for pass in Pass::ALL {
            let shape = GemmShape::linear(pass, s.tokens, s.in_features, s.out_features);
            let choice = gemm_backend(s.recipe, arch, pass, shape);
            emulated |= choice.emulated;
            ms += gemm_ms(shape, rate(&r, choice.backend));
            bf16 += gemm_ms(shape, r.bf16);
        }
        ms += quantizer_bytes(s, emulated) / (r.copy_tbps * 1e12) * 1e3;
    }
    (ms, bf16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(recipe: Recipe) -> SiteCost {
        SiteCost { tokens: 8192, in_features: 4096, out_features: 4096, recipe }
    }

    #[test]
    fn bf16_costs_what_bf16_costs() {
        let (ms, bf16) = step_ms(&[site(Recipe::Bf16)], Arch::sm(9, 0));
        assert_eq!(ms, bf16);
        // 3 GEMMs of 2 * 8192 * 4096^2 flops at 690 TFLOP/s.
        assert!((bf16 - 3.0 * 2.0 * 8192.0 * 4096.0 * 4096.0 / 690e12 * 1e3).abs() < 1e-9);
    }

    #[test]
    fn native_recipes_are_priced_at_their_own_rates() {
        let hopper = Arch::sm(9, 0);
        let (fp8, bf16) = step_ms(&[site(Recipe::Fp8Block)], hopper);
        assert!(fp8 < bf16, "fp8_block on Hopper must be cheaper than bf16: {fp8} vs {bf16}");
        // MXFP8 is emulated on Hopper (bf16 GEMMs plus dequantization traffic) but native on B200.
        let (mx_h, bf16_h) = step_ms(&[site(Recipe::Mxfp8)], hopper);
        assert!(mx_h > bf16_h);
        let (mx_b, bf16_b) = step_ms(&[site(Recipe::Mxfp8)], Arch::sm(10, 0));
        assert!(mx_b < bf16_b);
        let (nv_b, _) = step_ms(&[site(Recipe::Nvfp4)], Arch::sm(10, 0));
        assert!(nv_b < mx_b);
    }

    #[test]
    fn devices_without_rates_borrow_hoppers_and_say_so() {
        assert!(rates(Arch::sm(9, 0)).1 && rates(Arch::sm(10, 0)).1);
        assert!(!rates(Arch::sm(12, 0)).1 && !rates(Arch::CPU).1);
    }
}
