"""deepwell.mxfp8_quantize / mxfp8_dequantize on CPU: bit-exact against the float64 model of
docs/NUMERICS.md (tests/reference), the docs/NUMERICS.md vectors, edge cases, strides and every dim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepwell
from _util import FLOAT_DTYPES, bytes_of, np_f32, rounded, same_bits, wide_range
from reference import numerics as ref

MODES = ("rceil", "floor")
ELEMS = ("e4m3", "e5m2")
ELEM_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def check_against_model(x: torch.Tensor, dim: int, mode: str, elem: str) -> None:
    data, scale = deepwell.mxfp8_quantize(x, dim, mode, elem)
    want_data, want_scale = ref.mxfp8_quantize(np_f32(x), dim, mode, elem)
    assert data.dtype == ELEM_DTYPE[elem] and scale.dtype == torch.float8_e8m0fnu
    assert data.shape == x.shape and data.is_contiguous() and scale.is_contiguous()
    np.testing.assert_array_equal(bytes_of(scale), want_scale)
    np.testing.assert_array_equal(bytes_of(data), want_data)
    for out_dtype in FLOAT_DTYPES:
        got = deepwell.mxfp8_dequantize(data, scale, dim, out_dtype)
        want = rounded(ref.mxfp8_dequantize(want_data, want_scale, dim, elem), out_dtype)
        assert same_bits(got, want), f"dequantize to {out_dtype} differs"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", ELEMS)
def test_random_wide_range_matches_model(dtype, mode, elem, gen):
    x = wide_range((64, 256), gen, dtype)
    check_against_model(x, -1, mode, elem)


@pytest.mark.parametrize("shape,dim", [((3, 64, 5), 1), ((32, 7), 0), ((2, 3, 96), -1), ((4, 2, 32, 3), 2), ((32,), 0)])
@pytest.mark.parametrize("mode", MODES)
def test_every_dim_and_odd_shapes(shape, dim, mode, gen):
    x = torch.randn(shape, generator=gen).bfloat16()
    check_against_model(x, dim, mode, "e4m3")


def test_quantizing_a_dim_equals_quantizing_the_moved_dim_last(gen):
    x = torch.randn(8, 64, 6, generator=gen)
    d0, s0 = deepwell.mxfp8_quantize(x, 1)
    d1, s1 = deepwell.mxfp8_quantize(x.movedim(1, -1).contiguous(), -1)
    assert same_bits(d0.movedim(1, -1).contiguous(), d1)
    assert same_bits(s0.movedim(1, -1).contiguous(), s1)


@pytest.mark.parametrize("make", ["transpose", "slice", "expand", "offset"])
def test_non_contiguous_inputs(make, gen):
    base = torch.randn(64, 96, generator=gen).bfloat16()
    x = {
        "transpose": lambda: base.t(),  # (96, 64), blocks along a strided last dim
        "slice": lambda: base[:, ::3],  # (64, 32)
        "expand": lambda: base[:1, :64].expand(32, 64),
        "offset": lambda: base[5:37, 32:],
    }[make]()
    assert not x.is_contiguous() or make == "offset"
    for dim in range(x.dim()):
        if x.shape[dim] % 32 == 0:
            check_against_model(x, dim, "rceil", "e4m3")


# docs/NUMERICS.md "MXFP8" test vectors: a block of 32 equal values -> (scale byte, element byte).
F32_VECTORS = [
    # input bits or value, rceil (scale, elem), floor (scale, elem)
    (0.0, (0, 0x00), (0, 0x00)),
    (2.0**-126, (0, 0x40), (0, 0x40)),
    (448.0, (127, 0x7E), (127, 0x7E)),
    (-448.0, (127, 0xFE), (127, 0xFE)),
    (480.0, (128, 0x77), (127, 0x7E)),
    (1.0, (119, 0x78), (119, 0x78)),
    (float(np.finfo(np.float32).max), (247, 0x78), (246, 0x7E)),
    (np.uint32(0x40600001).view(np.float32).item(), (121, 0x76), (120, 0x7E)),
    (np.uint32(0x43FFFFFF).view(np.float32).item(), (128, 0x78), (127, 0x7E)),
]


@pytest.mark.parametrize("value,rceil,floor", F32_VECTORS)
def test_numerics_vectors_fp32(value, rceil, floor):
    x = torch.full((2, 32), value, dtype=torch.float32)
    for mode, (want_scale, want_elem) in (("rceil", rceil), ("floor", floor)):
        data, scale = deepwell.mxfp8_quantize(x, -1, mode)
        assert set(bytes_of(scale).ravel().tolist()) == {want_scale}, mode
        assert set(bytes_of(data).ravel().tolist()) == {want_elem}, mode


def test_numerics_vectors_bf16_inputs():
    # bf16 3.5 (from 0x40600001 rounded): rceil 120 / 0x7E. bf16 of 0x43FFFFFF is 512: 128 / 0x78 (both modes).
    x = torch.full((1, 32), np.uint32(0x40600001).view(np.float32).item()).bfloat16()
    data, scale = deepwell.mxfp8_quantize(x)
    assert bytes_of(scale)[0, 0] == 120 and bytes_of(data)[0, 0] == 0x7E
    x = torch.full((1, 32), np.uint32(0x43FFFFFF).view(np.float32).item()).bfloat16()
    for mode in MODES:
        data, scale = deepwell.mxfp8_quantize(x, -1, mode)
        assert bytes_of(scale)[0, 0] == 128 and bytes_of(data)[0, 0] == 0x78


def test_negative_zero_kept_in_a_block_of_ones():
    x = torch.ones(1, 32)
    x[0, 5] = -0.0
    data, scale = deepwell.mxfp8_quantize(x)
    assert bytes_of(scale)[0, 0] == 119
    assert bytes_of(data)[0, 5] == 0x80 and bytes_of(data)[0, 4] == 0x78


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("elem", ELEMS)
def test_non_finite_block_dequantizes_to_nan_and_others_are_untouched(bad, elem):
    x = torch.ones(2, 64)
    x[1, 40] = bad
    data, scale = deepwell.mxfp8_quantize(x, elem=elem)
    s = bytes_of(scale)
    assert s[1, 1] == 0xFF and s[1, 0] == s[0, 0] and s[0, 0] != 0xFF
    out = deepwell.mxfp8_dequantize(data, scale, out_dtype=torch.float32)
    assert torch.isnan(out[1, 32:]).all() and torch.equal(out[0], torch.ones(64))
    check_against_model(x, -1, "rceil", elem)


@pytest.mark.parametrize("mode", MODES)
def test_subnormals_saturation_and_tiny_blocks(mode, gen):
    rows = [
        torch.full((32,), 2.0**-149),  # smallest fp32 subnormal
        torch.linspace(2.0**-140, 2.0**-127, 32),  # all fp32 subnormals
        torch.linspace(-3.0e38, 3.0e38, 32),  # near fp32 max: huge scales
        torch.cat([torch.full((31,), 1e-30), torch.tensor([1e30])]),  # 60 decades in one block
        torch.cat([torch.full((31,), 1.0), torch.tensor([500.0])]),  # floor saturates here
    ]
    check_against_model(torch.stack(rows), -1, mode, "e4m3")
    check_against_model(torch.stack(rows), -1, mode, "e5m2")


def test_dequantize_round_trip_error_is_within_half_an_e4m3_ulp(gen):
    x = torch.randn(128, 256, generator=gen)
    y = deepwell.mxfp8_dequantize(*deepwell.mxfp8_quantize(x), out_dtype=torch.float32)
    # rceil keeps every element in E4M3's normal range or its subnormals: relative error <= 2^-4
    # for normal elements, absolute <= 2^-10 * block scale for subnormal ones.
    scale = deepwell.mxfp8_quantize(x)[1].float().repeat_interleave(32, -1)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((y - x).abs() <= bound).all()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_rowcol_equals_the_two_separate_quantizations(transposed, swizzle, mode, gen):
    x = wide_range((96, 160), gen, torch.bfloat16, lo=-5, hi=5)
    rd, rs, cd, cs = deepwell.mxfp8_quantize_rowcol(x, mode, "e4m3", transposed, swizzle)
    want_rd, want_rs = deepwell.mxfp8_quantize(x, -1, mode)
    want_cd, want_cs = deepwell.mxfp8_quantize(x.t().contiguous(), -1, mode) if transposed else deepwell.mxfp8_quantize(x, 0, mode)
    if swizzle:
        want_rs, want_cs = deepwell.swizzle_scales(want_rs), deepwell.swizzle_scales(want_cs)
    for got, want in ((rd, want_rd), (rs, want_rs), (cd, want_cd), (cs, want_cs)):
        assert same_bits(got, want)
