"""Independent float64 model of docs/NUMERICS.md (+ the decisions of rust/core/API.md).

The oracle the Rust reference quantizers and the CUDA kernels are tested against. Everything is
numpy; inputs are float32 arrays (bf16/fp16 widened by the caller) or torch tensors (converted with
``.float().numpy()``). Where the spec says an fp32 operation happens, it is computed in float64 and
rounded to fp32 (``formats.f32``; correct rounding argued there). Scale exponents come from exact
float64 ``frexp``, element casts from the decoded value tables of ``formats`` -- never from bits.

This module: MXFP8 and FP8-block quantizers and the Blackwell scale swizzle. NVFP4 (with the
Hadamard transform and stochastic rounding) lives in ``nvfp4.py``; all names are re-exported here.
"""

from __future__ import annotations

import numpy as np

from .formats import (  # noqa: F401  (re-exported)
    E2M1,
    E2M1_MAX,
    E4M3,
    E4M3_MAX,
    E5M2,
    E5M2_MAX,
    ELEMENTS,
    FLT_MAX,
    add32,
    amax,
    as_f32,
    cast_e2m1,
    cast_e4m3,
    cast_e5m2,
    decode_e2m1,
    decode_e4m3,
    decode_e5m2,
    decode_e8m0,
    div32,
    f32,
    mul32,
    sub32,
)
from .nvfp4 import (  # noqa: F401  (re-exported)
    HADAMARD_SIGNS,
    e2m1_stochastic,
    hadamard16,
    hadamard_matrix,
    nvfp4_block_scale,
    nvfp4_dequantize,
    nvfp4_encode_scale,
    nvfp4_global_amax,
    nvfp4_quantize,
    nvfp4_unpack,
    sr_bits,
    sr_bits_array,
)

MX_BLOCK = 32
FP8_BLOCK_DEFAULT = 128

# emax of the element format: floor(log2(max finite)); 448 = 1.75*2^8, 57344 = 1.75*2^15.
_EMAX = {"e4m3": 8, "e5m2": 15}


def _elem(elem: str):
    if elem not in ELEMENTS:
        raise ValueError(f"elem must be one of {sorted(ELEMENTS)}, got {elem!r}")
    return ELEMENTS[elem]


def _frexp(x):
    """x = f * 2^E with f in [0.5, 1): exact in float64 for every finite fp32 (subnormals too)."""
    f, E = np.frexp(np.asarray(x, np.float64))
    return f, E.astype(np.int64)


# ----------------------------------------------------------------------------- MXFP8
def e8m0_rceil(d) -> np.ndarray:
    """E8M0 byte of the rceil rule from d = fp32(amax * fp32(1/max)) (finite, >= 0).

    docs/NUMERICS.md's bit rule ("biased exponent of d, +1 if the mantissa is non-zero; for an
    fp32-subnormal d +1 only if mantissa > 0x400000; d == 0 -> 0; cap 254") equals
    ``e = clamp(ceil(log2 d) + 127, 0, 254)`` with d == 0 -> 0:
      * normal d = 1.m * 2^E: biased exponent E+127, and ceil(log2 d) = E + [m != 0];
      * subnormal d = m * 2^-149 (1 <= m < 2^23): m > 0x400000 = 2^22  <=>  d > 2^-127, and then
        ceil(log2 d) = -126 (as d < 2^-126), so e = 1; otherwise d <= 2^-127, ceil(log2 d) <= -127
        and the clamp gives e = 0, the rule's biased exponent 0 plus 0.
    ceil(log2 d) is exact from frexp: d = f * 2^E, f in [0.5, 1): E - 1 if f == 0.5 else E.
    Hence 2^(e-127) >= d, i.e. |x| * 2^(127-e) <= max up to the rounding of fp32(1/max).
    """
    d = np.asarray(d, np.float64)
    f, E = _frexp(d)
    ceil_log2 = np.where(f == 0.5, E - 1, E)
    return np.where(d == 0, 0, np.clip(ceil_log2 + 127, 0, 254)).astype(np.uint8)


def e8m0_floor(block_amax, emax: int) -> np.ndarray:
    """OCP v1.0 rule: e = clamp(floor(log2 amax) - emax, -127, 127) + 127; amax == 0 -> 0.
    floor(log2 amax) = E - 1 from frexp, exact for fp32 subnormals too (which clamp to e = 0 under
    any exponent convention: floor(log2) <= -127 and the unbiased field -126 both give e = 0)."""
    a = np.asarray(block_amax, np.float64)
    f, E = _frexp(a)
    return np.where(a == 0, 0, np.clip(E - 1 - emax, -127, 127) + 127).astype(np.uint8)


def mxfp8_scale_byte(block_amax, scale_mode: str = "rceil", elem: str = "e4m3") -> np.ndarray:
    """E8M0 scale byte from an fp32 block amax (NaN-propagating); docs/NUMERICS.md MXFP8 step 2.
    rceil: e8m0_rceil(fp32(amax * fp32(1/max))) -- multiply by the fp32 reciprocal, not divide.
    floor: e8m0_floor(amax, emax), emax = 8 (E4M3) or 15 (E5M2).
    Non-finite amax (the block holds NaN or Inf) -> 0xFF (docs/NUMERICS.md step 5, rust/core/API.md)."""
    fmt = _elem(elem)
    a = np.asarray(block_amax, np.float32).astype(np.float64)
    finite = np.isfinite(a)
    a0 = np.where(finite, a, 0.0)
    if scale_mode == "rceil":
        e = e8m0_rceil(mul32(a0, f32(1.0 / fmt.max)))
    elif scale_mode == "floor":
        e = e8m0_floor(a0, _EMAX[elem])
    else:
        raise ValueError(f"scale_mode must be 'rceil' or 'floor', got {scale_mode!r}")
    return np.where(finite, e, 0xFF).astype(np.uint8)


def _to_blocks(x, dim: int, block: int):
    """Move `dim` last and split it into (K/block, block)."""
    x = np.moveaxis(x, dim, -1)
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"size of the quantized dim ({k}) must be a multiple of {block}")
    return x.reshape(x.shape[:-1] + (k // block, block))


def mxfp8_quantize(x, dim: int = -1, scale_mode: str = "rceil", elem: str = "e4m3"):
    """MXFP8, 1x32 blocks along `dim` (docs/NUMERICS.md MXFP8).

    Returns (data uint8 codes, x's shape; scale uint8 E8M0 bytes, x's shape with `dim` / 32).
    q = cast_rne_satfinite(fp32(x * 2^(127-e))); the power of two is exact (2^-127 for e = 254 is
    an fp32 subnormal, 2^127 for e = 0). A block holding NaN/Inf: scale 0xFF and every element byte
    is the element NaN 0x7F (rust/core/API.md; docs/NUMERICS.md step 5).
    """
    fmt = _elem(elem)
    x = as_f32(x)
    dim = dim % x.ndim
    xb = _to_blocks(x, dim, MX_BLOCK).astype(np.float64)
    e = mxfp8_scale_byte(amax(xb, axis=-1), scale_mode, elem).astype(np.int64)
    bad = e == 0xFF
    mult = np.ldexp(1.0, np.where(bad, 0, 127 - e))[..., None]
    q = fmt.cast(mul32(xb, mult))
    q = np.where(bad[..., None], np.uint8(fmt.cast_nan_code), q).astype(np.uint8)
    data = np.moveaxis(q.reshape(q.shape[:-2] + (-1,)), -1, dim)
    scale = np.moveaxis(e.astype(np.uint8), -1, dim)
    return np.ascontiguousarray(data), np.ascontiguousarray(scale)


def mxfp8_dequantize(data, scale, dim: int = -1, elem: str = "e4m3") -> np.ndarray:
    """x' = fp32(decode(q) * 2^(e-127)); byte 0 -> 2^-127, 0xFF -> NaN (docs/NUMERICS.md MXFP8 step 4).
    Returns float32; a bf16/fp16 output is this value rounded once more (rust/core/API.md)."""
    fmt = _elem(elem)
    data = np.asarray(data)
    dim = dim % data.ndim
    qb = _to_blocks(data, dim, MX_BLOCK)
    s = np.moveaxis(np.asarray(scale), dim, -1)
    out = mul32(fmt.decode(qb), decode_e8m0(s)[..., None])
    return np.ascontiguousarray(np.moveaxis(out.reshape(out.shape[:-2] + (-1,)), -1, dim))


# ----------------------------------------------------------------------------- FP8 block
def fp8_block_scale(block_amax, pow2: bool = True) -> np.ndarray:
    """scale = fp32(448 / amax) (correctly rounded division); amax 0, Inf or NaN -> 1; an Inf
    scale (tiny amax) -> FLT_MAX; pow2: round DOWN to a power of two, 2^floor(log2 scale)
    (docs/NUMERICS.md "FP8 block"). Inf -> FLT_MAX happens before pow2, so it then gives 2^127."""
    a = np.asarray(block_amax, np.float32).astype(np.float64)
    ok = np.isfinite(a) & (a != 0)
    s = div32(448.0, np.where(ok, a, 1.0)).astype(np.float64)
    s = np.where(ok, np.minimum(s, FLT_MAX), 1.0)
    if pow2:
        f, E = _frexp(s)  # s is a normal fp32 here (>= 448 / FLT_MAX > 2^-126)
        s = np.ldexp(1.0, E - 1)
    return s.astype(np.float32)


def _fp8_tiles(x, br: int, bc: int):
    """(..., R, C) -> (..., R/br, br, C/bc, bc)."""
    if x.ndim < 2:
        raise ValueError("fp8_block expects (..., rows, cols)")
    r, c = x.shape[-2:]
    if r % br or c % bc:
        raise ValueError(f"shape ({r}, {c}) is not a multiple of the block ({br}, {bc})")
    return x.reshape(x.shape[:-2] + (r // br, br, c // bc, bc))


def fp8_block_quantize(x, block_rows: int = 1, block_cols: int = 128, pow2: bool = True):
    """DeepSeek-style FP8 blocks on (..., R, C) (docs/NUMERICS.md "FP8 block").

    Returns (data uint8 E4M3 codes, x's shape; scale_inv float32 (..., R/br, C/bc)) with
    q = cast_e4m3(fp32(x * scale)) and scale_inv = fp32(1 / scale). NaN elements cast to 0x7F;
    +-Inf elements (their block has scale 1) saturate to +-448 (rust/core/API.md)."""
    x = as_f32(x)
    t = _fp8_tiles(x, block_rows, block_cols).astype(np.float64)
    s = fp8_block_scale(amax(t, axis=(-3, -1)), pow2)
    q = cast_e4m3(mul32(t, s[..., :, None, :, None]))
    return q.reshape(x.shape), div32(1.0, s)


def fp8_block_dequantize(data, scale_inv, block_rows: int = 1, block_cols: int = 128) -> np.ndarray:
    """x' = fp32(e4m3(q) * scale_inv)."""
    data = np.asarray(data)
    t = _fp8_tiles(data, block_rows, block_cols)
    si = np.asarray(scale_inv, np.float32)[..., :, None, :, None]
    return mul32(decode_e4m3(t), si).reshape(data.shape)


# ----------------------------------------------------------------------------- FP8 tensor
_FP8_TENSOR = {"e4m3": (E4M3_MAX, cast_e4m3, decode_e4m3), "e5m2": (E5M2_MAX, cast_e5m2, decode_e5m2)}


def fp8_tensor_scale(tensor_amax, elem: str = "e4m3") -> np.float32:
    """fp8_block's scale rule with the format's max (448 or 57344), always rounded down to a power of
    two (docs/NUMERICS.md "FP8 tensor")."""
    fmax = _FP8_TENSOR[elem][0]
    a = np.float64(np.float32(tensor_amax))
    if not np.isfinite(a) or a == 0:
        return np.float32(1.0)
    s = min(np.float64(div32(fmax, a)), FLT_MAX)
    _, E = _frexp(s)
    return np.float32(np.ldexp(1.0, int(E) - 1))


def fp8_tensor_quantize(x, elem: str = "e4m3"):
    """One scale for the whole tensor from its NaN-propagating amax: (codes uint8 of x's shape,
    scale_inv float32) with q = cast(fp32(x * scale)), scale_inv = fp32(1 / scale)."""
    x = as_f32(x)
    _, cast, _ = _FP8_TENSOR[elem]
    s = fp8_tensor_scale(amax(x.reshape(-1), axis=0) if x.size else 0.0, elem)
    return cast(mul32(x.astype(np.float64), s)), np.float32(div32(1.0, s))


def fp8_tensor_dequantize(data, scale_inv, elem: str = "e4m3") -> np.ndarray:
    """x' = fp32(decode(q) * scale_inv)."""
    return mul32(_FP8_TENSOR[elem][2](np.asarray(data)), np.float32(scale_inv))


# ----------------------------------------------------------------------------- swizzle
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzled_len(rows: int, cols: int) -> int:
    return _round_up(rows, 128) * _round_up(cols, 4)


def swizzle_offset(r, c, cols: int):
    """Blackwell 128x4 tiles (docs/NUMERICS.md "Transposes and layouts"):
    ((r/128) * ceil(C/4) + c/4) * 512 + (r%32) * 16 + ((r%128)/32) * 4 + (c%4)."""
    r, c = np.asarray(r, np.int64), np.asarray(c, np.int64)
    tiles_per_row = -(-cols // 4)
    return ((r // 128) * tiles_per_row + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def swizzle_scales(scale2d) -> np.ndarray:
    """(R, C) uint8 scales -> 1-D uint8 of round_up(R,128) * round_up(C,4) bytes; padding bytes 0."""
    s = np.asarray(scale2d)
    if s.ndim != 2:
        raise ValueError("swizzle_scales expects a 2-D scale tensor")
    rows, cols = s.shape
    out = np.zeros(swizzled_len(rows, cols), np.uint8)
    r, c = np.indices((rows, cols))
    out[swizzle_offset(r, c, cols)] = s.astype(np.uint8)
    return out


def unswizzle_scales(flat, rows: int, cols: int) -> np.ndarray:
    """Inverse of swizzle_scales: the (rows, cols) scales back from the swizzled bytes."""
    flat = np.asarray(flat).reshape(-1)
    if flat.size != swizzled_len(rows, cols):
        raise ValueError(f"expected {swizzled_len(rows, cols)} bytes, got {flat.size}")
    r, c = np.indices((rows, cols))
    return flat[swizzle_offset(r, c, cols)].astype(np.uint8)
