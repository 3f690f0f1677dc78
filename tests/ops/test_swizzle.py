"""deepwell.swizzle_scales / unswizzle_scales: the 128x4 tiled layout of docs/NUMERICS.md, against the
model, round trips on shapes that are not multiples of 128 or 4, and torch's own reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepwell
from _util import bytes_of
from reference import numerics as ref


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (128, 4), (129, 5), (300, 17), (256, 8)])
@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.uint8])
def test_matches_model_and_round_trips(shape, dtype, gen):
    s = torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8).view(dtype)
    sw = deepwell.swizzle_scales(s)
    assert sw.dtype == dtype and sw.dim() == 1
    np.testing.assert_array_equal(bytes_of(sw), ref.swizzle_scales(bytes_of(s)))
    back = deepwell.unswizzle_scales(sw, *shape)
    assert back.shape == shape and torch.equal(back.view(torch.uint8), s.view(torch.uint8))


def test_matches_torch_to_blocked(gen):
    # torch's own helper for F.scaled_mm's SWIZZLE_32_4_4 layout (torch.testing internals; needs
    # expecttest, in the `test` extra).
    from torch.testing._internal.common_quantized import to_blocked
    s = torch.randint(1, 255, (256, 12), generator=gen, dtype=torch.uint8)
    assert torch.equal(deepwell.swizzle_scales(s), to_blocked(s).flatten())


def test_strided_input(gen):
    s = torch.randint(0, 255, (8, 40), generator=gen, dtype=torch.uint8)
    assert torch.equal(deepwell.swizzle_scales(s.t()), deepwell.swizzle_scales(s.t().contiguous()))
