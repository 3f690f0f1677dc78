//! CUDA kernels of the MoE ops (cuda/moe.cuh), bit-exact with `cpu.rs`. No host sync: the
//! capacity C and the static row count are known from the shapes alone.

use deepwell_core::moe::capacity;
use deepwell_gpu::kernels::moe::{MoeSizes, Scan};
use deepwell_gpu::kernels::Moe;
use deepwell_gpu::Params;

use super::{PermuteIndex, Route};
use crate::aten;
use crate::cuda::{self, float, ptr, Launch};
use crate::dtype::DType;
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

/// cuda/moe.cuh `MOE_MAX_EXPERTS`: a token's scores live in its thread's registers / local memory.
const MAX_EXPERTS: usize = 512;

const NULL: *const std::ffi::c_void = std::ptr::null();

/// One `moe_expert_scan` launch over `n` assignments.
struct Scanned<'a> {
    ids: &'a Tensor,
    dropped: Option<&'a Tensor>,
    n: i64,
    experts: usize,
}

impl Scanned<'_> {
    /// Launches mode `mode`; the pointers a mode does not use are null (moe.cuh).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        op: Op,
        launch: &Launch,
        mode: Scan,
        capacity: i64,
        offsets: Option<&Tensor>,
        dropped_out: Option<&Tensor>,
        counts: Option<&Tensor>,
        rows: Option<(&Tensor, &Tensor)>,
    ) -> Result<()> {
        let p = Params::new()
            .ptr(ptr(self.ids))
            .ptr(self.dropped.map_or(NULL, ptr))
            .i64(self.n)
            .i32(self.experts as i32)
            .i64(capacity)
            .ptr(offsets.map_or(NULL, ptr))
            .ptr(dropped_out.map_or(NULL, ptr))
            .ptr(counts.map_or(NULL, ptr))
            .ptr(rows.map_or(NULL, |r| ptr(r.0)))
            .ptr(rows.map_or(NULL, |r| ptr(r.1)));
        let sizes = MoeSizes { tokens: self.n as u64, experts: self.experts as u64 };
        // SAFETY: contiguous CUDA int32 / bool tensors on the launch's device holding n assignments,
        // E counts, E + 1 offsets and the static rows the offsets end at; null where the mode reads
        // nothing (moe.cuh `moe_expert_scan`).
        unsafe { launch.run(op, Moe::ExpertScan { mode }, sizes, p) }
    }
}

pub(super) fn route(op: Op, r: Route) -> Result<Vec<Tensor>> {
    let (t, e, k) = (r.tokens, r.cfg.experts, r.cfg.top_k);
    if e > MAX_EXPERTS {
        return Err(Error::Unsupported {
            op,
            what: format!("the CUDA router takes at most {MAX_EXPERTS} experts, got {e}"),
        });
    }
    let launch = cuda::launch_context(op, r.device)?;
    let outs = r.outputs(op)?;
    let logits = cuda::contiguous(op, r.logits)?;
    let bias = match r.bias {
        Some(b) => Some(cuda::contiguous(op, aten::to_dtype(op, b, DType::F32)?)?),
        None => None,
    };
    let [experts, dropped, counts, lb] = &outs;
    let plain = Tensor::empty(op, &[t as i64, k as i64], DType::I32, r.device)?;
    let (n_group, kept) = r.cfg.groups.map_or((0, 0), |g| (g.groups as i32, g.kept as i32));
    let sigmoid = matches!(r.cfg.score, deepwell_core::moe::ScoreFn::Sigmoid) as i32;
    let p = Params::new()
        .ptr(ptr(&logits))
        .ptr(bias.as_ref().map_or(NULL, ptr))
        .ptr(ptr(experts))
        .ptr(ptr(&plain))
        .i64(t as i64)
        .i32(e as i32)
        .i32(k as i32)
        .i32(sigmoid)
        .i32(n_group)
        .i32(kept);
    let sizes = MoeSizes { tokens: t as u64, experts: e as u64 };
    // SAFETY: logits (T, E) contiguous of the dtype named by the template, bias fp32 (E) or null,
    // experts and plain (T, K) int32, all on the launch's device; E <= MOE_MAX_EXPERTS (checked).
    unsafe { launch.run(op, Moe::RouteSelect { input: float(logits.dtype()) }, sizes, p)? };
    let n = (t * k) as i64;
    let cap = capacity(t, &r.cfg).map_or(-1, |c| c.min(i64::MAX as usize) as i64);
    let selected = Scanned { ids: experts, dropped: None, n, experts: e };
    selected.run(op, &launch, Scan::Capacity, cap, None, Some(dropped), Some(counts), None)?;
    let plain_scan = Scanned { ids: &plain, dropped: None, n, experts: e };
    plain_scan.run(op, &launch, Scan::Count, -1, None, None, Some(lb), None)?;
    drop(plain);
    Ok(outs.into())
}

pub(super) fn permute_index(op: Op, p: PermuteIndex) -> Result<Vec<Tensor>> {
    let launch = cuda::launch_context(op, p.device)?;
    let ids = cuda::contiguous(op, p.experts.share(op)?)?;
    let dropped = cuda::contiguous(op, p.dropped.share(op)?)?;
    let outs = p.outputs(op)?;
    let [row_of_slot, slot_of_row, offsets] = &outs;
    let counts = Tensor::empty(op, &[p.num_experts as i64], DType::I32, p.device)?;
    let scan = Scanned { ids: &ids, dropped: Some(&dropped), n: (p.tokens * p.top_k) as i64, experts: p.num_experts };
    scan.run(op, &launch, Scan::Count, -1, None, None, Some(&counts), None)?;
    let params = Params::new()
        .ptr(ptr(&counts))
        .i32(p.num_experts as i32)
        .i64(p.align as i64)
        .i64(p.rows as i64)
        .ptr(ptr(offsets));
    let sizes = MoeSizes { tokens: 1, experts: p.num_experts as u64 };
    // SAFETY: counts (E) and offsets (E + 1) int32 on the launch's device.
    unsafe { launch.run(op, Moe::Offsets, sizes, params)? };
    scan.run(op, &launch, Scan::Place, -1, Some(offsets), None, None, Some((row_of_slot, slot_of_row)))?;
    Ok(outs.into())
}
