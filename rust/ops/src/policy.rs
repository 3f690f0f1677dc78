//! `deepwell_policy_decide`: the precision policy of deepwell-core behind a JSON-in, JSON-out C
//! entry point, for `torch_ops/deepwell/policy.py` (and the compile backend's planner later).
//!
//! Request: `{"policy": {"precision": "auto", "first_last_bf16": true, "min_features": 512,
//! "name_overrides": [["glob", "recipe"], ...], "type_overrides": [["Linear", "bf16"], ...]},
//! "arch": "sm_90" | "cpu", "layers": [{"name", "module_type", "role", "index", "count",
//! "in_features", "out_features", "tokens" (optional)}, ...]}`.
//! Response: `{"decisions": [{"recipe", "emulated", "reason", "rule", "gemms"}, ...]}` or
//! `{"error": "..."}`; `gemms` (with `tokens` given) maps each pass (fprop, dgrad, wgrad) to
//! `{"backend", "emulated", "reason"}` from the GEMM dispatch table.
//!
//! `deepwell_arch_info`: what the recipe table says about a device, for `deepwell.probe()`.
//! Request: `{"arch": "sm_90"}`. Response: `{"arch", "family", "native": [recipes], "auto", "auto_reason"}`.
//!
//! `deepwell_guardrail_check`: the run-time guardrail (deepwell_core::policy::guardrail) for
//! `torch_ops/deepwell/guardrails.py`. Request: `{"stats": {"input_nonfinite", "output_nonfinite",
//! "saturated", "numel", "amax_input", "amax_output"}, "saturation_threshold": 1e-3}` (amaxes may be
//! the strings "nan", "inf", "-inf"). Response: `{"fallback": null | "reason"}` or `{"error": "..."}`.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::catch_unwind;

use deepwell_core::policy::{
    auto_recipe, check, decide, gemm_backend, native_recipes, Arch, GemmShape, GuardrailConfig, LayerInfo, LayerStats,
    Pass, Policy, Recipe, Role,
};
use serde_json::{json, Value};

fn field<'a>(v: &'a Value, key: &str) -> Result<&'a Value, String> {
    v.get(key).ok_or_else(|| format!("missing field '{key}'"))
}

fn text(v: &Value, key: &str) -> Result<String, String> {
    field(v, key)?.as_str().map(str::to_owned).ok_or_else(|| format!("field '{key}' must be a string"))
}

fn count(v: &Value, key: &str) -> Result<usize, String> {
    field(v, key)?.as_u64().map(|n| n as usize).ok_or_else(|| format!("field '{key}' must be a non-negative integer"))
}

/// An optional field: absent (or null) gives None; present with the wrong type is an error, never
/// the default (a policy with `min_features=-1` must not silently plan with 512).
fn optional<T>(v: &Value, key: &str, get: fn(&Value) -> Option<T>, what: &str) -> Result<Option<T>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => get(x).map(Some).ok_or_else(|| format!("field '{key}' must be {what}, got {x}")),
    }
}

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

fn respond(request: &str) -> Result<Value, String> {
    let req: Value = serde_json::from_str(request).map_err(|e| format!("request is not JSON: {e}"))?;
    let policy = policy(req.get("policy").unwrap_or(&Value::Null))?;
    let arch: Arch = parse(&text(&req, "arch")?, "arch")?;
    let layers = field(&req, "layers")?.as_array().ok_or("'layers' must be a list")?;
    let decisions: Vec<Value> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let info = layer(l).map_err(|e| format!("layers[{i}]: {e}"))?;
            let d = decide(&policy, &info, arch);
            let mut out = json!({"recipe": d.recipe.to_string(), "emulated": d.emulated, "reason": d.reason, "rule": format!("{:?}", d.rule)});
            let tokens = optional(l, "tokens", Value::as_u64, "a non-negative integer").map_err(|e| format!("layers[{i}]: {e}"))?;
            if let Some(tokens) = tokens {
                let gemms: serde_json::Map<String, Value> = Pass::ALL
                    .iter()
                    .map(|&pass| {
                        let shape = GemmShape::linear(pass, tokens as usize, info.in_features, info.out_features);
                        let c = gemm_backend(d.recipe, arch, pass, shape);
                        (pass.to_string(), json!({"backend": c.backend.describe(), "emulated": c.emulated, "reason": c.reason}))
                    })
                    .collect();
                out["gemms"] = Value::Object(gemms);
            }
            Ok(out)
        })
        .collect::<Result<_, String>>()?;
    Ok(json!({ "decisions": decisions }))
}

fn arch_info(request: &str) -> Result<Value, String> {
    let req: Value = serde_json::from_str(request).map_err(|e| format!("request is not JSON: {e}"))?;
    let arch: Arch = parse(&text(&req, "arch")?, "arch")?;
    let (auto, why) = auto_recipe(arch);
    let native: Vec<String> = native_recipes(arch).iter().map(|r| r.to_string()).collect();
    Ok(
        json!({"arch": arch.to_string(), "family": arch.family().name(), "native": native, "auto": auto.to_string(), "auto_reason": why}),
    )
}

/// Describes a device's recipes (see the module docs).
///
/// # Safety
/// `request` must be NULL or a NUL-terminated UTF-8 string.
#[no_mangle]
pub unsafe extern "C" fn deepwell_arch_info(request: *const c_char) -> *const c_char {
    // SAFETY: forwarded from the caller.
    unsafe { answer(request, arch_info) }
}

/// A float field, also accepting the strings JSON cannot carry as numbers ("nan", "inf", "-inf").
fn float(v: &Value, key: &str) -> Result<f64, String> {
    match field(v, key)? {
        Value::String(s) => s.parse::<f64>().map_err(|_| format!("field '{key}' must be a number, got {s:?}")),
        n => n.as_f64().ok_or_else(|| format!("field '{key}' must be a number")),
    }
}

fn guardrail(request: &str) -> Result<Value, String> {
    let req: Value = serde_json::from_str(request).map_err(|e| format!("request is not JSON: {e}"))?;
    let s = field(&req, "stats")?;
    let stats = LayerStats {
        input_nonfinite: count(s, "input_nonfinite")? as u64,
        output_nonfinite: count(s, "output_nonfinite")? as u64,
        saturated: count(s, "saturated")? as u64,
        numel: count(s, "numel")? as u64,
        amax_input: float(s, "amax_input")? as f32,
        amax_output: float(s, "amax_output")? as f32,
    };
    let d = GuardrailConfig::default();
    let threshold = optional(&req, "saturation_threshold", Value::as_f64, "a number")?;
    if threshold.is_some_and(|t| !(0.0..=1.0).contains(&t)) {
        return Err(format!("field 'saturation_threshold' must be in [0, 1], got {}", req["saturation_threshold"]));
    }
    let cfg = GuardrailConfig { saturation_threshold: threshold.unwrap_or(d.saturation_threshold) };
    Ok(json!({ "fallback": check(&stats, &cfg).map(|f| f.reason) }))
}

thread_local! {
    static RESPONSE: RefCell<CString> = RefCell::new(CString::default());
}

/// Answers `handler(request)` as a JSON string owned by this thread (valid until its next call).
///
/// # Safety
/// `request` must be NULL or a NUL-terminated UTF-8 string.
unsafe fn answer(request: *const c_char, handler: fn(&str) -> Result<Value, String>) -> *const c_char {
    let answer = if request.is_null() {
        json!({"error": "request is NULL"})
    } else {
        // SAFETY: guaranteed by the caller.
        let text = unsafe { CStr::from_ptr(request) }.to_string_lossy().into_owned();
        match catch_unwind(|| handler(&text)) {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => json!({ "error": e }),
            Err(_) => json!({"error": "internal panic (a bug in deepwell)"}),
        }
    };
    let c = crate::stack::c_message(&answer.to_string());
    RESPONSE.with(|slot| {
        *slot.borrow_mut() = c;
        slot.borrow().as_ptr()
    })
}

/// Checks one layer's statistics against the guardrails (see the module docs).
///
/// # Safety
/// `request` must be NULL or a NUL-terminated UTF-8 string.
#[no_mangle]
pub unsafe extern "C" fn deepwell_guardrail_check(request: *const c_char) -> *const c_char {
    // SAFETY: forwarded from the caller.
    unsafe { answer(request, guardrail) }
}

/// Decides every layer of the request (see the module docs). Returns a JSON string owned by this
/// thread, valid until the thread's next call. Never unwinds: bad requests answer `{"error"}`.
///
/// # Safety
/// `request` must be NULL or a NUL-terminated UTF-8 string.
#[no_mangle]
pub unsafe extern "C" fn deepwell_policy_decide(request: *const c_char) -> *const c_char {
    // SAFETY: forwarded from the caller.
    unsafe { answer(request, respond) }
}
