//! The precision policy and the GEMM dispatch table: pure decisions, no torch, no CUDA
//! (docs/DESIGN.md "Conventions"). Every decision carries a human-readable reason, which the plan prints.
//!
//! | module | what |
//! |---|---|
//! | [`recipe`] | [`Recipe`] (mxfp8, nvfp4, fp8_block, bf16), its block along K, [`Precision`] |
//! | [`arch`] | [`Arch`] (compute capability or CPU), [`native_recipes`], [`auto_recipe`] |
//! | [`gemm`] | the three passes ([`Pass`]), their [`GemmShape`], torch's [`ScalingType`] |
//! | [`dispatch`] | the table recipe x arch x pass -> [`GemmBackend`]: [`gemm_backend`] |
//! | [`grouped`] | MoE experts' grouped GEMMs, recipe x arch -> [`GroupedBackend`]: [`grouped_backend`] |
//! | [`glob`] | `*` / `?` globs for name overrides: [`glob_match`] |
//! | [`layer`] | what the planner says about a site: [`Role`], [`LayerInfo`] |
//! | [`decide`](mod@decide) | per-site rules: [`Policy`] + [`LayerInfo`] -> [`LayerDecision`] |
//! | [`guardrail`] | run-time fallback to bf16 from per-layer statistics: [`check`] |
//! | [`cost`] | predicted step time of a plan on a device (dryrun): [`cost::step_ms`] |
//! | [`parallel`] | data / tensor parallel degrees and FSDP sharding from sizes: [`parallel::plan`] |
//!
//! The flow (docs/DESIGN.md "Data flow of torch.compile"): the backend summarises each GEMM site as a
//! [`LayerInfo`]; [`decide`](fn@decide) picks its recipe from the [`Policy`] and the device's
//! [`Arch`]; [`gemm_backend`] picks the kernel of each pass; at run time [`check`] may demote a
//! layer to bf16.

pub mod arch;
pub mod cost;
pub mod decide;
pub mod dispatch;
pub mod gemm;
pub mod glob;
pub mod grouped;
pub mod guardrail;
pub mod layer;
pub mod parallel;
pub mod recipe;

pub use arch::{auto_recipe, is_emulated, is_native, native_recipes, why_not_native, Arch, ArchFamily};
pub use decide::{decide, decide_dense, decide_experts, LayerDecision, Policy, Rule};
pub use dispatch::{gemm_backend, GemmBackend, GemmChoice};
pub use gemm::{GemmShape, Pass, ScalingType};
pub use glob::glob_match;
pub use grouped::{grouped_backend, GroupedBackend, GroupedChoice, GroupedLayer};
pub use guardrail::{check, Fallback, GuardrailConfig, LayerStats};
pub use layer::{LayerInfo, Role};
pub use recipe::{Precision, Recipe};
