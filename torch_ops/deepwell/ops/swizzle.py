"""Blackwell's 128x4 tiled scale layout (what cuBLASLt block-scaled GEMMs and
`F.scaled_mm(..., swizzle=SWIZZLE_32_4_4)` read): schema, fake kernel, Python wrapper.

Kernels: rust/ops/src/ops/swizzle/; layout: docs/NUMERICS.md "Transposes and layouts".
"""

from __future__ import annotations

import torch

from . import _checks, _nondiff
from ._library import define

SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.uint8)

define("swizzle_scales(Tensor scale) -> Tensor")
define("unswizzle_scales(Tensor swizzled, int rows, int cols) -> Tensor")


def swizzled_len(rows: int, cols: int) -> int:
    """Bytes of the swizzled layout: rows padded to 128, scale columns padded to 4."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


@torch.library.register_fake("deepwell::swizzle_scales")
def _swizzle_fake(scale):
    op = "swizzle_scales"
    _checks.dtype_in(op, "scale", scale, SCALE_DTYPES)
    if scale.dim() != 2:
        _checks.fail(op, "scale", "be 2-d (rows, scale columns)", f"a {scale.dim()}-d tensor")
    _checks.non_empty(op, "scale", scale, 2)
    return scale.new_empty((swizzled_len(scale.shape[0], scale.shape[1]),))


@torch.library.register_fake("deepwell::unswizzle_scales")
def _unswizzle_fake(swizzled, rows, cols):
    op = "unswizzle_scales"
    _checks.dtype_in(op, "swizzled", swizzled, SCALE_DTYPES)
    if rows <= 0 or cols <= 0:
        _checks.fail(op, "rows, cols", "be positive", f"({rows}, {cols})")
    if swizzled_len(rows, cols) >= 2**63:
        _checks.fail(op, "rows, cols", "give a swizzled length below 2^63", f"({rows}, {cols})")
    _checks.shape_eq(op, "swizzled", swizzled, (swizzled_len(rows, cols),))
    return swizzled.new_empty((rows, cols))


# Not differentiable: backprop through these raises a clear error (ops/_nondiff.py).
_nondiff.register("swizzle_scales", "unswizzle_scales")


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Rearranges a (rows, cols) scale tensor into the 1-D 128x4-tiled layout (padding 0).

    Byte (r, c) lands at `((r // 128) * ceil(cols / 4) + c // 4) * 512 + (r % 32) * 16 +
    ((r % 128) // 32) * 4 + c % 4`.
    """
    return torch.ops.deepwell.swizzle_scales(scale)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_scales`: the (rows, cols) scales, padding dropped."""
    return torch.ops.deepwell.unswizzle_scales(swizzled, rows, cols)
