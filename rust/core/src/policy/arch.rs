//! The device a plan is made for, and which recipes run natively on it.
//!
//! Sources: cuBLASLt's scaling modes per compute capability (cuBLAS docs, "Narrow precision":
//! `VEC128_32F` / `BLK128x128_32F` are CC 9.0, `VEC32_UE8M0` / `VEC16_UE4M3` are CC 10.0+); torch's
//! `_check_deepseek_support` accepts blockwise 1x128 / 128x128 on **sm_90 only** (ATen's
//! `ScaledBlas.cpp`); MXFP8 `F.scaled_mm` on sm_90 fails with `CUBLAS_STATUS_NOT_SUPPORTED` (docs/BASELINES.md);
//! Transformer Engine's device gating (its `quantization.py`); docs/DESIGN.md "Recipes and hardware".
//!
//! | family | compute capability | native recipes | `auto` |
//! |---|---|---|---|
//! | datacenter Blackwell | 10.0, 10.3 | mxfp8, nvfp4, fp8_tensor, bf16 | mxfp8 |
//! | consumer Blackwell | 12.0, 12.1 | mxfp8, nvfp4, fp8_tensor, bf16 | mxfp8 |
//! | Hopper | 9.0 | fp8_block, fp8_tensor, bf16 | fp8_block |
//! | Ada | 8.9 | fp8_tensor, bf16 | bf16 |
//! | older (Ampere, ...) | < 8.9 | bf16 | bf16 |
//! | unvalidated | any other (10.1, 11.0, 13.x, ...) | bf16 | bf16 |
//! | CPU | none | none: everything runs as the reference | bf16 |
//!
//! fp8_tensor (per-tensor scales: cuBLASLt's original FP8 mode, CC 8.9+) is native wherever FP8
//! GEMMs exist but is never `auto`: it is the user's explicit choice (its one scale per tensor is
//! coarser than the block recipes; docs/DESIGN.md "Recipes"). Only sm_90 has run it here.
//!
//! sm_120/121 follow cuBLAS ("CC 10.0+") rather than Transformer Engine, which refuses MXFP8 there
//! (docs/DESIGN.md "Recipes"). Capabilities that deepwell has no table entry for get bf16 only: a decision
//! table never claims a native path nobody has validated. The blockwise path on sm_90 also needs
//! torch built with cuBLASLt >= 12.9 (the cu130 wheel); that is a property of the build, which the
//! probe checks, not of the architecture.
//!
//! A recipe that is not native still runs, as exact emulation (dequantize, then a bf16 GEMM; fp32
//! on CPU), and every decision says "emulated" when that happens.

use super::recipe::Recipe;
use crate::error::{CoreError, Result};
use std::fmt;
use std::str::FromStr;

/// A CUDA compute capability `(major, minor)`, or `None` for the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch(pub Option<(u32, u32)>);

/// The architecture families the recipe table distinguishes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArchFamily {
    /// No GPU: the reference implementations.
    Cpu,
    /// Compute capability below 8.9 (Ampere, Turing, ...).
    Older,
    /// sm_89 (Ada Lovelace).
    Ada,
    /// sm_90 (Hopper).
    Hopper,
    /// sm_100 / sm_103 (B200, B300).
    Blackwell,
    /// sm_120 / sm_121 (RTX 50, RTX PRO Blackwell, DGX Spark).
    BlackwellConsumer,
    /// A capability deepwell has not validated (10.1, 11.0, 13.x, ...).
    Unvalidated,
}

impl Arch {
    /// The CPU.
    pub const CPU: Arch = Arch(None);

    /// The CUDA device of compute capability `major.minor`.
    pub const fn sm(major: u32, minor: u32) -> Arch {
        Arch(Some((major, minor)))
    }

    /// Which row of the recipe table this device falls in.
    pub fn family(self) -> ArchFamily {
        match self.0 {
            None => ArchFamily::Cpu,
            Some((9, 0)) => ArchFamily::Hopper,
            Some((10, 0)) | Some((10, 3)) => ArchFamily::Blackwell,
            Some((12, 0)) | Some((12, 1)) => ArchFamily::BlackwellConsumer,
            Some((8, 9)) => ArchFamily::Ada,
            Some(cc) if cc < (8, 9) => ArchFamily::Older,
            Some(_) => ArchFamily::Unvalidated,
        }
    }
}

impl ArchFamily {
    /// A short human name, for reasons.
    pub fn name(self) -> &'static str {
        match self {
            ArchFamily::Cpu => "CPU",
            ArchFamily::Older => "pre-Ada GPU",
            ArchFamily::Ada => "Ada",
            ArchFamily::Hopper => "Hopper",
            ArchFamily::Blackwell => "datacenter Blackwell",
            ArchFamily::BlackwellConsumer => "consumer Blackwell",
            ArchFamily::Unvalidated => "unvalidated GPU",
        }
    }
}

impl fmt::Display for Arch {
    /// `cpu` or `sm_<major><minor>` (`sm_90`, `sm_100`, `sm_121`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => f.write_str("cpu"),
            Some((major, minor)) => write!(f, "sm_{major}{minor}"),
        }
    }
}

const ARCH_CHOICES: &str = "cpu, sm_<major><minor> (e.g. sm_90, sm_100, sm_90a), <major>.<minor>";

impl FromStr for Arch {
    type Err = CoreError;

    /// `cpu`, `sm_90` / `sm_100` / `sm_90a` (the last digit is the minor; an `a`/`f` feature
    /// suffix is ignored), or `9.0` / `10.3`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || CoreError::UnknownMode { what: "architecture", got: s.to_string(), choices: ARCH_CHOICES };
        let num = |t: &str| -> Option<u32> {
            (!t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())).then(|| t.parse().ok()).flatten()
        };
        if s == "cpu" {
            return Ok(Arch::CPU);
        }
        if let Some((major, minor)) = s.split_once('.') {
            return match (num(major), num(minor)) {
                (Some(a), Some(b)) => Ok(Arch::sm(a, b)),
                _ => Err(bad()),
            };
        }
        let digits = s.strip_prefix("sm_").ok_or_else(bad)?;
        let digits = digits.trim_end_matches(['a', 'f']);
        if digits.len() < 2 {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        match (num(major), num(minor)) {
            (Some(a), Some(b)) => Ok(Arch::sm(a, b)),
            _ => Err(bad()),
        }
    }
}

/// The recipes with a native GEMM on `arch`, fastest low-precision first (see the module table).
/// Empty on the CPU, where everything runs as the reference.
pub fn native_recipes(arch: Arch) -> &'static [Recipe] {
    match arch.family() {
        ArchFamily::Cpu => &[],
        ArchFamily::Hopper => &[Recipe::Fp8Block, Recipe::Fp8Tensor, Recipe::Bf16],
        ArchFamily::Blackwell | ArchFamily::BlackwellConsumer => {
            &[Recipe::Mxfp8, Recipe::Nvfp4, Recipe::Fp8Tensor, Recipe::Bf16]
        }
        ArchFamily::Ada => &[Recipe::Fp8Tensor, Recipe::Bf16],
        ArchFamily::Older | ArchFamily::Unvalidated => &[Recipe::Bf16],
    }
}

/// True when `recipe` has a native GEMM on `arch`.
pub fn is_native(recipe: Recipe, arch: Arch) -> bool {
    native_recipes(arch).contains(&recipe)
}

/// True when `recipe` would run as exact emulation on `arch`: a low-precision recipe without a
/// native GEMM. bf16 is never emulated (nothing is quantized; on the CPU it is torch's matmul).
pub fn is_emulated(recipe: Recipe, arch: Arch) -> bool {
    recipe.is_low_precision() && !is_native(recipe, arch)
}

/// What `precision="auto"` resolves to on `arch`, and why: the first native block-scaled recipe
/// (mxfp8 on Blackwell, fp8_block on Hopper), else bf16. fp8_tensor is never auto's answer.
///
/// On Blackwell nvfp4 has the higher peak, but auto picks mxfp8: NVFP4 training needs its extra
/// machinery (RHT, stochastic rounding, selective bf16 layers; arXiv 2509.25149) to match bf16,
/// while MXFP8 with RCEIL scales matches bf16 as is (arXiv 2506.08027).
pub fn auto_recipe(arch: Arch) -> (Recipe, String) {
    let family = arch.family();
    match native_recipes(arch).first() {
        Some(&r) if r.is_low_precision() && r != Recipe::Fp8Tensor => {
            (r, format!("auto: {r} is the fastest native recipe on {arch} ({})", family.name()))
        }
        _ => (Recipe::Bf16, format!("auto: bf16, {arch} ({}) has no native block-scaled recipe", family.name())),
    }
}

/// Why `recipe` has no native GEMM on `arch` (for "emulated" reasons). Empty when it is native.
pub fn why_not_native(recipe: Recipe, arch: Arch) -> String {
    if !is_emulated(recipe, arch) {
        return String::new();
    }
    let family = arch.family();
    match (recipe, family) {
        (_, ArchFamily::Cpu) => "the CPU has no low-precision GEMM (reference path)".to_string(),
        (_, ArchFamily::Unvalidated) => format!("{arch} is not in deepwell's validated table"),
        (Recipe::Fp8Block, ArchFamily::Blackwell | ArchFamily::BlackwellConsumer) => format!(
            "{arch}: cuBLASLt blockwise 1x128/128x128 scaling is sm_90 only \
             (torch _check_deepseek_support)"
        ),
        (Recipe::Fp8Block, _) => {
            format!("{arch}: cuBLASLt VEC128/BLK128x128 scaling needs CC 9.0")
        }
        (Recipe::Fp8Tensor, _) => format!("{arch}: cuBLASLt FP8 needs CC 8.9+"),
        (Recipe::Mxfp8, _) => format!("{arch}: cuBLASLt VEC32_UE8M0 (MXFP8) needs CC 10.0+"),
        (Recipe::Nvfp4, _) => format!("{arch}: cuBLASLt VEC16_UE4M3 (NVFP4) needs CC 10.0+"),
        (Recipe::Bf16, _) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print() {
        for (s, a, shown) in [
            ("cpu", Arch::CPU, "cpu"),
            ("sm_90", Arch::sm(9, 0), "sm_90"),
            ("sm_90a", Arch::sm(9, 0), "sm_90"),
            ("sm_100", Arch::sm(10, 0), "sm_100"),
            ("sm_100f", Arch::sm(10, 0), "sm_100"),
            ("sm_121", Arch::sm(12, 1), "sm_121"),
            ("8.9", Arch::sm(8, 9), "sm_89"),
            ("10.3", Arch::sm(10, 3), "sm_103"),
        ] {
            assert_eq!(s.parse::<Arch>(), Ok(a), "{s}");
            assert_eq!(a.to_string(), shown);
        }
        for bad in ["", "sm_", "sm_9", "gpu", "9.", ".0", "sm_x0", "9.0.1", "sm_+90"] {
            let e = bad.parse::<Arch>().unwrap_err();
            assert!(e.to_string().contains("unknown architecture"), "{bad}: {e}");
        }
    }

    #[test]
    fn families() {
        for (a, f) in [
            (Arch::CPU, ArchFamily::Cpu),
            (Arch::sm(7, 0), ArchFamily::Older),
            (Arch::sm(8, 0), ArchFamily::Older),
            (Arch::sm(8, 6), ArchFamily::Older),
            (Arch::sm(8, 9), ArchFamily::Ada),
            (Arch::sm(9, 0), ArchFamily::Hopper),
            (Arch::sm(10, 0), ArchFamily::Blackwell),
            (Arch::sm(10, 3), ArchFamily::Blackwell),
            (Arch::sm(12, 0), ArchFamily::BlackwellConsumer),
            (Arch::sm(12, 1), ArchFamily::BlackwellConsumer),
            (Arch::sm(9, 1), ArchFamily::Unvalidated),
            (Arch::sm(10, 1), ArchFamily::Unvalidated),
            (Arch::sm(11, 0), ArchFamily::Unvalidated),
            (Arch::sm(13, 0), ArchFamily::Unvalidated),
        ] {
            assert_eq!(a.family(), f, "{a}");
        }
    }
}
