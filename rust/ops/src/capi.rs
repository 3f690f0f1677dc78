//! The C API that Python calls (torch_ops/deepwell/_native.py, through ctypes): one function,
//!
//! ```c
//! const char* deepwell_call(const char* name, const char* request);   // JSON in, JSON out
//! ```
//!
//! and one convention. The response is `{"ok": <value>}` or `{"error": "<message>", "kind":
//! "invalid" | "failed"}`: "invalid" for a request the caller got wrong (Python raises ValueError),
//! "failed" for an operation that could not be done (RuntimeError). The string belongs to the
//! calling thread and stays valid until that thread's next call. Nothing unwinds out: a panic is
//! answered as a "failed" internal error. Kernels do not come through here: the dispatcher calls
//! them (`kernel.rs`).
//!
//! Every entry is a `fn(&Value) -> Result<Value, Failure>` in the module that owns its concern;
//! `ENTRIES` lists them with their requests and answers.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::catch_unwind;

use serde_json::{json, Value};

use crate::error::Error;
use crate::ops::linear::{self, weight_cache};
use crate::{policy, register};

/// Why a call failed (the two kinds of the convention).
#[derive(Debug)]
pub enum Failure {
    /// The request is wrong: a missing field, a value out of range (Python: ValueError).
    Invalid(String),
    /// The request was fine but the operation failed: loading, compiling (Python: RuntimeError).
    Failed(String),
}

impl From<String> for Failure {
    fn from(msg: String) -> Failure {
        Failure::Invalid(msg)
    }
}

impl From<&str> for Failure {
    fn from(msg: &str) -> Failure {
        Failure::Invalid(msg.to_owned())
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Failed(e.to_string())
    }
}

pub type Answer = Result<Value, Failure>;

type Entry = fn(&Value) -> Answer;

/// name, handler, request -> answer.
const ENTRIES: &[(&str, Entry, &str)] = &[
    ("register", register::register_entry, "{libtorch_cpu, libtorch_cuda?, nvrtc?, cache_dir?, print_compile} -> null"),
    ("compile_all", register::compile_all_entry, "{nvrtc, archs: [\"sm_90a\", ...]} -> report text"),
    ("version", register::version_entry, "{} -> \"0.1.0\""),
    ("kernel_table", register::kernel_table_entry, "{} -> [{op, key, args, returns}]"),
    ("policy_decide", policy::decide_entry, "{policy, arch, layers} -> {decisions}"),
    ("arch_info", policy::arch_info_entry, "{arch} -> {arch, family, variant, native, auto, auto_reason}"),
    ("grouped_backend", policy::grouped_backend_entry, "{recipe, arch, aligned, tiled?, torch_mxfp8_grouped?} -> {backend, emulated, reason}"),
    ("recipes", policy::recipes_entry, "{} -> [{name, block_k, low_precision, elem_max, ...}]"),
    ("roles", policy::roles_entry, "{sites: [[name, module_type], ...]} -> [role]"),
    ("step_cost", policy::step_cost_entry, "{arch, sites: [{tokens, in_features, out_features, recipe}], other_bytes} -> {step_ms, bf16_step_ms, rates_from}"),
    ("parallel_plan", policy::parallel_plan_entry, "{cluster: {world_size, devices_per_node, memory_bytes, peer_access}, model: {weight_bytes, gradient_bytes, optimizer_bytes, activation_bytes, largest_unit_bytes, blocks?}, tensor?} -> {data, tensor, fsdp, reshard_after_forward, per_rank_bytes, sm_carveout, collectives, unit_blocks, ends_join_blocks, forward_prefetch, reason}"),
    ("direct_cublaslt", crate::gemm::cublaslt::direct_cublaslt_entry, "{enable?} -> {enabled, loaded, calls, declined: {why: count}} (FP8 GEMMs on cuBLASLt called directly; false: through aten::_scaled_mm_v2)"),
    ("sm_carveout", crate::cuda::sm_carveout_entry, "{sms?} -> sms (SMs deepwell's persistent GEMMs leave to collectives; sets them when given)"),
    ("fp8_gemm_tile", crate::gemm::fp8_gemm::fp8_gemm_tile_entry, "{tile?} -> tile (\"128\", \"256\", \"2x128\", \"128x192\", \"128x192h\", \"192\" or null: the tile shape forced on deepwell's FP8 GEMM; sets it when given)"),
    ("fp8_gemm_config", crate::gemm::fp8_gemm::fp8_gemm_config_entry, "{rows, cols, k, sms} -> {heuristic, runs} (the tile shape of deepwell's FP8 GEMM for a dense fprop / dgrad of that size)"),
    ("guardrail_check", policy::guardrail_entry, "{stats, saturation_threshold?} -> {fallback}"),
    ("weight_cache_stats", weight_cache::stats_entry, "{} -> {entries, hits, misses}"),
    ("weight_cache_clear", weight_cache::clear_entry, "{} -> null"),
    ("weight_cache_new_epoch", weight_cache::clear_entry, "{} -> null (an optimizer stepped)"),
    ("weight_cache_scope", weight_cache::scope_entry, "{enter: bool} -> null"),
    ("weight_cache_reuse", weight_cache::reuse_entry, "{allowed: bool} -> null"),
    ("manual_seed", linear::manual_seed_entry, "{seed: u64} -> null"),
    ("host_time", crate::host_time::entry, "{enable?: bool} -> null | {span: [seconds, count]}"),
    ("entries", entries_entry, "{} -> [[name, request -> answer], ...]"),
];

fn entries_entry(_: &Value) -> Answer {
    Ok(json!(ENTRIES.iter().map(|(name, _, doc)| json!([name, doc])).collect::<Vec<_>>()))
}

thread_local! {
    static RESPONSE: RefCell<CString> = RefCell::new(CString::default());
}

/// The answer to `name` with `request`, as the convention's JSON value.
pub fn call(name: &str, request: &str) -> Value {
    let answer = match ENTRIES.iter().find(|(n, ..)| *n == name) {
        None => Err(Failure::Invalid(format!("no entry named {name:?}"))),
        Some((_, entry, _)) => match serde_json::from_str::<Value>(if request.is_empty() { "{}" } else { request }) {
            Err(e) => Err(Failure::Invalid(format!("request is not JSON: {e}"))),
            Ok(req) => catch_unwind(|| entry(&req))
                .unwrap_or_else(|_| Err(Failure::Failed("internal panic (a bug in deepwell, please report)".into()))),
        },
    };
    match answer {
        Ok(v) => json!({ "ok": v }),
        Err(Failure::Invalid(msg)) => json!({ "error": msg, "kind": "invalid" }),
        Err(Failure::Failed(msg)) => json!({ "error": msg, "kind": "failed" }),
    }
}

/// The C entry point (see the module docs).
///
/// # Safety
/// `name` and `request` must be NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn deepwell_call(name: *const c_char, request: *const c_char) -> *const c_char {
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: guaranteed by the caller.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let answer = catch_unwind(|| call(&text(name), &text(request)))
        .unwrap_or_else(|_| json!({"error": "internal panic (a bug in deepwell, please report)", "kind": "failed"}));
    let c = crate::stack::c_message(&answer.to_string());
    RESPONSE.with(|slot| {
        *slot.borrow_mut() = c;
        slot.borrow().as_ptr()
    })
}

/// Field helpers for the entries' requests: a missing or mistyped field is an `Invalid` failure
/// naming it, never a default.
pub mod fields {
    use serde_json::Value;

    pub fn get<'a>(v: &'a Value, key: &str) -> Result<&'a Value, String> {
        v.get(key).ok_or_else(|| format!("missing field '{key}'"))
    }

    pub fn text(v: &Value, key: &str) -> Result<String, String> {
        get(v, key)?.as_str().map(str::to_owned).ok_or_else(|| format!("field '{key}' must be a string"))
    }

    pub fn count(v: &Value, key: &str) -> Result<usize, String> {
        get(v, key)?.as_u64().map(|n| n as usize).ok_or_else(|| format!("field '{key}' must be a non-negative integer"))
    }

    pub fn flag(v: &Value, key: &str) -> Result<bool, String> {
        get(v, key)?.as_bool().ok_or_else(|| format!("field '{key}' must be a bool"))
    }

    /// Absent (or null) gives None; present with the wrong type is an error, never the default
    /// (a policy with `min_features=-1` must not silently plan with 512).
    pub fn optional<T>(v: &Value, key: &str, get: fn(&Value) -> Option<T>, what: &str) -> Result<Option<T>, String> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => get(x).map(Some).ok_or_else(|| format!("field '{key}' must be {what}, got {x}")),
        }
    }

    pub fn opt_text(v: &Value, key: &str) -> Result<Option<String>, String> {
        optional(v, key, |x| x.as_str().map(str::to_owned), "a string")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_entries_and_bad_json_are_invalid() {
        assert_eq!(call("nope", "{}")["kind"], "invalid");
        assert_eq!(call("version", "{not json")["kind"], "invalid");
        assert_eq!(call("version", "")["ok"], env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn every_entry_is_listed_once() {
        let mut names: Vec<_> = ENTRIES.iter().map(|(n, ..)| *n).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ENTRIES.len());
    }
}
