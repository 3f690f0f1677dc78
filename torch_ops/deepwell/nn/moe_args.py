"""The checks of `deepwell.DeepwellMoE`'s arguments: its constructor's numbers and its input's hidden
size. A bad one raises at once with a message naming deepwell.DeepwellMoE, the argument, what was
expected and what was given, instead of a ZeroDivisionError at construction, an all-NaN output
(`route_scale=nan`) or torch's "mat1 and mat2 shapes cannot be multiplied" at the first forward.
"""

from __future__ import annotations

import math
import operator

import torch

from ..ops.moe import MAX_EXPERTS

WHO = "deepwell.DeepwellMoE"


def _fail(arg: str, expected: str, got) -> None:
    raise ValueError(f"{WHO}: {arg} must be {expected}, got {got!r}")


def _int(arg: str, v, lo: int, hi: int | None = None, why: str = "") -> int:
    """`v` as an int in [lo, hi] (a bool is no size; numpy's and torch's integers are); `why`
    names the bound."""
    if isinstance(v, bool):
        _fail(arg, "an int", v)
    try:
        n = operator.index(v)
    except TypeError:
        _fail(arg, "an int", v)
    if n < lo or (hi is not None and n > hi):
        _fail(arg, (f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}") + why, v)
    return n


def _float(arg: str, v, positive: bool, none_ok: bool = False) -> float | None:
    """`v` as a finite float, > 0 when `positive`, else >= 0; None passes where `none_ok`."""
    if v is None and none_ok:
        return None
    try:
        f = float(v) if not isinstance(v, (bool, str)) else None
    except (TypeError, ValueError):
        f = None
    either = "None or " if none_ok else ""
    if f is None or not math.isfinite(f):
        _fail(arg, f"{either}a finite number", v)
    if f < 0 or (positive and f == 0):
        _fail(arg, either + ("> 0" if positive else ">= 0"), v)
    return f


def check_config(
    *,
    dim,
    ffn_dim,
    num_experts,
    top_k,
    route_scale,
    n_group,
    topk_group,
    capacity_factor,
    bias_update_rate,
    num_shared_experts,
    shared_ffn_dim,
    aux_loss_coef,
    z_loss_coef,
) -> None:
    """Every numeric argument of DeepwellMoE's constructor. The router's own constraints (top_k,
    n_group, topk_group) are moe_route's (rust/ops/src/ops/moe/mod.rs `Route::new`), and E is
    bounded by moe_permute_index's `MAX_EXPERTS`, so no forward fails on a constructor's number."""
    _int("dim", dim, 1)
    _int("ffn_dim", ffn_dim, 1)
    e = _int("num_experts", num_experts, 1, MAX_EXPERTS, " (moe_permute_index's MAX_EXPERTS)")
    k = _int("top_k", top_k, 1, e, " (num_experts)")
    groups = _int("n_group", n_group, 0)
    if groups and (e % groups or e // groups < 2):
        _fail("n_group", f"0 (no groups) or split the {e} experts into groups of at least 2", n_group)
    kept = _int("topk_group", topk_group, 0)
    if groups and not (1 <= kept <= groups and kept * (e // groups) >= k):
        _fail("topk_group", f"in [1, {groups}] and keep at least top_k={k} experts", topk_group)
    _float("route_scale", route_scale, positive=True)
    cf = _float("capacity_factor", capacity_factor, positive=True, none_ok=True)
    if cf is not None and cf > 3.4028234663852886e38:  # moe_route's bound: it travels to Rust as an fp32
        _fail("capacity_factor", "None or at most 3.4028234663852886e38 (fp32's largest)", capacity_factor)
    _float("bias_update_rate", bias_update_rate, positive=False)
    _int("num_shared_experts", num_shared_experts, 0)
    if shared_ffn_dim is not None:
        _int("shared_ffn_dim", shared_ffn_dim, 1)
    _float("aux_loss_coef", aux_loss_coef, positive=False)
    _float("z_loss_coef", z_loss_coef, positive=False)


def check_input(x: torch.Tensor, dim: int) -> None:
    """x is (..., dim): the hidden size the router and the experts were built for."""
    if x.dim() < 1 or x.shape[-1] != dim:
        shape = "[" + ", ".join(str(s) for s in x.shape) + "]"
        raise RuntimeError(f"{WHO}: the input must be (..., dim) with dim={dim}, got shape {shape}")
