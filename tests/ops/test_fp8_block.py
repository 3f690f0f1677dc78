"""deepwell.fp8_block_quantize / fp8_block_dequantize on CPU: bit-exact against the float64 model of
docs/NUMERICS.md "FP8 block", for 1x128, 128x1 and 128x128 blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepwell
from _util import FLOAT_DTYPES, bytes_of, np_f32, rounded, same_bits, wide_range
from reference import numerics as ref

BLOCKS = [(1, 128), (128, 1), (128, 128)]


def check_against_model(x, br=1, bc=128, pow2=True):
    data, scale_inv = deepwell.fp8_block_quantize(x, br, bc, pow2)
    want_data, want_scale = ref.fp8_block_quantize(np_f32(x), br, bc, pow2)
    assert data.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    np.testing.assert_array_equal(scale_inv.numpy().view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(bytes_of(data), want_data)
    for out_dtype in FLOAT_DTYPES:
        got = deepwell.fp8_block_dequantize(data, scale_inv, br, bc, out_dtype)
        assert same_bits(got, rounded(ref.fp8_block_dequantize(want_data, want_scale, br, bc), out_dtype))
    return data, scale_inv


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("pow2", [True, False])
def test_random_matches_model(dtype, block, pow2, gen):
    x = wide_range((256, 256), gen, dtype, lo=-6, hi=6)
    check_against_model(x, *block, pow2)


def test_batched_and_non_contiguous(gen):
    x = torch.randn(2, 128, 256, generator=gen).bfloat16()
    for block in BLOCKS:
        check_against_model(x, *block)
        check_against_model(x.transpose(1, 2), *block)


def test_scale_rules():
    # amax 0 -> scale 1; amax 448 -> scale 1; amax 1 -> 448 rounded down to 256 with pow2;
    # tiny amax -> 448/amax overflows to Inf -> FLT_MAX (pow2: 2^127).
    x = torch.zeros(4, 128)
    x[1, 0], x[2, 0], x[3, 0] = 448.0, 1.0, 1e-39
    _, s = check_against_model(x)
    assert s[:3, 0].tolist() == [1.0, 1.0, 1.0 / 256]
    assert s[3, 0].item() == np.float32(1.0) / np.float32(2.0**127)
    _, s = check_against_model(x, pow2=False)
    assert s[2, 0].item() == np.float32(1.0) / np.float32(448.0)
    assert s[3, 0].item() == np.float32(1.0) / np.finfo(np.float32).max


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_block_gets_scale_one(bad):
    x = torch.full((1, 256), 2.0)
    x[0, 7] = bad
    data, s = check_against_model(x)
    assert s[0, 0].item() == 1.0 and s[0, 1].item() == 1.0 / 128
    assert bytes_of(data)[0, 7] == (0x7F if bad != bad else 0x7E)


@pytest.mark.parametrize("pow2", [True, False])
def test_rowcol_equals_row_and_transposed_quantizations(pow2, gen):
    x = wide_range((256, 384), gen, torch.bfloat16, lo=-4, hi=4)
    rd, rs, cd, cs = deepwell.fp8_block_quantize_rowcol(x, pow2)
    want_rd, want_rs = deepwell.fp8_block_quantize(x, 1, 128, pow2)
    want_cd, want_cs = deepwell.fp8_block_quantize(x.t().contiguous(), 1, 128, pow2)
    for got, want in ((rd, want_rd), (rs, want_rs), (cd, want_cd), (cs, want_cs)):
        assert same_bits(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m_major_scales", [False, True])
@pytest.mark.parametrize("copies", ["rows", "cols"])
def test_one_copy_is_rowcols_copy(device, m_major_scales, copies, gen):
    """`copies="rows"` / `"cols"` write one of rowcol's two copies, the same bits (its kernels are
    the 1x128 quantizer and the transposing one), for ordinary values and every special one (zeros,
    subnormals, saturation, Inf, NaN); the other copy comes back empty."""
    x = wide_range((256, 384), gen, torch.bfloat16, lo=-42, hi=38)
    flat = x.view(-1)
    flat[:128], flat[300], flat[1000], flat[2000] = 0.0, 3e38, float("inf"), float("nan")
    x = x.to(device)
    both = deepwell.fp8_block_quantize_rowcol(x, True, m_major_scales)
    one = deepwell.fp8_block_quantize_rowcol(x, True, m_major_scales, copies)
    kept = (0, 1) if copies == "rows" else (2, 3)
    for i in range(4):
        if i in kept:
            assert same_bits(one[i].cpu(), both[i].cpu()), i
        else:
            assert one[i].shape == (0,) and one[i].dtype == both[i].dtype, i


def test_copies_must_be_named():
    with pytest.raises(RuntimeError, match=r"fp8_block_quantize_rowcol: argument 'copies' must be one of 'both', "
                                           r"'rows', 'cols'.*\"row\""):
        deepwell.fp8_block_quantize_rowcol(torch.ones(128, 128), True, False, "row")
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fake kernel says the same
        with pytest.raises(RuntimeError, match=r"fp8_block_quantize_rowcol: argument 'copies'"):
            deepwell.fp8_block_quantize_rowcol(mode.from_tensor(torch.ones(128, 128)), True, False, "row")
