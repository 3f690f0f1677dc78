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
//! Every entry is a `fn(&Value) -> Answer` (`entry.rs`) in the module that owns its concern, which
//! lists it in its own `ENTRIES` table with its request and answer; `TABLES` gathers the tables.
//! The modules never import this file.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::catch_unwind;

use serde_json::{json, Value};

use crate::entry::{Answer, Entries, Entry, Failure};
use crate::ops::linear::{self, weight_cache};
use crate::{policy, register};

/// Every module's entries (each module lists its own in `ENTRIES`), then `entries` itself.
const TABLES: &[Entries] = &[
    register::ENTRIES,
    policy::ENTRIES,
    crate::gemm::cublaslt::ENTRIES,
    crate::cuda::ENTRIES,
    crate::gemm::fp8_gemm::ENTRIES,
    weight_cache::ENTRIES,
    linear::ENTRIES,
    crate::host_time::ENTRIES,
    &[("entries", entries_entry, "{} -> [[name, request -> answer], ...]")],
];

fn all_entries() -> impl Iterator<Item = &'static (&'static str, Entry, &'static str)> {
    TABLES.iter().flat_map(|t| t.iter())
}

fn entries_entry(_: &Value) -> Answer {
    Ok(json!(all_entries().map(|(name, _, doc)| json!([name, doc])).collect::<Vec<_>>()))
}

thread_local! {
    static RESPONSE: RefCell<CString> = RefCell::new(CString::default());
}

/// The answer to `name` with `request`, as the convention's JSON value.
pub fn call(name: &str, request: &str) -> Value {
    let answer = match all_entries().find(|(n, ..)| *n == name) {
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
        let mut names: Vec<_> = all_entries().map(|(n, ..)| *n).collect();
        let count = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), count);
    }
}
