"""Mixture-of-Experts routing and token permutation: `moe_route`, `moe_permute_index` (schemas, fake
kernels, wrappers) and the two differentiable, deterministic moves between token order and the
expert-grouped buffer, `moe_dispatch` and `moe_combine` (docs/DESIGN.md "MoE"), built from the fused
value-move ops `moe_gather_rows`, `moe_sum_slots`, `moe_slot_dots` (rust/ops/src/ops/moe/combine.rs).

Kernels: rust/ops/src/ops/moe/ (maths: rust/core/src/moe). The Rust ops return integers only —
which experts, which assignments were dropped, where each row goes — and are not differentiable;
every value that carries a gradient (routing weights, losses, expert outputs) is computed by torch
from those indices, so gradients reach the router gate and the experts through ordinary ops.

The expert-grouped buffer has a static number of rows R = round_up(T·K + E·(align − 1), align)
(`static_rows`): each expert's rows are contiguous (experts in index order, assignments in flat
slot order t·K + k), every group is padded with zero rows to a multiple of `align`, and the spare
rows are zero rows at the end of the last group, so `offsets[E] == R`. Static shapes need no host
sync and compile without data-dependent sizes.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _nondiff
from ._function import cast
from ._library import define

define(
    "moe_route(Tensor logits, Tensor? bias, int top_k, str score_func, int n_group, int topk_group, "
    "float capacity_factor) -> (Tensor experts, Tensor dropped, Tensor counts, Tensor lb_counts)"
)
define(
    "moe_permute_index(Tensor experts, Tensor dropped, int num_experts, int align) "
    "-> (Tensor row_of_slot, Tensor slot_of_row, Tensor offsets)"
)

define("moe_gather_rows(Tensor src, Tensor index, Tensor? weights, int top_k) -> Tensor")
define("moe_sum_slots(Tensor rows, Tensor row_of_slot, Tensor? weights) -> Tensor")
define("moe_slot_dots(Tensor rows, Tensor row_of_slot, Tensor grad) -> Tensor")

SCORE_FUNCS = ("softmax", "sigmoid")

#: The most experts `moe_permute_index` takes (rust/ops/src/ops/moe/mod.rs `MAX_EXPERTS`: the CUDA
#: placement reads every assignment once per expert, and padding adds up to E·(align − 1) rows).
MAX_EXPERTS = 2**16


def static_rows(assignments: int, num_experts: int, align: int) -> int:
    """Rows of the expert-grouped buffer (deepwell_core::moe::static_rows)."""
    return -(-(assignments + num_experts * (align - 1)) // align) * align


def _rust_float(v: float) -> str:
    """A float as Rust's Display writes it (the messages of both sides are the same)."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return str(int(v)) if v == int(v) else repr(v)


def _check_route(op, logits, bias, top_k, score_func, n_group, topk_group, capacity_factor) -> None:
    """Mirrors `Route::new` in rust/ops/src/ops/moe/mod.rs."""
    _checks.dtype_in(op, "logits", logits, _checks.FLOAT_INPUTS)
    _checks.same_device(op, ("logits", logits), *(() if bias is None else (("bias", bias),)))
    if logits.dim() != 2:
        _checks.fail(op, "logits", "be 2-d (tokens, experts)", f"a {logits.dim()}-d tensor")
    _checks.non_empty(op, "logits", logits, 2)
    e = logits.shape[1]
    if bias is not None:
        _checks.dtype_in(op, "bias", bias, _checks.FLOAT_INPUTS)
        _checks.shape_eq(op, "bias", bias, (e,))
    _checks.choice(op, "score_func", score_func, SCORE_FUNCS)
    if not 1 <= top_k <= e:
        _checks.fail(op, "top_k", f"be in [1, {e}] (the experts)", top_k)
    if n_group != 0:
        if n_group < 0 or e % n_group != 0 or e // n_group < 2:
            _checks.fail(op, "n_group", f"be 0 (no groups) or split the {e} experts into groups of at least 2", n_group)
        if not 1 <= topk_group <= n_group or topk_group * (e // n_group) < top_k:
            _checks.fail(op, "topk_group", f"be in [1, {n_group}] and keep at least top_k={top_k} experts", topk_group)
    cf = capacity_factor
    if not (cf == 0.0 or (0.0 < cf <= 3.4028234663852886e38)):
        _checks.fail(op, "capacity_factor", "be 0 (dropless) or a positive finite number", _rust_float(cf))


@torch.library.register_fake("deepwell::moe_route")
def _route_fake(logits, bias, top_k, score_func, n_group, topk_group, capacity_factor):
    _check_route("moe_route", logits, bias, top_k, score_func, n_group, topk_group, capacity_factor)
    t, e = logits.shape
    i32 = dict(dtype=torch.int32, device=logits.device)
    return (
        logits.new_empty((t, top_k), **i32),
        logits.new_empty((t, top_k), dtype=torch.bool),
        logits.new_empty((e,), **i32),
        logits.new_empty((e,), **i32),
    )


def _check_permute(op, experts, dropped, num_experts, align) -> int:
    """Mirrors `PermuteIndex::new`; returns the buffer's rows."""
    _checks.dtype_in(op, "experts", experts, (torch.int32,))
    _checks.dtype_in(op, "dropped", dropped, (torch.bool,))
    _checks.same_device(op, ("experts", experts), ("dropped", dropped))
    if experts.dim() != 2:
        _checks.fail(op, "experts", "be 2-d (tokens, top_k)", f"a {experts.dim()}-d tensor")
    _checks.non_empty(op, "experts", experts, 2)
    _checks.shape_eq(op, "dropped", dropped, experts.shape)
    if num_experts < 1:
        _checks.fail(op, "num_experts", "be positive", num_experts)
    if num_experts > MAX_EXPERTS:
        _checks.fail(op, "num_experts", f"be at most {MAX_EXPERTS}", num_experts)
    if not 1 <= align <= 1024:
        _checks.fail(op, "align", "be in [1, 1024]", align)
    t, k = experts.shape
    rows = static_rows(t * k, num_experts, align)
    if rows > 2**31 - 1:
        got = f"{t} x {k} assignments, {num_experts} experts, align {align} ({rows} rows)"
        _checks.fail(op, "experts", "give fewer than 2^31 rows (int32 indices)", got)
    return rows


@torch.library.register_fake("deepwell::moe_permute_index")
def _permute_fake(experts, dropped, num_experts, align):
    rows = _check_permute("moe_permute_index", experts, dropped, num_experts, align)
    return experts.new_empty(experts.shape), experts.new_empty((rows,)), experts.new_empty((num_experts + 1,))


def _two_d(op, arg, t, what):
    if t.dim() != 2:
        _checks.fail(op, arg, f"be 2-d {what}", f"a {t.dim()}-d tensor")
    _checks.non_empty(op, arg, t, 2)
    return t.shape


def _check_weights(op, weights, t, k):
    if weights is not None:
        _checks.dtype_in(op, "weights", weights, (torch.float32,))
        _checks.shape_eq(op, "weights", weights, (t, k))


def _fits_int32(op, arg, n, what):
    if n > 2**31 - 1:
        _checks.fail(op, arg, "give fewer than 2^31 slots (int32 indices)", f"{n} {what}")


def _check_gather(op, src, index, weights, top_k):
    """Mirrors `GatherRows::new` in rust/ops/src/ops/moe/combine.rs."""
    _checks.dtype_in(op, "src", src, _checks.FLOAT_INPUTS)
    _checks.dtype_in(op, "index", index, (torch.int32,))
    _checks.same_device(op, ("src", src), ("index", index), *(() if weights is None else (("weights", weights),)))
    t, d = _two_d(op, "src", src, "(tokens, hidden)")
    if index.dim() != 1:
        _checks.fail(op, "index", "be 1-d (rows)", f"a {index.dim()}-d tensor")
    _checks.non_empty(op, "index", index, 1)
    if top_k < 1:
        _checks.fail(op, "top_k", "be positive", top_k)
    _fits_int32(op, "src", t * top_k, "slots")
    _check_weights(op, weights, t, top_k)


@torch.library.register_fake("deepwell::moe_gather_rows")
def _gather_rows_fake(src, index, weights, top_k):
    _check_gather("moe_gather_rows", src, index, weights, top_k)
    return src.new_empty((index.shape[0], src.shape[1]))


def _check_slots(op, rows, row_of_slot, weights, grad):
    """Mirrors `Slots::new` in rust/ops/src/ops/moe/combine.rs."""
    _checks.dtype_in(op, "rows", rows, _checks.FLOAT_INPUTS)
    _checks.dtype_in(op, "row_of_slot", row_of_slot, (torch.int32,))
    extra = [(n, x) for n, x in (("weights", weights), ("grad", grad)) if x is not None]
    _checks.same_device(op, ("rows", rows), ("row_of_slot", row_of_slot), *extra)
    _, d = _two_d(op, "rows", rows, "(rows, hidden)")
    t, k = _two_d(op, "row_of_slot", row_of_slot, "(tokens, top_k)")
    _fits_int32(op, "row_of_slot", t * k, "slots")
    _check_weights(op, weights, t, k)
    if grad is not None:
        _checks.dtype_in(op, "grad", grad, (rows.dtype,))
        _checks.shape_eq(op, "grad", grad, (t, d))
    return t, k, d


@torch.library.register_fake("deepwell::moe_sum_slots")
def _sum_slots_fake(rows, row_of_slot, weights):
    t, _, d = _check_slots("moe_sum_slots", rows, row_of_slot, weights, None)
    return rows.new_empty((t, d))


@torch.library.register_fake("deepwell::moe_slot_dots")
def _slot_dots_fake(rows, row_of_slot, grad):
    t, k, _ = _check_slots("moe_slot_dots", rows, row_of_slot, None, grad)
    return rows.new_empty((t, k), dtype=torch.float32)


# Integer outputs: nothing to differentiate (logits' gradient comes through the weights, in torch).
_nondiff.register(
    "moe_route",
    "moe_permute_index",
    hint="routing decisions are integers; the routing weights are differentiable torch ops of the logits "
    "(deepwell.DeepwellMoE computes them), so detach() the logits passed to the router op",
)
_nondiff.register(
    "moe_gather_rows",
    "moe_sum_slots",
    "moe_slot_dots",
    hint="these are the building blocks of deepwell.moe_dispatch / moe_combine, which are differentiable: "
    "call those instead",
)


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None = None,
    top_k: int = 2,
    score_func: str = "softmax",
    n_group: int = 0,
    topk_group: int = 0,
    capacity_factor: float = 0.0,
):
    """Chooses each token's experts (rust/core/src/moe/router.rs).

    Scores are softmax(logits) or sigmoid(logits) in fp32; selection is top-k of scores + bias
    (the bias changes selection only) within the best `topk_group` of `n_group` groups (group score:
    the sum of its top-2; 0 = no groups); ties go to the lower expert index. With
    `capacity_factor` > 0 each expert keeps at most ceil(T·K/E · cf) assignments, the earliest in
    flat order t·K + k ("position" dropping); 0 is dropless.

    Returns:
        experts: (T, K) int32, best first. dropped: (T, K) bool. counts: (E,) int32 kept
        assignments per expert. lb_counts: (E,) int32 tokens per expert under a plain top-K of
        the scores (no bias, groups or capacity), the f_e of the Switch load-balancing loss.
    """
    return torch.ops.deepwell.moe_route(
        logits, bias, top_k, score_func, n_group, topk_group, float(capacity_factor)
    )


def moe_permute_index(experts: torch.Tensor, dropped: torch.Tensor, num_experts: int, align: int = 1):
    """Where each assignment goes in the expert-grouped buffer (rust/core/src/moe/permute.rs).
    `num_experts` in [1, 2^16] (`MAX_EXPERTS`), `align` in [1, 1024], and the buffer's
    R = static_rows(T·K, E, align) rows below 2^31 (int32 indices).

    Returns:
        row_of_slot: (T, K) int32, the buffer row of each assignment (-1 when dropped).
        slot_of_row: (R,) int32, the flat slot t·K + k each row holds (-1 for a padding row).
        offsets: (E + 1,) int32, the start row of each expert's group, then R.
    """
    return torch.ops.deepwell.moe_permute_index(experts, dropped, num_experts, align)


# ---------------------------------------------------------------------------------------------
# The differentiable moves. Each one's backward is a gather of the other's kind, so both directions
# are plain gathers and fixed-order sums: no atomics, the same bits every run (an index_add_ /
# scatter_add_ backward would be nondeterministic on CUDA). The fused ops above do each move in one
# pass (one kernel, each output element written once) with the numerics of the pure-torch formulas
# below, which stay as the float64 path (the ops take fp32 / bf16 / fp16) and as the tests' reference.


def _gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src[index] with rows of zeros where index == -1."""
    valid = index >= 0
    out = src.index_select(0, index.clamp(min=0).long())
    return torch.where(valid.unsqueeze(-1), out, out.new_zeros(()))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _sum_slots(rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """out[t] = Σ_k w[t, k] · rows[row_of_slot[t, k]] in k order, in fp32 (float64 stays float64),
    skipping dropped slots. One (T, D) gather per k: no (T, K, D) fp32 temporary."""
    acc = _acc(rows.dtype)
    out = None
    for j in range(row_of_slot.shape[1]):
        term = cast(_gather_rows(rows, row_of_slot[:, j]), acc)
        if weights is not None:
            term = term * weights[:, j : j + 1].to(acc)
        out = term if out is None else out + term
    return out


def _fused(*tensors: torch.Tensor) -> bool:
    """The fused ops apply: float tensors of the ops' dtypes (float64 takes the torch path) on a
    device with deepwell kernels (or fake / meta tensors while tracing)."""
    return all(t.dtype in _checks.FLOAT_INPUTS and t.device.type in ("cpu", "cuda", "meta") for t in tensors)


def _tokens(slot_of_row: torch.Tensor, top_k: int) -> torch.Tensor:
    return torch.where(slot_of_row >= 0, torch.div(slot_of_row, top_k, rounding_mode="floor"), -1)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_of_row, row_of_slot, top_k):
        ctx.save_for_backward(row_of_slot)
        ctx.dtype = x.dtype
        if _fused(x) and slot_of_row.dtype == torch.int32:
            return torch.ops.deepwell.moe_gather_rows(x, slot_of_row, None, top_k)
        return _gather_rows(x, _tokens(slot_of_row, top_k))

    @staticmethod
    def backward(ctx, grad):
        (row_of_slot,) = ctx.saved_tensors
        # The fused sum rounds once to grad's dtype: the same bits as the fp32 sum cast to x's dtype
        # only when the two dtypes agree (autograd hands back x's dtype).
        if _fused(grad) and grad.dtype == ctx.dtype and row_of_slot.dtype == torch.int32:
            return torch.ops.deepwell.moe_sum_slots(grad, row_of_slot, None), None, None, None
        return _sum_slots(grad, row_of_slot, None).to(ctx.dtype), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, row_of_slot, slot_of_row):
        ctx.save_for_backward(rows, weights, row_of_slot, slot_of_row)
        if _fused(rows, weights) and row_of_slot.dtype == torch.int32:
            # The sum reads the weights as fp32 either way (_sum_slots' .to(acc)).
            return torch.ops.deepwell.moe_sum_slots(rows, row_of_slot, weights.float())
        return cast(_sum_slots(rows, row_of_slot, weights), rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, row_of_slot, slot_of_row = ctx.saved_tensors
        t, k = row_of_slot.shape
        fused = _fused(rows, weights, grad) and grad.dtype == rows.dtype and row_of_slot.dtype == torch.int32
        d_rows = d_weights = None
        if ctx.needs_input_grad[0]:
            # d rows[r] = w[slot] · grad[token of slot] (fp32 product, one rounding); padding rows get 0.
            if fused:
                d_rows = torch.ops.deepwell.moe_gather_rows(grad, slot_of_row, weights.float(), k)
            else:
                acc = _acc(rows.dtype)
                w_row = _gather_rows(weights.reshape(-1, 1).to(acc), slot_of_row)
                d_rows = (_gather_rows(grad.to(acc), _tokens(slot_of_row, k)) * w_row).to(rows.dtype)
        if ctx.needs_input_grad[1]:
            # d w[t, k] = dot(rows[row_of_slot[t, k]], grad[t]) in fp32; the fused op sums in a fixed
            # order (cuda/moe.cuh moe_slot_dots), the torch path in torch's.
            if fused:
                d_weights = torch.ops.deepwell.moe_slot_dots(rows, row_of_slot, grad).to(weights.dtype)
            else:
                acc = _acc(torch.promote_types(rows.dtype, weights.dtype))
                g = grad.to(acc)
                cols = [(_gather_rows(rows, row_of_slot[:, j]).to(acc) * g).sum(-1) for j in range(k)]
                d_weights = torch.stack(cols, dim=1).to(weights.dtype)
        return d_rows, d_weights, None, None


def moe_dispatch(x: torch.Tensor, slot_of_row: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """The expert-grouped buffer (R, D): row r = x[slot_of_row[r] // K], zero rows for padding.

    Differentiable in x; the backward sums each token's K row gradients in k order."""
    return _Dispatch.apply(x, slot_of_row, row_of_slot, row_of_slot.shape[1])


def moe_combine(
    rows: torch.Tensor, weights: torch.Tensor, row_of_slot: torch.Tensor, slot_of_row: torch.Tensor
) -> torch.Tensor:
    """Back to token order: out[t] = Σ_k weights[t, k] · rows[row_of_slot[t, k]], summed in k order
    in fp32 and cast to rows' dtype once; dropped assignments contribute 0 (their weights are not
    renormalised). Differentiable in rows and weights."""
    return _Combine.apply(rows, weights, row_of_slot, slot_of_row)


def moe_gather_rows(
    src: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None = None, top_k: int = 1
) -> torch.Tensor:
    """(R, D) of src's dtype: row r = src[index[r] // top_k] (a bit copy), or with fp32 weights (T, K)
    fp32(weights.flatten()[index[r]]) · fp32(src[index[r] // top_k]) rounded once; zero rows where
    index[r] == -1. Not differentiable itself (moe_dispatch / moe_combine are)."""
    return torch.ops.deepwell.moe_gather_rows(src, index, weights, top_k)


def moe_sum_slots(rows: torch.Tensor, row_of_slot: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(T, D) of rows' dtype: out[t] = Σ_k fp32(w[t, k]) · fp32(rows[row_of_slot[t, k]]) summed in k
    order in fp32 (each product and sum rounded, no fma), cast once; dropped slots (-1) add +0."""
    return torch.ops.deepwell.moe_sum_slots(rows, row_of_slot, weights)


def moe_slot_dots(rows: torch.Tensor, row_of_slot: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(T, K) fp32: dot(rows[row_of_slot[t, k]], grad[t]) in the fixed order of cuda/moe.cuh
    `moe_slot_dots` (lane-strided chunks of 8, then a 32-lane tree); 0 for dropped slots."""
    return torch.ops.deepwell.moe_slot_dots(rows, row_of_slot, grad)
