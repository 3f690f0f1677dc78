"""Op-boundary sweep: every public op (torch.ops.deepwell.*) and deepwell.Linear fed hostile input.
A bad call must raise a RuntimeError (ValueError for Python-level arguments) that names the op and
the argument, the fake kernel must reject it with the same message, and a good call must still give
the same bits afterwards. Test ids start with the class (`pytest -k "meta-"` runs one class):

- dtype-      a wrong dtype for every tensor argument
- empty-      a 0-element tensor for every tensor argument (first or last dim 0)
- zerodim-    a 0-d tensor for every tensor argument (equal to the 1-element call where that is the contract)
- layout-     strided, transposed and misaligned (storage offset 1) views: bits equal to the contiguous call
- dim-        out-of-range dims, block sizes, sizes and seeds (int64 extremes included)
- string-     bad strings for every str argument, and deepwell.Linear's recipe
- nonfinite-  NaN/Inf scales to the dequantizers, NaN/Inf inputs and global_amax: the documented result
- meta-       all-meta calls give correctly shaped meta outputs; any cpu/meta mix raises
- device-     cpu/cuda mixes (GPU only)
- thread-     8 threads calling ops at once: bits equal to a single-threaded run

Backprop through the (non-differentiable) quantizers is tested in test_not_differentiable.py.

`PYTHONPATH=torch_ops:tests python tests/ops/test_boundary.py` prints the number of cases per class (so
does test_case_counts, with -s).
"""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import deepwell
from _util import same_bits
from op_cases import _x

ops = torch.ops.deepwell
F = (torch.float32, torch.bfloat16, torch.float16)
E4M3, E5M2, E8M0, U8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.uint8


def _e8m0(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 150, (rows, cols), dtype=U8, generator=g).view(E8M0)


def good_call(op: str) -> dict:
    """A valid call of `op`, as keyword arguments in schema order."""
    if op == "mxfp8_quantize":
        return dict(x=_x(4, 64), dim=-1, scale_mode="rceil", elem="e4m3")
    if op == "mxfp8_quantize_rowcol":
        return dict(x=_x(64, 96), scale_mode="rceil", elem="e4m3", col_transposed=False, swizzle=False)
    if op == "mxfp8_dequantize":
        data, scale = ops.mxfp8_quantize(_x(4, 64))
        return dict(data=data, scale=scale, dim=-1, out_dtype=None)
    if op == "nvfp4_quantize":
        amax = torch.tensor([4.0])
        return dict(x=_x(32, 32), global_amax=amax, block_2d=False, stochastic=False, seed=0, hadamard=False)
    if op == "nvfp4_dequantize":
        data, scale, gs = ops.nvfp4_quantize(_x(4, 32))
        return dict(data=data, scale=scale, global_scale=gs, out_dtype=None)
    if op == "fp8_block_quantize":
        return dict(x=_x(128, 256), block_rows=1, block_cols=128, pow2=True)
    if op == "fp8_block_quantize_rowcol":
        return dict(x=_x(128, 256), pow2=True)
    if op == "fp8_block_dequantize":
        data, scale_inv = ops.fp8_block_quantize(_x(4, 256))
        return dict(data=data, scale_inv=scale_inv, block_rows=1, block_cols=128, out_dtype=None)
    if op == "fp8_block_swiglu_quantize_rowcol":
        return dict(gate_up=_x(128, 256), pow2=True)
    if op == "fp8_block_swiglu_backward_quantize_rowcol":
        return dict(gate_up=_x(128, 256), grad=_x(128, 128, seed=1), pow2=True)
    if op == "swizzle_scales":
        return dict(scale=_e8m0(130, 6))
    if op == "unswizzle_scales":
        return dict(swizzled=ops.swizzle_scales(_e8m0(130, 6)), rows=130, cols=6)
    lin = dict(x=_x(4, 64), weight=_x(32, 64, seed=1), bias=_x(32, seed=2))
    if op == "scaled_linear":
        return dict(lin, recipe="mxfp8", seed=None)
    if op == "mxfp8_linear":
        return lin
    assert op == "scaled_linear_backward", op
    return dict(grad_out=_x(4, 32), x=_x(4, 64, seed=1), weight=_x(32, 64, seed=2), recipe="mxfp8", seed=None,
                need_input=True, need_weight=True)  # fmt: skip


#: The dtypes each tensor argument accepts (mirrors rust/ops/src/ops/*/mod.rs).
ALLOWED = {
    "mxfp8_quantize": {"x": F},
    "mxfp8_quantize_rowcol": {"x": F},
    "mxfp8_dequantize": {"data": (E4M3, E5M2), "scale": (E8M0,)},
    "nvfp4_quantize": {"x": F, "global_amax": (torch.float32,)},
    "nvfp4_dequantize": {"data": (U8,), "scale": (E4M3,), "global_scale": (torch.float32,)},
    "fp8_block_quantize": {"x": F},
    "fp8_block_quantize_rowcol": {"x": F},
    "fp8_block_dequantize": {"data": (E4M3,), "scale_inv": (torch.float32,)},
    "fp8_block_swiglu_quantize_rowcol": {"gate_up": F},
    "fp8_block_swiglu_backward_quantize_rowcol": {"gate_up": F, "grad": (torch.bfloat16,)},
    "swizzle_scales": {"scale": (E8M0, E4M3, U8)},
    "unswizzle_scales": {"swizzled": (E8M0, E4M3, U8)},
    "scaled_linear": {"x": F, "weight": F, "bias": F},
    "mxfp8_linear": {"x": F, "weight": F, "bias": F},
    "scaled_linear_backward": {"grad_out": F, "x": F, "weight": F},
}
OPS = sorted(ALLOWED)
#: Tensor arguments whose contract is "one element": a 0-d tensor is valid there.
SCALARS = {("nvfp4_quantize", "global_amax"), ("nvfp4_dequantize", "global_scale")}
WRONG_DTYPES = (torch.int32, torch.float64, torch.bool, torch.int8, torch.float32, torch.complex64)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def call(op: str, kw: dict):
    return getattr(ops, op)(**kw)


def outputs(r) -> tuple:
    return tuple(r) if isinstance(r, (tuple, list)) else (r,)


def assert_same(got, want, what: str) -> None:
    got, want = outputs(got), outputs(want)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert same_bits(g, w), f"{what}: output {i} differs"


_REFERENCE: dict[str, tuple] = {}


def reference(op: str) -> tuple:
    """The good call's outputs, computed once (before any bad call of this test session)."""
    if op not in _REFERENCE:
        _REFERENCE[op] = outputs(call(op, good_call(op)))
    return _REFERENCE[op]


def expect_error(op: str, kw: dict, parts: list[str], exc=RuntimeError) -> str:
    """The call raises `exc` naming the op and `parts`, the fake kernel says the same, and the op
    still works afterwards."""
    reference(op)
    with pytest.raises(exc) as real:
        call(op, kw)
    msg = str(real.value)
    for p in [f"deepwell.{op}", *parts]:
        assert p in msg, f"{p!r} not in {msg!r}"
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(exc) as fake:
        call(op, kw)
    assert str(fake.value) == msg, "the fake kernel's message differs from the real kernel's"
    assert_same(call(op, good_call(op)), reference(op), f"{op} after an error")
    return msg


def tensor_args(op: str):
    return [(op, arg) for arg in ALLOWED[op]]


# ---------------------------------------------------------------------------------------------
# dtype-


def _dtype_cases():
    for op, arg in (c for op in OPS for c in tensor_args(op)):
        for wrong in [d for d in WRONG_DTYPES if d not in ALLOWED[op][arg]][:4]:
            yield pytest.param(op, arg, wrong, id=f"dtype-{op}-{arg}-{str(wrong)[6:]}")


@pytest.mark.parametrize("op,arg,wrong", list(_dtype_cases()))
def test_wrong_dtype(op, arg, wrong):
    kw = good_call(op)
    kw[arg] = torch.zeros(kw[arg].shape, dtype=wrong)
    expect_error(op, kw, [f"argument '{arg}' must have dtype", "got"])


# ---------------------------------------------------------------------------------------------
# empty- and zerodim-


def _empty_cases():
    for op, arg in (c for op in OPS for c in tensor_args(op)):
        for where in ("first", "last"):
            yield pytest.param(op, arg, where, id=f"empty-{op}-{arg}-{where}")


@pytest.mark.parametrize("op,arg,where", list(_empty_cases()))
def test_empty(op, arg, where):
    kw = good_call(op)
    shape = list(kw[arg].shape) or [1]
    shape[0 if where == "first" else -1] = 0
    kw[arg] = torch.empty(shape, dtype=kw[arg].dtype)
    expect_error(op, kw, [f"argument '{arg}' must"])


@pytest.mark.parametrize(
    "op,arg", [pytest.param(op, arg, id=f"zerodim-{op}-{arg}") for op in OPS for _, arg in tensor_args(op)]
)
def test_zero_dim(op, arg):
    kw = good_call(op)
    one = kw[arg].reshape(-1)[:1].reshape(())
    if (op, arg) in SCALARS:
        want = call(op, kw)
        kw[arg] = one
        assert_same(call(op, kw), want, f"{op} with a 0-d {arg}")
    else:
        kw[arg] = one
        expect_error(op, kw, [f"argument '{arg}' must"])


# ---------------------------------------------------------------------------------------------
# layout-: strided, transposed and misaligned views hold the same values and give the same bits.


def _strided(t):
    """Every other element of a buffer twice as long along the last dim."""
    bits = _BITS[t.element_size()]
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    big.view(bits)[..., ::2] = t.view(bits)
    return big[..., ::2]


def _transposed(t):
    """Column-major storage: the transpose of a contiguous transpose."""
    bits = _BITS[t.element_size()]
    return t.view(bits).t().contiguous().t().view(t.dtype)


def _offset(t):
    """The same values at storage offset 1 (the data pointer misaligned for vector loads)."""
    bits = _BITS[t.element_size()]
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
    flat.view(bits)[1:] = t.reshape(-1).view(bits)
    return flat[1:].view(t.shape)


LAYOUTS = {"strided": _strided, "transposed": _transposed, "offset": _offset}


def _layout_cases():
    for op, arg in (c for op in OPS for c in tensor_args(op)):
        for name in LAYOUTS:
            ndim = good_call(op)[arg].dim()
            if (name == "transposed" and ndim != 2) or (name == "strided" and ndim == 0):
                continue
            yield pytest.param(op, arg, name, id=f"layout-{op}-{arg}-{name}")
    for op in OPS:
        yield pytest.param(op, None, "offset", id=f"layout-{op}-all-offset")


@pytest.mark.parametrize("op,arg,layout", list(_layout_cases()))
def test_layout(op, arg, layout):
    kw = good_call(op)
    want = call(op, kw)
    for a in [arg] if arg else ALLOWED[op]:
        view = LAYOUTS[layout](kw[a])
        assert same_bits(view, kw[a])
        assert not view.is_contiguous() or layout == "offset" or view.numel() == 1
        kw[a] = view
    assert_same(call(op, kw), want, f"{op} with {layout} {arg or 'all tensors'}")


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda name: f"layout-Linear-x-{name}")
def test_layout_linear_module(layout):
    layer = deepwell.Linear(64, 32, recipe="mxfp8", guardrails=False)
    x = _x(4, 64, dtype=torch.float32)
    assert same_bits(layer(LAYOUTS[layout](x)), layer(x))


# ---------------------------------------------------------------------------------------------
# dim-: out-of-range ints fail with the argument named; in-range extremes (seeds) work.

I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
BAD_INTS = [
    ("mxfp8_quantize", {"dim": 2}, "'dim'"),
    ("mxfp8_quantize", {"dim": -3}, "'dim'"),
    ("mxfp8_quantize", {"dim": I64_MAX}, "'dim'"),
    ("mxfp8_quantize", {"dim": I64_MIN}, "'dim'"),
    ("mxfp8_dequantize", {"dim": 5}, "'dim'"),
    ("mxfp8_dequantize", {"dim": I64_MIN}, "'dim'"),
    ("mxfp8_dequantize", {"dim": 0}, "'data'"),
    ("fp8_block_quantize", {"block_rows": 0}, "'block_rows, block_cols'"),
    ("fp8_block_quantize", {"block_rows": -1}, "'block_rows, block_cols'"),
    ("fp8_block_quantize", {"block_cols": 2**40}, "'block_rows, block_cols'"),
    ("fp8_block_quantize", {"block_rows": 64, "block_cols": 64}, "'block_rows, block_cols'"),
    ("fp8_block_dequantize", {"block_rows": 1, "block_cols": 64}, "'block_rows, block_cols'"),
    ("fp8_block_dequantize", {"block_cols": I64_MIN}, "'block_rows, block_cols'"),
    ("unswizzle_scales", {"rows": 0}, "'rows, cols'"),
    ("unswizzle_scales", {"cols": -6}, "'rows, cols'"),
    ("unswizzle_scales", {"rows": I64_MIN}, "'rows, cols'"),
    ("unswizzle_scales", {"rows": 2**62, "cols": 2**62}, "'rows, cols'"),
    ("unswizzle_scales", {"rows": I64_MAX, "cols": 1}, "'rows, cols'"),
    ("unswizzle_scales", {"rows": 2**40, "cols": 3}, "'swizzled'"),
    ("unswizzle_scales", {"rows": 300}, "'swizzled'"),
]
GOOD_INTS = [
    ("nvfp4_quantize", {"stochastic": True, "seed": I64_MIN}),
    ("nvfp4_quantize", {"stochastic": True, "seed": I64_MAX}),
    ("nvfp4_quantize", {"stochastic": True, "seed": -1, "hadamard": True}),
    ("scaled_linear", {"recipe": "nvfp4", "seed": -1}),
    ("scaled_linear_backward", {"recipe": "nvfp4", "seed": I64_MIN}),
    ("scaled_linear_backward", {"recipe": "nvfp4", "seed": I64_MAX}),
]


def _int_id(prefix: str, op: str, change: dict) -> str:
    return f"{prefix}-{op}-" + "-".join(f"{k}={v}" for k, v in change.items())


@pytest.mark.parametrize("op,change,arg", [pytest.param(*c, id=_int_id("dim", *c[:2])) for c in BAD_INTS])
def test_bad_int(op, change, arg):
    expect_error(op, {**good_call(op), **change}, [f"argument {arg} must"])


@pytest.mark.parametrize("op,change", [pytest.param(*c, id=_int_id("dim-ok", *c)) for c in GOOD_INTS])
def test_extreme_seed_is_deterministic(op, change):
    kw = {**good_call(op), **change}
    assert_same(call(op, kw), call(op, kw), f"{op} {change}")


# ---------------------------------------------------------------------------------------------
# string-

BAD_STRINGS = {"empty": "", "upper": None, "space": None, "nul": None, "unicode": "é", "long": "x" * 10_000}


def _mangle(good: str, how: str) -> str:
    return {"upper": good.upper(), "space": good + " ", "nul": good + "\0"}.get(how, BAD_STRINGS.get(how))


def _string_cases():
    for op in OPS:
        for arg, value in good_call(op).items():
            if isinstance(value, str):
                for how in BAD_STRINGS:
                    yield pytest.param(op, arg, how, id=f"string-{op}-{arg}-{how}")


@pytest.mark.parametrize("op,arg,how", list(_string_cases()))
def test_bad_string(op, arg, how):
    kw = good_call(op)
    kw[arg] = _mangle(kw[arg], how)
    msg = expect_error(op, kw, [f"argument '{arg}' must be one of"])
    assert len(msg) < 2_000, "the message repeats a huge argument in full"


@pytest.mark.parametrize("recipe", ["fp4", "", "MXFP8", None, 3], ids=lambda r: f"string-Linear-recipe-{r!r}")
def test_linear_bad_recipe(recipe):
    with pytest.raises((ValueError, TypeError), match=r"deepwell.Linear: argument 'recipe' must be one of"):
        deepwell.Linear(64, 32, recipe=recipe)
    layer = deepwell.Linear(64, 32, recipe="mxfp8", guardrails=False)
    assert layer(_x(4, 64, dtype=torch.float32)).shape == (4, 32)


# ---------------------------------------------------------------------------------------------
# nonfinite-: special scales follow IEEE products; special amaxes follow docs/NUMERICS.md.

SPECIALS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "zero": 0.0}
f32 = torch.float32


@pytest.mark.parametrize("v", SPECIALS, ids=lambda v: f"nonfinite-fp8_block_dequantize-scale_inv-{v}")
def test_fp8_block_special_scale(v):
    kw = dict(good_call("fp8_block_dequantize"), out_dtype=f32)
    kw["scale_inv"] = kw["scale_inv"].clone()
    kw["scale_inv"][0, 0] = SPECIALS[v]
    want = kw["data"].float() * kw["scale_inv"].repeat_interleave(128, dim=1)
    assert same_bits(call("fp8_block_dequantize", kw), want)


@pytest.mark.parametrize("v", SPECIALS, ids=lambda v: f"nonfinite-nvfp4_dequantize-global_scale-{v}")
def test_nvfp4_special_global_scale(v):
    kw = dict(good_call("nvfp4_dequantize"), out_dtype=f32)
    unit = call("nvfp4_dequantize", dict(kw, global_scale=torch.tensor(1.0)))
    kw["global_scale"] = torch.tensor(SPECIALS[v])
    assert same_bits(call("nvfp4_dequantize", kw), unit * SPECIALS[v])


# (op, the scale's NaN code, block size): E4M3 0x7F is NaN; E8M0 has no Inf and 0xFF is NaN. That
# block, and only it, dequantizes to NaN.
NAN_SCALES = [("nvfp4_dequantize", 0x7F, 16), ("mxfp8_dequantize", 0xFF, 32)]


@pytest.mark.parametrize("op,code,block", NAN_SCALES, ids=[f"nonfinite-{op}-scale-nan" for op, _, _ in NAN_SCALES])
def test_nan_block_scale(op, code, block):
    kw = dict(good_call(op), out_dtype=f32)
    want = call(op, kw)
    kw["scale"] = kw["scale"].clone()
    kw["scale"].view(U8)[0, 0] = code
    got = call(op, kw)
    assert got[0, :block].isnan().all() and same_bits(got[0, block:], want[0, block:]) and same_bits(got[1:], want[1:])


@pytest.mark.parametrize("v", ["nan", "inf", "-inf"], ids=lambda v: f"nonfinite-nvfp4_quantize-amax-{v}")
def test_nvfp4_special_global_amax(v):
    """docs/NUMERICS.md: a global amax of 0, ±Inf or NaN gives S_enc = 1."""
    kw = good_call("nvfp4_quantize")
    want = call("nvfp4_quantize", dict(kw, global_amax=torch.tensor([0.0])))
    assert_same(call("nvfp4_quantize", dict(kw, global_amax=torch.tensor([SPECIALS[v]]))), want, v)


@pytest.mark.parametrize(
    "op,v",
    [
        pytest.param(op, v, id=f"nonfinite-{op}-x-{v}")
        for op in ("mxfp8_quantize", "fp8_block_quantize", "nvfp4_quantize")
        for v in ("nan", "inf")
    ],
)
def test_special_input_is_confined_to_its_block(op, v):
    """A NaN/Inf element changes its own block only (its scale: NaN for MX, 1 for FP8 block)."""
    kw = good_call(op)
    want = outputs(call(op, kw))
    x = kw["x"].clone()
    x[-1, 0] = SPECIALS[v]
    got = outputs(call(op, dict(kw, x=x, **({"global_amax": None} if op == "nvfp4_quantize" else {}))))
    if op == "nvfp4_quantize":  # the computed global amax is non-finite: S_enc = 1 everywhere
        assert got[2].item() == 1.0
        return
    data, scale = got[0].view(U8), got[1]
    assert same_bits(data[:-1], want[0].view(U8)[:-1]) and same_bits(scale[:-1], want[1][:-1])
    if op == "mxfp8_quantize":
        assert scale.view(U8)[-1, 0] == 0xFF
    else:
        assert scale[-1, 0] == 1.0


# ---------------------------------------------------------------------------------------------
# meta- and device-


def _meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("op", [pytest.param(op, id=f"meta-{op}-all") for op in OPS])
def test_meta_call(op):
    got = outputs(call(op, {k: _meta(v) for k, v in good_call(op).items()}))
    want = reference(op)
    assert [(o.device.type, o.shape, o.dtype) for o in got] == [("meta", w.shape, w.dtype) for w in want]


def _mixed_cases(device: str):
    for op in OPS:
        if len(ALLOWED[op]) > 1:
            for arg in ALLOWED[op]:
                cls = "meta" if device == "meta" else "device"
                yield pytest.param(op, arg, id=f"{cls}-{op}-{arg}-on-{device}")


@pytest.mark.parametrize("op,arg", list(_mixed_cases("meta")))
def test_cpu_meta_mix(op, arg):
    kw = good_call(op)
    kw[arg] = kw[arg].to("meta")
    with pytest.raises(RuntimeError, match=rf"deepwell\.{op}: argument '\w+' must be on (cpu|meta) like"):
        call(op, kw)
    # ... and the rest on meta, this one on the CPU.
    kw = {k: (v if k == arg else _meta(v)) for k, v in good_call(op).items()}
    with pytest.raises(RuntimeError, match=rf"deepwell\.{op}: argument '\w+' must be on (cpu|meta) like"):
        call(op, kw)
    assert_same(call(op, good_call(op)), reference(op), op)


@pytest.mark.parametrize("_", [pytest.param(0, id="meta-Linear")])
def test_meta_linear_module(_):
    """A meta deepwell.Linear gives meta outputs of the right shape; a meta layer on CPU input raises."""
    layer = deepwell.Linear(64, 32, device="meta", recipe="mxfp8", guardrails=False)
    assert layer(torch.empty(2, 4, 64, device="meta")).shape == (2, 4, 32)
    with pytest.raises(RuntimeError, match=r"deepwell\.scaled_linear: argument 'weight' must be on cpu like"):
        layer(torch.randn(4, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("op,arg", list(_mixed_cases("cuda")))
def test_cpu_cuda_mix(op, arg):
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) and k != arg else v) for k, v in good_call(op).items()}
    with pytest.raises(RuntimeError, match=rf"deepwell\.{op}: argument '\w+' must be on"):
        call(op, kw)


# ---------------------------------------------------------------------------------------------
# thread-: 8 threads at once, results bit-identical to one thread.


def _linear_step(recipe: str):
    """scaled_linear forward and backward with a fixed seed: (y, dx, dw, db)."""

    def step():
        x = _x(64, 128, dtype=torch.float32, seed=5).requires_grad_()
        w = _x(128, 128, dtype=torch.float32, seed=6).requires_grad_()
        b = _x(128, dtype=torch.float32, seed=7).requires_grad_()
        y = ops.scaled_linear(x, w, b, recipe, 1234)
        y.backward(_x(64, 128, dtype=torch.float32, seed=8))
        return (y.detach(), x.grad, w.grad, b.grad)

    return step


def _op_call(op: str, **change):
    return lambda: call(op, {**good_call(op), **change})


THREAD_WORK = {
    "mxfp8_quantize": _op_call("mxfp8_quantize"),
    "nvfp4_quantize": _op_call("nvfp4_quantize", stochastic=True, seed=9, hadamard=True),
    "fp8_block_quantize_rowcol": _op_call("fp8_block_quantize_rowcol"),
    "mxfp8_dequantize": _op_call("mxfp8_dequantize"),
    **{f"scaled_linear-{r}": _linear_step(r) for r in ("mxfp8", "nvfp4", "fp8_block", "bf16")},
}


def _run_threads(work: list, n_threads=8, rounds=3):
    """Runs every callable `rounds` times in each of `n_threads` threads started together."""
    results = collections.defaultdict(list)
    errors = []
    barrier = threading.Barrier(n_threads)

    def worker(i):
        try:
            barrier.wait()
            for r in range(rounds):
                for j in range(len(work)):
                    k = (j + i + r) % len(work)  # each thread in its own order
                    results[k].append(outputs(work[k]()))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("name", [pytest.param(n, id=f"thread-{n}") for n in [*THREAD_WORK, "all"]])
def test_threads_match_single_thread(name):
    names = list(THREAD_WORK) if name == "all" else [name]
    work = [THREAD_WORK[n] for n in names]
    want = [outputs(w()) for w in work]
    for k, got in _run_threads(work).items():
        for g in got:
            assert_same(g, want[k], f"{names[k]} in a thread")


# ---------------------------------------------------------------------------------------------


CLASSES = ("dtype", "empty", "zerodim", "layout", "dim", "string", "nonfinite", "meta", "device", "thread")


def case_ids() -> list[str]:
    """The ids of every parametrized case of this module (GPU-only ones included)."""
    ids = []
    for f in [v for k, v in globals().items() if k.startswith("test_")]:
        for mark in getattr(f, "pytestmark", []):
            if mark.name == "parametrize":
                make_id = mark.kwargs.get("ids")
                for i, p in enumerate(mark.args[1]):
                    ids.append(getattr(p, "id", None) or (make_id(p) if callable(make_id) else make_id[i]))
    return ids


def case_counts() -> collections.Counter:
    return collections.Counter(i.split("-")[0] for i in case_ids())


def test_case_counts():
    counts = case_counts()
    print("\nboundary cases per class:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    assert set(counts) == set(CLASSES)


if __name__ == "__main__":
    counts = case_counts()
    print(", ".join(f"{k} {v}" for k, v in sorted(counts.items())), f"(total {sum(counts.values())})")
