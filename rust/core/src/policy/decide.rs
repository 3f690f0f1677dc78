//! The precision policy: one recipe per GEMM site, with the reason (docs/DESIGN.md "Precision policy").
//!
//! [`decide`] applies these rules in order; the first that fires decides:
//!
//! 1. **Name override**: the first `(glob, recipe)` of `name_overrides` whose glob matches the
//!    qualified module name ([`glob_match`]).
//! 2. **Type override**: the first `(type, recipe)` of `type_overrides` equal to the module type.
//! 3. **Role**: embeddings, norms, router gates and the LM head stay bf16 (TE and the NVFP4 paper
//!    keep them high precision; docs/DESIGN.md "Precision policy").
//! 4. **First / last site**: the first and last GEMM sites stay bf16 when `first_last_bf16`
//!    (Megatron-Core's `--first-last-layers-bf16`).
//! 5. **Precision**: the policy's recipe; `auto` resolves with [`auto_recipe`]. bf16 ends here.
//! 6. **Block divisibility**: `in_features` (fprop's K) and `out_features` (dgrad's K; also the
//!    weight's second tile dim for fp8_block's 128x128 blocks) must be multiples of the recipe's
//!    block, else bf16.
//! 7. **Min features**: `in_features` or `out_features` below `min_features` is too small to gain
//!    (quantization costs more than the faster GEMM saves), so bf16.
//! 8. Otherwise the recipe of rule 5, native, or emulated with the reason when the device has no
//!    native GEMM for it.
//! 9. **Expert tokens** ([`decide_experts`], MoE expert projections under precision `auto` only): a
//!    low-precision recipe of rule 8 that the cost model ([`super::cost::grouped_site_ms`]) predicts
//!    no faster than bf16 at the call's rows per expert stays bf16, as rule 7 keeps dense layers
//!    too small to gain.
//! 10. **Dense tokens** ([`decide_dense`], other sites under precision `auto`, when the planner
//!     knows the site's rows per call): the same test for one linear layer, through the cost model
//!     behind `dryrun` ([`super::cost::step_ms`]: its three GEMMs at the dispatched kernels' rates
//!     plus its quantizers' bytes). Rule 7's fixed threshold cannot see the rows: a 1024 x 512
//!     projection over 16k rows spends 0.052 ms moving its quantizers' 155 MB at 3 TB/s, more than
//!     its FP8 GEMMs save (0.049 against bf16's 0.075 ms), while 2048 x 2048 over 8k rows gains
//!     (0.269 against 0.299 ms).
//!
//! Overrides are explicit user choices, so they skip rules 3, 4 and 7, but **not** rule 6: a
//! recipe whose block does not divide K cannot be quantized at all, so an override to it falls
//! back to bf16 and the reason names both the override and the failed divisibility. wgrad's K is
//! the token count, which is only known per call; [`super::gemm_backend`] checks it.

use super::arch::{auto_recipe, is_emulated, why_not_native, Arch};
use super::cost::{grouped_site_ms, step_ms, GroupedSiteCost, SiteCost};
use super::glob::glob_match;
use super::layer::LayerInfo;
use super::recipe::{Precision, Recipe};

/// The user's precision policy. `Policy::default()` is the documented default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The recipe for sites no other rule keeps in bf16 (default `auto`).
    pub precision: Precision,
    /// Keep the first and last GEMM sites in bf16 (default true).
    pub first_last_bf16: bool,
    /// Sites with `in_features` or `out_features` below this stay bf16 (default 512; 0 disables).
    pub min_features: usize,
    /// `(glob, recipe)` by qualified name; the first match wins.
    pub name_overrides: Vec<(String, Recipe)>,
    /// `(module type, recipe)`, exact type-name match; the first match wins.
    pub type_overrides: Vec<(String, Recipe)>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            precision: Precision::Auto,
            first_last_bf16: true,
            min_features: 512,
            name_overrides: Vec::new(),
            type_overrides: Vec::new(),
        }
    }
}

/// The rule that made a decision (the numbered list in the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// 1: a `name_overrides` glob matched.
    NameOverride,
    /// 2: a `type_overrides` entry matched.
    TypeOverride,
    /// 3: the site's role stays bf16.
    Role,
    /// 4: first or last GEMM site.
    FirstLast,
    /// 5 and 8: the policy's precision (fixed or auto).
    Precision,
    /// 6: K not divisible by the recipe's block.
    BlockDivisibility,
    /// 7: too small to gain.
    MinFeatures,
    /// 9: an expert projection with too few rows per expert to gain.
    ExpertTokens,
    /// 10: a dense site whose rows per call are too few to gain.
    DenseTokens,
}

/// The policy's verdict for one site.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerDecision {
    /// The recipe the site runs.
    pub recipe: Recipe,
    /// True when the recipe has no native GEMM on the device and runs as exact emulation.
    pub emulated: bool,
    /// Why, in words: names the rule and, for a low-precision recipe, native or emulated.
    pub reason: String,
    /// The rule that decided.
    pub rule: Rule,
}

fn bf16(rule: Rule, reason: String) -> LayerDecision {
    LayerDecision { recipe: Recipe::Bf16, emulated: false, reason, rule }
}

/// `recipe` on `arch`, saying native or emulated (rule 8, and overrides that pass rule 6).
fn with_recipe(recipe: Recipe, arch: Arch, rule: Rule, why: String) -> LayerDecision {
    let emulated = is_emulated(recipe, arch);
    let reason = if emulated {
        format!("{why}; emulated on this device ({})", why_not_native(recipe, arch))
    } else if recipe.is_low_precision() {
        format!("{why}; native on {arch}")
    } else {
        why
    };
    LayerDecision { recipe, emulated, reason, rule }
}

/// Rule 6 for `recipe` on `layer`: the reason it fails, if it does.
fn indivisible(recipe: Recipe, layer: &LayerInfo) -> Option<String> {
    let block = recipe.block_k()?;
    if layer.in_features % block != 0 {
        return Some(format!("K={} not divisible by {block} ({recipe} block): bf16", layer.in_features));
    }
    if layer.out_features % block != 0 {
        return Some(format!(
            "out_features={} (dgrad's K) not divisible by {block} ({recipe} block): bf16",
            layer.out_features
        ));
    }
    None
}

/// An override's decision: rule 6 still applies.
fn overridden(recipe: Recipe, layer: &LayerInfo, arch: Arch, rule: Rule, why: String) -> LayerDecision {
    match indivisible(recipe, layer) {
        Some(fail) => bf16(Rule::BlockDivisibility, format!("{why}, but {fail}")),
        None => with_recipe(recipe, arch, rule, why),
    }
}

/// Decides one site's recipe (rules in the module docs).
pub fn decide(policy: &Policy, layer: &LayerInfo, arch: Arch) -> LayerDecision {
    if let Some((glob, r)) = policy.name_overrides.iter().find(|(g, _)| glob_match(g, &layer.name)) {
        let why = format!("name override {glob:?} -> {r}");
        return overridden(*r, layer, arch, Rule::NameOverride, why);
    }
    if let Some((ty, r)) = policy.type_overrides.iter().find(|(t, _)| *t == layer.module_type) {
        let why = format!("type override {ty:?} -> {r}");
        return overridden(*r, layer, arch, Rule::TypeOverride, why);
    }
    if let Some(why) = layer.role.keeps_bf16() {
        return bf16(Rule::Role, why.to_string());
    }
    if policy.first_last_bf16 && layer.count > 0 {
        let (first, last) = (layer.index == 0, layer.index + 1 == layer.count);
        let which = match (first, last) {
            (true, true) => Some("first and last"),
            (true, false) => Some("first"),
            (false, true) => Some("last"),
            (false, false) => None,
        };
        if let Some(which) = which {
            let (pos, n) = (layer.index + 1, layer.count);
            return bf16(
                Rule::FirstLast,
                format!("{which} GEMM site ({pos} of {n}): bf16 by policy (first_last_bf16)"),
            );
        }
    }
    let (recipe, why) = match policy.precision {
        Precision::Fixed(r) => (r, format!("policy precision {r}")),
        Precision::Auto => auto_recipe(arch),
    };
    if recipe == Recipe::Bf16 {
        return bf16(Rule::Precision, why);
    }
    if let Some(fail) = indivisible(recipe, layer) {
        return bf16(Rule::BlockDivisibility, fail);
    }
    let smallest = layer.in_features.min(layer.out_features);
    if smallest < policy.min_features {
        let dim = if layer.in_features <= layer.out_features { "in" } else { "out" };
        return bf16(
            Rule::MinFeatures,
            format!("{dim}_features={smallest} < min_features={}: too small to gain: bf16", policy.min_features),
        );
    }
    with_recipe(recipe, arch, Rule::Precision, why)
}

/// True when `d` is `auto`'s own low-precision choice (rules 5 and 8), which rules 9 and 10 may
/// still overturn; overrides and fixed precisions are the user's and stand.
fn auto_low_precision(policy: &Policy, d: &LayerDecision) -> bool {
    policy.precision == Precision::Auto && d.rule == Rule::Precision && d.recipe != Recipe::Bf16
}

/// [`decide`] for one dense linear layer, then rule 10 when the site's `tokens` (its GEMMs' rows
/// per call) are known.
pub fn decide_dense(policy: &Policy, layer: &LayerInfo, arch: Arch, tokens: Option<usize>) -> LayerDecision {
    let d = decide(policy, layer, arch);
    let Some(tokens) = tokens.filter(|&t| t > 0 && auto_low_precision(policy, &d)) else { return d };
    let site = SiteCost { tokens, in_features: layer.in_features, out_features: layer.out_features, recipe: d.recipe };
    let (ms, bf16_ms) = step_ms(&[site], arch);
    if ms < bf16_ms {
        return d;
    }
    bf16(
        Rule::DenseTokens,
        format!(
            "auto: {} predicted {ms:.3} ms forward + backward against bf16's {bf16_ms:.3} at {tokens} rows: too small \
             to gain",
            d.recipe
        ),
    )
}

/// [`decide`] for one projection of `experts` stacked expert weights, then rule 9 when the call's
/// `assignments` (tokens x top-k, the grouped GEMMs' rows) are known.
pub fn decide_experts(
    policy: &Policy,
    layer: &LayerInfo,
    arch: Arch,
    experts: usize,
    assignments: Option<usize>,
) -> LayerDecision {
    let d = decide(policy, layer, arch);
    let Some(assignments) = assignments.filter(|_| auto_low_precision(policy, &d)) else { return d };
    let site = GroupedSiteCost {
        experts,
        assignments,
        in_features: layer.in_features,
        out_features: layer.out_features,
        recipe: d.recipe,
    };
    let (ms, bf16_ms) = grouped_site_ms(&site, arch);
    if ms < bf16_ms {
        return d;
    }
    let per_expert = assignments as f64 / experts.max(1) as f64;
    bf16(
        Rule::ExpertTokens,
        format!(
            "auto: {} predicted {ms:.3} ms forward + backward against bf16's {bf16_ms:.3} at {per_expert:.0} rows per \
             expert: too few to gain",
            d.recipe
        ),
    )
}
