//! The recipes deepwell offers and the user's precision choice (docs/DESIGN.md "Recipes and hardware").
//!
//! | recipe | elements | scales | block along K |
//! |---|---|---|---|
//! | `mxfp8` | E4M3 | E8M0 per 1x32 (OCP MX v1.0; docs/NUMERICS.md "MXFP8") | 32 |
//! | `nvfp4` | E2M1 | E4M3 per 1x16 + fp32 per tensor (arXiv 2509.25149; docs/NUMERICS.md "NVFP4") | 16 |
//! | `fp8_block` | E4M3 | fp32 per 1x128 (activations, grads), 128x128 (weights); docs/NUMERICS.md "FP8 block" | 128 |
//! | `fp8_tensor` | E4M3 (x, W), E5M2 (grads) | one fp32 per tensor from its current amax; docs/NUMERICS.md "FP8 tensor" | none (any K) |
//! | `bf16` | bf16 | none | none |

use crate::error::{CoreError, Result};
use std::fmt;
use std::str::FromStr;

/// One quantization recipe for a GEMM site's three GEMMs (fprop, dgrad, wgrad).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recipe {
    /// MXFP8: E4M3 elements, one E8M0 scale per 32 consecutive elements along K.
    Mxfp8,
    /// NVFP4: E2M1 elements, one E4M3 scale per 16 along K, one fp32 scale per tensor.
    Nvfp4,
    /// DeepSeek-style FP8: E4M3, fp32 scales per 1x128 (activations/grads) or 128x128 (weights).
    Fp8Block,
    /// Per-tensor current scaling (torchao's `tensorwise`): E4M3 activations and weights, E5M2
    /// gradients, one power-of-two fp32 scale per tensor. Only where the user asks: `auto` never
    /// picks it ([`super::auto_recipe`]).
    Fp8Tensor,
    /// No quantization: a plain bf16 GEMM.
    Bf16,
}

const RECIPE_CHOICES: &str = "mxfp8, nvfp4, fp8_block, fp8_tensor, bf16";

impl Recipe {
    /// Every recipe, in the order the docs list them.
    pub const ALL: [Recipe; 5] = [Recipe::Mxfp8, Recipe::Nvfp4, Recipe::Fp8Block, Recipe::Fp8Tensor, Recipe::Bf16];

    /// The user-facing spelling (also what `Display` prints and `FromStr` accepts).
    pub fn as_str(self) -> &'static str {
        match self {
            Recipe::Mxfp8 => "mxfp8",
            Recipe::Nvfp4 => "nvfp4",
            Recipe::Fp8Block => "fp8_block",
            Recipe::Fp8Tensor => "fp8_tensor",
            Recipe::Bf16 => "bf16",
        }
    }

    /// Elements per scale along the GEMM's K dimension; `None` for bf16 (no blocks), 1 for
    /// fp8_tensor (one scale for the whole tensor: every K quantizes).
    ///
    /// Every operand of every pass is quantized along that pass's K, so K must be a multiple of
    /// this (the reference quantizers assert it: `mxfp8.rs`, `nvfp4.rs`, `fp8_block.rs`). For
    /// fp8_block the weight's 128x128 tiles also need `out_features % 128 == 0`, which is the
    /// dgrad K anyway.
    pub fn block_k(self) -> Option<usize> {
        match self {
            Recipe::Mxfp8 => Some(32),
            Recipe::Nvfp4 => Some(16),
            Recipe::Fp8Block => Some(128),
            Recipe::Fp8Tensor => Some(1),
            Recipe::Bf16 => None,
        }
    }

    /// True for every recipe that quantizes (all but bf16).
    pub fn is_low_precision(self) -> bool {
        self != Recipe::Bf16
    }
}

impl fmt::Display for Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Recipe {
    type Err = CoreError;

    /// Accepts exactly the spellings of [`Recipe::as_str`] (lower case).
    fn from_str(s: &str) -> Result<Self> {
        Recipe::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| CoreError::UnknownMode {
            what: "recipe",
            got: s.to_string(),
            choices: RECIPE_CHOICES,
        })
    }
}

/// The user's `precision=` argument: a fixed recipe, or `auto` (the device's fastest native one,
/// [`super::auto_recipe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Resolve per device with [`super::auto_recipe`].
    #[default]
    Auto,
    /// This recipe on every site the policy does not keep in bf16.
    Fixed(Recipe),
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Precision::Auto => f.write_str("auto"),
            Precision::Fixed(r) => r.fmt(f),
        }
    }
}

impl FromStr for Precision {
    type Err = CoreError;

    /// `"auto"` or one of the recipe spellings.
    fn from_str(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(Precision::Auto);
        }
        s.parse::<Recipe>().map(Precision::Fixed).map_err(|_| CoreError::UnknownMode {
            what: "precision",
            got: s.to_string(),
            choices: "auto, mxfp8, nvfp4, fp8_block, fp8_tensor, bf16",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_blocks() {
        for (r, s, b) in [
            (Recipe::Mxfp8, "mxfp8", Some(32)),
            (Recipe::Nvfp4, "nvfp4", Some(16)),
            (Recipe::Fp8Block, "fp8_block", Some(128)),
            (Recipe::Fp8Tensor, "fp8_tensor", Some(1)),
            (Recipe::Bf16, "bf16", None),
        ] {
            assert_eq!(r.to_string(), s);
            assert_eq!(s.parse::<Recipe>(), Ok(r));
            assert_eq!(r.block_k(), b);
            assert_eq!(r.is_low_precision(), b.is_some());
            assert_eq!(s.parse::<Precision>(), Ok(Precision::Fixed(r)));
            assert_eq!(Precision::Fixed(r).to_string(), s);
        }
        assert_eq!("auto".parse::<Precision>(), Ok(Precision::Auto));
        assert_eq!(Precision::default(), Precision::Auto);
    }

    #[test]
    fn unknown_names_list_the_choices() {
        let e = "MXFP8".parse::<Recipe>().unwrap_err();
        assert!(e.to_string().contains("unknown recipe \"MXFP8\""), "{e}");
        assert!(e.to_string().contains("fp8_block"), "{e}");
        let e = "fp8".parse::<Precision>().unwrap_err();
        assert!(e.to_string().contains("unknown precision \"fp8\""), "{e}");
        assert!(e.to_string().contains("auto"), "{e}");
        assert!("".parse::<Recipe>().is_err());
    }
}
