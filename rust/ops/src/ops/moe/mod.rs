//! `deepwell.moe_route` and `deepwell.moe_permute_index`: the discrete half of a Mixture-of-Experts
//! layer (docs/DESIGN.md "MoE"). Schemas, fake kernels and the differentiable half (weights, losses,
//! gather, grouped GEMMs, combine): torch_ops/deepwell/ops/moe.py and nn/moe.py. Checks here, shared by
//! the CPU reference (`cpu.rs`, maths in rust/core/src/moe) and CUDA (`cuda.rs`, cuda/moe.cuh).
//!
//! The split follows the autograd: these ops only decide *which* expert takes which token and where
//! its row goes (integers, not differentiable); torch computes every value that carries a gradient
//! from those indices, so gradients reach the router gate and the experts through ordinary ops.
//!
//! - `moe_route(logits (T, E), bias (E)?, top_k, score_func, n_group, topk_group, capacity_factor)
//!   -> (experts int32 (T, K), dropped bool (T, K), counts int32 (E), lb_counts int32 (E))`
//! - `moe_permute_index(experts int32 (T, K), dropped bool (T, K), num_experts, align)
//!   -> (row_of_slot int32 (T, K), slot_of_row int32 (R), offsets int32 (E + 1))` with the static
//!   R = `deepwell_core::moe::static_rows(T·K, E, align)`; E <= 2^16 ([`MAX_EXPERTS`]), align in
//!   [1, 1024], R < 2^31.
//!
//! The value moves between token order and that buffer (`moe_gather_rows`, `moe_sum_slots`,
//! `moe_slot_dots`, fused and deterministic) are in `combine.rs`.

pub mod combine;
mod combine_cpu;
mod combine_cuda;
pub(crate) mod cpu;
pub(crate) mod cuda;

use deepwell_core::moe::{static_rows, Groups, RouterConfig, ScoreFn};

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::run_on;
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static ROUTE: OpSpec = OpSpec {
    name: "moe_route",
    args: &[
        ("logits", Kind::Tensor),
        ("bias", Kind::OptTensor),
        ("top_k", Kind::Int),
        ("score_func", Kind::Str),
        ("n_group", Kind::Int),
        ("topk_group", Kind::Int),
        ("capacity_factor", Kind::Float),
    ],
    returns: 4,
};

pub static PERMUTE_INDEX: OpSpec = OpSpec {
    name: "moe_permute_index",
    args: &[("experts", Kind::Tensor), ("dropped", Kind::Tensor), ("num_experts", Kind::Int), ("align", Kind::Int)],
    returns: 3,
};

pub fn kernels() -> Vec<Kernel> {
    use combine::{gather_rows_boxed, slot_dots_boxed, sum_slots_boxed, GATHER_ROWS, SLOT_DOTS, SUM_SLOTS};
    [
        cpu_and_cuda!(ROUTE, route_boxed),
        cpu_and_cuda!(PERMUTE_INDEX, permute_index_boxed),
        cpu_and_cuda!(GATHER_ROWS, gather_rows_boxed),
        cpu_and_cuda!(SUM_SLOTS, sum_slots_boxed),
        cpu_and_cuda!(SLOT_DOTS, slot_dots_boxed),
    ]
    .concat()
}

// ---------------------------------------------------------------------------------------------
// The typed API

/// The router's options as the schema spells them.
pub struct RouteOptions {
    pub top_k: i64,
    pub score_func: String,
    pub n_group: i64,
    pub topk_group: i64,
    pub capacity_factor: f64,
}

/// `moe_route`: [experts, dropped, counts, lb_counts].
pub fn route(op: Op, on: Backend, logits: Tensor, bias: Option<Tensor>, o: RouteOptions) -> Result<[Tensor; 4]> {
    let r = Route::new(op, on, logits, bias, o)?;
    run_on(op, on, r, cpu::route, cuda::route)
}

/// `moe_permute_index`: [row_of_slot, slot_of_row, offsets].
pub fn permute_index(op: Op, on: Backend, experts: Tensor, dropped: Tensor, e: i64, align: i64) -> Result<[Tensor; 3]> {
    let p = PermuteIndex::new(op, on, experts, dropped, e, align)?;
    run_on(op, on, p, cpu::permute_index, cuda::permute_index)
}

fn route_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (logits, bias) = (a.tensor("logits")?, a.opt_tensor("bias")?);
    let o = RouteOptions {
        top_k: a.int("top_k")?,
        score_func: a.str("score_func")?,
        n_group: a.int("n_group")?,
        topk_group: a.int("topk_group")?,
        capacity_factor: a.float("capacity_factor")?,
    };
    Ok(route(a.op(), on, logits, bias, o)?.into())
}

fn permute_index_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (experts, dropped) = (a.tensor("experts")?, a.tensor("dropped")?);
    let (e, align) = (a.int("num_experts")?, a.int("align")?);
    Ok(permute_index(a.op(), on, experts, dropped, e, align)?.into())
}

// ---------------------------------------------------------------------------------------------
// Validation (mirrored by torch_ops/deepwell/ops/moe.py)

/// A validated `moe_route` call: logits (tokens, experts).
struct Route {
    logits: Tensor,
    bias: Option<Tensor>,
    dtype: DType,
    device: Device,
    tokens: usize,
    cfg: RouterConfig,
}

impl Route {
    fn new(op: Op, backend: Backend, logits: Tensor, bias: Option<Tensor>, o: RouteOptions) -> Result<Route> {
        let dtype = check::dtype_in(op, "logits", &logits, &check::FLOAT_INPUTS)?;
        let mut tensors = vec![("logits", &logits)];
        if let Some(b) = &bias {
            tensors.push(("bias", b));
        }
        let device = check::same_device(op, backend, &tensors)?;
        if logits.dim() != 2 {
            return Err(Error::arg(op, "logits", "be 2-d (tokens, experts)", format!("a {}-d tensor", logits.dim())));
        }
        check::non_empty(op, "logits", &logits, 2)?;
        let (tokens, e) = (logits.sizes()[0] as usize, logits.sizes()[1]);
        if let Some(b) = &bias {
            check::dtype_in(op, "bias", b, &check::FLOAT_INPUTS)?;
            check::shape_eq(op, "bias", b, &[e])?;
        }
        let score = match o.score_func.as_str() {
            "softmax" => ScoreFn::Softmax,
            "sigmoid" => ScoreFn::Sigmoid,
            other => return Err(Error::arg(op, "score_func", "be one of 'softmax', 'sigmoid'", check::quoted(other))),
        };
        if !(1..=e).contains(&o.top_k) {
            return Err(Error::arg(op, "top_k", format!("be in [1, {e}] (the experts)"), o.top_k));
        }
        let groups = if o.n_group == 0 {
            None
        } else {
            if o.n_group < 0 || e % o.n_group != 0 || e / o.n_group < 2 {
                let want = format!("be 0 (no groups) or split the {e} experts into groups of at least 2");
                return Err(Error::arg(op, "n_group", want, o.n_group));
            }
            if !(1..=o.n_group).contains(&o.topk_group) || o.topk_group * (e / o.n_group) < o.top_k {
                let want = format!("be in [1, {}] and keep at least top_k={} experts", o.n_group, o.top_k);
                return Err(Error::arg(op, "topk_group", want, o.topk_group));
            }
            Some(Groups { groups: o.n_group as usize, kept: o.topk_group as usize })
        };
        let cf = o.capacity_factor;
        if !(cf == 0.0 || (cf > 0.0 && cf.is_finite() && cf <= f32::MAX as f64)) {
            return Err(Error::arg(op, "capacity_factor", "be 0 (dropless) or a positive finite number", cf));
        }
        let cfg = RouterConfig {
            experts: e as usize,
            top_k: o.top_k as usize,
            score,
            renormalize: false,
            scale: 1.0,
            groups,
            capacity_factor: (cf > 0.0).then_some(cf as f32),
        };
        Ok(Route { logits, bias, dtype, device, tokens, cfg })
    }

    /// The four outputs, allocated on the call's device.
    fn outputs(&self, op: Op) -> Result<[Tensor; 4]> {
        let (t, k, e) = (self.tokens as i64, self.cfg.top_k as i64, self.cfg.experts as i64);
        Ok([
            Tensor::empty(op, &[t, k], DType::I32, self.device)?,
            Tensor::empty(op, &[t, k], DType::Bool, self.device)?,
            Tensor::empty(op, &[e], DType::I32, self.device)?,
            Tensor::empty(op, &[e], DType::I32, self.device)?,
        ])
    }
}

/// The most experts `moe_permute_index` takes (torch_ops/deepwell/ops/moe.py `MAX_EXPERTS`). The
/// CUDA counts and placement read every assignment once per expert (cuda/moe.cuh
/// `moe_expert_scan`: one CTA per expert), and the padding adds up to E·(align − 1) rows, so E
/// drives both work and memory; 2^16 is far above any MoE layer's experts (DeepSeek-V3: 256) and
/// keeps E·(align − 1) < 2^26 rows, where a caller's 2^31 experts or 2^21 experts padded to 1024
/// would ask for gigabytes before any check on the data.
pub const MAX_EXPERTS: i64 = 1 << 16;

/// A validated `moe_permute_index` call.
struct PermuteIndex {
    experts: Tensor,
    dropped: Tensor,
    device: Device,
    tokens: usize,
    top_k: usize,
    num_experts: usize,
    align: usize,
    /// The static buffer's rows.
    rows: usize,
}

impl PermuteIndex {
    fn new(op: Op, backend: Backend, experts: Tensor, dropped: Tensor, e: i64, align: i64) -> Result<PermuteIndex> {
        check::dtype_in(op, "experts", &experts, &[DType::I32])?;
        check::dtype_in(op, "dropped", &dropped, &[DType::Bool])?;
        let device = check::same_device(op, backend, &[("experts", &experts), ("dropped", &dropped)])?;
        if experts.dim() != 2 {
            return Err(Error::arg(op, "experts", "be 2-d (tokens, top_k)", format!("a {}-d tensor", experts.dim())));
        }
        check::non_empty(op, "experts", &experts, 2)?;
        check::shape_eq(op, "dropped", &dropped, experts.sizes())?;
        if e < 1 {
            return Err(Error::arg(op, "num_experts", "be positive", e));
        }
        if e > MAX_EXPERTS {
            return Err(Error::arg(op, "num_experts", format!("be at most {MAX_EXPERTS}"), e));
        }
        if !(1..=1024).contains(&align) {
            return Err(Error::arg(op, "align", "be in [1, 1024]", align));
        }
        let (tokens, top_k) = (experts.sizes()[0] as usize, experts.sizes()[1] as usize);
        let rows = (e as u128 * (align as u128 - 1) + (tokens * top_k) as u128).div_ceil(align as u128) * align as u128;
        if rows > i32::MAX as u128 {
            let got = format!("{tokens} x {top_k} assignments, {e} experts, align {align} ({rows} rows)");
            return Err(Error::arg(op, "experts", "give fewer than 2^31 rows (int32 indices)", got));
        }
        let (num_experts, align) = (e as usize, align as usize);
        debug_assert_eq!(rows as usize, static_rows(tokens * top_k, num_experts, align));
        Ok(PermuteIndex { experts, dropped, device, tokens, top_k, num_experts, align, rows: rows as usize })
    }

    fn outputs(&self, op: Op) -> Result<[Tensor; 3]> {
        let (t, k) = (self.tokens as i64, self.top_k as i64);
        Ok([
            Tensor::empty(op, &[t, k], DType::I32, self.device)?,
            Tensor::empty(op, &[self.rows as i64], DType::I32, self.device)?,
            Tensor::empty(op, &[self.num_experts as i64 + 1], DType::I32, self.device)?,
        ])
    }
}
