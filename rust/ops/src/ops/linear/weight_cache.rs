//! The weights' GEMM operands, cached until the weight changes.
//!
//! A linear layer quantizes its weight twice per update (along K for fprop, along N for dgrad), not
//! once per call: micro-batches and gradient accumulation reuse the cached operands. An entry is
//! keyed by the weight's identity (device, data pointer, sizes, strides, dtype) and the operand
//! forms, and is valid while the weight's version counter (bumped by every in-place write:
//! optimizer steps, `copy_`, `load_state_dict`) is unchanged.
//!
//! Each entry holds a reference to the weight, so its memory cannot be freed and reused by another
//! tensor while the entry lives: a matching address always means the same storage. The cost is that
//! a dropped model's weights stay alive until evicted (least recently used beyond `CAPACITY`
//! entries) or `deepwell.clear_weight_cache()`.
//!
//! Limits (documented in the README): writes that bypass the version counter (`weight.data.add_`,
//! writes through `.numpy()` or DLPack) are not seen; call `deepwell.clear_weight_cache()` after
//! them. Inference tensors have no version counter and are never cached.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use deepwell_core::policy::Recipe;

use super::operand::{Form, Operand};
use crate::aten;
use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::tensor::Tensor;

/// Entries kept before the least recently used is evicted (a 70B dense model has ~560 linears).
const CAPACITY: usize = 1024;

#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    device: Device,
    ptr: usize,
    sizes: Vec<i64>,
    strides: Vec<i64>,
    dtype: DType,
    recipe: Recipe,
    forms: (Form, Form),
}

/// A weight's fprop operand (W along K) and dgrad operand (W^T along N).
pub struct WeightOperands {
    pub fprop: Operand,
    pub dgrad: Operand,
}

struct Entry {
    version: i64,
    _weight: Tensor,
    operands: WeightOperands,
    last_used: u64,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<Key, Entry>,
    clock: u64,
}

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);
static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);

/// Which of the two operands a caller wants.
#[derive(Clone, Copy)]
pub enum Want {
    Fprop,
    Dgrad,
}

fn pick(op: Op, w: &WeightOperands, want: Want) -> Result<Operand> {
    match want {
        Want::Fprop => w.fprop.share(op),
        Want::Dgrad => w.dgrad.share(op),
    }
}

/// The weight's operand `want` for these forms, from the cache or made by `make` (and cached).
pub fn operand(
    op: Op,
    weight: &Tensor,
    recipe: Recipe,
    forms: (Form, Form),
    want: Want,
    make: impl FnOnce() -> Result<WeightOperands>,
) -> Result<Operand> {
    let Some(version) = aten::version(op, weight) else {
        MISSES.fetch_add(1, Ordering::Relaxed);
        return pick(op, &make()?, want);
    };
    let key = Key {
        device: weight.device(),
        ptr: weight.data_ptr() as usize,
        sizes: weight.sizes().to_vec(),
        strides: weight.strides().to_vec(),
        dtype: weight.dtype(),
        recipe,
        forms,
    };
    {
        let mut guard = CACHE.lock().unwrap_or_else(|p| p.into_inner());
        let cache = guard.get_or_insert_with(Cache::default);
        cache.clock += 1;
        let clock = cache.clock;
        if let Some(e) = cache.entries.get_mut(&key) {
            if e.version == version {
                e.last_used = clock;
                HITS.fetch_add(1, Ordering::Relaxed);
                return pick(op, &e.operands, want);
            }
        }
    }
    // Made outside the lock (kernels launch here); a racing thread may make the same entry twice.
    MISSES.fetch_add(1, Ordering::Relaxed);
    let operands = make()?;
    let result = pick(op, &operands, want)?;
    let weight = weight.share(op)?;
    let evicted = {
        let mut guard = CACHE.lock().unwrap_or_else(|p| p.into_inner());
        let cache = guard.get_or_insert_with(Cache::default);
        cache.clock += 1;
        let entry = Entry { version, _weight: weight, operands, last_used: cache.clock };
        let replaced = cache.entries.insert(key, entry);
        let lru = if cache.entries.len() > CAPACITY {
            let oldest = cache.entries.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| k.clone());
            oldest.and_then(|k| cache.entries.remove(&k))
        } else {
            None
        };
        (replaced, lru)
    };
    // Tensors are released after the lock is dropped (freeing may enter torch's allocator).
    drop(evicted);
    Ok(result)
}

/// Drops every entry (and the weight references they hold).
pub fn clear() {
    let old = CACHE.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(old);
}

/// (entries, hits, misses) since the process started.
pub fn stats() -> (u64, u64, u64) {
    let n = CACHE.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, |c| c.entries.len());
    (n as u64, HITS.load(Ordering::Relaxed), MISSES.load(Ordering::Relaxed))
}

/// C entry point: writes (entries, hits, misses) to `out[0..3]`.
///
/// # Safety
/// `out` must point to three writable u64.
#[no_mangle]
pub unsafe extern "C" fn deepwell_weight_cache_stats(out: *mut u64) -> i32 {
    let Ok((n, h, m)) = std::panic::catch_unwind(stats) else { return 1 };
    if out.is_null() {
        return 1;
    }
    // SAFETY: guaranteed by the caller.
    unsafe {
        *out = n;
        *out.add(1) = h;
        *out.add(2) = m;
    }
    0
}

/// C entry point: drops every cached weight operand.
#[no_mangle]
pub extern "C" fn deepwell_weight_cache_clear() -> i32 {
    std::panic::catch_unwind(clear).map_or(1, |_| 0)
}
