//! deepwell's block-scaled FP8 GEMM on Hopper (cuda/fp8_gemm.cuh): the launch from torch tensors.
//! Operands arrive as the fp8_block quantizers make them for cuBLASLt (docs/BASELINES.md): codes
//! (rows, K) contiguous and 1x128 scales stored M-major, so the same operands feed either GEMM.
//!
//! | operand | codes | scales the kernel reads |
//! |---|---|---|
//! | A | (rows, K) E4M3 | (K/128, rows) fp32: sa[kb, r] |
//! | B, `Tile128` (a weight) | (groups * cols, K) E4M3 | (groups, cols/128, K/128) fp32 |
//! | B, `Tile128`, groups side by side (W^T of experts) | (cols, groups * K) E4M3 | (cols/128, groups * K/128) fp32 |
//! | B, `Row1x128` (wgrad's x) | (cols, K) E4M3 | (K/128, cols) fp32 |
//!
//! What it computes is the exact product of the dequantized operands up to fp32 accumulation
//! order; `reference.rs` in ops/fp8_gemm is that product, computed on dequantized copies.

use deepwell_gpu::kernels::fp8_gemm::{BScales, Fp8Gemm, GemmSizes, Grouping, TileShape};
use deepwell_gpu::tma::{Elem, Map2d};
use deepwell_gpu::Params;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::cuda::{self, float, ptr, Launch};
use crate::dtype::DType;
use crate::error::{Op, Result};
use crate::tensor::Tensor;

/// Where group g's B lies in the B tensor (`Grouping::Rows`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BGroups {
    /// (groups * cols, K): stacked weights, group g from row g * cols (the forward).
    Stacked,
    /// (cols, groups * K): group g from column g * K (the dgrad's W^T of every expert, one
    /// transposing quantization of the stacked (groups * N, K) weights).
    SideBySide,
}

/// One launch's operands, every tensor contiguous on one CUDA device (the callers check).
pub struct Gemm<'a> {
    pub a: &'a Tensor,
    /// A's scales, (K/128, rows) contiguous.
    pub sa: &'a Tensor,
    pub b: &'a Tensor,
    /// B's scales in `b_scales`' layout, contiguous.
    pub sb: &'a Tensor,
    pub b_scales: BScales,
    pub grouping: Grouping,
    pub b_groups: BGroups,
    /// (cols,) fp32, or None.
    pub bias: Option<&'a Tensor>,
    /// (groups + 1,) int32 for grouped launches.
    pub offsets: Option<&'a Tensor>,
    /// A's rows (all groups' for `Grouping::Rows`), each output's columns, the shared K (the
    /// whole length for `Grouping::K`), the number of groups (1 for a dense GEMM).
    pub rows: i64,
    pub cols: i64,
    pub k: i64,
    pub groups: i64,
    pub out: DType,
}

/// Whether the kernel takes this GEMM (else the caller runs the reference): K whole 128-blocks,
/// rows % 4 (A's M-major scale rows are 16-byte aligned for TMA), cols % 8 (paired stores and B's
/// scale rows), B's tile scales whole 128-column tiles.
pub fn fits(rows: i64, cols: i64, k: i64, b_scales: BScales) -> bool {
    let cols_ok = match b_scales {
        BScales::Tile128 => cols % 128 == 0,
        BScales::Row1x128 => cols % 8 == 0,
    };
    rows > 0 && cols > 0 && k > 0 && k % 128 == 0 && rows % 4 == 0 && cols_ok
}

/// The names of the tile shapes, as `DEEPWELL_FP8_GEMM_TILE` and the `fp8_gemm_tile` entry take them.
const SHAPES: [(&str, TileShape); 6] = [
    ("128", TileShape::Rows128),
    ("256", TileShape::Rows256),
    ("2x128", TileShape::Pair128),
    ("128x192", TileShape::Wide192),
    ("128x192h", TileShape::Wide192Halves),
    ("192", TileShape::Rows192),
];

/// The tile shape every launch is forced to, for testing and benchmarking the choice
/// `Fp8Gemm::shape_for` makes: index into `SHAPES` + 1, 0 for Rust's choice, u8::MAX before the
/// first read of `DEEPWELL_FP8_GEMM_TILE` (its first value). Process-wide.
static FORCED: AtomicU8 = AtomicU8::new(u8::MAX);

fn forced_shape() -> Option<TileShape> {
    let mut code = FORCED.load(Ordering::Relaxed);
    if code == u8::MAX {
        let env = std::env::var("DEEPWELL_FP8_GEMM_TILE").unwrap_or_default();
        code = SHAPES.iter().position(|(name, _)| *name == env).map_or(0, |i| i as u8 + 1);
        let _ = FORCED.compare_exchange(u8::MAX, code, Ordering::Relaxed, Ordering::Relaxed);
        code = FORCED.load(Ordering::Relaxed);
    }
    code.checked_sub(1).map(|i| SHAPES[i as usize].1)
}

/// The C API's `fp8_gemm_tile` entry: `{tile?}` -> the tile shape forced on every launch of
/// deepwell's FP8 GEMM ("128", "256", "2x128", "128x192", "128x192h", "192"; a launch the shape cannot
/// serve, the wide or 192-row tile on a grouped or wgrad GEMM, keeps Rust's choice), or null for Rust's choice; sets it when
/// `tile` is given (null clears it).
pub fn fp8_gemm_tile_entry(req: &serde_json::Value) -> crate::entry::Answer {
    if let Some(given) = req.get("tile") {
        let code = match given.as_str() {
            None if given.is_null() => 0,
            name => SHAPES.iter().position(|(n, _)| Some(*n) == name).map(|i| i as u8 + 1).ok_or_else(|| {
                format!(
                    "fp8_gemm_tile: 'tile' must be one of \"128\", \"256\", \"2x128\", \"128x192\", \"128x192h\", \"192\" or null, got {given}"
                )
            })?,
        };
        FORCED.store(code, Ordering::Relaxed);
    }
    let name = forced_shape().and_then(|s| SHAPES.iter().find(|(_, t)| *t == s)).map(|(n, _)| *n);
    Ok(serde_json::json!(name))
}

/// The C API's `fp8_gemm_config` entry: `{rows, cols, k, sms}` -> the tile shape Rust's heuristic
/// (`Fp8Gemm::shape_for`) gives a dense GEMM against a weight's 128x128 tile scales (fprop, dgrad)
/// on `sms` multiprocessors, and the one a launch takes now (the forced shape, if any): what the
/// benchmarks print per shape.
pub fn fp8_gemm_config_entry(req: &serde_json::Value) -> crate::entry::Answer {
    let get = |name: &str| {
        req.get(name)
            .and_then(serde_json::Value::as_u64)
            .filter(|v| *v > 0)
            .ok_or_else(|| format!("fp8_gemm_config: '{name}' must be a positive integer, got {:?}", req.get(name)))
    };
    let sizes = GemmSizes { rows: get("rows")?, cols: get("cols")?, k: get("k")?, groups: 1 };
    let sms = u32::try_from(get("sms")?).map_err(|_| "fp8_gemm_config: 'sms' is too large".to_string())?;
    let name = |t: TileShape| SHAPES.iter().find(|(_, s)| *s == t).map_or("?", |(n, _)| *n);
    let chosen = Fp8Gemm::shape_for(Grouping::Dense, BScales::Tile128, sizes, sms);
    let runs = forced_shape().filter(|s| s.serves(Grouping::Dense, BScales::Tile128)).unwrap_or(chosen);
    Ok(serde_json::json!({"heuristic": name(chosen), "runs": name(runs)}))
}

/// The output tensor: (rows, cols), or (groups, rows, cols) for a K-grouped launch.
pub fn run(op: Op, launch: &Launch, g: &Gemm) -> Result<Tensor> {
    let device = g.a.device();
    let shape: Vec<i64> = match g.grouping {
        Grouping::K => vec![g.groups, g.rows, g.cols],
        _ => vec![g.rows, g.cols],
    };
    let out = Tensor::empty(op, &shape, g.out, device)?;
    let (rows, cols, k) = (g.rows as u64, g.cols as u64, g.k as u64);
    let sizes = GemmSizes { rows, cols, k, groups: g.groups as u64 };
    let sms = launch.dev.persistent_sms();
    let shape = forced_shape()
        .filter(|s| s.serves(g.grouping, g.b_scales))
        .unwrap_or_else(|| Fp8Gemm::shape_for(g.grouping, g.b_scales, sizes, sms));
    let kernel = shape.kernel(float(g.out), g.b_scales, g.grouping);
    let block_m = kernel.block_m() as u32;
    let codes = |t: &Tensor, n: u64, box_rows: u32| Map2d {
        ptr: ptr(t),
        elem: Elem::U8,
        rows: n,
        cols: k,
        row_stride: k,
        box_rows,
        box_cols: 128,
        swizzle_128b: true,
    };
    let scales = |t: &Tensor, n: u64, box_cols: u32| Map2d {
        ptr: ptr(t),
        elem: Elem::F32,
        rows: k / 128,
        cols: n,
        row_stride: n,
        box_rows: 1,
        box_cols,
        swizzle_128b: false,
    };
    // B's whole extent, and where group g starts in it (rows, K elements; the tile scales' strides).
    let (b_rows, b_k) = match g.b_groups {
        BGroups::Stacked => (g.b.numel() as u64 / k, k),
        BGroups::SideBySide => (cols, g.b.numel() as u64 / cols),
    };
    let kb = g.k / 128;
    let (group_rows, group_k, sb_tile_row, sb_group) = match (g.grouping, g.b_groups) {
        (Grouping::Rows, BGroups::Stacked) => (g.cols, 0, kb, g.cols / 128 * kb),
        (Grouping::Rows, BGroups::SideBySide) => (0, g.k, g.groups * kb, kb),
        _ => (0, 0, kb, 0),
    };
    let map_err = cuda::gpu_err(op);
    let tma_a = codes(g.a, rows, block_m).encode().map_err(&map_err)?;
    let b_box = kernel.b_box_rows() as u32;
    let tma_b =
        Map2d { rows: b_rows, cols: b_k, row_stride: b_k, ..codes(g.b, b_rows, b_box) }.encode().map_err(&map_err)?;
    let tma_sa = scales(g.sa, rows, kernel.sa_box() as u32).encode().map_err(&map_err)?;
    // Tile scales are read by the math threads; a map is still passed (the kernel ignores it).
    let tma_sb = match g.b_scales {
        BScales::Row1x128 => scales(g.sb, cols, 128).encode().map_err(&map_err)?,
        BScales::Tile128 => tma_sa,
    };
    let null = std::ptr::null();
    let p = Params::new()
        .tensor_map(&tma_a)
        .tensor_map(&tma_b)
        .tensor_map(&tma_sa)
        .tensor_map(&tma_sb)
        .ptr(if g.b_scales == BScales::Tile128 { ptr(g.sb) } else { null })
        .ptr(g.bias.map_or(null, ptr))
        .ptr(g.offsets.map_or(null, ptr))
        .ptr(ptr(&out))
        .i64(g.rows)
        .i64(g.cols)
        .i64(g.k)
        .i32(g.groups as i32)
        .i64(group_rows)
        .i64(group_k)
        .i64(sb_tile_row)
        .i64(sb_group);
    // SAFETY: every tensor is contiguous on the launch's device with the shapes cuda/fp8_gemm.cuh
    // documents for these sizes (the callers validated them), the maps describe exactly those
    // tensors, and `out` has the output's shape.
    unsafe { launch.run_persistent(op, kernel, sizes, p)? };
    Ok(out)
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: crate::entry::Entries = &[
    ("fp8_gemm_tile", fp8_gemm_tile_entry, "{tile?} -> tile (\"128\", \"256\", \"2x128\", \"128x192\", \"128x192h\", \"192\" or null: the tile shape forced on deepwell's FP8 GEMM; sets it when given)"),
    ("fp8_gemm_config", fp8_gemm_config_entry, "{rows, cols, k, sms} -> {heuristic, runs} (the tile shape of deepwell's FP8 GEMM for a dense fprop / dgrad of that size)"),
];
