//! What an entry of the C API is (`capi.rs` dispatches to them): a `fn(&Value) -> Answer` in the
//! module that owns its concern, listed in that module's `ENTRIES` table with its request and answer.
//! Modules depend on this file, never on `capi.rs`, which depends on them.

use serde_json::Value;

use crate::error::Error;

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

/// One entry: its handler.
pub type Entry = fn(&Value) -> Answer;

/// A module's entries: name, handler, "request -> answer".
pub type Entries = &'static [(&'static str, Entry, &'static str)];

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
