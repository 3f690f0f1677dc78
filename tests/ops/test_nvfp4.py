"""deepwell.nvfp4_quantize / nvfp4_dequantize on CPU: bit-exact against the float64 model, the
docs/NUMERICS.md vector, 2D blocks, stochastic rounding, the Hadamard transform and edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepwell
from _util import FLOAT_DTYPES, bytes_of, np_f32, rounded, same_bits, wide_range
from reference import numerics as ref


def check_against_model(x, global_amax=None, block_2d=False, seed=None, hadamard=False):
    amax_t = None if global_amax is None else torch.tensor([global_amax], dtype=torch.float32)
    data, scale, gs = deepwell.nvfp4_quantize(x, amax_t, block_2d, seed is not None, seed or 0, hadamard)
    want_data, want_scale, want_sdec = ref.nvfp4_quantize(np_f32(x), global_amax, block_2d, seed, hadamard)
    assert data.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn and gs.dtype == torch.float32
    assert gs.shape == () and gs.item() == want_sdec
    np.testing.assert_array_equal(bytes_of(scale), want_scale)
    np.testing.assert_array_equal(bytes_of(data), want_data)
    for out_dtype in FLOAT_DTYPES:
        got = deepwell.nvfp4_dequantize(data, scale, gs, out_dtype)
        assert same_bits(got, rounded(ref.nvfp4_dequantize(want_data, want_scale, want_sdec), out_dtype))
    return data, scale, gs


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
def test_random_matches_model(dtype, block_2d, hadamard, gen):
    x = (torch.randn(48, 128, generator=gen) * torch.rand(48, 1, generator=gen) * 10).to(dtype)
    check_against_model(x, block_2d=block_2d, hadamard=hadamard)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_wide_range_matches_model(dtype, gen):
    check_against_model(wide_range((32, 64), gen, dtype, lo=-8, hi=8))


def test_given_global_amax_and_leading_dims(gen):
    x = torch.randn(2, 3, 16, 32, generator=gen).bfloat16()
    check_against_model(x, global_amax=3.0)
    check_against_model(x, global_amax=3.0, block_2d=True)


def test_numerics_vector():
    # global_amax = 10: S_enc = 268.8; block amax 10 -> scale 448 (0x7E) and element 6;
    # block amax 0.5 -> scale 22 (0x5B); block amax 0 -> scale 0 and data 0.
    x = torch.zeros(1, 48)
    x[0, :16] = 10.0
    x[0, 16:32] = 0.5
    data, scale, gs = check_against_model(x)
    assert bytes_of(scale).tolist() == [[0x7E, 0x5B, 0x00]]
    assert (data[0, :8] == 0x77).all() and (data[0, 16:] == 0).all()
    assert gs.item() == np.float32(1.0) / np.float32(268.8)


def test_e2m1_ties_round_to_even():
    # global_amax 10.5 gives S_enc = 2688 / 10.5 = 256 exactly; a block amax of 6 gives sb = 256, so
    # the element encode factor is exactly 1 and x is rounded as it is.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    x = torch.tensor([ties + [6.0] * 7], dtype=torch.float32)
    out = deepwell.nvfp4_dequantize(*deepwell.nvfp4_quantize(x, torch.tensor([10.5])), torch.float32)
    assert out[0, :9].tolist() == want


def test_two_d_blocks_share_one_scale_per_tile(gen):
    x = torch.randn(32, 64, generator=gen)
    _, scale, _ = deepwell.nvfp4_quantize(x, block_2d=True)
    s = bytes_of(scale).reshape(2, 16, 4)
    assert (s == s[:, :1, :]).all()
    # ... so the 2-D quantization of W^T is the transpose of that of W (docs/NUMERICS.md "Transposes").
    d1 = deepwell.nvfp4_dequantize(*deepwell.nvfp4_quantize(x, block_2d=True), torch.float32)
    d2 = deepwell.nvfp4_dequantize(*deepwell.nvfp4_quantize(x.t().contiguous(), block_2d=True), torch.float32)
    assert torch.equal(d1, d2.t())


def test_stochastic_rounding_is_seeded_and_unbiased(gen):
    x = torch.randn(16, 64, generator=gen)
    a = check_against_model(x, seed=7)
    b = deepwell.nvfp4_quantize(x, None, False, True, 7)
    c = deepwell.nvfp4_quantize(x, None, False, True, 8)
    assert same_bits(a[0], b[0]) and not same_bits(a[0], c[0])
    # The mean over many seeds converges to the value the RNE path would quantize exactly.
    gs = torch.tensor([float(x.abs().max())])
    draws = torch.stack(
        [deepwell.nvfp4_dequantize(*deepwell.nvfp4_quantize(x, gs, False, True, s), torch.float32).double() for s in range(400)]
    )
    _, scale, sdec = deepwell.nvfp4_quantize(x, gs)
    step = scale.float().repeat_interleave(16, -1) * sdec * 2  # the widest E2M1 gap, in x units
    assert ((draws.mean(0) - x.double()).abs() <= 4 * step / np.sqrt(400) + 1e-6).all()


def test_hadamard_preserves_dot_products(gen):
    a, b = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    ha = torch.from_numpy(ref.hadamard16(a.numpy())).double()
    hb = torch.from_numpy(ref.hadamard16(b.numpy())).double()
    torch.testing.assert_close(ha @ hb.t(), a.double() @ b.double().t(), rtol=1e-5, atol=1e-5)
    check_against_model(a, hadamard=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_block(bad):
    x = torch.ones(1, 32)
    x[0, 20] = bad
    data, scale, gs = check_against_model(x)
    assert bytes_of(scale)[0, 1] == 0x7F and (data[0, 8:] == 0).all()
    out = deepwell.nvfp4_dequantize(data, scale, gs, torch.float32)
    assert torch.isnan(out[0, 16:]).all() and not torch.isnan(out[0, :16]).any()


def test_zeros_and_negative_zero():
    x = torch.zeros(1, 16)
    x[0, 3] = -0.0
    data, scale, gs = check_against_model(x)
    assert gs.item() == 1.0 and bytes_of(scale)[0, 0] == 0


def test_non_contiguous(gen):
    base = torch.randn(64, 64, generator=gen).bfloat16()
    check_against_model(base.t())
    check_against_model(base[::2, 16:48])
