//! The three GEMMs (passes) of a linear layer, their shapes, and torch's scale granularities.
//!
//! For `y = x W^T` with x (tokens, in) and W (out, in), each pass is an `(M, K) x (K, N)` GEMM:
//!
//! | pass | GEMM | M | N | K | operands quantized along K |
//! |---|---|---|---|---|---|
//! | fprop | `y = x W^T` | tokens | out | in | x row-wise, W row-wise |
//! | dgrad | `dx = dy W` | tokens | in | out | dy row-wise, W column-wise |
//! | wgrad | `dW = dy^T x` | out | in | tokens | dy column-wise, x column-wise |
//!
//! (docs/DESIGN.md "Recipes and hardware"; TE's fprop = X_row W_row, dgrad = dY_row W_col,
//! wgrad = X_col dY_col.)

use crate::error::{CoreError, Result};
use std::fmt;
use std::str::FromStr;

/// One of the three GEMMs of a linear layer's training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Forward: `y = x W^T`, K = in_features.
    Fprop,
    /// Input gradient: `dx = dy W`, K = out_features.
    Dgrad,
    /// Weight gradient: `dW = dy^T x`, K = tokens.
    Wgrad,
}

impl Pass {
    /// The three passes in execution order.
    pub const ALL: [Pass; 3] = [Pass::Fprop, Pass::Dgrad, Pass::Wgrad];

    /// `fprop`, `dgrad` or `wgrad`.
    pub fn as_str(self) -> &'static str {
        match self {
            Pass::Fprop => "fprop",
            Pass::Dgrad => "dgrad",
            Pass::Wgrad => "wgrad",
        }
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Pass {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self> {
        Pass::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| CoreError::UnknownMode {
            what: "GEMM pass",
            got: s.to_string(),
            choices: "fprop, dgrad, wgrad",
        })
    }
}

/// The `(M, K) x (K, N)` problem of one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// The contraction dimension: the one every operand is quantized along.
    pub k: usize,
}

impl GemmShape {
    /// The shape of `pass` for a linear layer `in_features -> out_features` over `tokens` rows
    /// (the table in the module docs).
    pub fn linear(pass: Pass, tokens: usize, in_features: usize, out_features: usize) -> Self {
        let (m, n, k) = match pass {
            Pass::Fprop => (tokens, out_features, in_features),
            Pass::Dgrad => (tokens, in_features, out_features),
            Pass::Wgrad => (out_features, in_features, tokens),
        };
        GemmShape { m, n, k }
    }
}

/// A scale granularity, named and numbered as torch's `torch.nn.functional.ScalingType`
/// (the `scale_recipe_a/b` integers of `aten::_scaled_mm_v2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScalingType {
    /// One fp32 scale for the whole operand (fp8_tensor).
    TensorWise,
    /// One scale per 16 elements along K (NVFP4, E4M3 scales).
    BlockWise1x16,
    /// One scale per 32 elements along K (MXFP8, E8M0 scales).
    BlockWise1x32,
    /// One fp32 scale per 128 elements along K (activations and gradients of fp8_block).
    BlockWise1x128,
    /// One fp32 scale per 128x128 tile (weights of fp8_block).
    BlockWise128x128,
}

impl ScalingType {
    /// The integer torch's `ScalingType` enum gives this mode (TensorWise = 0, RowWise = 1,
    /// BlockWise1x16 = 2, BlockWise1x32 = 3, BlockWise1x128 = 4, BlockWise128x128 = 5).
    pub fn torch_code(self) -> i64 {
        match self {
            ScalingType::TensorWise => 0,
            ScalingType::BlockWise1x16 => 2,
            ScalingType::BlockWise1x32 => 3,
            ScalingType::BlockWise1x128 => 4,
            ScalingType::BlockWise128x128 => 5,
        }
    }

    /// `tensor`, `1x16`, `1x32`, `1x128` or `128x128`.
    pub fn block(self) -> &'static str {
        match self {
            ScalingType::TensorWise => "tensor",
            ScalingType::BlockWise1x16 => "1x16",
            ScalingType::BlockWise1x32 => "1x32",
            ScalingType::BlockWise1x128 => "1x128",
            ScalingType::BlockWise128x128 => "128x128",
        }
    }
}
