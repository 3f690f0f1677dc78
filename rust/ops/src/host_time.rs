//! Where a deepwell op spends its host (CPU) time: named spans, off by default.
//!
//! A GPU training step is host-bound when launching its work takes as long as running it, and a
//! deepwell op's host time is spent between the dispatcher's boxed call and its launches: decoding,
//! validation, the policy's GEMM choice, allocations and aten calls through the stable ABI, kernel
//! launches. torch.profiler sees only what goes through the dispatcher or CUDA's APIs, so the rest
//! is timed here: `span("name")` returns a guard that adds its lifetime to `name`'s total when it
//! drops, while timing is switched on (`host_time` entry, `{"enable": true}`); switched off, a span
//! costs one relaxed atomic load. Spans nest: every total is inclusive (an op's total holds the
//! aten calls it makes). `benchmarks/bench_overhead.py --spans` prints the table.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde_json::{json, Value};

use crate::entry::{fields, Answer, Entries};

static ON: AtomicBool = AtomicBool::new(false);
/// One name's spans so far.
#[derive(Clone, Copy, Default)]
struct Total {
    ns: u64,
    count: u64,
    /// The longest single span.
    longest_ns: u64,
}

static TOTALS: Mutex<Option<HashMap<&'static str, Total>>> = Mutex::new(None);

/// A running span; records on drop.
pub struct Span {
    name: &'static str,
    start: Option<Instant>,
}

/// Times the guard's lifetime under `name` (nothing while timing is off).
#[inline]
pub fn span(name: &'static str) -> Span {
    let start = ON.load(Ordering::Relaxed).then(Instant::now);
    Span { name, start }
}

/// `span` for an aten op's C name (read as text only while timing is on).
#[inline]
pub fn span_c(name: &'static std::ffi::CStr) -> Span {
    let on = ON.load(Ordering::Relaxed);
    Span { name: if on { name.to_str().unwrap_or("aten") } else { "" }, start: on.then(Instant::now) }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            let ns = start.elapsed().as_nanos() as u64;
            let mut totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
            let e = totals.get_or_insert_with(HashMap::new).entry(self.name).or_default();
            e.ns += ns;
            e.count += 1;
            e.longest_ns = e.longest_ns.max(ns);
        }
    }
}

/// `host_time`: `{"enable": bool}` switches timing on (totals reset) or off; `{}` reads the totals
/// as `{name: [seconds, count, longest seconds]}` (the longest single span: where a rare pause of
/// the host goes).
pub fn entry(req: &Value) -> Answer {
    if req.get("enable").is_some() {
        let on = fields::flag(req, "enable")?;
        *TOTALS.lock().unwrap_or_else(|p| p.into_inner()) = None;
        ON.store(on, Ordering::Relaxed);
        return Ok(Value::Null);
    }
    let totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
    let map = totals
        .iter()
        .flatten()
        .map(|(name, t)| (name.to_string(), json!([t.ns as f64 * 1e-9, t.count, t.longest_ns as f64 * 1e-9])));
    Ok(Value::Object(map.collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_add_up_only_while_on() {
        drop(span("off"));
        entry(&json!({"enable": true})).unwrap();
        for _ in 0..3 {
            let _outer = span("outer");
            drop(span("inner"));
        }
        let t = entry(&json!({})).unwrap();
        entry(&json!({"enable": false})).unwrap();
        assert_eq!(t["outer"][1], 3);
        assert_eq!(t["inner"][1], 3);
        assert!(t["outer"][0].as_f64().unwrap() >= t["inner"][0].as_f64().unwrap());
        // The longest span lies between the mean and the total.
        let (total, longest) = (t["outer"][0].as_f64().unwrap(), t["outer"][2].as_f64().unwrap());
        assert!(longest <= total && longest * 3.0 >= total, "{t}");
        assert!(t.get("off").is_none());
    }
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: Entries = &[("host_time", entry, "{enable?: bool} -> null | {span: [seconds, count]}")];
