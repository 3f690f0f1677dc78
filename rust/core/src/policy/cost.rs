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
//!
//! [`grouped_site_ms`] prices one MoE expert projection the same way (its grouped GEMMs at the
//! rate of the backend [`grouped_backend`] picks, its quantizers at copy bandwidth); DeepwellMoE's
//! `auto` plan keeps bf16 experts where FP8 would be slower.

use super::arch::{Arch, ArchFamily};
use super::dispatch::{gemm_backend, GemmBackend};
use super::gemm::{GemmShape, Pass, ScalingType};
use super::grouped::{grouped_backend, GroupedBackend, GroupedLayer};
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
    /// `torch._grouped_mm` in bf16 (MoE experts).
    pub bf16_grouped: f64,
    /// deepwell's FP8 grouped GEMM over row groups (experts' forward and dgrad).
    pub fp8_block_grouped: f64,
    /// deepwell's K-grouped FP8 wgrad with long per-expert K; [`wgrad_rate`] scales it down for
    /// the few K-blocks of fine-grained experts.
    pub fp8_block_grouped_wgrad: f64,
    pub copy_tbps: f64,
    /// Where the numbers come from, for the estimate's printout.
    pub source: &'static str,
}

const HOPPER: Rates = Rates {
    bf16: 690.0,
    fp8_block_weight: 1150.0,
    fp8_block_both: 900.0,
    fp8_block_deepwell: 900.0, // bench_gemm on the H100: 704-1067 dense
    fp8_tensor: 1250.0,
    mxfp8: 1150.0, // never used: MX GEMMs do not run on sm_90
    nvfp4: 1150.0,
    // bench_gemm's grouped shapes (E8 / E64 / E128): torch._grouped_mm 562-690 on the
    // H100; deepwell's row-grouped FP8 844-1010 (H100); its wgrad 770 / 491 / 440 (H200) with 32 /
    // 8 / 4.5 K-blocks per expert, which 950 * kb / (kb + 7.5) fits (wgrad_rate).
    bf16_grouped: 600.0,
    fp8_block_grouped: 880.0,
    fp8_block_grouped_wgrad: 950.0,
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
    bf16_grouped: 2250.0,
    fp8_block_grouped: 4500.0, // never used: the kernel is sm_90a only
    fp8_block_grouped_wgrad: 4500.0,
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

/// One MoE expert projection: `experts` weights `in_features -> out_features` (gate_up: D -> 2F;
/// down: F -> D), the layer's `assignments` rows (tokens x top-k) split among them, in `recipe`.
#[derive(Debug, Clone, Copy)]
pub struct GroupedSiteCost {
    pub experts: usize,
    pub assignments: usize,
    pub in_features: usize,
    pub out_features: usize,
    pub recipe: Recipe,
}

/// K-blocks per expert at which the K-grouped wgrad runs at half its peak: a tile of few K-blocks
/// spends proportionally more on its setup and its epilogue (fitted in HOPPER's comment).
const WGRAD_HALF_KBLOCKS: f64 = 7.5;

/// The K-grouped FP8 wgrad's rate when each expert has `rows_per_expert` rows (its K).
fn wgrad_rate(r: &Rates, rows_per_expert: f64) -> f64 {
    let kb = rows_per_expert / 128.0;
    r.fp8_block_grouped_wgrad * kb / (kb + WGRAD_HALF_KBLOCKS)
}

/// Predicted milliseconds of one expert projection's forward + backward (its three grouped GEMMs
/// and its quantizers) on `arch`, and the same projection in bf16. Groups are taken as padded to
/// the recipe's block (DeepwellMoE pads them) and as even (the average expert's rows).
pub fn grouped_site_ms(s: &GroupedSiteCost, arch: Arch) -> (f64, f64) {
    let (r, _) = rates(arch);
    let (a, k, n, e) = (s.assignments as f64, s.in_features as f64, s.out_features as f64, s.experts.max(1) as f64);
    let flops = 2.0 * a * k * n; // per pass
    let ms = |flops: f64, tflops: f64| flops / (tflops * 1e12) * 1e3;
    let bf16 = 3.0 * ms(flops, r.bf16_grouped);
    let copy = |bytes: f64| bytes / (r.copy_tbps * 1e12) * 1e3;
    // DeepwellMoE pads the groups; the experts' shapes and torch's kernels are taken as fitting.
    let layer = GroupedLayer { aligned: true, tiled: true, torch_mxfp8_grouped: true };
    let predicted = match grouped_backend(s.recipe, arch, layer).backend {
        GroupedBackend::GroupedMm => bf16,
        // x and dy each quantized once into rows and columns (2 bytes in, 2 out per element); the
        // weights twice, as W (forward) and W^T (backward): 2 in, 1 out each.
        GroupedBackend::Fp8BlockGrouped => {
            2.0 * ms(flops, r.fp8_block_grouped)
                + ms(flops, wgrad_rate(&r, a / e))
                + copy(4.0 * a * (k + n) + 6.0 * e * k * n)
        }
        // Three MXFP8 GEMMs at the dense rate; x and dy quantized into rows and columns, the weights
        // as W and W^T, as for fp8_block.
        GroupedBackend::Mxfp8Grouped => 3.0 * ms(flops, r.mxfp8) + copy(4.0 * a * (k + n) + 6.0 * e * k * n),
        // bf16 grouped GEMMs plus the dense emulation's quantize and dequantize traffic.
        GroupedBackend::EmulatedGrouped => bf16 + copy((2.0 * a * (k + n) + 2.0 * e * k * n) * 6.0),
        // Each expert a dense layer of its own rows.
        GroupedBackend::PerExpertLoop => {
            let one = SiteCost {
                tokens: (s.assignments / s.experts.max(1)).max(1),
                in_features: s.in_features,
                out_features: s.out_features,
                recipe: s.recipe,
            };
            e * step_ms(&[one], arch).0
        }
    };
    (predicted, bf16)
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

    fn experts(
        experts: usize,
        tokens: usize,
        top_k: usize,
        in_features: usize,
        out_features: usize,
    ) -> GroupedSiteCost {
        GroupedSiteCost { experts, assignments: tokens * top_k, in_features, out_features, recipe: Recipe::Fp8Block }
    }

    #[test]
    fn fp8_experts_pay_where_measured_faster_and_not_where_slower() {
        // bench_moe's layers (8192 tokens, fwd + bwd) on sm_90, fp8_block vs bf16:
        // Mixtral 1.12x, E64 0.85x, E128 0.69x. The model ranks every projection the same way.
        let hopper = Arch::sm(9, 0);
        let ratio = |e, k, d, f| {
            let (up, up_bf16) = grouped_site_ms(&experts(e, 8192, k, d, 2 * f), hopper);
            let (down, down_bf16) = grouped_site_ms(&experts(e, 8192, k, f, d), hopper);
            assert_eq!(up < up_bf16, down < down_bf16, "E{e}: the projections disagree");
            (up_bf16 + down_bf16) / (up + down)
        };
        let (mixtral, e64, e128) = (ratio(8, 2, 4096, 14336), ratio(64, 8, 2048, 1408), ratio(128, 8, 2048, 768));
        assert!(mixtral > 1.05 && mixtral < 1.2, "{mixtral}");
        assert!(e64 > 0.75 && e64 < 0.95, "{e64}");
        assert!(e128 > 0.55 && e128 < 0.8, "{e128}");
    }

    #[test]
    fn grouped_costs_follow_the_grouped_dispatch() {
        let site = experts(8, 4096, 2, 1024, 4096);
        // bf16 experts cost what bf16 costs; emulation (sm_100 fp8_block) costs more than bf16.
        let (bf16, same) = grouped_site_ms(&GroupedSiteCost { recipe: Recipe::Bf16, ..site }, Arch::sm(9, 0));
        assert_eq!(bf16, same);
        assert!((bf16 - 3.0 * 2.0 * 8192.0 * 1024.0 * 4096.0 / 600e12 * 1e3).abs() < 1e-9);
        let (emulated, bf16) = grouped_site_ms(&site, Arch::sm(10, 0));
        assert!(emulated > bf16);
        // nvfp4 experts are a loop of dense layers: each expert priced as one.
        let nv = GroupedSiteCost { recipe: Recipe::Nvfp4, ..site };
        let one = SiteCost { tokens: 1024, in_features: 1024, out_features: 4096, recipe: Recipe::Nvfp4 };
        assert!((grouped_site_ms(&nv, Arch::sm(10, 0)).0 - 8.0 * step_ms(&[one], Arch::sm(10, 0)).0).abs() < 1e-9);
        // A handful of tokens per expert: the weights' quantization dominates, FP8 never pays.
        let (few, few_bf16) = grouped_site_ms(&experts(64, 256, 8, 2048, 2816), Arch::sm(9, 0));
        assert!(few > few_bf16);
    }
}
