"""Tests of the float64 reference model itself (tests/reference), against every test vector of
docs/NUMERICS.md (its further MXFP8 vectors from torchao included), torch's own
float8 casts, and sanity properties (error bounds, swizzle round trip, SR unbiasedness)."""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (pyproject's pythonpath does it too)
from reference import numerics as ref  # noqa: E402  (the same import as the op tests)

FLT_MAX = float(np.finfo(np.float32).max)


def bits_f32(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def f32_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32).astype(np.int64)


def block(v, dtype=torch.float32, first=None):
    """32 equal values (optionally another first value) as fp32 numpy, via `dtype` (bf16 rounds)."""
    vals = [v] * 32
    if first is not None:
        vals[0] = first
    return torch.tensor(vals, dtype=torch.float64).to(dtype).float().numpy()


# ----------------------------------------------------------------------------- fp32 arithmetic
def test_fp32_ops_are_correctly_rounded():
    """float64 op + one rounding to fp32 == IEEE fp32 op (numpy's float32 arithmetic), subnormal and
    overflowing results included."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 0xFF800000, (2, 200000), dtype=np.uint64).astype(np.uint32)
    a, b = bits.view(np.float32)
    a, b = a[np.isfinite(a) & np.isfinite(b)], b[np.isfinite(a) & np.isfinite(b)]
    with np.errstate(all="ignore"):
        for ours, theirs in [(ref.mul32, np.multiply), (ref.div32, np.divide), (ref.add32, np.add),
                             (ref.sub32, np.subtract)]:
            np.testing.assert_array_equal(ours(a, b), theirs(a, b))
            small = np.ldexp(a, -100).astype(np.float32)  # subnormal results
            np.testing.assert_array_equal(ours(small, b), theirs(small, b))
    assert ref.f32(1.5 * 2.0**-150) == 2.0**-149 and ref.f32(2.0**-150) == 0.0  # ties to even
    assert np.signbit(ref.f32(-(2.0**-151)))


# ----------------------------------------------------------------------------- element formats
def test_tables():
    e4, e5, e2 = ref.E4M3, ref.E5M2, ref.E2M1
    assert (e4.max, e5.max, e2.max) == (448.0, 57344.0, 6.0)
    assert e4.values[1] == 2.0**-9 and e4.values[8] == 2.0**-6 and len(e4.values) == 127
    assert e5.values[1] == 2.0**-16 and e5.values[4] == 2.0**-14 and len(e5.values) == 124
    assert list(e2.values) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert np.isnan(ref.decode_e4m3([0x7F, 0xFF])).all()
    assert list(ref.decode_e5m2([0x7C, 0xFC])) == [math.inf, -math.inf]
    assert np.isnan(ref.decode_e5m2([0x7D, 0x7E, 0x7F, 0xFF])).all()
    assert list(ref.decode_e2m1(range(16))) == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    e8 = ref.decode_e8m0([0, 1, 127, 254, 255])
    assert list(e8[:4]) == [2.0**-127, 2.0**-126, 1.0, 2.0**127] and np.isnan(e8[4])


@pytest.mark.parametrize("name,tdtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
                                         ("e8m0", torch.float8_e8m0fnu)])
def test_decode_matches_torch(name, tdtype):
    codes = np.arange(256, dtype=np.uint8)
    ours = getattr(ref, f"decode_{name}")(codes)
    theirs = torch.from_numpy(codes).view(tdtype).double().numpy()
    np.testing.assert_array_equal(ours, theirs)  # NaN positions must agree too


@pytest.mark.parametrize("fmt,tdtype", [(ref.E4M3, torch.float8_e4m3fn), (ref.E5M2, torch.float8_e5m2)])
def test_cast_matches_torch(fmt, tdtype):
    """Every midpoint of neighbouring values, +-1 fp32 ulp around it, and random fp32 values."""
    v = np.concatenate([fmt.values, -fmt.values])
    mids = np.float32((fmt.values[1:] + fmt.values[:-1]) / 2)
    ulp_dn = np.nextafter(mids, np.float32(0))
    ulp_up = np.nextafter(mids, np.float32(np.inf))
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(20000) * np.exp2(rng.integers(-20, 17, 20000))).astype(np.float32)
    x = np.concatenate([v, mids, ulp_dn, ulp_up, -mids, -ulp_dn, -ulp_up, rand]).astype(np.float32)
    x = np.clip(x, -fmt.max, fmt.max)  # torch's out-of-range behaviour differs between formats
    ours = fmt.cast(x)
    theirs = torch.from_numpy(x).to(tdtype).view(torch.uint8).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_cast_specials():
    c4 = ref.cast_e4m3([449, 464, 480, 1e30, math.inf, -math.inf, math.nan, -0.0, 0.0])
    assert list(c4) == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x80, 0x00]
    # signed zero: below half the smallest subnormal, and the exact tie 2^-10 (even code 0)
    assert list(ref.cast_e4m3([-(2.0**-11), -(2.0**-10), 2.0**-10, 3 * 2.0**-11])) == [0x80, 0x80, 0x00, 0x01]
    # subnormal/normal boundary tie 7.5*2^-9 -> 0x08 (even), 6.5*2^-9 -> 0x06
    assert list(ref.cast_e4m3([7.5 * 2.0**-9, 6.5 * 2.0**-9])) == [0x08, 0x06]
    c5 = ref.cast_e5m2([57344, 61440, 1e9, math.inf, -math.inf, math.nan, -0.0])
    assert list(c5) == [0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0x7F, 0x80]


def test_e2m1_ties():
    """docs/NUMERICS.md NVFP4 step 3: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; > 5 -> 6."""
    x = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 7.0, 1e30, math.inf]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]
    assert list(ref.decode_e2m1(ref.cast_e2m1(x))) == want
    assert list(ref.decode_e2m1(ref.cast_e2m1(np.negative(x)))) == [-w for w in want]
    assert list(ref.cast_e2m1([-0.0, -0.2, 0.2, math.nan])) == [0x8, 0x8, 0x0, 0x0]
    assert list(ref.cast_e2m1([0.2500001, 0.7499999, 2.5000002, 4.9999995])) == [1, 1, 5, 6]


# ----------------------------------------------------------------------------- MXFP8
BF16 = torch.bfloat16
F32_MAX_BITS = 0x7F7FFFFF
# (block input, rceil (scale, data[0]), floor (scale, data[0])) -- docs/NUMERICS.md MXFP8 test vectors
MX_VECTORS = [
    ("zero", block(0.0), (0, 0x00), (0, 0x00)),
    ("2^-126", block(2.0**-126), (0, 0x40), (0, 0x40)),
    ("448", block(448.0), (127, 0x7E), (127, 0x7E)),
    ("-448", block(-448.0), (127, 0xFE), (127, 0xFE)),
    ("480", block(480.0), (128, 0x77), (127, 0x7E)),
    ("-480", block(-480.0), (128, 0xF7), (127, 0xFE)),
    ("1.0", block(1.0), (119, 0x78), (119, 0x78)),
    ("fp32 max", block(bits_f32(F32_MAX_BITS)), (247, 0x78), (246, 0x7E)),
    ("bf16 max", block(float(torch.finfo(BF16).max), BF16), (247, 0x78), (246, 0x7E)),
    ("0x40600001", block(bits_f32(0x40600001)), (121, 0x76), (120, 0x7E)),
    ("0x40600001 bf16", block(bits_f32(0x40600001), BF16), (120, 0x7E), (120, 0x7E)),
    ("0x43FFFFFF", block(bits_f32(0x43FFFFFF)), (128, 0x78), (127, 0x7E)),
    ("0x43FFFFFF bf16", block(bits_f32(0x43FFFFFF), BF16), (128, 0x78), (128, 0x78)),
    ("-0.0 with 1.0s", block(1.0, first=-0.0), (119, 0x80), (119, 0x80)),
    # docs/NUMERICS.md "MXFP8": the further vectors (torchao)
    ("max with 1.0s", block(1.0, first=bits_f32(F32_MAX_BITS)), (247, 0x78), (246, 0x7E)),
    ("2^-149 with 1.0s", block(1.0, first=-(2.0**-149)), (119, 0x80), (119, 0x80)),
    ("2^-149", block(2.0**-149), (0, 0x00), (0, 0x00)),
    ("-2^-149", block(-(2.0**-149)), (0, 0x80), (0, 0x80)),
    ("2^-133 bf16", block(2.0**-133, BF16), (0, 0x08), (0, 0x08)),
    ("-2^-133 bf16", block(-(2.0**-133), BF16), (0, 0x88), (0, 0x88)),
]


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("name,x,rceil,floor", MX_VECTORS, ids=[v[0] for v in MX_VECTORS])
def test_mxfp8_vectors(name, x, rceil, floor, mode):
    scale, d0 = rceil if mode == "rceil" else floor
    data, s = ref.mxfp8_quantize(x, scale_mode=mode)
    assert s.shape == (1,) and s[0] == scale
    assert data[0] == d0
    if name.endswith("with 1.0s"):  # the others: 1.0 * 2^(127-scale)
        assert (data[1:] == ref.cast_e4m3(np.ldexp(1.0, 127 - scale))).all()
    else:
        assert (data == d0).all()
    # the bound rceil guarantees
    if mode == "rceil":
        assert np.abs(x.astype(np.float64)).max() * 2.0 ** (127 - scale) <= 448


def test_mxfp8_bf16_vectors_really_differ():
    """The bf16 rows are a trap only if bf16 rounding changes the input."""
    assert block(bits_f32(0x40600001), BF16)[0] == 3.5
    assert block(bits_f32(0x43FFFFFF), BF16)[0] == 512.0


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_mxfp8_non_finite_block(elem, bad):
    x = np.ones((2, 64), np.float32)
    x[1, 40] = bad
    data, s = ref.mxfp8_quantize(x, elem=elem)
    assert s.tolist() == [[119 if elem == "e4m3" else 112] * 2, [119 if elem == "e4m3" else 112, 0xFF]]
    assert (data[1, 32:] == 0x7F).all() and (data[1, :32] != 0x7F).all()
    out = ref.mxfp8_dequantize(data, s, elem=elem)
    assert np.isnan(out[1, 32:]).all() and (out[:, :32] == 1).all() and (out[0] == 1).all()


def test_mxfp8_e5m2():
    data, s = ref.mxfp8_quantize(block(1.0), elem="e5m2")
    assert s[0] == 112 and data[0] == 0x78  # 1.0 * 2^15 = 32768 = 1.0 * 2^(30-15)
    data, s = ref.mxfp8_quantize(block(60000.0), elem="e5m2", scale_mode="floor")
    assert s[0] == 127 and data[0] == 0x7B  # saturated at 57344


def _rceil_bit_rule(d: np.ndarray) -> np.ndarray:
    """docs/NUMERICS.md's literal wording on fp32 bits, for checking ref.e8m0_rceil."""
    b = f32_bits(d)
    exp, man = (b >> 23) & 0xFF, b & 0x7FFFFF
    inc = np.where(exp == 0, man > 0x400000, man != 0)
    return np.minimum(exp + inc, 254)


def test_rceil_equals_bit_rule():
    rng = np.random.default_rng(1)
    bits = np.concatenate([
        rng.integers(0, 0x7F800000, 200000),  # every finite non-negative fp32 is reachable
        np.arange(0, 64), 0x400000 + np.arange(-3, 4), 0x800000 + np.arange(-3, 4),
        0x7F000000 + np.arange(-3, 4), np.arange(0x7F7FFFF0, 0x7F800000), 0x3F800000 + np.arange(-3, 4),
    ]).astype(np.uint32)
    d = bits.view(np.float32)
    np.testing.assert_array_equal(ref.e8m0_rceil(d), _rceil_bit_rule(d))


def test_floor_equals_exponent_field():
    rng = np.random.default_rng(2)
    bits = np.concatenate([rng.integers(1, 0x7F800000, 100000), np.arange(1, 64)]).astype(np.uint32)
    a = bits.view(np.float32)
    unbiased = np.maximum(((bits.astype(np.int64) >> 23) & 0xFF) - 127, -126)  # subnormal: -126
    want = np.clip(unbiased - 8, -127, 127) + 127
    np.testing.assert_array_equal(ref.mxfp8_scale_byte(a, "floor"), want)


def test_rceil_multiply_not_divide():
    """fp32(1/448) is not exact; the rule multiplies by it. Check both round the same way near
    448 * 2^k (docs/NUMERICS.md "MXFP8" step 2) so the |x|/s <= 448 bound holds."""
    r = np.float32(1 / 448)
    assert float(r) != 1 / 448
    base = np.float32(448.0)
    x = np.nextafter(base, np.float32(0)) + np.arange(-2000, 2000, dtype=np.float32) * np.spacing(base)
    for k in (-20, 0, 20):
        xk = np.ldexp(x, k).astype(np.float32)
        e = ref.mxfp8_scale_byte(xk).astype(np.int64)
        assert (xk.astype(np.float64) * np.ldexp(1.0, 127 - e) <= 448).all()


finite_f32 = st.floats(min_value=-float(np.float32(1e37)), max_value=float(np.float32(1e37)), width=32)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, (2, 64), elements=finite_f32), st.integers(-30, 30))
def test_mxfp8_roundtrip_bound(x, shift):
    with np.errstate(over="ignore"):
        x = np.ldexp(x, shift).astype(np.float32)
    x[~np.isfinite(x)] = 0
    data, s = ref.mxfp8_quantize(x)
    out = ref.mxfp8_dequantize(data, s).astype(np.float64)
    unit = np.repeat(np.ldexp(1.0, s.astype(np.int64) - 127), 32, axis=-1)
    err = np.abs(out - x)
    ok = np.abs(x) < OVERFLOW_EDGE  # above it the dequantized value is 2^128 = Inf (next test)
    assert (err <= 2.0**-4 * np.abs(x) + 2.0**-10 * unit + 2.0**-149)[ok].all()
    assert (np.signbit(out) == np.signbit(x)).all()


OVERFLOW_EDGE = 248 * 2.0**120  # midpoint of 240 and 256 (E4M3 neighbours) times 2^120


def test_dequantize_overflows_near_flt_max():
    """Implied by docs/NUMERICS.md's 'fp32 max -> 247 / 0x78' row (and stated there): 0x78 * 2^(247-127) =
    256 * 2^120 = 2^128, which is +Inf in fp32 (and bf16). Every |x| >= 248 * 2^120 rounds there.
    FP8 block with pow2 scales has the same edge (scale 2^-120 for amax = FLT_MAX)."""
    below = np.nextafter(np.float32(OVERFLOW_EDGE), np.float32(0))
    for v, want in [(FLT_MAX, math.inf), (OVERFLOW_EDGE, math.inf), (below, 240 * 2.0**120)]:
        data, s = ref.mxfp8_quantize(block(float(v)))
        assert ref.mxfp8_dequantize(data, s)[0] == want
    data, si = ref.fp8_block_quantize(np.full((1, 128), FLT_MAX, np.float32))
    assert si[0, 0] == 2.0**120 and data[0, 0] == 0x78
    assert ref.fp8_block_dequantize(data, si)[0, 0] == math.inf
    data, si = ref.fp8_block_quantize(np.full((1, 128), FLT_MAX, np.float32), pow2=False)
    assert ref.fp8_block_dequantize(data, si)[0, 0] == np.float32(FLT_MAX)


def test_mxfp8_dims():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 3, 32)).astype(np.float32)
    d0, s0 = ref.mxfp8_quantize(x, dim=0)
    d2, s2 = ref.mxfp8_quantize(np.ascontiguousarray(np.moveaxis(x, 0, -1)), dim=-1)
    assert s0.shape == (2, 3, 32) and d0.shape == x.shape
    np.testing.assert_array_equal(d0, np.moveaxis(d2, -1, 0))
    np.testing.assert_array_equal(s0, np.moveaxis(s2, -1, 0))
    back = ref.mxfp8_dequantize(d0, s0, dim=0)
    np.testing.assert_allclose(back, x, rtol=2**-4, atol=2**-9)


# ----------------------------------------------------------------------------- NVFP4
def test_nvfp4_vector():
    """docs/NUMERICS.md: global_amax = 10: S_enc = 268.8; block amax 10 -> sb 448 (0x7E), 10 -> 6;
    block amax 0.5 -> sb 22 (0x5B); block amax 0 -> sb 0 and data 0."""
    x = np.zeros(48, np.float32)
    x[3], x[16 + 5], x[16 + 6] = 10.0, 0.5, -0.25
    assert ref.nvfp4_encode_scale(10.0) == np.float32(268.8)
    data, scale, s_dec = ref.nvfp4_quantize(x, global_amax=np.float32(10.0))
    assert s_dec == np.float32(1.0) / np.float32(268.8)
    assert scale.tolist() == [0x7E, 0x5B, 0x00]
    assert data.shape == (24,) and data.dtype == np.uint8
    codes = ref.nvfp4_unpack(data)
    assert codes[3] == 0x7 and codes[21] == 0x7  # 10 -> 6; 0.5 * 12.218 = 6.109 -> 6
    assert codes[22] == 0xD  # -0.25 * 12.218 = -3.05 -> -3 (sign bit | code 5)
    assert data[1] == 0x70 and data[10] == 0x70  # element 2i low nibble, 2i+1 high nibble
    assert (codes[32:] == 0).all() and (codes[:3] == 0).all()
    out = ref.nvfp4_dequantize(data, scale, s_dec)
    assert out[3] == np.float32(np.float32(6 * 448.0) * s_dec)
    np.testing.assert_allclose(out[[3, 21, 22]], [10.0, 22 * 6 / 268.8, -22 * 3 / 268.8], rtol=1e-6)
    # global amax computed from the tensor gives the same here
    d2, s2, sd2 = ref.nvfp4_quantize(x)
    assert (d2 == data).all() and (s2 == scale).all() and sd2 == s_dec


@pytest.mark.parametrize("g", [0.0, math.inf, math.nan])
def test_nvfp4_degenerate_global_amax(g):
    assert ref.nvfp4_encode_scale(g) == 1.0
    x = np.zeros(16, np.float32)
    data, scale, s_dec = ref.nvfp4_quantize(x, global_amax=g)
    assert s_dec == 1.0 and (data == 0).all() and (scale == 0).all()


def test_nvfp4_tiny_global_amax_saturates_to_flt_max():
    assert ref.nvfp4_encode_scale(2.0**-149) == np.float32(FLT_MAX)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nvfp4_non_finite_block(bad):
    x = np.ones(48, np.float32)
    x[20] = bad
    data, scale, s_dec = ref.nvfp4_quantize(x, global_amax=1.0)
    assert scale.tolist() == [0x7E, 0x7F, 0x7E]
    assert (data[8:16] == 0).all() and (data[:8] == 0x77).all()
    out = ref.nvfp4_dequantize(data, scale, s_dec)
    assert np.isnan(out[16:32]).all() and np.isfinite(out[:16]).all()
    _, _, s_dec_auto = ref.nvfp4_quantize(x)  # NaN/Inf global amax -> S_enc = 1
    assert s_dec_auto == 1.0


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, (4, 32), elements=st.floats(-1e4, 1e4, width=32)), st.integers(-40, 40))
def test_nvfp4_roundtrip_bound(x, shift):
    x = np.ldexp(x, shift).astype(np.float32)
    # A tensor amax below 2688 * 2^-126 (~3.2e-35) makes S_dec an fp32 subnormal (and below
    # 2688 / FLT_MAX S_enc saturates): precision is lost there by design of the formula.
    assume(np.abs(x).max() == 0 or np.abs(x).max() >= 2.0**-100)
    data, scale, s_dec = ref.nvfp4_quantize(x)
    out = ref.nvfp4_dequantize(data, scale, s_dec).astype(np.float64)
    unit = np.repeat(ref.decode_e4m3(scale), 16, axis=-1) * float(s_dec)  # value of one E2M1 unit
    bamax = np.repeat(np.abs(x.astype(np.float64)).reshape(4, 2, 16).max(-1), 16, axis=-1)
    # half a grid step (<= 1 unit) plus saturation when sb rounded down (<= 6 * 2^-4 units for a
    # normal E4M3 sb; a subnormal one (code < 8) rounds by up to half its step 2^-9, absolutely: up
    # to 6 * 2^-10 * S_dec more), plus the fp32 roundings and sb underflow (block amax far below the
    # global amax)
    codes = scale.repeat(16, -1)
    subnormal_sb = np.where((codes & 0x7F) < 8, 6 * 2.0**-10 * float(s_dec), 0)
    err = np.abs(out - x)
    assert (err <= 1.375 * unit + subnormal_sb + 1e-5 * np.abs(x) + np.where(codes == 0, bamax, 0) + 1e-44).all()


def test_nvfp4_2d_blocks_transpose_identical():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((32, 48)) * np.exp2(rng.integers(-6, 6, (32, 48)))).astype(np.float32)
    d, s, sd = ref.nvfp4_quantize(w, block_2d=True)
    dt, st_, sdt = ref.nvfp4_quantize(np.ascontiguousarray(w.T), block_2d=True)
    assert sd == sdt
    q, qt = ref.nvfp4_unpack(d), ref.nvfp4_unpack(dt)
    np.testing.assert_array_equal(q, qt.T)
    np.testing.assert_array_equal(np.repeat(s, 16, axis=1), np.repeat(st_, 16, axis=1).T)
    assert (s.reshape(2, 16, 3)[:, :1] == s.reshape(2, 16, 3)).all()  # one scale per tile
    # 1D blocks do differ
    d1, _, _ = ref.nvfp4_quantize(w)
    d1t, _, _ = ref.nvfp4_quantize(np.ascontiguousarray(w.T))
    assert (ref.nvfp4_unpack(d1) != ref.nvfp4_unpack(d1t).T).any()


def test_hadamard():
    H = ref.hadamard_matrix()
    np.testing.assert_allclose(H @ H.T, np.eye(16), atol=1e-15)
    # unit vectors are transformed exactly: column j of H
    np.testing.assert_array_equal(ref.hadamard16(np.eye(16, dtype=np.float32)), H.T.astype(np.float32))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    y = ref.hadamard16(x)
    want = (x.reshape(8, 4, 16).astype(np.float64) @ H.T).reshape(8, 64)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert y.dtype == np.float32
    # the transform is orthogonal: GEMM products are preserved (the wgrad use)
    a, b = rng.standard_normal((3, 16)), rng.standard_normal((5, 16))
    np.testing.assert_allclose((a @ H.T) @ (b @ H.T).T, a @ b.T, atol=1e-12)
    # nvfp4 with hadamard = nvfp4 of the transformed tensor; its global amax is post-transform
    d, s, sd = ref.nvfp4_quantize(x, hadamard=True)
    d2, s2, sd2 = ref.nvfp4_quantize(y)
    assert (d == d2).all() and (s == s2).all() and sd == sd2
    assert ref.nvfp4_global_amax(x, hadamard=True) == np.abs(y).max()


def test_hadamard_op_order_in_fp32():
    """Each butterfly add is rounded to fp32: 1 + 2^-24 + ... must lose the tiny parts."""
    v = np.zeros(16, np.float32)
    v[0], v[1] = 1.0, 2.0**-24
    y = ref.hadamard16(v)
    assert y[0] == np.float32(0.25)  # fp32(1 + 2^-24) = 1 (tie to even): the 2^-24 is lost
    assert y[1] == np.float32(1 - 2.0**-24) * np.float32(0.25)  # 1 - 2^-24 is exact in fp32


def test_sr_bits():
    # splitmix64 seeded with 0: 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, ...
    assert [ref.sr_bits(0, i) for i in range(4)] == [0xE220A839, 0x6E789E6A, 0x06C45D18, 0xF88BB8A8]
    rng = np.random.default_rng(6)
    idx = np.concatenate([np.arange(100), rng.integers(0, 2**63, 100)]).astype(np.uint64)
    for seed in (0, 1, 12345, 2**64 - 1, 0x9E3779B97F4A7C15):
        want = [ref.sr_bits(seed, int(i)) for i in idx]
        assert ref.sr_bits_array(seed, idx).tolist() == want


def test_e2m1_stochastic_rule():
    grid = ref.E2M1.values
    for g in grid:  # grid points are fixed for any bits
        for b in (0, 0xFF, 0x80000000, 0xFFFFFFFF):
            assert ref.decode_e2m1(ref.e2m1_stochastic(g, b)) == g
            assert ref.decode_e2m1(ref.e2m1_stochastic(-g, b)) == -g
    # v = 1.25: t = 0.5; u = (bits >> 8) * 2^-24; hi iff u < t
    assert ref.decode_e2m1(ref.e2m1_stochastic(1.25, (2**23 - 1) << 8)) == 1.5
    assert ref.decode_e2m1(ref.e2m1_stochastic(1.25, 2**23 << 8)) == 1.0
    assert ref.decode_e2m1(ref.e2m1_stochastic(-1.25, 0)) == -1.5
    assert ref.decode_e2m1(ref.e2m1_stochastic(5.0, 0x7FFFFFFF)) == 6.0  # t = 0.5, u < 0.5
    assert ref.decode_e2m1(ref.e2m1_stochastic([7.0, math.inf, -1e30], 0)).tolist() == [6, 6, -6]
    assert ref.e2m1_stochastic(-0.0, 0) == 0x8


@pytest.mark.parametrize("v", [0.1, 0.3, 1.1, 2.6, 4.9, 5.99, -3.3])
def test_e2m1_stochastic_unbiased(v):
    n = 40000
    bits = ref.sr_bits_array(7, np.arange(n))
    mean = ref.decode_e2m1(ref.e2m1_stochastic(np.full(n, v), bits)).mean()
    assert abs(mean - v) < 4 * 1.0 / math.sqrt(n)  # step <= 2, so sd <= 1


def test_nvfp4_stochastic_index_convention():
    """Element (r, c) of the (rows, K) view draws sr_bits(seed, r*K + c); scales stay RNE."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    seed = 2**63 + 5
    d, s, sd = ref.nvfp4_quantize(x, stochastic_seed=seed)
    _, s_rne, sd_rne = ref.nvfp4_quantize(x)
    assert (s == s_rne).all() and sd == sd_rne
    q = ref.nvfp4_unpack(d).reshape(6, 32)
    sb = ref.decode_e4m3(s.reshape(6, 2))
    for r, c in [(0, 0), (0, 31), (4, 17), (5, 31)]:
        enc = min(float(ref.div32(1.0, ref.mul32(sb[r, c // 16], sd))), FLT_MAX)
        v = ref.mul32(x.reshape(6, 32)[r, c], enc)
        assert q[r, c] == ref.e2m1_stochastic(v, ref.sr_bits(seed, r * 32 + c))


def test_nvfp4_stochastic_mean_converges():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    xs = np.repeat(x, 4096, axis=0)  # many independent draws (the index differs per row)
    d, s, sd = ref.nvfp4_quantize(xs, stochastic_seed=1234)
    out = ref.nvfp4_dequantize(d, s, sd).astype(np.float64)
    assert (s == s[0]).all()
    unit = ref.decode_e4m3(s[0]).repeat(16) * float(sd)  # x' = code value * unit
    inside = np.abs(x[0]) <= 6 * unit  # elements that saturate at 6 (sb rounded down) are biased
    assert inside.sum() > 48
    assert (np.abs(out.mean(0) - x[0])[inside] < 4 * 2 * unit[inside] / math.sqrt(4096) + 1e-6).all()
    # deterministic given the seed, different for another seed; RNE path differs from SR
    d2, _, _ = ref.nvfp4_quantize(xs, stochastic_seed=1234)
    d3, _, _ = ref.nvfp4_quantize(xs, stochastic_seed=1235)
    assert (d == d2).all() and (d != d3).any()
    assert (ref.nvfp4_quantize(xs)[0] != d).any()


# ----------------------------------------------------------------------------- FP8 block
def test_fp8_block_scale_rules():
    s = ref.fp8_block_scale([0.0, math.inf, math.nan, 2.0**-149, 3.0, 448.0, 1000.0], pow2=False)
    assert s.tolist() == [1.0, 1.0, 1.0, FLT_MAX, float(np.float32(448 / 3)), 1.0, float(np.float32(0.448))]
    s = ref.fp8_block_scale([0.0, math.inf, math.nan, 2.0**-149, 3.0, 448.0, 1000.0, 0.5], pow2=True)
    assert s.tolist() == [1.0, 1.0, 1.0, 2.0**127, 128.0, 1.0, 0.25, 512.0]


@pytest.mark.parametrize("shape,br,bc", [((4, 256), 1, 128), ((2, 256, 384), 128, 128), ((128, 128), 128, 128)])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_block_roundtrip(shape, br, bc, pow2):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))).astype(np.float32)
    data, si = ref.fp8_block_quantize(x, br, bc, pow2)
    assert data.shape == x.shape and si.dtype == np.float32
    assert si.shape == shape[:-2] + (shape[-2] // br, shape[-1] // bc)
    # against torch's own cast of x * scale
    scale = np.float32(1) / si if pow2 else None
    if pow2:  # scale and scale_inv are exact reciprocals for powers of two
        tiles = x.reshape(shape[:-2] + (shape[-2] // br, br, shape[-1] // bc, bc))
        xs = (tiles * scale[..., :, None, :, None]).reshape(shape).astype(np.float32)
        assert np.abs(xs).max() <= 448
        np.testing.assert_array_equal(data, torch.from_numpy(xs).to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    out = ref.fp8_block_dequantize(data, si, br, bc)
    unit = np.kron(si, np.ones((br, bc))).reshape(shape)
    assert (np.abs(out - x) <= 2.0**-4 * np.abs(x) + 2.0**-10 * unit).all()


def test_fp8_block_specials():
    x = np.ones((2, 128), np.float32)
    x[0, 5], x[1, 7], x[1, 8] = math.nan, math.inf, -math.inf
    data, si = ref.fp8_block_quantize(x)
    assert si.tolist() == [[1.0], [1.0]]
    assert data[0, 5] == 0x7F and data[0, 0] == ref.cast_e4m3(1.0)
    assert data[1, 7] == 0x7E and data[1, 8] == 0xFE


# ----------------------------------------------------------------------------- swizzle
def _to_blocked(s: np.ndarray) -> np.ndarray:
    """Independent formulation (torchao's to_blocked): pad, tile 128x4, each tile as (32, 4, 4)
    with rows r = i*32 + j stored at j*16 + i*4 + c."""
    r, c = s.shape
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    p = np.zeros((rp, cp), np.uint8)
    p[:r, :c] = s
    t = p.reshape(rp // 128, 128, cp // 4, 4).transpose(0, 2, 1, 3)  # (rt, ct, 128, 4)
    t = t.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3)  # (tile, j, i, c)
    return t.reshape(-1)


@pytest.mark.parametrize("shape", [(1, 1), (3, 9), (128, 4), (129, 5), (200, 7), (256, 8), (300, 13)])
def test_swizzle_roundtrip(shape):
    rng = np.random.default_rng(10)
    s = rng.integers(1, 256, shape).astype(np.uint8)
    flat = ref.swizzle_scales(s)
    assert flat.shape == (ref.swizzled_len(*shape),) and flat.dtype == np.uint8
    assert (flat != 0).sum() == s.size  # padding bytes are 0
    np.testing.assert_array_equal(flat, _to_blocked(s))
    np.testing.assert_array_equal(ref.unswizzle_scales(flat, *shape), s)


def test_swizzle_offsets():
    off = lambda r, c, cols=8: int(ref.swizzle_offset(r, c, cols))  # noqa: E731
    assert [off(0, 0), off(0, 1), off(1, 0), off(32, 0), off(127, 3)] == [0, 1, 16, 4, 31 * 16 + 12 + 3]
    assert off(0, 4) == 512 and off(128, 0) == 2 * 512 and off(128, 0, cols=9) == 3 * 512
