"""The weight cache against the slow, obviously correct path, under every way a weight can change.

The reference quantizes a fresh copy of the weight on every call (`w.clone()`: a new storage each
time, so nothing can be reused). The paths under test are the default (no reuse across calls) and
`deepwell.microbatches()` (reuse across the micro-batches of one step). Both must give the
reference's losses and weights bit for bit, whatever the optimizer (fused optimizers do not move
the version counter, the bug this file was written for) and whatever writes the weight.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import deepwell
from _util import same_bits

ops = torch.ops.deepwell
DIM = 128  # fp8_block's 128x128 weight tiles
RECIPES = ("fp8_block", "mxfp8", "nvfp4")

OPTIMIZERS = {
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=3e-3, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=True),
    "adamw-single": lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=False),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=3e-3, fused=True),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
}


class MLP(torch.nn.Module):
    """Two deepwell linears; `fresh=True` is the reference (a new copy of each weight per call)."""

    def __init__(self, recipe: str, fresh: bool = False, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(DIM, DIM, generator=g) / DIM**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(DIM, DIM, generator=g) / DIM**0.5)
        self.recipe, self.fresh = recipe, fresh

    def _w(self, w):
        return w.clone() if self.fresh else w

    def forward(self, x):
        h = torch.relu(ops.scaled_linear(x, self._w(self.w1), None, self.recipe, None))
        return ops.scaled_linear(h, self._w(self.w2), None, self.recipe, None)


def _batches(steps: int, micro: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(64, DIM, generator=g) for _ in range(micro)] for _ in range(steps)]


def _train(model, make_opt, batches, scope: bool):
    """Losses and final weights of a run with gradient accumulation over each step's micro-batches."""
    deepwell.manual_seed(7)  # NVFP4's stochastic rounding draws the same seeds in every run
    opt = make_opt(list(model.parameters()))
    losses = []
    for micro in batches:
        with deepwell.microbatches() if scope else contextlib.nullcontext():
            for x in micro:
                loss = model(x).square().mean()
                loss.backward()
                losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def _assert_same_run(a, b):
    (la, wa), (lb, wb) = a, b
    assert same_bits(la, lb), f"losses differ: {la.tolist()} vs {lb.tolist()}"
    for x, y in zip(wa, wb):
        assert same_bits(x, y)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_training_matches_the_uncached_path(recipe, name):
    """N steps x 2 micro-batches: default and micro-batch reuse give the reference bit for bit."""
    batches = _batches(steps=4, micro=2)
    reference = _train(MLP(recipe, fresh=True), OPTIMIZERS[name], batches, scope=False)
    _assert_same_run(_train(MLP(recipe), OPTIMIZERS[name], batches, scope=False), reference)
    before = deepwell.weight_cache_info()
    _assert_same_run(_train(MLP(recipe), OPTIMIZERS[name], batches, scope=True), reference)
    after = deepwell.weight_cache_info()
    # Each weight was quantized once per step and reused by its other passes: w2 by fwd2, bwd1 and
    # bwd2; w1 by fwd2 (x needs no gradient, so the first layer's backward never reads W).
    assert after["misses"] - before["misses"] == 2 * len(batches)
    assert after["hits"] - before["hits"] == (3 + 1) * len(batches)
    assert after["entries"] == 0  # the scope closed


def test_the_default_path_never_reuses():
    before = deepwell.weight_cache_info()
    _train(MLP("fp8_block"), OPTIMIZERS["adamw-fused"], _batches(2, 2), scope=False)
    after = deepwell.weight_cache_info()
    assert after["hits"] == before["hits"] and after["entries"] == 0


def _with(fn):
    def write(w: torch.nn.Parameter):
        with torch.no_grad():
            fn(w)

    return write


def _resize_and_refill(w):
    """What FSDP2 does to an unsharded parameter: free its storage, re-allocate it, copy into it."""
    new = torch.randn_like(w)
    w.untyped_storage().resize_(0)
    w.untyped_storage().resize_(w.numel() * w.element_size())
    w.copy_(new)


def _set_data(w):
    w.data = torch.randn_like(w)


def _to_and_back(w):
    w.data = w.data.to(torch.float16).to(torch.float32) + 1.0


WRITES = {
    "no-grad-add": _with(lambda w: w.add_(1.0)),
    "copy": _with(lambda w: w.copy_(torch.randn_like(w))),
    "data-assign": _set_data,
    "dtype-round-trip": _to_and_back,
    "storage-resize": _with(_resize_and_refill),
}
# Seen only because nothing is reused outside a scope (no signal moves: no version bump).
WRITES_BYPASSING_THE_COUNTER = {
    "data-add": lambda w: w.data.add_(1.0),
    "data-copy": lambda w: w.data.copy_(torch.randn_like(w)),
    "numpy-write": lambda w: w.detach().numpy().__imul__(-1.0),
}


def _fresh(x, w, recipe):
    return ops.scaled_linear(x, w.clone(), None, recipe, 3)


def _check_write(write, recipe: str, scope: bool):
    """Forward, write, forward and backward: each pass must see the written weight."""
    x = torch.randn(64, DIM, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(DIM, DIM))
    with deepwell.microbatches() if scope else contextlib.nullcontext():
        y0 = ops.scaled_linear(x, w, None, recipe, 3)
        assert same_bits(y0, _fresh(x, w, recipe))
        write(w)
        y1 = ops.scaled_linear(x, w, None, recipe, 3)
        assert same_bits(y1, _fresh(x, w, recipe))
        assert not same_bits(y1, y0)
        y1.sum().backward()  # dx = dy W: the backward's operand of W follows the write too
        dx, x.grad = x.grad, None
    _fresh(x, w.detach(), recipe).sum().backward()
    assert same_bits(dx, x.grad)


@pytest.mark.parametrize("scope", [False, True], ids=["default", "microbatches"])
@pytest.mark.parametrize("write", WRITES, ids=list(WRITES))
@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8"])
def test_every_write_is_seen(write, recipe, scope):
    _check_write(WRITES[write], recipe, scope)


@pytest.mark.parametrize("write", WRITES_BYPASSING_THE_COUNTER, ids=list(WRITES_BYPASSING_THE_COUNTER))
def test_writes_bypassing_the_version_counter_are_seen_outside_a_scope(write):
    _check_write(WRITES_BYPASSING_THE_COUNTER[write], "fp8_block", scope=False)


def test_load_state_dict_is_seen_inside_a_scope():
    model, other = MLP("fp8_block"), MLP("fp8_block", seed=5)
    x = torch.randn(64, DIM)
    with deepwell.microbatches():
        y0 = model(x)
        model.load_state_dict(other.state_dict())
        y1 = model(x)
    assert same_bits(y1, MLP("fp8_block", fresh=True, seed=5)(x))
    assert not same_bits(y0, y1)


@pytest.mark.parametrize("name", ["adamw-fused", "sgd-fused", "adamw-foreach"])
def test_an_optimizer_step_inside_a_scope_ends_reuse(name):
    """The global optimizer hooks drop every entry, even for steps that move no version counter."""
    model = MLP("fp8_block")
    opt = OPTIMIZERS[name](list(model.parameters()))
    x = torch.randn(64, DIM)
    with deepwell.microbatches():
        model(x).sum().backward()
        assert deepwell.weight_cache_info()["entries"] == 2
        opt.step()
        assert deepwell.weight_cache_info()["entries"] == 0
        y = model(x)
    reference = MLP("fp8_block", fresh=True)
    reference.load_state_dict(model.state_dict())
    assert same_bits(y, reference(x))


def test_a_new_tensor_at_a_freed_weights_address_is_not_a_hit():
    """`w.data = ...` frees the old storage; the entry's alias keeps it, so no other tensor can take
    its address while the entry lives (without the check, stale hits came in 10 of 20 trials)."""
    x = torch.randn(64, DIM)
    w = torch.nn.Parameter(torch.randn(DIM, DIM))
    with deepwell.microbatches():
        for _ in range(20):
            assert same_bits(ops.scaled_linear(x, w, None, "fp8_block", 0), _fresh(x, w, "fp8_block"))
            w.data = torch.randn(DIM, DIM)


def test_a_weight_at_the_address_of_a_resized_storage_is_not_a_hit():
    """FSDP2 frees a block's gathered weights in place (`storage.resize_(0)`) after its forward; the
    next block's weights may land at that address with a version counter of the same value. Found
    by the 2-process Trainer test (tests/distributed/test_parallel.py): wrong losses from the second step."""
    x = torch.randn(64, DIM)
    reused = 0
    with deepwell.microbatches():
        for _ in range(20):
            w0 = torch.empty(DIM, DIM).normal_()  # (no temporaries: the allocator reuses addresses)
            ops.scaled_linear(x, w0, None, "fp8_block", 0)  # cached
            address = w0.data_ptr()
            w0.untyped_storage().resize_(0)  # FSDP2's reshard after forward
            w1 = torch.empty(DIM, DIM).normal_()
            reused += w1.data_ptr() == address
            assert w1._version == w0._version
            assert same_bits(ops.scaled_linear(x, w1, None, "fp8_block", 0), _fresh(x, w1, "fp8_block"))
    assert reused, "the allocator never reused the address: the test proved nothing"  # 5 of 20 here


def test_entries_whose_storage_moved_are_swept_out():
    """FSDP2 frees each gathered weight after its pass and gathers it into fresh memory for the
    next: such an entry can never hit again, and a scope must not keep its operands until it closes.
    A miss sweeps them out once the entries have doubled since the last sweep (at 32 at least:
    weight_cache.rs `dead`), and a live entry keeps hitting. Each weight has its own shape, so no
    entry is replaced by a later weight at a reused address: only the sweeps remove them."""
    x = torch.randn(64, DIM)
    with deepwell.microbatches():
        kept = torch.randn(DIM, DIM)
        ops.scaled_linear(x, kept, None, "fp8_block", 0)
        seen = []
        for i in range(1, 61):
            w = torch.randn(128 * i, DIM)
            ops.scaled_linear(x, w, None, "fp8_block", 0)
            seen.append(deepwell.weight_cache_info()["entries"])
            w.untyped_storage().resize_(0)  # FSDP2's reshard
        # 2, 3, ..., 32; then the miss that finds 32 sweeps out the 31 dead: kept's and its own.
        assert seen[:31] == list(range(2, 33)) and seen[31] == 2 and max(seen) == 32, seen
        hits = deepwell.weight_cache_info()["hits"]
        assert same_bits(ops.scaled_linear(x, kept, None, "fp8_block", 0), _fresh(x, kept, "fp8_block"))
        assert deepwell.weight_cache_info()["hits"] == hits + 1  # a live entry stays
    assert deepwell.weight_cache_info()["entries"] == 0


def test_views_and_dtypes_of_one_storage_are_told_apart():
    x = torch.randn(64, DIM)
    sq = torch.randn(DIM, DIM)
    with deepwell.microbatches():
        a, b = ops.scaled_linear(x, sq, None, "mxfp8", 0), ops.scaled_linear(x, sq.t(), None, "mxfp8", 0)
        c = ops.scaled_linear(x, sq.bfloat16(), None, "mxfp8", 0)
    assert same_bits(b, _fresh(x, sq.t().contiguous(), "mxfp8"))
    assert not same_bits(a, b)
    assert same_bits(c, _fresh(x, sq.bfloat16(), "mxfp8"))


def test_scopes_nest_and_the_outermost_drops_the_entries():
    x, w = torch.randn(64, DIM), torch.randn(DIM, DIM)
    with deepwell.microbatches():
        with deepwell.microbatches():
            ops.scaled_linear(x, w, None, "fp8_block", 0)
        assert deepwell.weight_cache_info()["entries"] == 1
        hits = deepwell.weight_cache_info()["hits"]
        ops.scaled_linear(x, w, None, "fp8_block", 0)
        assert deepwell.weight_cache_info()["hits"] == hits + 1
    assert deepwell.weight_cache_info()["entries"] == 0


def test_reuse_switched_off_caches_nothing_even_in_an_open_scope():
    """`allow_reuse(False)` (what compiling CUDA graphs does) drops the entries of an open scope and
    caches nothing after; `allow_reuse(True)` restores reuse. Results never change."""
    from deepwell.nn.weight_cache import allow_reuse

    x, w = torch.randn(64, DIM), torch.randn(DIM, DIM)
    want = _fresh(x, w, "fp8_block")
    try:
        with deepwell.microbatches():
            ops.scaled_linear(x, w, None, "fp8_block", 0)
            assert deepwell.weight_cache_info()["entries"] == 1
            allow_reuse(False)
            assert deepwell.weight_cache_info()["entries"] == 0
            hits = deepwell.weight_cache_info()["hits"]
            for _ in range(2):
                assert same_bits(ops.scaled_linear(x, w, None, "fp8_block", 0), want)
            assert deepwell.weight_cache_info() | {"misses": 0} == {"entries": 0, "hits": hits, "misses": 0}
            allow_reuse(True)
            for _ in range(2):
                assert same_bits(ops.scaled_linear(x, w, None, "fp8_block", 0), want)
            assert deepwell.weight_cache_info()["hits"] == hits + 1
    finally:
        allow_reuse(True)


def test_inference_tensors_are_never_cached():
    x = torch.randn(64, DIM)
    with torch.inference_mode():
        w = torch.randn(DIM, DIM)
    with deepwell.microbatches():
        ops.scaled_linear(x, w, None, "fp8_block", 0)
        assert deepwell.weight_cache_info()["entries"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw-fused", "adam-capturable", "adamw-capturable-foreach"])
def test_cuda_training_matches_the_uncached_path(name):
    """The fused and capturable optimizers on the GPU (capturable needs CUDA tensors)."""
    make = {
        "adamw-fused": OPTIMIZERS["adamw-fused"],
        "adam-capturable": lambda p: torch.optim.Adam(p, lr=3e-3, capturable=True, foreach=False),
        "adamw-capturable-foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, capturable=True, foreach=True),
    }[name]
    batches = [[x.cuda() for x in micro] for micro in _batches(steps=3, micro=2)]
    runs = []
    for fresh, scope in ((True, False), (False, False), (False, True)):
        runs.append(_train(MLP("fp8_block", fresh=fresh).cuda(), make, batches, scope=scope))
    _assert_same_run(runs[1], runs[0])
    _assert_same_run(runs[2], runs[0])


@pytest.mark.gpu
def test_cuda_graph_capture_never_reuses():
    """Under capture a hit would skip the quantization in every replay: capture bypasses the cache."""
    x = torch.randn(64, DIM, device="cuda")
    w = torch.randn(DIM, DIM, device="cuda")
    with deepwell.microbatches():
        ops.scaled_linear(x, w, None, "fp8_block", 0)  # an entry exists
        hits = deepwell.weight_cache_info()["hits"]
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops.scaled_linear(x, w, None, "fp8_block", 0)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            y = ops.scaled_linear(x, w, None, "fp8_block", 0)
        with torch.no_grad():
            w.copy_(torch.randn_like(w))
        graph.replay()
        torch.cuda.synchronize()
        assert deepwell.weight_cache_info()["hits"] == hits + 1  # the warm-up's, not the capture's
    assert same_bits(y, _fresh(x, w, "fp8_block"))


def test_optimizer_hooks_exist_only_while_a_scope_is_open():
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    with deepwell.microbatches():
        with deepwell.microbatches():
            assert len(_global_optimizer_pre_hooks) == before[0] + 1
        assert len(_global_optimizer_post_hooks) == before[1] + 1
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == before
