//! cuBLASLt's FP8 GEMM (tensor-wise, 1x128 and 128x128 block scales) called directly, the way
//! `aten::_scaled_mm_v2` calls it, with each shape's descriptors and algorithm kept instead of
//! rebuilt on every call.
//!
//! Why: `_scaled_mm_v2` builds its matmul descriptor and layouts and asks cuBLASLt's heuristic for
//! an algorithm on every call. On the H100 a block-scaled GEMM cost 20-46 us of host time through
//! it (two leases) and 25 us or less called directly (benchmarks/bench_overhead.py --spans, the
//! `-cublaslt` results); a 0.95B training step makes 288 such GEMMs. Under FSDP2 on 2 GPUs the
//! fp8_block step's host time sits close to its GPU time (docs/DESIGN.md "Scale-out").
//!
//! What is the same as torch's call (aten/src/ATen/cuda/CUDABlas.cpp `scaled_gemm`, torch 2.11):
//! the same library (torch's own libcublasLt, found already loaded: abi/cublaslt.rs), the same
//! row-major-as-transposed mapping (cuBLAS's A is our B with TRANSA = T, cuBLAS's B is our A), the same scale
//! modes and pointers, compute type, bias epilogue, SM count target under a carveout, fast
//! accumulation off, and the same heuristic inputs: the descriptor with its scale pointers set (the
//! heuristic finds nothing for the block modes without them) and torch's workspace limit
//! (`CUBLASLT_WORKSPACE_SIZE` KiB, default 1024). So the same algorithm: tests/ops/test_cublaslt_direct.py
//! compares the bits.
//!
//! What differs: torch's shape and layout checks are replaced by `Shape::of`, which accepts only
//! the layouts deepwell's operands have (operand.rs); anything else is declined (counted in
//! `DECLINED`) and the caller goes through aten, which checks and raises its own errors. The
//! descriptors are cached per thread: their scale and bias pointers are set before each call, so
//! a descriptor is never shared between threads.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use deepwell_core::policy::ScalingType;

use crate::abi::cublaslt::{
    api, Api, Desc, Heuristic, Layout, Pref, COMPUTE_32F, DESC_A_SCALE_MODE, DESC_A_SCALE_POINTER, DESC_BIAS_DATA_TYPE,
    DESC_BIAS_POINTER, DESC_B_SCALE_MODE, DESC_B_SCALE_POINTER, DESC_EPILOGUE, DESC_FAST_ACCUM, DESC_SM_COUNT_TARGET,
    DESC_TRANSA, DESC_TRANSB, EPILOGUE_BIAS, OP_N, OP_T, PREF_MAX_WORKSPACE_BYTES, R_16BF, R_16F, R_32F, R_8F_E4M3,
    R_8F_E5M2, SCALE_BLK128X128_32F, SCALE_SCALAR_32F, SCALE_VEC128_32F,
};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

static ENABLED: AtomicBool = AtomicBool::new(true);
/// GEMMs run on this path so far: the tests' proof that it ran (no silent fallback to aten).
static CALLS: AtomicU64 = AtomicU64::new(0);
/// Why calls went to aten instead, with counts (the entry reports them).
static DECLINED: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

fn decline(why: impl Into<String>) -> Result<Option<Tensor>> {
    if let Ok(mut d) = DECLINED.lock() {
        *d.entry(why.into()).or_default() += 1;
    }
    Ok(None)
}

/// The C API's `direct_cublaslt` entry: `{enable?}` -> whether deepwell calls cuBLASLt itself
/// (true by default; false sends every FP8 GEMM through `aten::_scaled_mm_v2`, to compare), whether
/// torch's cuBLASLt was found, how many GEMMs this path has run, and why others went to aten.
pub fn direct_cublaslt_entry(req: &serde_json::Value) -> crate::entry::Answer {
    if let Some(given) = req.get("enable") {
        let on =
            given.as_bool().ok_or_else(|| format!("direct_cublaslt: 'enable' must be true or false, got {given}"))?;
        ENABLED.store(on, Ordering::Relaxed);
    }
    Ok(serde_json::json!({
        "enabled": ENABLED.load(Ordering::Relaxed),
        "loaded": api().is_some(),
        "calls": CALLS.load(Ordering::Relaxed),
        "declined": DECLINED.lock().map(|d| d.clone()).unwrap_or_default(),
    }))
}

/// cuBLASLt's scale mode for a torch `ScalingType`, where this path takes it.
fn scale_mode(s: ScalingType) -> Option<c_int> {
    match s {
        ScalingType::TensorWise => Some(SCALE_SCALAR_32F),
        ScalingType::BlockWise1x128 => Some(SCALE_VEC128_32F),
        ScalingType::BlockWise128x128 => Some(SCALE_BLK128X128_32F),
        ScalingType::BlockWise1x16 | ScalingType::BlockWise1x32 => None, // swizzled MX scales: aten's
    }
}

fn data_type(d: DType) -> Option<c_int> {
    match d {
        DType::E4M3 => Some(R_8F_E4M3),
        DType::E5M2 => Some(R_8F_E5M2),
        DType::BF16 => Some(R_16BF),
        DType::F16 => Some(R_16F),
        DType::F32 => Some(R_32F),
        _ => None,
    }
}

/// Whether `scale` (fp32) has the layout cuBLASLt reads for an operand of `rows` x `k` in mode `s`,
/// as deepwell's quantizers lay it out and `_scaled_mm_v2` takes it:
/// - tensor-wise: one value;
/// - 1x128: (rows, ceil(k/128)) M-major (strides (1, rows)), the leading dimension `rows` 16-byte
///   aligned (rows % 4);
/// - 128x128: (ceil(k/128), ceil(rows/128)) seen through a transpose (strides (1, ceil(k/128))),
///   the leading dimension 16-byte aligned.
pub fn scale_layout_ok(sizes: &[i64], strides: &[i64], s: ScalingType, rows: i64, k: i64) -> bool {
    let kb = (k + 127) / 128;
    let lead_ok = |lead: i64| lead % 4 == 0;
    let two_d = |want: [i64; 2], lead: i64| {
        sizes == want && strides[0] == 1 && (want[1] == 1 || strides[1] == lead) && lead_ok(lead)
    };
    match s {
        ScalingType::TensorWise => sizes.iter().product::<i64>() == 1,
        ScalingType::BlockWise1x128 => sizes.len() == 2 && two_d([rows, kb], rows),
        ScalingType::BlockWise128x128 => sizes.len() == 2 && two_d([kb, (rows + 127) / 128], kb),
        _ => false,
    }
}

/// One GEMM's identity for the cache: everything the descriptors and the heuristic see.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    /// The heuristic's answer depends on the device (its SMs, its arch).
    device: i32,
    m: i64,
    n: i64,
    k: i64,
    a_type: c_int,
    b_type: c_int,
    mode_a: c_int,
    mode_b: c_int,
    out: c_int,
    bias: bool,
    sm_target: u32,
}

/// A shape's descriptors and algorithm, built once per thread.
struct Plan {
    desc: Desc,
    la: Layout,
    lb: Layout,
    ld: Layout,
    algo: Heuristic,
}

thread_local! {
    /// Each shape's plan, or the heuristic's status when it found no algorithm.
    static PLANS: RefCell<HashMap<Key, std::result::Result<Plan, c_int>>> = RefCell::new(HashMap::new());
}

/// The per-call descriptor attributes, in cuBLAS's naming (its A is our B).
struct Pointers {
    scale_a: *mut c_void,
    scale_b: *mut c_void,
    bias: Option<*mut c_void>,
}

impl Pointers {
    /// Sets them on `desc` (before the heuristic too: torch's call has them set when it asks).
    ///
    /// # Safety
    /// `desc` is a live descriptor of this thread.
    unsafe fn set(&self, api: &Api, op: Op, desc: Desc) -> Result<()> {
        // SAFETY: pointer attributes take a `void*`.
        unsafe {
            set(api, op, desc, DESC_A_SCALE_POINTER, &self.scale_a)?;
            set(api, op, desc, DESC_B_SCALE_POINTER, &self.scale_b)?;
            if let Some(bias) = self.bias {
                set(api, op, desc, DESC_BIAS_POINTER, &bias)?;
            }
        }
        Ok(())
    }
}

fn status(op: Op, call: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Internal { op, msg: format!("{call} failed with cublasStatus_t {code}") })
    }
}

/// Sets one descriptor attribute from a value.
///
/// # Safety
/// `T` must be the attribute's documented type.
unsafe fn set<T>(api: &Api, op: Op, desc: Desc, attr: c_int, v: &T) -> Result<()> {
    // SAFETY: guaranteed by the caller; `v` lives across the call (cuBLASLt copies it).
    let code = unsafe { (api.cublasLtMatmulDescSetAttribute)(desc, attr, (v as *const T).cast(), size_of::<T>()) };
    status(op, "cublasLtMatmulDescSetAttribute", code)
}

/// Builds `key`'s descriptors and asks the heuristic once; Err(status) when it has no algorithm.
fn build(api: &Api, op: Op, key: Key, pointers: &Pointers) -> Result<std::result::Result<Plan, c_int>> {
    let mut desc: Desc = std::ptr::null_mut();
    // SAFETY: valid out pointers; every attribute gets its documented type (cublasLt.h).
    unsafe {
        status(op, "cublasLtMatmulDescCreate", (api.cublasLtMatmulDescCreate)(&mut desc, COMPUTE_32F, R_32F))?;
        // cuBLAS is column-major: the row-major (M, N) output is (N, M) = op(W) (N, K) x op(X) (K, M),
        // W's rows seen transposed (TRANSA = T), X as it is (TRANSB = N): torch's mapping.
        set(api, op, desc, DESC_TRANSA, &OP_T)?;
        set(api, op, desc, DESC_TRANSB, &OP_N)?;
        set(api, op, desc, DESC_A_SCALE_MODE, &key.mode_b)?;
        set(api, op, desc, DESC_B_SCALE_MODE, &key.mode_a)?;
        set(api, op, desc, DESC_FAST_ACCUM, &0i8)?;
        if key.sm_target > 0 {
            set(api, op, desc, DESC_SM_COUNT_TARGET, &(key.sm_target as i32))?;
        }
        if key.bias {
            set(api, op, desc, DESC_EPILOGUE, &EPILOGUE_BIAS)?;
            set(api, op, desc, DESC_BIAS_DATA_TYPE, &key.out)?;
        }
        pointers.set(api, op, desc)?;
    }
    let layout = |ty: c_int, rows: i64, cols: i64, ld: i64| -> Result<Layout> {
        let mut l: Layout = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        let code = unsafe { (api.cublasLtMatrixLayoutCreate)(&mut l, ty, rows as u64, cols as u64, ld) };
        status(op, "cublasLtMatrixLayoutCreate", code).map(|_| l)
    };
    let la = layout(key.b_type, key.k, key.n, key.k)?; // W: (N, K) row-major = (K, N) column-major
    let lb = layout(key.a_type, key.k, key.m, key.k)?; // X: (M, K) row-major = (K, M) column-major
    let ld = layout(key.out, key.n, key.m, key.n)?; // out: (M, N) row-major = (N, M) column-major
    let mut pref: Pref = std::ptr::null_mut();
    let mut found = 0;
    let mut algo = Heuristic { algo: [0; 8], workspace: 0, state: 0, waves: 0.0, reserved: [0; 4] };
    // SAFETY: valid handles and out pointers; the preference is destroyed after the query.
    unsafe {
        status(op, "cublasLtMatmulPreferenceCreate", (api.cublasLtMatmulPreferenceCreate)(&mut pref))?;
        let limit = api.workspace_limit as u64;
        let code = (api.cublasLtMatmulPreferenceSetAttribute)(
            pref,
            PREF_MAX_WORKSPACE_BYTES,
            (&limit as *const u64).cast(),
            size_of::<u64>(),
        );
        status(op, "cublasLtMatmulPreferenceSetAttribute", code)?;
        // C is D (beta = 0), as in torch's call.
        let code =
            (api.cublasLtMatmulAlgoGetHeuristic)(api.handle, desc, la, lb, ld, ld, pref, 1, &mut algo, &mut found);
        (api.cublasLtMatmulPreferenceDestroy)(pref);
        if code != 0 || found == 0 {
            return Ok(Err(if code != 0 { code } else { -1 })); // aten's path says why
        }
    }
    Ok(Ok(Plan { desc, la, lb, ld, algo }))
}

/// The GEMM's sizes and element types, when every operand has the layout this path takes.
pub struct Shape {
    pub m: i64,
    pub n: i64,
    pub k: i64,
}

impl Shape {
    /// `a` (M, K) and `b` (N, K) row-major FP8, fp32 scales as `scale_layout_ok` wants, bias a
    /// contiguous (N) vector of the output's dtype (bf16) or none; else why not. (Pointer
    /// alignment is `scaled_mm`'s rule.)
    pub fn of(
        a: &Tensor,
        b: &Tensor,
        sa: (&Tensor, ScalingType),
        sb: (&Tensor, ScalingType),
        bias: Option<&Tensor>,
        out: DType,
    ) -> std::result::Result<Shape, &'static str> {
        let (m, k) = match a.sizes() {
            [m, k] if *m > 0 && *k > 0 => (*m, *k),
            _ => return Err("a is not a non-empty matrix"),
        };
        let n = b.sizes().first().copied().unwrap_or(0);
        let row_major = |t: &Tensor, rows: i64| t.sizes() == [rows, k] && (t.strides() == [k, 1] || rows == 1);
        if !row_major(a, m) {
            return Err("a is not (M, K) row-major");
        }
        if n <= 0 || !row_major(b, n) {
            return Err("b is not (N, K) row-major");
        }
        if ![sa.0, sb.0].iter().all(|s| s.dtype() == DType::F32) {
            return Err("a scale is not fp32");
        }
        if !scale_layout_ok(sa.0.sizes(), sa.0.strides(), sa.1, m, k) {
            return Err("a's scales are not in cuBLASLt's layout");
        }
        if !scale_layout_ok(sb.0.sizes(), sb.0.strides(), sb.1, n, k) {
            return Err("b's scales are not in cuBLASLt's layout");
        }
        if !bias
            .map_or(true, |t| out == DType::BF16 && t.dtype() == DType::BF16 && t.sizes() == [n] && t.is_contiguous())
        {
            return Err("the bias is not a contiguous bf16 (N) vector into a bf16 output");
        }
        Ok(Shape { m, n, k })
    }
}

/// The alignment every pointer of a call shares, capped at 256 bytes (what cuBLASLt's heuristic
/// assumes unless told otherwise).
fn alignment(ptrs: &[*mut c_void]) -> u32 {
    ptrs.iter().map(|&p| (p as usize | 256).trailing_zeros()).min().map_or(256, |bits| 1 << bits)
}

/// `a @ b^T (+ bias)` in `out` on cuBLASLt, or None when this path does not take the call (switched
/// off, cuBLASLt not loaded, a layout it does not know, data less than 256-byte aligned, no
/// algorithm; `DECLINED` counts why): the caller then goes through `aten::_scaled_mm_v2`, which
/// takes every case torch supports.
pub fn scaled_mm(
    op: Op,
    a: &Tensor,
    b: &Tensor,
    sa: (&Tensor, ScalingType),
    sb: (&Tensor, ScalingType),
    bias: Option<&Tensor>,
    out: DType,
) -> Result<Option<Tensor>> {
    let _time = crate::host_time::span("cublasLt (direct)");
    if !ENABLED.load(Ordering::Relaxed) {
        return decline("switched off");
    }
    let Some(api) = api() else { return decline("torch's libcublasLt is not loaded") };
    let Device::Cuda(index) = a.device() else { return decline("not a CUDA tensor") };
    let shape = match Shape::of(a, b, sa, sb, bias, out) {
        Ok(shape) => shape,
        Err(why) => return decline(why),
    };
    let (Some(mode_a), Some(mode_b)) = (scale_mode(sa.1), scale_mode(sb.1)) else {
        return decline("MX scales (swizzled)");
    };
    let (Some(a_type), Some(b_type), Some(out_type)) = (data_type(a.dtype()), data_type(b.dtype()), data_type(out))
    else {
        return decline("an element type cuBLASLt's FP8 GEMM does not take");
    };
    // cuBLASLt's heuristic assumes 256-byte aligned matrices unless told otherwise; so does torch's
    // call, which sets no alignment preference. Less aligned data goes to aten. The scales too:
    // their pointers are in the descriptor the heuristic sees, and a cached plan must only serve
    // calls the query it came from stood for.
    let mut ptrs = vec![a.data_ptr(), b.data_ptr(), sa.0.data_ptr(), sb.0.data_ptr()];
    ptrs.extend(bias.map(|t| t.data_ptr()));
    if alignment(&ptrs) < 256 {
        return decline("data less than 256-byte aligned");
    }
    let launch = crate::cuda::launch_context(op, a.device())?;
    // torch's carveout reaches cuBLASLt as an SM count target; deepwell's (set with torch's by the
    // plan, crate::cuda::sm_carveout_entry) does the same here.
    let left = deepwell_gpu::sms_left_to_collectives();
    let sm_target = if left > 0 { launch.dev.persistent_sms() } else { 0 };
    let key = Key {
        device: index,
        m: shape.m,
        n: shape.n,
        k: shape.k,
        a_type,
        b_type,
        mode_a,
        mode_b,
        out: out_type,
        bias: bias.is_some(),
        sm_target,
    };
    // cuBLAS's A is W (our b), its B is X (our a): their scales swap with them.
    let pointers = Pointers { scale_a: sb.0.data_ptr(), scale_b: sa.0.data_ptr(), bias: bias.map(|t| t.data_ptr()) };
    PLANS.with(|plans| -> Result<Option<Tensor>> {
        let mut plans = plans.borrow_mut();
        let plan = match plans.get(&key) {
            Some(p) => p,
            None => {
                let p = build(api, op, key, &pointers)?;
                plans.entry(key).or_insert(p)
            }
        };
        let plan = match plan {
            Ok(plan) => plan,
            Err(code) => return decline(format!("no algorithm (heuristic status {code})")),
        };
        let y = Tensor::empty(op, &[shape.m, shape.n], out, Device::Cuda(index))?;
        let workspace = if plan.algo.workspace > 0 {
            Some(Tensor::empty(op, &[plan.algo.workspace as i64], DType::U8, Device::Cuda(index))?)
        } else {
            None
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the descriptor belongs to this thread; pointers are device memory of the sizes
        // the layouts describe (Shape::of checked them), alive until the call is enqueued, and
        // torch's allocator keeps them for the stream's later work (stream-ordered frees).
        unsafe {
            // cuBLASLt launches through the runtime API, on the current device: this one's context.
            launch.dev.make_current().map_err(crate::cuda::gpu_err(op))?;
            pointers.set(api, op, plan.desc)?;
            let (ws, ws_bytes) =
                workspace.as_ref().map_or((std::ptr::null_mut(), 0), |w| (w.data_ptr(), plan.algo.workspace));
            let code = (api.cublasLtMatmul)(
                api.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                b.data_ptr(),
                plan.la,
                a.data_ptr(),
                plan.lb,
                (&beta as *const f32).cast(),
                y.data_ptr(),
                plan.ld,
                y.data_ptr(),
                plan.ld,
                &plan.algo.algo,
                ws,
                ws_bytes,
                launch.stream,
            );
            status(op, "cublasLtMatmul", code)?;
        }
        CALLS.fetch_add(1, Ordering::Relaxed);
        Ok(Some(y))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_layouts_taken_and_refused() {
        let (m, n, k) = (256, 512, 1024);
        // 1x128 of A: (M, K/128) M-major; row-major is refused.
        assert!(scale_layout_ok(&[m, 8], &[1, m], ScalingType::BlockWise1x128, m, k));
        assert!(!scale_layout_ok(&[m, 8], &[8, 1], ScalingType::BlockWise1x128, m, k));
        // A leading dimension of 6 rows is not 16-byte aligned.
        assert!(!scale_layout_ok(&[6, 8], &[1, 6], ScalingType::BlockWise1x128, 6, k));
        // One block along K: the stride across blocks does not matter.
        assert!(scale_layout_ok(&[4, 1], &[1, 1], ScalingType::BlockWise1x128, 4, 128));
        // 128x128 of B: (K/128, N/128) seen transposed from row-major (N/128, K/128); not its
        // transpose, not K/128 = 2 (unaligned), not other sizes.
        assert!(scale_layout_ok(&[8, 4], &[1, 8], ScalingType::BlockWise128x128, n, k));
        assert!(!scale_layout_ok(&[8, 4], &[4, 1], ScalingType::BlockWise128x128, n, k));
        assert!(!scale_layout_ok(&[2, 4], &[1, 2], ScalingType::BlockWise128x128, n, 256));
        assert!(!scale_layout_ok(&[4, 8], &[1, 4], ScalingType::BlockWise128x128, n, k));
        // Tensor-wise: one value; MX scales are aten's.
        assert!(scale_layout_ok(&[], &[], ScalingType::TensorWise, m, k));
        assert!(!scale_layout_ok(&[2], &[1], ScalingType::TensorWise, m, k));
        assert!(!scale_layout_ok(&[m, 32], &[1, m], ScalingType::BlockWise1x32, m, k));
    }

    #[test]
    fn alignment_is_the_weakest_pointers_capped_at_256() {
        let p = |a: usize| a as *mut c_void;
        assert_eq!(alignment(&[p(0x1000), p(0x2200)]), 256);
        assert_eq!(alignment(&[p(0x1000), p(0x2080)]), 128);
        assert_eq!(alignment(&[p(0x1010)]), 16);
        assert_eq!(alignment(&[]), 256);
    }

    #[test]
    fn scale_modes_are_cublaslt_h_values() {
        assert_eq!(scale_mode(ScalingType::TensorWise), Some(0));
        assert_eq!(scale_mode(ScalingType::BlockWise1x128), Some(4));
        assert_eq!(scale_mode(ScalingType::BlockWise128x128), Some(5));
        assert_eq!(scale_mode(ScalingType::BlockWise1x32), None);
    }
}

/// This module's entries of the C API (`capi.rs`): name, handler, request -> answer.
pub const ENTRIES: crate::entry::Entries = &[
    ("direct_cublaslt", direct_cublaslt_entry, "{enable?} -> {enabled, loaded, calls, declined: {why: count}} (FP8 GEMMs on cuBLASLt called directly; false: through aten::_scaled_mm_v2)"),
];
