//! The grouped-GEMM dispatch table of MoE experts (`deepwell.grouped_linear`): which kernels run an
//! expert layer's three passes for a recipe on a device ([`grouped_backend`]).

use super::arch::{is_emulated, why_not_native, Arch, ArchFamily};
use super::recipe::Recipe;

/// How one grouped expert layer runs (forward, dgrad and wgrad together).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupedBackend {
    /// `torch._grouped_mm` in the input's dtype (bf16: one CUTLASS grouped kernel on sm_90 / sm_100).
    GroupedMm,
    /// deepwell's sm_90a block-scaled FP8 grouped GEMMs (cuda/fp8_gemm.cuh): forward and dgrad over
    /// row groups, wgrad over K groups. No host sync.
    Fp8BlockGrouped,
    /// Exact emulation: the dense layer's quantizers on the whole buffer, dequantized, then
    /// `torch._grouped_mm` per pass. No host sync.
    EmulatedGrouped,
    /// Blackwell's native MXFP8 grouped GEMM through `torch._scaled_grouped_mm` (E8M0 scales in
    /// the 128x4 tiled layout per group): forward and dgrad over row groups, wgrad over K groups.
    /// No host sync.
    Mxfp8Grouped,
    /// A loop over `scaled_linear` per expert, each dispatched like a dense layer (reads the
    /// offsets on the host: a sync on CUDA).
    PerExpertLoop,
}

impl GroupedBackend {
    /// The name the Python package switches on.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupedBackend::GroupedMm => "grouped_mm",
            GroupedBackend::Fp8BlockGrouped => "fp8_block_grouped",
            GroupedBackend::EmulatedGrouped => "emulated_grouped",
            GroupedBackend::Mxfp8Grouped => "mxfp8_grouped",
            GroupedBackend::PerExpertLoop => "per_expert_loop",
        }
    }
}

/// One grouped layer's dispatch decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupedChoice {
    pub backend: GroupedBackend,
    /// True when the recipe's numerics are emulated rather than run natively.
    pub emulated: bool,
    pub reason: String,
}

/// What the caller knows about one grouped layer besides its recipe and device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupedLayer {
    /// Every group's rows are a multiple of the recipe's block (`moe_permute_index(..., align=
    /// block)`), which the wgrad's quantization along the tokens needs (a block never spans two
    /// experts).
    pub aligned: bool,
    /// in_features and out_features are multiples of 128: every expert's scales fill whole 128x4
    /// tiles of the layout the MXFP8 grouped GEMM reads.
    pub tiled: bool,
    /// The running torch has the MXFP8 grouped GEMM (`torch._scaled_grouped_mm` with E8M0 scales,
    /// built with FBGEMM GenAI / MSLK; sm_100 only).
    pub torch_mxfp8_grouped: bool,
}

/// Chooses how an expert layer of `recipe` runs on `arch` (`layer`: see [`GroupedLayer`]).
///
/// | recipe | sm_90 | other GPUs, CPU |
/// |---|---|---|
/// | bf16 | `GroupedMm` | `GroupedMm` |
/// | fp8_block | aligned: `Fp8BlockGrouped`, else `PerExpertLoop` | aligned: `EmulatedGrouped`, else `PerExpertLoop` |
/// | mxfp8 | aligned: `EmulatedGrouped`, else `PerExpertLoop` | Blackwell: aligned, tiled and torch's kernel there: `Mxfp8Grouped`, else `PerExpertLoop` (native); else as sm_90 |
/// | nvfp4 | `PerExpertLoop` (per-expert global scale and stochastic rounding) | `PerExpertLoop` |
/// | fp8_tensor | `PerExpertLoop` | `PerExpertLoop` |
pub fn grouped_backend(recipe: Recipe, arch: Arch, layer: GroupedLayer) -> GroupedChoice {
    let aligned = layer.aligned;
    let emulated = is_emulated(recipe, arch);
    let choice = |backend: GroupedBackend, why: String| GroupedChoice {
        backend,
        emulated: emulated && backend != GroupedBackend::GroupedMm,
        reason: format!("{recipe} experts on {arch}: {why}"),
    };
    let unaligned = "groups not padded to the block (the wgrad quantizes along the tokens per expert)";
    match recipe {
        Recipe::Bf16 => choice(GroupedBackend::GroupedMm, "torch._grouped_mm".into()),
        Recipe::Fp8Block if arch.family() == ArchFamily::Hopper && aligned => {
            choice(GroupedBackend::Fp8BlockGrouped, "deepwell's FP8 grouped GEMMs (sm_90a kernel)".into())
        }
        Recipe::Fp8Block | Recipe::Mxfp8 if emulated && aligned => choice(
            GroupedBackend::EmulatedGrouped,
            format!("grouped exact emulation ({})", why_not_native(recipe, arch)),
        ),
        Recipe::Fp8Block | Recipe::Mxfp8 if !aligned => {
            choice(GroupedBackend::PerExpertLoop, format!("a scaled_linear per expert: {unaligned}"))
        }
        Recipe::Mxfp8 if arch.family() == ArchFamily::Blackwell && layer.tiled && layer.torch_mxfp8_grouped => {
            choice(GroupedBackend::Mxfp8Grouped, "torch._scaled_grouped_mm (native MXFP8 grouped GEMMs)".into())
        }
        Recipe::Mxfp8 if !emulated => {
            let why = if layer.torch_mxfp8_grouped {
                "in_features or out_features not a multiple of 128 (the grouped GEMM's scale tiles)"
            } else {
                "this torch has no MXFP8 grouped GEMM here (torch._scaled_grouped_mm needs sm_100 and FBGEMM GenAI / MSLK)"
            };
            choice(GroupedBackend::PerExpertLoop, format!("a scaled_linear per expert: {why}"))
        }
        _ => choice(GroupedBackend::PerExpertLoop, "a scaled_linear per expert (no grouped kernel)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOPPER: Arch = Arch(Some((9, 0)));
    const B200: Arch = Arch(Some((10, 0)));

    #[test]
    fn every_row_of_the_table() {
        use GroupedBackend::*;
        let cases = [
            (Recipe::Bf16, HOPPER, true, GroupedMm, false),
            (Recipe::Bf16, Arch::CPU, false, GroupedMm, false),
            (Recipe::Fp8Block, HOPPER, true, Fp8BlockGrouped, false),
            (Recipe::Fp8Block, HOPPER, false, PerExpertLoop, false),
            (Recipe::Fp8Block, B200, true, EmulatedGrouped, true),
            (Recipe::Fp8Block, Arch::CPU, true, EmulatedGrouped, true),
            (Recipe::Fp8Block, Arch::CPU, false, PerExpertLoop, true),
            (Recipe::Mxfp8, HOPPER, true, EmulatedGrouped, true),
            (Recipe::Mxfp8, B200, true, PerExpertLoop, false),
            (Recipe::Nvfp4, HOPPER, true, PerExpertLoop, true),
            (Recipe::Fp8Tensor, HOPPER, true, PerExpertLoop, false),
        ];
        for (recipe, arch, aligned, backend, emulated) in cases {
            let c = grouped_backend(recipe, arch, GroupedLayer { aligned, ..Default::default() });
            assert_eq!((c.backend, c.emulated), (backend, emulated), "{recipe} {arch} aligned={aligned}");
            assert!(c.reason.starts_with(&format!("{recipe} experts on {arch}")), "{}", c.reason);
        }
    }

    #[test]
    fn native_mxfp8_grouped_needs_blackwell_aligned_tiled_groups_and_torchs_kernel() {
        let all = GroupedLayer { aligned: true, tiled: true, torch_mxfp8_grouped: true };
        let c = grouped_backend(Recipe::Mxfp8, B200, all);
        assert_eq!((c.backend, c.emulated), (GroupedBackend::Mxfp8Grouped, false));
        assert!(c.reason.contains("torch._scaled_grouped_mm"), "{}", c.reason);
        for (layer, why) in [
            (GroupedLayer { aligned: false, ..all }, "not padded"),
            (GroupedLayer { tiled: false, ..all }, "multiple of 128"),
            (GroupedLayer { torch_mxfp8_grouped: false, ..all }, "FBGEMM GenAI / MSLK"),
        ] {
            let c = grouped_backend(Recipe::Mxfp8, B200, layer);
            assert_eq!((c.backend, c.emulated), (GroupedBackend::PerExpertLoop, false), "{layer:?}");
            assert!(c.reason.contains(why), "{}", c.reason);
        }
        // Everywhere else mxfp8 stays what it was: consumer Blackwell and Hopper never take it.
        assert_eq!(grouped_backend(Recipe::Mxfp8, Arch(Some((12, 0))), all).backend, GroupedBackend::PerExpertLoop);
        assert_eq!(grouped_backend(Recipe::Mxfp8, HOPPER, all).backend, GroupedBackend::EmulatedGrouped);
        assert_eq!(grouped_backend(Recipe::Fp8Block, B200, all).backend, GroupedBackend::EmulatedGrouped);
    }
}
