"""NVFP4 part of the float64 reference model (docs/NUMERICS.md "NVFP4"; rust/core/API.md nvfp4/hadamard/rng).

Two-level scaling: fp32 per-tensor S_dec = 1/S_enc, E4M3 per-16 block scale sb, E2M1 elements.
Every fp32 operation is float64 rounded to fp32 (see formats.f32). Options: 16x16 2D blocks,
seeded stochastic rounding, 16-point Hadamard transform along the last dim.
"""

from __future__ import annotations

import numpy as np

from .formats import (
    E2M1,
    FLT_MAX,
    add32,
    amax,
    as_f32,
    cast_e2m1,
    cast_e4m3,
    decode_e2m1,
    decode_e4m3,
    div32,
    f32,
    mul32,
    sub32,
)

NVFP4_BLOCK = 16
E4M3_NAN = 0x7F

# ----------------------------------------------------------------------------- Hadamard (rust/core/API.md)
# H = (1/4) * diag(s) * H16, H16 the Sylvester (natural-order) Hadamard matrix, s fixed.
HADAMARD_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)


def hadamard_matrix() -> np.ndarray:
    """The exact float64 16x16 matrix H, H16[i, j] = (-1)^popcount(i & j); H @ H.T = I."""
    i = np.arange(16)
    h16 = np.array([[(-1.0) ** bin(a & b).count("1") for b in i] for a in i])
    return 0.25 * HADAMARD_SIGNS[:, None] * h16


def hadamard16(x) -> np.ndarray:
    """y = H v on every 16-element chunk of the last dim, with rust/core/API.md's fp32 op order: in-place
    butterflies h = 1, 2, 4, 8, each (a, b) -> (fp32(a+b), fp32(a-b)) for j in each 2h-group's
    first half, b = v[j+h]; then v[i] = fp32(v[i] * (0.25 * s[i])). Returns float32."""
    x = as_f32(x)
    k = x.shape[-1]
    if k % 16:
        raise ValueError(f"hadamard16: last dim ({k}) must be a multiple of 16")
    v = x.reshape(x.shape[:-1] + (k // 16, 16)).astype(np.float64)
    v = [v[..., i] for i in range(16)]
    for h in (1, 2, 4, 8):
        for i in range(0, 16, 2 * h):
            for j in range(i, i + h):
                a, b = v[j], v[j + h]
                v[j], v[j + h] = add32(a, b), sub32(a, b)
    out = np.stack([mul32(v[i], 0.25 * HADAMARD_SIGNS[i]) for i in range(16)], axis=-1)
    return out.reshape(x.shape)


# ----------------------------------------------------------------------------- RNG (rust/core/API.md rng.rs)
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def sr_bits(seed: int, index: int) -> int:
    """splitmix64 output for state seed + (index+1) * gamma (mod 2^64), upper 32 bits.
    (index 0 is the first output of Vigna's splitmix64 seeded with `seed`.)"""
    z = (int(seed) + (int(index) + 1) * _GAMMA) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return z >> 32


def sr_bits_array(seed: int, index) -> np.ndarray:
    """sr_bits over an integer array of indices (numpy uint64 arithmetic wraps mod 2^64)."""
    idx = np.asarray(index).astype(np.uint64)
    z = np.uint64(int(seed) & _M64) + (idx + np.uint64(1)) * np.uint64(_GAMMA)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(32)).astype(np.uint32)


def e2m1_stochastic(v, bits) -> np.ndarray:
    """Stochastic E2M1 rounding of v = fp32(x * enc) (rust/core/API.md): |v| >= 6 -> 6; otherwise
    lo <= |v| < hi are neighbours on the grid, t = (|v| - lo) / (hi - lo) (exact: Sterbenz and a
    power-of-two divisor), u = (bits >> 8) * 2^-24; hi if u < t else lo; sign kept (so -0.0 -> code 8).
    P(hi) = t up to 2^-24, hence E[result] = |v|: unbiased. NaN -> 0 (never reached)."""
    v = np.asarray(v, np.float64)
    bits = np.asarray(bits).astype(np.int64)
    a = np.abs(v)
    grid, codes = E2M1.values, E2M1.codes
    lo_i = np.clip(np.searchsorted(grid, np.where(np.isnan(a), 0, a), side="right") - 1, 0, len(grid) - 2)
    lo, hi = grid[lo_i], grid[lo_i + 1]
    t = (a - lo) / (hi - lo)
    u = (bits >> 8) * 2.0**-24
    code = np.where(u < t, codes[lo_i + 1], codes[lo_i])
    code = np.where(a >= E2M1.max, codes[-1], code)
    code = np.where(np.signbit(v), code | 0x8, code)
    return np.where(np.isnan(v), 0, code).astype(np.uint8)


# ----------------------------------------------------------------------------- NVFP4
def nvfp4_encode_scale(global_amax) -> np.float32:
    """S_enc = min(fp32(448*6 / global_amax), FLT_MAX); global_amax 0, Inf or NaN -> 1 (rust/core/API.md)."""
    g = np.float32(global_amax)
    if g == 0 or not np.isfinite(g):
        return np.float32(1.0)
    return np.float32(min(float(div32(448.0 * 6.0, g)), FLT_MAX))


def nvfp4_global_amax(x, hadamard: bool = False) -> np.float32:
    """NaN-propagating max|x| over the tensor, after the Hadamard transform when asked."""
    x = as_f32(x)
    if hadamard:
        x = hadamard16(x)
    return np.float32(amax(x))


def nvfp4_block_scale(block_amax, s_enc) -> np.ndarray:
    """sb = cast_e4m3(fp32(block_amax * fp32(S_enc * fp32(1/6)))); block amax NaN/Inf -> 0x7F."""
    ba = np.asarray(block_amax, np.float64)
    sb = cast_e4m3(mul32(ba, mul32(s_enc, f32(1.0 / 6.0))))
    return np.where(np.isfinite(ba), sb, E4M3_NAN).astype(np.uint8)


def nvfp4_quantize(x, global_amax=None, block_2d: bool = False, stochastic_seed=None, hadamard: bool = False):
    """NVFP4 along the last dim (docs/NUMERICS.md NVFP4 steps 1-6; rust/core/API.md nvfp4_quantize).

    x (..., K), K % 16 == 0; leading dims are flattened into rows (the Rust API's (rows, k) view).
    Returns (data uint8 (..., K/2), element 2i in the low nibble; scale uint8 E4M3 (..., K/16);
    S_dec float32 scalar).
      hadamard: x is replaced by hadamard16(x) first (so a global amax computed here is post-RHT;
                a global_amax passed in is used as given).
      block_2d: one amax per 16x16 tile of the (rows, K) view, its scale written to all 16 rows
                (rows % 16 == 0).
      stochastic_seed: element rounding by e2m1_stochastic with bits sr_bits(seed, i), i the flat
                index r*K + c of the element in the (rows, K) view (scales stay RNE).
    A block (or tile) holding NaN/Inf: scale 0x7F, data nibbles 0.
    """
    x = as_f32(x)
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"nvfp4: last dim ({k}) must be a multiple of 16")
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if hadamard:
        x2 = hadamard16(x2)
    ga = nvfp4_global_amax(x2) if global_amax is None else np.float32(as_f32(global_amax).reshape(()))
    s_enc = nvfp4_encode_scale(ga)
    s_dec = div32(1.0, s_enc)[()]

    xb = x2.reshape(rows, k // 16, 16).astype(np.float64)
    if block_2d:
        if rows % 16:
            raise ValueError(f"nvfp4 2D blocks: rows ({rows}) must be a multiple of 16")
        tile_amax = amax(x2.reshape(rows // 16, 16, k // 16, 16), axis=(1, 3))
        block_amax = np.repeat(tile_amax, 16, axis=0)
    else:
        block_amax = amax(xb, axis=-1)
    sb = nvfp4_block_scale(block_amax, s_enc)
    bad = ~np.isfinite(block_amax)

    # enc = min(fp32(1 / fp32(float(sb) * S_dec)), FLT_MAX); sb = 0 gives 1/0 = Inf -> FLT_MAX.
    with np.errstate(invalid="ignore"):
        enc = np.minimum(div32(1.0, mul32(decode_e4m3(sb), s_dec)), np.float32(FLT_MAX))
        v = mul32(xb, enc[..., None])
    if stochastic_seed is None:
        q = cast_e2m1(v)
    else:
        idx = np.arange(rows * k, dtype=np.uint64).reshape(rows, k // 16, 16)
        q = e2m1_stochastic(v, sr_bits_array(stochastic_seed, idx))
    q = np.where(bad[..., None], 0, q).astype(np.uint8).reshape(rows, k)

    data = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return (
        data.reshape(x.shape[:-1] + (k // 2,)),
        sb.reshape(x.shape[:-1] + (k // 16,)),
        np.float32(s_dec),
    )


def nvfp4_unpack(data) -> np.ndarray:
    """(..., K/2) bytes -> (..., K) 4-bit codes, low nibble first."""
    data = np.asarray(data).astype(np.uint8)
    q = np.stack([data & 0xF, data >> 4], axis=-1)
    return q.reshape(data.shape[:-1] + (2 * data.shape[-1],))


def nvfp4_dequantize(data, scale, s_dec) -> np.ndarray:
    """x' = fp32(fp32(e2m1(q) * float(sb)) * S_dec), left to right (rust/core/API.md). Scale 0x7F -> NaN."""
    q = nvfp4_unpack(data)
    k = q.shape[-1]
    qb = q.reshape(q.shape[:-1] + (k // 16, 16))
    t = mul32(decode_e2m1(qb), decode_e4m3(np.asarray(scale))[..., None])
    return mul32(t, np.float32(s_dec)).reshape(q.shape)
