"""Mixture-of-Experts routing and token permutation: `moe_route`, `moe_permute_index` (schemas, fake
kernels, wrappers) and the two differentiable, deterministic moves between token order and the
expert-grouped buffer, `moe_dispatch` and `moe_combine` (docs/DESIGN.md "MoE").

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
from ._library import define

define(
    "moe_route(Tensor logits, Tensor? bias, int top_k, str score_func, int n_group, int topk_group, "
    "float capacity_factor) -> (Tensor experts, Tensor dropped, Tensor counts, Tensor lb_counts)"
)
define(
    "moe_permute_index(Tensor experts, Tensor dropped, int num_experts, int align) "
    "-> (Tensor row_of_slot, Tensor slot_of_row, Tensor offsets)"
)

SCORE_FUNCS = ("softmax", "sigmoid")


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
    if not 1 <= align <= 1024:
        _checks.fail(op, "align", "be in [1, 1024]", align)
    t, k = experts.shape
    rows = static_rows(t * k, num_experts, align)
    if rows > 2**31 - 1 or num_experts >= 2**31 - 1:
        got = f"{t} x {k} assignments, {num_experts} experts, align {align} ({rows} rows)"
        _checks.fail(op, "experts", "give fewer than 2^31 rows (int32 indices)", got)
    return rows


@torch.library.register_fake("deepwell::moe_permute_index")
def _permute_fake(experts, dropped, num_experts, align):
    rows = _check_permute("moe_permute_index", experts, dropped, num_experts, align)
    return experts.new_empty(experts.shape), experts.new_empty((rows,)), experts.new_empty((num_experts + 1,))


# Integer outputs: nothing to differentiate (logits' gradient comes through the weights, in torch).
_nondiff.register(
    "moe_route",
    "moe_permute_index",
    hint="routing decisions are integers; the routing weights are differentiable torch ops of the logits "
    "(deepwell.DeepwellMoE computes them), so detach() the logits passed to the router op",
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

    Returns:
        row_of_slot: (T, K) int32, the buffer row of each assignment (-1 when dropped).
        slot_of_row: (R,) int32, the flat slot t·K + k each row holds (-1 for a padding row).
        offsets: (E + 1,) int32, the start row of each expert's group, then R.
    """
    return torch.ops.deepwell.moe_permute_index(experts, dropped, num_experts, align)


# ---------------------------------------------------------------------------------------------
# The differentiable moves. Each one's backward is a gather of the other's kind, so both directions
# are plain gathers and fixed-order sums: no atomics, the same bits every run (an index_add_ /
# scatter_add_ backward would be nondeterministic on CUDA).


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
        term = _gather_rows(rows, row_of_slot[:, j]).to(acc)
        if weights is not None:
            term = term * weights[:, j : j + 1].to(acc)
        out = term if out is None else out + term
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_of_row, row_of_slot, top_k):
        ctx.save_for_backward(row_of_slot)
        ctx.dtype = x.dtype
        token = torch.where(slot_of_row >= 0, torch.div(slot_of_row, top_k, rounding_mode="floor"), -1)
        return _gather_rows(x, token)

    @staticmethod
    def backward(ctx, grad):
        (row_of_slot,) = ctx.saved_tensors
        return _sum_slots(grad, row_of_slot, None).to(ctx.dtype), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weights, row_of_slot, slot_of_row):
        ctx.save_for_backward(rows, weights, row_of_slot, slot_of_row)
        return _sum_slots(rows, row_of_slot, weights).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, row_of_slot, slot_of_row = ctx.saved_tensors
        t, k = row_of_slot.shape
        d_rows = d_weights = None
        if ctx.needs_input_grad[0]:
            # d rows[r] = w[slot] · grad[token of slot]; padding rows get 0.
            acc = _acc(rows.dtype)
            w_row = _gather_rows(weights.reshape(-1, 1).to(acc), slot_of_row)
            token = torch.where(slot_of_row >= 0, torch.div(slot_of_row, k, rounding_mode="floor"), -1)
            d_rows = (_gather_rows(grad.to(acc), token) * w_row).to(rows.dtype)
        if ctx.needs_input_grad[1]:
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
