"""deepwell's direct cuBLASLt FP8 GEMM (rust/ops/src/gemm/cublaslt.rs) against the call it replaces,
`aten::_scaled_mm_v2` on the same operands (the `direct_cublaslt` switch off): the same bits for
every recipe and pass it takes, under every way a cached plan's inputs can change (shape, bias,
output dtype, SM carveout, fresh data, another thread), with the path's own GEMM count proving it
ran rather than silently falling back to aten."""

from __future__ import annotations

import threading

import pytest
import torch

from deepwell import _native

ops = torch.ops.deepwell


def _switch(enable: bool | None = None) -> dict:
    return _native.call("direct_cublaslt", {} if enable is None else {"enable": enable})


def _both(fn):
    """fn() on the direct path, then through aten; with the GEMMs the direct path ran."""
    before = _switch(True)["calls"]
    fast = fn()
    torch.cuda.synchronize()
    ran = _switch()["calls"] - before
    _switch(False)
    try:
        slow = fn()
    finally:
        _switch(True)
    return fast, slow, ran


def _same(fast, slow):
    fast, slow = (fast,) if torch.is_tensor(fast) else fast, (slow,) if torch.is_tensor(slow) else slow
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"differs from aten::_scaled_mm_v2 at {(a != b).sum().item()} elements"


def _layer(m, k, n, dtype, bias, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    dy = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    return x, w, b, dy


def test_switch_answers_and_checks_its_argument():
    state = _switch()
    assert state["enabled"] is True and isinstance(state["loaded"], bool) and state["calls"] >= 0
    assert isinstance(state["declined"], dict)
    with pytest.raises(ValueError, match="direct_cublaslt: 'enable' must be true or false, got \"yes\""):
        _switch("yes")
    assert _switch()["enabled"] is True


# (M, K, N): K % 512 == 0 for fp8_block's fprop and dgrad on cuBLASLt (the policy sends other K to
# deepwell's kernel); M = 132 is no multiple of 128; the first shape again at the end, after the
# cache holds the others.
SHAPES = [(256, 1024, 512), (512, 2048, 1536), (132, 512, 1024), (256, 1024, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_backward_match_aten_bit_for_bit(recipe, dtype, bias):
    if not _switch()["loaded"]:
        pytest.skip("torch's libcublasLt is not loaded in this process")
    for i, (m, k, n) in enumerate(SHAPES):
        x, w, b, dy = _layer(m, k, n, dtype, bias, seed=i)
        fast, slow, ran = _both(lambda: ops.scaled_linear(x, w, b, recipe, None))
        _same(fast, slow)
        assert ran == 1, f"the forward GEMM ran {ran} times on the direct path, not once: {_switch()['declined']}"
        fast, slow, ran = _both(lambda: ops.scaled_linear_backward(dy, x, w, recipe, None, True, True))
        _same(fast, slow)
        # wgrad contracts over the M tokens: with M = 132 the policy runs it off cuBLASLt (fp8_block:
        # M % 128 != 0, bf16; fp8_tensor: M % 16 != 0, emulated; rust/core/src/policy/dispatch.rs).
        want = 2 if m % 128 == 0 else 1
        assert ran == want, f"dgrad and wgrad ran {ran} times on the direct path, not {want}: {_switch()['declined']}"


@pytest.mark.gpu
def test_fresh_data_in_a_cached_shape_gives_fresh_results():
    """The plan is cached per shape; the operands' pointers and scales are set on every call."""
    if not _switch()["loaded"]:
        pytest.skip("torch's libcublasLt is not loaded in this process")
    outs = []
    for seed in (1, 2):
        x, w, b, _ = _layer(256, 1024, 512, torch.bfloat16, True, seed)
        fast, slow, ran = _both(lambda: ops.scaled_linear(x, w, b, "fp8_block", None))
        _same(fast, slow)
        outs.append(fast)
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_sm_carveout_and_another_thread_match_aten():
    """A carveout is part of the plan's key (an SM count target); a thread builds its own plans."""
    if not _switch()["loaded"]:
        pytest.skip("torch's libcublasLt is not loaded in this process")
    x, w, b, dy = _layer(512, 2048, 1536, torch.bfloat16, True, seed=5)
    own = _native.call("sm_carveout")
    try:
        for left in (8, 0):
            _native.call("sm_carveout", {"sms": left})
            fast, slow, ran = _both(lambda: ops.scaled_linear_backward(dy, x, w, "fp8_block", None, True, True))
            _same(fast, slow)
            assert ran == 2
    finally:
        _native.call("sm_carveout", {"sms": own})
    main = ops.scaled_linear(x, w, b, "fp8_block", None)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("y", ops.scaled_linear(x, w, b, "fp8_block", None)))
    thread.start()
    thread.join()
    assert torch.equal(box["y"], main)
