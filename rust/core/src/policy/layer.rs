//! What the planner tells the policy about one GEMM site: its [`Role`] and its [`LayerInfo`].

use crate::error::{CoreError, Result};
use std::str::FromStr;

/// What a GEMM site is for, as the planner classifies its owning module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Token embedding (a lookup, or a tied projection).
    Embedding,
    /// Attention projections (q, k, v, o).
    Attention,
    /// Dense MLP projections.
    Mlp,
    /// MoE expert GEMMs (grouped).
    Experts,
    /// MoE router gate.
    Router,
    /// Normalization layers.
    Norm,
    /// Output head / logits.
    LmHead,
    /// Anything else.
    Other,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 8] = [
        Role::Embedding,
        Role::Attention,
        Role::Mlp,
        Role::Experts,
        Role::Router,
        Role::Norm,
        Role::LmHead,
        Role::Other,
    ];

    /// The spelling `FromStr` accepts: `embedding`, `attention`, `mlp`, `experts`, `router`,
    /// `norm`, `lm_head`, `other`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::Attention => "attention",
            Role::Mlp => "mlp",
            Role::Experts => "experts",
            Role::Router => "router",
            Role::Norm => "norm",
            Role::LmHead => "lm_head",
            Role::Other => "other",
        }
    }

    /// The reason rule 3 gives, or `None` for roles that take the recipe.
    pub(super) fn keeps_bf16(self) -> Option<&'static str> {
        match self {
            Role::Embedding => Some("embeddings stay bf16 by policy"),
            Role::Norm => Some("norms stay bf16 by policy"),
            Role::Router => Some("router gates stay bf16 by policy"),
            Role::LmHead => Some("LM head (logits) stays bf16 by policy"),
            Role::Attention | Role::Mlp | Role::Experts | Role::Other => None,
        }
    }
}

impl FromStr for Role {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self> {
        Role::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| CoreError::UnknownMode {
            what: "layer role",
            got: s.to_string(),
            choices: "embedding, attention, mlp, experts, router, norm, lm_head, other",
        })
    }
}

/// One GEMM site as the planner summarises it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// Qualified module name, e.g. `layers.3.mlp.up_proj`.
    pub name: String,
    /// Module class name, e.g. `Linear`.
    pub module_type: String,
    /// What the site is for.
    pub role: Role,
    /// Position among the model's GEMM sites, from 0.
    pub index: usize,
    /// Number of GEMM sites in the model.
    pub count: usize,
    /// The weight's input features (fprop's K).
    pub in_features: usize,
    /// The weight's output features (dgrad's K).
    pub out_features: usize,
}
