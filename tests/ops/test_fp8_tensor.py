"""deepwell.fp8_tensor_quantize / _rowcol / _dequantize on CPU: bit-exact against the float64 model
of docs/NUMERICS.md "FP8 tensor" (one power-of-two scale per tensor, E4M3 or E5M2), the scale
rules and special values, and the rowcol copy being the codes transposed. The CUDA kernels are
compared with these in test_cuda_kernels.py; the fp8_tensor linear layers in test_linear.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepwell
from _util import FLOAT_DTYPES, bytes_of, np_f32, rounded, same_bits, wide_range
from reference import numerics as ref

ELEMS = ("e4m3", "e5m2")
CODE_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def check_against_model(x, elem="e4m3"):
    data, scale_inv = deepwell.fp8_tensor_quantize(x, elem)
    want_data, want_scale = ref.fp8_tensor_quantize(np_f32(x), elem)
    assert data.dtype == CODE_DTYPE[elem] and data.shape == x.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == ()
    assert np.float32(scale_inv.item()).view(np.uint32) == want_scale.view(np.uint32)
    np.testing.assert_array_equal(bytes_of(data), want_data)
    for out_dtype in FLOAT_DTYPES:
        got = deepwell.fp8_tensor_dequantize(data, scale_inv, out_dtype)
        assert same_bits(got, rounded(ref.fp8_tensor_dequantize(want_data, want_scale, elem), out_dtype))
    return data, scale_inv


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("spread", [3, 30])
def test_random_matches_model(dtype, elem, spread, gen):
    """Narrow data, and data spanning 1e-30..1e30 (most of it flushes to zero or saturates: one
    scale serves the whole tensor, which is exactly the recipe's weakness the model must agree on)."""
    check_against_model(wide_range((96, 200), gen, dtype, lo=-spread, hi=spread), elem)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 7), (33, 1)])
def test_any_shape_and_strided_views(shape, gen):
    x = torch.randn(shape, generator=gen)
    check_against_model(x)
    base = torch.randn(40, 66, generator=gen).bfloat16()
    check_against_model(base.t())
    check_against_model(base[:, 1:])


@pytest.mark.parametrize("elem", ELEMS)
def test_scale_rules(elem):
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[elem]
    # amax 0 -> scale 1; amax = max -> 1; amax 3 -> max / 3 rounded down to a power of two;
    # a subnormal amax -> max / amax overflows -> FLT_MAX -> 2^127.
    for amax, scale in [(0.0, 1.0), (fmax, 1.0), (3.0, 2.0 ** np.floor(np.log2(fmax / 3))), (1e-45, 2.0**127)]:
        x = torch.zeros(4, 8)
        x[1, 2] = -amax
        _, s = check_against_model(x, elem)
        assert s.item() == np.float32(1.0) / np.float32(scale), (amax, s)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensor_gets_scale_one(elem, bad):
    """Like fp8_block's blocks: amax NaN/Inf gives scale 1, NaN stays visible, Inf saturates."""
    x = torch.full((2, 16), 0.5)
    x[1, 3] = bad
    data, s = check_against_model(x, elem)
    assert s.item() == 1.0
    assert bytes_of(data)[1, 3] == (0x7F if bad != bad else {"e4m3": 0x7E, "e5m2": 0x7B}[elem])


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("shape", [(70, 130), (1, 5), (128, 64)])
def test_rowcol_is_the_codes_and_the_codes_transposed(elem, shape, gen):
    x = wide_range(shape, gen, torch.bfloat16, lo=-3, hi=3)
    rows, cols, s = deepwell.fp8_tensor_quantize_rowcol(x, elem)
    want, want_s = deepwell.fp8_tensor_quantize(x, elem)
    assert same_bits(rows, want) and same_bits(s, want_s)
    assert same_bits(cols, want.t().contiguous())
    # ...which is also the quantization of x^T: one scale, so transposing commutes with quantizing.
    assert same_bits(cols, deepwell.fp8_tensor_quantize(x.t().contiguous(), elem)[0])


def _special_values(gen, dtype):
    """(name, x): tensors whose amax is each special case of the scale rule."""
    x = wide_range((96, 80), gen, dtype, lo=-3, hi=3)
    cases = {"random": x, "zeros": torch.zeros(5, 7, dtype=dtype), "negative zero": -torch.zeros(4, 4, dtype=dtype)}
    tiny = torch.finfo(dtype).tiny
    cases["subnormals"] = (torch.randn(33, 9, generator=gen) * tiny / 8).to(dtype)
    cases["huge"] = torch.full((3, 17), torch.finfo(dtype).max, dtype=dtype) * torch.randn(3, 17, generator=gen).sign().to(dtype)
    for name, bad in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
        y = x.clone()
        y[7, 3] = bad
        cases[name] = y
    y = x.clone()
    y[0, 0], y[50, 9] = float("inf"), float("nan")  # NaN wins over Inf
    cases["inf and nan"] = y
    return cases.items()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("elem", ELEMS)
def test_a_given_amax_gives_the_ops_own_codes(device, dtype, elem, gen):
    """The shortcut the backend takes (x's amax reduced by torch, fused by Inductor into x's producer,
    then handed to the quantizer) against the quantizer's own amax pass, bit for bit: eager and under
    torch.compile, for every special case of the scale rule (zeros, subnormals, saturation, NaN, Inf)."""
    amax_of = deepwell.ops.fp8_tensor.amax_of
    compiled = torch.compile(lambda t: deepwell.fp8_tensor_quantize_rowcol(t, elem, amax_of(t)), fullgraph=True)
    for name, x in _special_values(gen, dtype):
        x = x.to(device)
        want = deepwell.fp8_tensor_quantize_rowcol(x, elem)
        for how, got in (("eager", deepwell.fp8_tensor_quantize_rowcol(x, elem, amax_of(x))), ("compiled", compiled(x))):
            assert all(same_bits(a, b) for a, b in zip(got, want)), (name, how)
        want_amax = torch.tensor(np.float32(ref.amax(np_f32(x.cpu()).reshape(-1), axis=0)), device=device)
        assert same_bits(amax_of(x), want_amax), name
    torch._dynamo.reset()


def test_bad_inputs_name_the_op_and_argument():
    x = torch.ones(4, 8)
    for amax, match in ((torch.ones((), dtype=torch.bfloat16), r"'amax' must have dtype torch.float32"),
                        (torch.ones(1), r"'amax' must have shape \[\]")):
        with pytest.raises(RuntimeError, match="deepwell.fp8_tensor_quantize_rowcol: argument " + match):
            deepwell.fp8_tensor_quantize_rowcol(x, "e4m3", amax)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fake kernel says the same
            with pytest.raises(RuntimeError, match="deepwell.fp8_tensor_quantize_rowcol: argument " + match):
                deepwell.fp8_tensor_quantize_rowcol(mode.from_tensor(x), "e4m3", mode.from_tensor(amax))
    with pytest.raises(RuntimeError, match=r"fp8_tensor_quantize.*'elem'.*\"e4m2\""):
        deepwell.fp8_tensor_quantize(torch.ones(4), "e4m2")
    with pytest.raises(RuntimeError, match=r"fp8_tensor_quantize_rowcol.*'x' must be 2-d"):
        deepwell.fp8_tensor_quantize_rowcol(torch.ones(2, 3, 4))
    with pytest.raises(RuntimeError, match=r"fp8_tensor_quantize.*'x' must be non-empty"):
        deepwell.fp8_tensor_quantize(torch.ones(0, 4))
    data, s = deepwell.fp8_tensor_quantize(torch.ones(4))
    with pytest.raises(RuntimeError, match=r"fp8_tensor_dequantize.*'scale_inv' must hold one value"):
        deepwell.fp8_tensor_dequantize(data, torch.ones(2))
    with pytest.raises(RuntimeError, match=r"fp8_tensor_dequantize.*'data' must have dtype"):
        deepwell.fp8_tensor_dequantize(torch.ones(4), s)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("copies", ["rows", "cols"])
def test_one_copy_is_rowcols_copy(device, copies, gen):
    """`copies="rows"` (the plain cast) / `"cols"` (the transposing kernel alone) write one of rowcol's
    copies with its scale, the same bits, with and without a given amax, for every special case of
    the scale rule; the other copy comes back empty."""
    amax_of = deepwell.ops.fp8_tensor.amax_of
    for name, x in _special_values(gen, torch.bfloat16):
        x = x.to(device)
        both = deepwell.fp8_tensor_quantize_rowcol(x, "e4m3")
        for amax in (None, amax_of(x)):
            one = deepwell.fp8_tensor_quantize_rowcol(x, "e4m3", amax, copies)
            kept, empty = (0, 1) if copies == "rows" else (1, 0)
            assert same_bits(one[kept].cpu(), both[kept].cpu()) and same_bits(one[2].cpu(), both[2].cpu()), name
            assert one[empty].shape == (0,) and one[empty].dtype == both[empty].dtype, name


def test_copies_must_be_named():
    with pytest.raises(RuntimeError, match=r"fp8_tensor_quantize_rowcol: argument 'copies' must be one of 'both', "
                                           r"'rows', 'cols'.*\"Rows\""):
        deepwell.fp8_tensor_quantize_rowcol(torch.ones(4, 8), "e4m3", None, "Rows")
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fake kernel says the same
        with pytest.raises(RuntimeError, match=r"fp8_tensor_quantize_rowcol: argument 'copies'"):
            deepwell.fp8_tensor_quantize_rowcol(mode.from_tensor(torch.ones(4, 8)), "e4m3", None, "Rows")
