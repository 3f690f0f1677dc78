//! The weights' GEMM operands, reused only where the weight provably did not change.
//!
//! **Default: no reuse.** Every forward quantizes W along K for fprop and every backward quantizes
//! the weight autograd saved along N for dgrad. Nothing outlives the call, so nothing can be stale,
//! however the weight was written (optimizers fused or not, `p.data`, DLPack, FSDP2 re-sharding).
//!
//! **Inside a reuse scope** (`deepwell.microbatches()`: gradient accumulation, where the user
//! promises the weights stay fixed), the first pass that needs a weight makes both of its operands
//! and later passes reuse them. A cached pair is reused only while all of these hold, each a signal
//! on its own:
//! - the scope that made it is still open (closing it drops every entry);
//! - no optimizer step happened since (torch's global optimizer step hooks call
//!   the `weight_cache_new_epoch` entry, which drops every entry; torch_ops/deepwell/nn/weight_cache.py);
//! - the same storage: the key holds the data pointer, sizes, strides, dtype and device, and the
//!   entry holds an *alias* of the weight (its own TensorImpl on the same storage), so dropping the
//!   weight cannot free the storage and hand its address to another tensor while the entry lives;
//!   `w.data = t` swaps the parameter's storage and so changes the key. A storage can still give
//!   its memory up in place: FSDP2 frees a block's gathered weights with `storage.resize_(0)` after
//!   the forward, and the allocator may place the next block's weights at that address, with a
//!   version counter of the same value. So a hit also needs the alias to still point at the key's
//!   address: two live storages never share an address, so then the weight is on the entry's
//!   storage (tests/nn/test_weight_cache.py and tests/distributed/test_parallel.py reproduce both). An entry
//!   whose alias no longer points at its key's address can never hit again: such entries are
//!   dropped as entries accumulate (`dead`), so a scope does not hold freed passes' operands
//!   until it closes;
//! - the same version counter (in-place writes through the parameter: `copy_`, `load_state_dict`,
//!   `torch.no_grad()` updates, foreach/single-tensor optimizers);
//! - no CUDA graph is being captured on the current stream (a replay runs only what was captured:
//!   a hit at capture time would skip the quantization in every replay);
//! - reuse is not switched off for the process (`weight_cache_reuse`): the deepwell backend does
//!   so when it compiles CUDA graphs, whose warm-up runs allocate from the graphs' private pool,
//!   where an entry would be a live tensor the graphs do not track.
//!
//! What a scope cannot see: writes that bypass the version counter inside it (`w.data.add_()`,
//! writes through DLPack). They break the scope's promise; outside a scope they are harmless.
//!
//! tests/nn/test_weight_cache.py proves each rule against the uncached path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};

use deepwell_core::policy::Recipe;
use serde_json::{json, Value};

use crate::aten;
use crate::dtype::{DType, Device};
use crate::entry::{fields, Answer, Entries};
use crate::error::{Op, Result};
use crate::gemm::{Form, Operand};
use crate::tensor::Tensor;

/// Entries kept before the least recently used is evicted (a 70B dense model has ~560 linears).
const CAPACITY: usize = 1024;

/// The fewest entries at which a miss looks for dead ones (`dead`).
const SWEEP_AT_LEAST: usize = 32;

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
    /// An alias of the weight: keeps its storage alive, and tells whether that storage still holds
    /// the key's address (see the module docs).
    alias: Tensor,
    operands: WeightOperands,
    last_used: u64,
}

/// Everything behind the lock. `generation` changes whenever entries become invalid (a scope opens
/// or closes, an optimizer steps, the cache is cleared): an entry made while it changed is dropped.
#[derive(Default)]
struct State {
    /// Open reuse scopes (nested scopes count as one).
    depth: u32,
    /// Reuse switched off for the process (`weight_cache_reuse`): scopes then cache nothing.
    off: bool,
    generation: u64,
    entries: HashMap<Key, Entry>,
    clock: u64,
    /// The entry count at which the next miss sweeps out dead entries (`dead`).
    sweep_at: usize,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| Mutex::new(State::default()));
static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);

fn lock() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

impl State {
    /// Starts a new generation; returns the dropped entries (release them after the lock).
    fn invalidate(&mut self) -> HashMap<Key, Entry> {
        self.generation += 1;
        self.sweep_at = 0;
        std::mem::take(&mut self.entries)
    }
}

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

/// True while torch's current stream of the weight's device captures a CUDA graph.
fn capturing(op: Op, weight: &Tensor) -> Result<bool> {
    match weight.device() {
        Device::Cuda(i) => {
            let stream = crate::cuda::current_stream(op, i)?;
            crate::cuda::device(op, i)?.is_capturing(stream).map_err(crate::cuda::gpu_err(op))
        }
        _ => Ok(false),
    }
}

/// The weight's operand `want`: made by `make_one` outside a reuse scope; inside one, from the
/// cache or made with its sibling by `make_pair` (and cached) under the rules of the module doc.
pub fn operand(
    op: Op,
    weight: &Tensor,
    recipe: Recipe,
    forms: (Form, Form),
    want: Want,
    make_one: impl FnOnce() -> Result<Operand>,
    make_pair: impl FnOnce() -> Result<WeightOperands>,
) -> Result<Operand> {
    let _time = crate::host_time::span("weight operand (cache + quantize)");
    let generation = {
        let s = lock();
        (s.depth > 0 && !s.off).then_some(s.generation)
    };
    let version = match generation {
        Some(_) if !capturing(op, weight)? => aten::version(op, weight),
        _ => None, // no scope, a graph capture, or an inference tensor (no version counter)
    };
    let (Some(generation), Some(version)) = (generation, version) else {
        MISSES.fetch_add(1, Ordering::Relaxed);
        return make_one();
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
        let mut s = lock();
        s.clock += 1;
        let clock = s.clock;
        if let Some(e) = s.entries.get_mut(&key) {
            if e.version == version && e.alias.data_ptr() as usize == key.ptr {
                e.last_used = clock;
                HITS.fetch_add(1, Ordering::Relaxed);
                return pick(op, &e.operands, want);
            }
        }
    }
    // Made outside the lock (kernels launch here); a racing thread may make the same entry twice.
    MISSES.fetch_add(1, Ordering::Relaxed);
    let operands = make_pair()?;
    let result = pick(op, &operands, want)?;
    let alias = aten::alias(op, weight)?;
    let dropped = {
        let mut s = lock();
        if s.generation != generation {
            // The scope closed or an optimizer stepped while we quantized: keep nothing.
            vec![Entry { version, alias, operands, last_used: 0 }]
        } else {
            s.clock += 1;
            let entry = Entry { version, alias, operands, last_used: s.clock };
            let mut dropped = dead(&mut s);
            dropped.extend(s.entries.insert(key, entry));
            if s.entries.len() > CAPACITY {
                let oldest = s.entries.iter().min_by_key(|(_, e)| e.last_used).map(|(k, _)| k.clone());
                dropped.extend(oldest.and_then(|k| s.entries.remove(&k)));
            }
            dropped
        }
    };
    // Tensors are released after the lock is dropped (freeing may enter torch's allocator).
    drop(dropped);
    Ok(result)
}

/// Takes out the entries that can never hit again (their weight's storage no longer holds the
/// key's address) once the entries have doubled since the last sweep (and number at least
/// `SWEEP_AT_LEAST`): a sweep reads every entry's pointer, so sweeping at every miss would cost a
/// model of N linears N^2 / 2 reads a step, and doubling keeps it to a few per miss while at most
/// half of the entries are dead. FSDP2 frees a block's gathered weights after its forward (or
/// backward) and gathers them into new memory for the next pass, so without this a scope around
/// a sharded model would keep every pass's operands, dead, until it closed (with 2 gloo processes
/// and 2 micro-batches, 56 misses, 0-3 hits and ~50 entries per step before this). Under the lock.
fn dead(s: &mut State) -> Vec<Entry> {
    if s.entries.len() < s.sweep_at.max(SWEEP_AT_LEAST) {
        return Vec::new();
    }
    let gone: Vec<Entry> = s.entries.extract_if(|k, e| e.alias.data_ptr() as usize != k.ptr).map(|(_, e)| e).collect();
    s.sweep_at = 2 * s.entries.len();
    gone
}

/// Drops every entry (and the weight aliases they hold).
pub fn clear() {
    let dropped = lock().invalidate();
    drop(dropped);
}

/// (entries, hits, misses) since the process started; a miss is a quantization of a weight.
pub fn stats() -> (u64, u64, u64) {
    let n = lock().entries.len();
    (n as u64, HITS.load(Ordering::Relaxed), MISSES.load(Ordering::Relaxed))
}

/// `weight_cache_stats`: `{"entries", "hits", "misses"}`.
pub fn stats_entry(_: &Value) -> Answer {
    let (entries, hits, misses) = stats();
    Ok(json!({ "entries": entries, "hits": hits, "misses": misses }))
}

/// `weight_cache_clear` and `weight_cache_new_epoch` (an optimizer is about to step or has
/// stepped: every cached operand may be stale): drop every entry.
pub fn clear_entry(_: &Value) -> Answer {
    clear();
    Ok(Value::Null)
}

/// `weight_cache_reuse`: `{"allowed": false}` switches reuse off for the process (every entry is
/// dropped, scopes cache nothing), `{"allowed": true}` back on.
pub fn reuse_entry(req: &Value) -> Answer {
    let allowed = fields::flag(req, "allowed")?;
    let dropped = {
        let mut s = lock();
        s.off = !allowed;
        s.invalidate()
    };
    drop(dropped); // after the lock
    Ok(Value::Null)
}

/// `weight_cache_scope`: `{"enter": true}` opens a reuse scope, `{"enter": false}` closes one.
/// Closing the outermost drops every entry; closing with none open is refused.
pub fn scope_entry(req: &Value) -> Answer {
    let dropped = {
        let mut s = lock();
        if fields::flag(req, "enter")? {
            s.depth += 1;
            HashMap::new()
        } else {
            match s.depth {
                0 => return Err("no reuse scope is open".into()),
                1 => {
                    s.depth = 0;
                    s.invalidate()
                }
                _ => {
                    s.depth -= 1;
                    HashMap::new()
                }
            }
        }
    };
    drop(dropped); // after the lock
    Ok(Value::Null)
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: Entries = &[
    ("weight_cache_stats", stats_entry, "{} -> {entries, hits, misses}"),
    ("weight_cache_clear", clear_entry, "{} -> null"),
    ("weight_cache_new_epoch", clear_entry, "{} -> null (an optimizer stepped)"),
    ("weight_cache_scope", scope_entry, "{enter: bool} -> null"),
    ("weight_cache_reuse", reuse_entry, "{allowed: bool} -> null"),
];
