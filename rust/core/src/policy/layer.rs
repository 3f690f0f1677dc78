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

    /// The role of a module from its qualified name and class, as the planner classifies sites and
    /// `deepwell.capture` tags modules. The class decides embeddings and norms; otherwise the name's
    /// components, in this order: the last component names an LM head (`lm_head`, `output`,
    /// `logits`, `classifier`), a router (`router`, `gate`, `gating`, `w_gate`) or an embedding
    /// (`embed*`, `wte`, `wpe`, `tok_embeddings`); any component names experts (`experts`),
    /// attention (`attn`, `q_proj`, `wq`, `c_attn`, ...) or an MLP (`mlp`, `w1`, `up_proj`,
    /// `c_fc`, ...) — the spellings of LLaMA, Hugging Face, GPT-2 and Mixtral/DeepSeek checkpoints.
    pub fn of_module(name: &str, module_type: &str) -> Role {
        const LM_HEAD: &[&str] = &["lm_head", "output", "logits", "classifier"];
        const ROUTER: &[&str] = &["router", "gate", "gating", "w_gate"];
        const EMBEDDING: &[&str] = &["wte", "wpe", "tok_embeddings"];
        const ATTENTION: &[&str] = &[
            "attn",
            "attention",
            "self_attn",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "wq",
            "wk",
            "wv",
            "wo",
            "qkv",
            "c_attn",
        ];
        const MLP: &[&str] = &[
            "mlp",
            "ffn",
            "feed_forward",
            "w1",
            "w2",
            "w3",
            "gate_proj",
            "up_proj",
            "down_proj",
            "fc1",
            "fc2",
            "c_fc",
            "c_proj",
        ];
        if module_type.contains("Embedding") {
            return Role::Embedding;
        }
        if module_type.contains("Norm") {
            return Role::Norm;
        }
        let parts: Vec<&str> = name.split('.').collect();
        let last = parts.last().copied().unwrap_or("");
        let any = |set: &[&str]| parts.iter().any(|p| set.contains(p));
        if LM_HEAD.contains(&last) {
            Role::LmHead
        } else if ROUTER.contains(&last) {
            Role::Router
        } else if EMBEDDING.contains(&last)
            || (last.starts_with("embed") && last.chars().all(|c| c.is_alphanumeric() || c == '_'))
        {
            Role::Embedding
        } else if parts.contains(&"experts") {
            Role::Experts
        } else if any(ATTENTION) {
            Role::Attention
        } else if any(MLP) {
            Role::Mlp
        } else {
            Role::Other
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

#[cfg(test)]
mod tests {
    use super::Role;

    #[test]
    fn roles_of_the_usual_checkpoint_names() {
        let cases = [
            ("layers.0.attention.wq", "Linear", Role::Attention),
            ("model.layers.3.self_attn.q_proj", "Linear", Role::Attention),
            ("transformer.h.1.attn.c_attn", "Conv1D", Role::Attention),
            ("layers.1.feed_forward.w2", "Linear", Role::Mlp),
            ("transformer.h.1.mlp.c_proj", "Conv1D", Role::Mlp),
            ("model.layers.0.block_sparse_moe.experts.3.w1", "Linear", Role::Experts),
            ("model.layers.0.block_sparse_moe.gate", "Linear", Role::Router),
            ("model.layers.0.mlp.gate", "Linear", Role::Router),
            ("output", "Linear", Role::LmHead),
            ("lm_head", "Linear", Role::LmHead),
            ("tok_embeddings", "Embedding", Role::Embedding),
            ("model.embed_tokens", "Linear", Role::Embedding),
            ("transformer.wte", "Parameter", Role::Embedding),
            ("layers.0.attention_norm", "RMSNorm", Role::Norm),
            ("blocks.0.proj", "Linear", Role::Other),
            ("", "Parameter", Role::Other),
        ];
        for (name, ty, want) in cases {
            assert_eq!(Role::of_module(name, ty), want, "{name} ({ty})");
        }
    }
}
