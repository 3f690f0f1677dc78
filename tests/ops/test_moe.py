"""deepwell.moe_route, moe_permute_index, moe_dispatch and moe_combine against the float64 model of
tests/reference/moe.py: every router option, ties, capacity, the expert-grouped layout's invariants
(contiguous, stable, aligned, static size), gradients and determinism, and the same error messages
from the Rust kernels and the fake kernels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import deepwell
from reference import moe as ref

ROUTERS = [
    dict(top_k=1, score_func="softmax"),
    dict(top_k=2, score_func="softmax"),
    dict(top_k=4, score_func="sigmoid"),
    dict(top_k=2, score_func="sigmoid", bias=True),
    dict(top_k=3, score_func="sigmoid", bias=True, n_group=4, topk_group=2),
    dict(top_k=2, score_func="softmax", n_group=2, topk_group=1),
    dict(top_k=2, score_func="softmax", capacity_factor=1.0),
    dict(top_k=3, score_func="sigmoid", bias=True, capacity_factor=0.5),
    dict(top_k=8, score_func="softmax", capacity_factor=1.5),
]


def _route(logits, bias=None, top_k=2, score_func="softmax", n_group=0, topk_group=0, capacity_factor=None):
    return deepwell.moe_route(logits, bias, top_k, score_func, n_group, topk_group, capacity_factor or 0.0)


@pytest.mark.parametrize("cfg", ROUTERS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_the_model(cfg, dtype, gen):
    cfg = dict(cfg)
    t, e = 37, 8
    logits = torch.randn(t, e, generator=gen).to(dtype)
    bias = torch.randn(e, generator=gen) * 0.1 if cfg.pop("bias", False) else None
    experts, dropped, counts, lb = _route(logits, bias, **cfg)
    want = ref.route(logits.float().numpy(), None if bias is None else bias.numpy(), **cfg)
    assert experts.dtype == torch.int32 and dropped.dtype == torch.bool and counts.dtype == torch.int32
    np.testing.assert_array_equal(experts.numpy(), want[0])
    np.testing.assert_array_equal(dropped.numpy(), want[1])
    np.testing.assert_array_equal(counts.numpy(), want[2])
    np.testing.assert_array_equal(lb.numpy(), want[3])
    assert counts.sum() == (~dropped).sum() and lb.sum() == t * cfg["top_k"]


def test_ties_go_to_the_lower_expert_and_every_token_gets_distinct_experts():
    experts, *_ = _route(torch.zeros(3, 6), top_k=4)
    assert experts.tolist() == [[0, 1, 2, 3]] * 3
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0]])
    assert _route(logits, top_k=2)[0].tolist() == [[1, 2]]


def test_the_bias_changes_selection_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    assert _route(logits, bias, top_k=1, score_func="sigmoid")[0].tolist() == [[3]]


def test_group_limited_routing_never_picks_a_masked_expert_even_with_a_negative_bias():
    # Hugging Face's old 0.0 mask let a negative bias pick a masked expert (transformers#45440).
    logits = torch.tensor([[5.0, 4.0, -9.0, -9.0]])
    bias = torch.tensor([-50.0, -50.0, 0.0, 0.0])
    experts, *_ = _route(logits, bias, top_k=2, score_func="sigmoid", n_group=2, topk_group=1)
    assert sorted(experts[0].tolist()) == [2, 3]  # group 1 wins on biased scores; group 0 is masked


def test_capacity_drops_the_latest_assignments():
    logits = torch.tensor([[5.0, 0.0]] * 3 + [[0.0, 5.0]])
    experts, dropped, counts, _ = _route(logits, top_k=1, capacity_factor=1.0)  # C = ceil(4/2) = 2
    assert dropped[:, 0].tolist() == [False, False, True, False] and counts.tolist() == [2, 1]


def _check_layout(experts, dropped, e, align):
    row_of_slot, slot_of_row, offsets = deepwell.moe_permute_index(experts, dropped, e, align)
    t, k = experts.shape
    rows = -(-(t * k + e * (align - 1)) // align) * align
    assert slot_of_row.shape == (rows,) and offsets.shape == (e + 1,) and row_of_slot.shape == (t, k)
    off = offsets.tolist()
    assert off[0] == 0 and off[-1] == rows and all(o % align == 0 for o in off)
    flat_e, flat_d, flat_r = experts.reshape(-1).tolist(), dropped.reshape(-1).tolist(), row_of_slot.reshape(-1).tolist()
    for ex in range(e):
        slots = [s for s in slot_of_row[off[ex]:off[ex + 1]].tolist() if s >= 0]
        want = [s for s in range(t * k) if flat_e[s] == ex and not flat_d[s]]
        assert slots == want  # contiguous, in slot order
        assert slot_of_row[off[ex]:off[ex] + len(want)].tolist() == want  # padding after the rows
    for s in range(t * k):
        assert (flat_r[s] == -1) == flat_d[s]
        if not flat_d[s]:
            assert slot_of_row[flat_r[s]] == s


@pytest.mark.parametrize("align", [1, 4, 16, 128])
@pytest.mark.parametrize("case", ["random", "one_expert", "empty_experts", "capacity"])
def test_permute_index_layout(align, case, gen):
    t, k, e = 29, 3, 8
    logits = torch.randn(t, e, generator=gen)
    if case == "one_expert":
        logits[:, 5] += 100  # every token's first choice
        logits[:, 2] += 50
    if case == "empty_experts":
        logits[:, :4] -= 100
    experts, dropped, *_ = _route(logits, top_k=k, capacity_factor=0.7 if case == "capacity" else None)
    _check_layout(experts, dropped, e, align)


def test_permute_index_refuses_out_of_range_experts():
    experts = torch.tensor([[0, 8]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"deepwell.moe_permute_index: argument 'experts' must hold expert indices in \[0, 8\), got 8 at \[0, 1\]"):
        deepwell.moe_permute_index(experts, torch.zeros(1, 2, dtype=torch.bool), 8, 1)


def _layout(t=11, k=2, e=4, align=4, seed=0, cf=None):
    g = torch.Generator().manual_seed(seed)
    experts, dropped, *_ = _route(torch.randn(t, e, generator=g), top_k=k, capacity_factor=cf)
    return experts, dropped, deepwell.moe_permute_index(experts, dropped, e, align)


@pytest.mark.parametrize("cf", [None, 0.6])
def test_dispatch_and_combine_match_the_model_with_gradients(cf):
    experts, dropped, (row_of_slot, slot_of_row, offsets) = _layout(cf=cf)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(11, 2, generator=g, dtype=torch.float64, requires_grad=True)
    xp = deepwell.moe_dispatch(x, slot_of_row, row_of_slot)
    rows = xp * torch.arange(1, xp.shape[0] + 1, dtype=torch.float64).unsqueeze(-1)  # a row-dependent op
    y = deepwell.moe_combine(rows, w, row_of_slot, slot_of_row)
    # The model: y[t] = Σ_k w[t,k] · (row index + 1) · x[t] over kept slots.
    want = torch.zeros_like(x)
    for t in range(11):
        for j in range(2):
            r = row_of_slot[t, j].item()
            if r >= 0:
                want[t] += w[t, j] * (r + 1) * x[t]
    torch.testing.assert_close(y, want)
    pad = slot_of_row < 0
    assert torch.all(xp[pad] == 0)
    torch.autograd.gradcheck(
        lambda x, w: deepwell.moe_combine(deepwell.moe_dispatch(x, slot_of_row, row_of_slot) * 2, w, row_of_slot, slot_of_row),
        (x, w),
    )


def test_combine_is_deterministic_and_sums_in_k_order():
    experts, dropped, (row_of_slot, slot_of_row, _) = _layout(t=64, k=4, e=8, align=1)
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(slot_of_row.shape[0], 33, generator=g).bfloat16()
    w = torch.rand(64, 4, generator=g)
    a = deepwell.moe_combine(rows, w, row_of_slot, slot_of_row)
    b = deepwell.moe_combine(rows, w, row_of_slot, slot_of_row)
    assert torch.equal(a, b)
    picked = rows[row_of_slot.long()].float() * w.unsqueeze(-1)
    want = ((picked[:, 0] + picked[:, 1]) + picked[:, 2]) + picked[:, 3]
    assert torch.equal(a, want.bfloat16())


BAD_ROUTE = [
    (dict(logits=torch.zeros(4)), "argument 'logits' must be 2-d (tokens, experts), got a 1-d tensor"),
    (dict(logits=torch.zeros(4, 8, dtype=torch.int32)), "argument 'logits' must have dtype"),
    (dict(top_k=9), "argument 'top_k' must be in [1, 8] (the experts), got 9"),
    (dict(score_func="relu"), "argument 'score_func' must be one of 'softmax', 'sigmoid', got \"relu\""),
    (dict(n_group=3), "argument 'n_group' must be 0 (no groups) or split the 8 experts into groups of at least 2, got 3"),
    (dict(n_group=4, topk_group=1, top_k=3), "argument 'topk_group' must be in [1, 4] and keep at least top_k=3 experts, got 1"),
    (dict(capacity_factor=-1.0), "argument 'capacity_factor' must be 0 (dropless) or a positive finite number, got -1"),
    (dict(capacity_factor=float("nan")), "got NaN"),
    (dict(bias=torch.zeros(7)), "argument 'bias' must have shape [8], got [7]"),
]


@pytest.mark.parametrize("bad,message", BAD_ROUTE, ids=[m[:40] for _, m in BAD_ROUTE])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_route_errors_are_the_same_in_rust_and_in_the_fake(bad, message, device):
    args = dict(logits=torch.zeros(4, 8), bias=None, top_k=2, score_func="softmax", n_group=0, topk_group=0, capacity_factor=0.0)
    args.update(bad)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(RuntimeError) as err:
        torch.ops.deepwell.moe_route(*args.values())
    assert str(err.value).startswith("deepwell.moe_route: ") and message in str(err.value)


BAD_PERMUTE = [
    (dict(experts=torch.zeros(4, 2, dtype=torch.int64)), "argument 'experts' must have dtype torch.int32, got torch.int64"),
    (dict(dropped=torch.zeros(4, 3, dtype=torch.bool)), "argument 'dropped' must have shape [4, 2], got [4, 3]"),
    (dict(num_experts=0), "argument 'num_experts' must be positive, got 0"),
    (dict(align=0), "argument 'align' must be in [1, 1024], got 0"),
    (dict(experts=torch.zeros(4, dtype=torch.int32)), "argument 'experts' must be 2-d (tokens, top_k), got a 1-d tensor"),
]


@pytest.mark.parametrize("bad,message", BAD_PERMUTE, ids=[m[:40] for _, m in BAD_PERMUTE])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_permute_errors_are_the_same_in_rust_and_in_the_fake(bad, message, device):
    args = dict(experts=torch.zeros(4, 2, dtype=torch.int32), dropped=torch.zeros(4, 2, dtype=torch.bool), num_experts=8, align=1)
    args.update(bad)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(RuntimeError) as err:
        torch.ops.deepwell.moe_permute_index(*args.values())
    assert str(err.value) == f"deepwell.moe_permute_index: {message}"


def test_the_router_ops_are_not_differentiable():
    logits = torch.randn(4, 8, requires_grad=True)
    experts, *_ = torch.ops.deepwell.moe_route(logits, None, 2, "softmax", 0, 0, 0.0)
    assert not experts.requires_grad and math.isfinite(float(experts.sum()))


# ---------------------------------------------------------------------------------------------
# CUDA kernels (cuda/moe.cuh): the same bits as the CPU reference.

GPU_ROUTERS = ROUTERS + [dict(top_k=8, score_func="sigmoid", bias=True, n_group=8, topk_group=4, experts=256),
                         dict(top_k=8, score_func="softmax", experts=128, capacity_factor=1.25),
                         dict(top_k=2, score_func="softmax", experts=512)]


def _logits(t, e, dtype, gen, kind):
    x = torch.randn(t, e, generator=gen)
    if kind == "ties":
        x = (x * 2).round() / 2  # many exact ties
    if kind == "nan":
        x[3] = float("nan")
        x[5, 1] = float("inf")
        x[7, :] = float("-inf")
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_ROUTERS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["random", "ties", "nan"])
def test_cuda_route_is_bit_identical_to_cpu(cfg, dtype, kind, gen):
    cfg = dict(cfg)
    e = cfg.pop("experts", 8)
    logits = _logits(1000, e, dtype, gen, kind)
    bias = (torch.randn(e, generator=gen) * 0.1).to(dtype) if cfg.pop("bias", False) else None
    cpu = _route(logits, bias, **cfg)
    gpu = _route(logits.cuda(), None if bias is None else bias.cuda(), **cfg)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("align", [1, 16, 128])
@pytest.mark.parametrize("cf", [None, 0.5])
@pytest.mark.parametrize("shape", [(1, 1, 1), (4096, 8, 128), (3000, 2, 8), (77, 4, 64)])
def test_cuda_permute_index_is_bit_identical_to_cpu(align, cf, shape, gen):
    t, k, e = shape
    logits = torch.randn(t, e, generator=gen)
    logits[: t // 2, 0] += 100  # one hot expert, and empty ones
    experts, dropped, *_ = _route(logits, top_k=k, capacity_factor=cf)
    cpu = deepwell.moe_permute_index(experts, dropped, e, align)
    gpu = deepwell.moe_permute_index(experts.cuda(), dropped.cuda(), e, align)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
def test_cuda_dispatch_and_combine_are_deterministic():
    experts, dropped, _ = _layout(t=4096, k=8, e=64, align=1)
    row_of_slot, slot_of_row, _ = (o.cuda() for o in deepwell.moe_permute_index(experts.cuda(), dropped.cuda(), 64, 1))
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(4096, 8, device="cuda", requires_grad=True)
    outs = []
    for _ in range(2):
        y = deepwell.moe_combine(deepwell.moe_dispatch(x, slot_of_row, row_of_slot) * 1.5, w, row_of_slot, slot_of_row)
        gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
        outs.append((y, gx, gw))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
