//! The C API entries of the precision policy, the recipe table and the guardrails (`capi.rs`): the
//! decisions of deepwell-core, for the Python package, which keeps none of its own.
//!
//! `policy_decide` — request: `{"policy": {"precision": "auto", "first_last_bf16": true,
//! "min_features": 512, "name_overrides": [["glob", "recipe"], ...], "type_overrides": [["Linear",
//! "bf16"], ...]}, "arch": "sm_90" | "cpu", "layers": [{"name", "module_type", "role", "index",
//! "count", "in_features", "out_features", "tokens" (optional), "experts" (optional)}, ...]}`;
//! answer: `{"decisions": [{"recipe", "emulated", "reason", "rule", "gemms"}, ...]}`, where `gemms`
//! (with `tokens` given) maps each pass (fprop, dgrad, wgrad) to `{"backend", "emulated",
//! "reason"}` from the GEMM dispatch table. A layer with `experts` is one projection of that many
//! stacked expert weights (DeepwellMoE), `tokens` then the grouped GEMMs' rows (tokens x top-k):
//! deepwell_core `decide_experts` (rule 9: auto keeps it bf16 where FP8 is predicted no faster);
//! any other layer with `tokens` (its rows per call) goes through `decide_dense` (rule 10, the same
//! test for one linear layer).
//!
//! `arch_info` — `{"arch": "sm_90"}` -> `{"arch", "family", "variant" (the NVRTC target, e.g.
//! "sm_90a"; null for "cpu"), "native": [recipes], "auto", "auto_reason"}`, for `deepwell.probe()`,
//! `deepwell.Linear(recipe="auto")`.
//!
//! `recipes` — every recipe's block along K and element format (`recipes_entry`).
//!
//! `grouped_backend` — `{"recipe", "arch", "aligned": bool, "tiled": bool?, "torch_mxfp8_grouped":
//! bool?}` -> `{"backend": "grouped_mm" | "fp8_block_grouped" | "emulated_grouped" | "mxfp8_grouped"
//! | "per_expert_loop", "emulated", "reason"}`: how MoE experts of that recipe run
//! (deepwell_core::policy::grouped_backend, `GroupedLayer` for the flags), for `grouped_linear`.
//!
//! `roles` — the role of each `[name, module_type]` site (deepwell_core `Role::of_module`).
//!
//! `guardrail_check` — the run-time guardrail (deepwell_core::policy::guardrail): `{"stats":
//! {"input_nonfinite", "output_nonfinite", "saturated", "numel", "amax_input", "amax_output"},
//! "saturation_threshold": 1e-3}` (amaxes may be the strings "nan", "inf", "-inf") -> `{"fallback":
//! null | "reason"}`.
//!
//! A present field of the wrong type is refused, never replaced by its default.

use deepwell_core::formats::{E2M1_MAX, E4M3_MAX};
use deepwell_core::policy::cost::{self, SiteCost};
use deepwell_core::policy::parallel::{self, Cluster, ModelSize};
use deepwell_core::policy::{
    auto_recipe, check, decide_dense, decide_experts, gemm_backend, grouped_backend, native_recipes, Arch, GemmShape,
    GroupedLayer, GuardrailConfig, LayerInfo, LayerStats, Pass, Policy, Recipe, Role,
};
use serde_json::{json, Value};

use crate::entry::fields::{count, flag, get as field, optional, text};
use crate::entry::{Answer, Entries};

fn parse<T: std::str::FromStr>(s: &str, what: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    s.parse().map_err(|e: T::Err| format!("{what}: {e}"))
}

fn overrides(v: &Value, key: &str) -> Result<Vec<(String, Recipe)>, String> {
    let Some(list) = v.get(key) else { return Ok(Vec::new()) };
    let items = list.as_array().ok_or_else(|| format!("'{key}' must be a list of [pattern, recipe] pairs"))?;
    items
        .iter()
        .map(|pair| match pair.as_array().map(Vec::as_slice) {
            Some([Value::String(p), Value::String(r)]) => Ok((p.clone(), parse(r, key)?)),
            _ => Err(format!("'{key}' entries must be [pattern, recipe] pairs of strings, got {pair}")),
        })
        .collect()
}

fn policy(v: &Value) -> Result<Policy, String> {
    let d = Policy::default();
    let precision = optional(v, "precision", |x| x.as_str().map(str::to_owned), "a string")?;
    Ok(Policy {
        precision: precision.map_or(Ok(d.precision), |s| parse(&s, "precision"))?,
        first_last_bf16: optional(v, "first_last_bf16", Value::as_bool, "a bool")?.unwrap_or(d.first_last_bf16),
        min_features: optional(v, "min_features", Value::as_u64, "a non-negative integer")?
            .map_or(d.min_features, |n| n as usize),
        name_overrides: overrides(v, "name_overrides")?,
        type_overrides: overrides(v, "type_overrides")?,
    })
}

fn layer(v: &Value) -> Result<LayerInfo, String> {
    Ok(LayerInfo {
        name: text(v, "name")?,
        module_type: text(v, "module_type")?,
        role: parse::<Role>(&text(v, "role")?, "role")?,
        index: count(v, "index")?,
        count: count(v, "count")?,
        in_features: count(v, "in_features")?,
        out_features: count(v, "out_features")?,
    })
}

/// `policy_decide` (see the module docs).
pub fn decide_entry(req: &Value) -> Answer {
    let policy = policy(req.get("policy").unwrap_or(&Value::Null))?;
    let arch: Arch = parse(&text(req, "arch")?, "arch")?;
    let layers = field(req, "layers")?.as_array().ok_or("'layers' must be a list")?;
    let decisions: Vec<Value> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let at = |e: String| format!("layers[{i}]: {e}");
            let info = layer(l).map_err(at)?;
            let tokens = optional(l, "tokens", Value::as_u64, "a non-negative integer").map_err(at)?;
            let experts = optional(l, "experts", Value::as_u64, "a positive integer").map_err(at)?;
            let d = match experts {
                Some(0) => return Err(at("'experts' must be a positive integer, got 0".into())),
                // One projection of stacked expert weights: `tokens` are the grouped GEMMs' rows.
                Some(e) => decide_experts(&policy, &info, arch, e as usize, tokens.map(|t| t as usize)),
                None => decide_dense(&policy, &info, arch, tokens.map(|t| t as usize)),
            };
            let mut out = json!({"recipe": d.recipe.to_string(), "emulated": d.emulated, "reason": d.reason, "rule": format!("{:?}", d.rule)});
            // Each pass's dense GEMM kernel (experts run grouped GEMMs: `grouped_backend` says which).
            if let (Some(tokens), None) = (tokens, experts) {
                let gemms: serde_json::Map<String, Value> = Pass::ALL
                    .iter()
                    .map(|&pass| {
                        let shape = GemmShape::linear(pass, tokens as usize, info.in_features, info.out_features);
                        let c = gemm_backend(d.recipe, arch, pass, shape);
                        (pass.to_string(), json!({"backend": c.backend.describe_on(arch), "emulated": c.emulated, "reason": c.reason}))
                    })
                    .collect();
                out["gemms"] = Value::Object(gemms);
            }
            Ok(out)
        })
        .collect::<Result<_, String>>()?;
    Ok(json!({ "decisions": decisions }))
}

/// `arch_info` (see the module docs).
pub fn arch_info_entry(req: &Value) -> Answer {
    let arch: Arch = parse(&text(req, "arch")?, "arch")?;
    let (auto, why) = auto_recipe(arch);
    let native: Vec<String> = native_recipes(arch).iter().map(|r| r.to_string()).collect();
    let variant = arch.0.and_then(|(major, minor)| deepwell_gpu::arch::nvrtc_arch(major as i32, minor as i32).ok());
    Ok(json!({
        "arch": arch.to_string(), "family": arch.family().name(), "variant": variant,
        "native": native, "auto": auto.to_string(), "auto_reason": why,
    }))
}

/// `grouped_backend`: the experts' dispatch (see the module docs).
pub fn grouped_backend_entry(req: &Value) -> Answer {
    let recipe: Recipe = parse(&text(req, "recipe")?, "recipe")?;
    let arch: Arch = parse(&text(req, "arch")?, "arch")?;
    let optional_flag = |key: &str| optional(req, key, Value::as_bool, "a bool").map(|v| v.unwrap_or(false));
    let layer = GroupedLayer {
        aligned: flag(req, "aligned")?,
        tiled: optional_flag("tiled")?,
        torch_mxfp8_grouped: optional_flag("torch_mxfp8_grouped")?,
    };
    let c = grouped_backend(recipe, arch, layer);
    Ok(json!({"backend": c.backend.as_str(), "emulated": c.emulated, "reason": c.reason}))
}

/// `recipes`: each recipe's name, block along K, and its element format's largest finite value,
/// that value's code (sign bit clear) and half its ulp: what the guardrails' clip counter and the
/// fake kernels' shape checks need, from the one table.
pub fn recipes_entry(_: &Value) -> Answer {
    let rows: Vec<Value> = Recipe::ALL
        .iter()
        .map(|&r| {
            let elem = match r {
                // fp8_tensor: the activations' format (its gradients are E5M2).
                Recipe::Mxfp8 | Recipe::Fp8Block | Recipe::Fp8Tensor => {
                    json!({"name": "e4m3", "max": E4M3_MAX, "max_code": 0x7E, "half_ulp_at_max": 16.0})
                }
                Recipe::Nvfp4 => json!({"name": "e2m1", "max": E2M1_MAX, "max_code": 0x7, "half_ulp_at_max": 1.0}),
                Recipe::Bf16 => Value::Null,
            };
            json!({"name": r.as_str(), "block_k": r.block_k(), "low_precision": r.is_low_precision(), "elem": elem})
        })
        .collect();
    Ok(Value::Array(rows))
}

/// `roles`: each [name, module_type] site's role (deepwell_core `Role::of_module`).
pub fn roles_entry(req: &Value) -> Answer {
    let sites = field(req, "sites")?.as_array().ok_or("field 'sites' must be a list of [name, module_type]")?;
    let roles = sites
        .iter()
        .map(|s| match s.as_array().map(Vec::as_slice) {
            Some([Value::String(name), Value::String(ty)]) => Ok(json!(Role::of_module(name, ty).as_str())),
            _ => Err(format!("'sites' entries must be [name, module_type] pairs of strings, got {s}")),
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Value::Array(roles))
}

/// `step_cost`: the cost model's predicted step time (deepwell_core `cost::step_ms`) of the
/// sites on `arch`, plus `other_bytes` of memory traffic (everything that is not a GEMM site) at
/// the device's copy bandwidth; the same for the sites all in bf16.
pub fn step_cost_entry(req: &Value) -> Answer {
    let arch: Arch = parse(&text(req, "arch")?, "arch")?;
    let sites = field(req, "sites")?.as_array().ok_or("field 'sites' must be a list")?;
    let sites = sites
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let site = || -> Result<SiteCost, String> {
                Ok(SiteCost {
                    tokens: count(s, "tokens")?,
                    in_features: count(s, "in_features")?,
                    out_features: count(s, "out_features")?,
                    recipe: parse(&text(s, "recipe")?, "recipe")?,
                })
            };
            site().map_err(|e| format!("sites[{i}]: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let other_bytes = optional(req, "other_bytes", Value::as_f64, "a number of bytes")?.unwrap_or(0.0);
    let (rates, _) = cost::rates(arch);
    let other_ms = other_bytes / (rates.copy_tbps * 1e12) * 1e3;
    let (ms, bf16) = cost::step_ms(&sites, arch);
    Ok(json!({"step_ms": ms + other_ms, "bf16_step_ms": bf16 + other_ms, "rates_from": rates_from(arch)}))
}

/// Where `arch`'s rates come from, saying so when they are borrowed from another device.
fn rates_from(arch: Arch) -> String {
    let (rates, own) = cost::rates(arch);
    if own {
        rates.source.to_owned()
    } else {
        format!("{} (no rates for {arch}: borrowed)", rates.source)
    }
}

/// A float field, also accepting the strings JSON cannot carry as numbers ("nan", "inf", "-inf").
fn float(v: &Value, key: &str) -> Result<f64, String> {
    match field(v, key)? {
        Value::String(s) => s.parse::<f64>().map_err(|_| format!("field '{key}' must be a number, got {s:?}")),
        n => n.as_f64().ok_or_else(|| format!("field '{key}' must be a number")),
    }
}

/// `guardrail_check` (see the module docs).
pub fn guardrail_entry(req: &Value) -> Answer {
    let s = field(req, "stats")?;
    let stats = LayerStats {
        input_nonfinite: count(s, "input_nonfinite")? as u64,
        output_nonfinite: count(s, "output_nonfinite")? as u64,
        saturated: count(s, "saturated")? as u64,
        numel: count(s, "numel")? as u64,
        amax_input: float(s, "amax_input")? as f32,
        amax_output: float(s, "amax_output")? as f32,
    };
    let d = GuardrailConfig::default();
    let threshold = optional(req, "saturation_threshold", Value::as_f64, "a number")?;
    if threshold.is_some_and(|t| !(0.0..=1.0).contains(&t)) {
        return Err(
            format!("field 'saturation_threshold' must be in [0, 1], got {}", req["saturation_threshold"]).into()
        );
    }
    let cfg = GuardrailConfig { saturation_threshold: threshold.unwrap_or(d.saturation_threshold) };
    Ok(json!({ "fallback": check(&stats, &cfg).map(|f| f.reason) }))
}

/// `parallel_plan`: data / tensor degrees and FSDP sharding (deepwell_core `parallel::plan`).
pub fn parallel_plan_entry(req: &Value) -> Answer {
    let c = field(req, "cluster")?;
    let m = field(req, "model")?;
    let bytes = |v: &Value, key: &str| count(v, key).map(|n| n as u64);
    let cluster = Cluster {
        world_size: u32::try_from(count(c, "world_size")?).map_err(|_| "field 'world_size' is too large")?,
        devices_per_node: u32::try_from(count(c, "devices_per_node")?)
            .map_err(|_| "field 'devices_per_node' is too large")?,
        memory_bytes: bytes(c, "memory_bytes")?,
        peer_access: flag(c, "peer_access")?,
    };
    let model = ModelSize {
        weight_bytes: bytes(m, "weight_bytes")?,
        gradient_bytes: bytes(m, "gradient_bytes")?,
        optimizer_bytes: bytes(m, "optimizer_bytes")?,
        activation_bytes: bytes(m, "activation_bytes")?,
        largest_unit_bytes: bytes(m, "largest_unit_bytes")?,
        blocks: u32::try_from(optional(m, "blocks", Value::as_u64, "a count")?.unwrap_or(0))
            .map_err(|_| "field 'blocks' is too large")?,
    };
    let forced = optional(req, "tensor", Value::as_u64, "a positive integer")?;
    if let Some(t) = forced {
        if t == 0 || u64::from(cluster.world_size.max(1)) % t != 0 {
            return Err(format!(
                "field 'tensor' must be a positive divisor of world_size {}, got {t}",
                cluster.world_size
            )
            .into());
        }
    }
    let p = parallel::plan_with_tensor(&cluster, &model, forced.map(|t| t as u32));
    Ok(json!({
        "data": p.data, "tensor": p.tensor, "fsdp": p.fsdp, "reshard_after_forward": p.reshard_after_forward, "sm_carveout": p.sm_carveout,
        "collectives": p.collectives.name(), "unit_blocks": p.unit_blocks, "ends_join_blocks": p.ends_join_blocks, "forward_prefetch": p.forward_prefetch, "per_rank_bytes": p.per_rank_bytes, "reason": p.reason,
    }))
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: Entries = &[
    ("policy_decide", decide_entry, "{policy, arch, layers} -> {decisions}"),
    ("arch_info", arch_info_entry, "{arch} -> {arch, family, variant, native, auto, auto_reason}"),
    ("grouped_backend", grouped_backend_entry, "{recipe, arch, aligned, tiled?, torch_mxfp8_grouped?} -> {backend, emulated, reason}"),
    ("recipes", recipes_entry, "{} -> [{name, block_k, low_precision, elem_max, ...}]"),
    ("roles", roles_entry, "{sites: [[name, module_type], ...]} -> [role]"),
    ("step_cost", step_cost_entry, "{arch, sites: [{tokens, in_features, out_features, recipe}], other_bytes} -> {step_ms, bf16_step_ms, rates_from}"),
    ("parallel_plan", parallel_plan_entry, "{cluster: {world_size, devices_per_node, memory_bytes, peer_access}, model: {weight_bytes, gradient_bytes, optimizer_bytes, activation_bytes, largest_unit_bytes, blocks?}, tensor?} -> {data, tensor, fsdp, reshard_after_forward, per_rank_bytes, sm_carveout, collectives, unit_blocks, ends_join_blocks, forward_prefetch, reason}"),
    ("guardrail_check", guardrail_entry, "{stats, saturation_threshold?} -> {fallback}"),
];
