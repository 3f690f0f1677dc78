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

/// Chooses how an expert layer of `recipe` runs on `arch`; `aligned`: every group's rows are a
/// multiple of the recipe's block (`moe_permute_index(..., align=block)`), which the wgrad's
/// quantization along the tokens needs (a block never spans two experts).
///
/// | recipe | sm_90 | other GPUs, CPU |
/// |---|---|---|
/// | bf16 | `GroupedMm` | `GroupedMm` |
/// | fp8_block | aligned: `Fp8BlockGrouped`, else `PerExpertLoop` | aligned: `EmulatedGrouped`, else `PerExpertLoop` |
/// | mxfp8 | aligned: `EmulatedGrouped`, else `PerExpertLoop` | Blackwell: `PerExpertLoop` (native); else as sm_90 |
/// | nvfp4 | `PerExpertLoop` (per-expert global scale and stochastic rounding) | `PerExpertLoop` |
/// | fp8_tensor | `PerExpertLoop` | `PerExpertLoop` |
pub fn grouped_backend(recipe: Recipe, arch: Arch, aligned: bool) -> GroupedChoice {
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
            let c = grouped_backend(recipe, arch, aligned);
            assert_eq!((c.backend, c.emulated), (backend, emulated), "{recipe} {arch} aligned={aligned}");
            assert!(c.reason.starts_with(&format!("{recipe} experts on {arch}")), "{}", c.reason);
        }
    }
}
