"""Element formats and fp32 arithmetic of the float64 reference model (docs/NUMERICS.md "Element formats").

Independence from the Rust codecs is deliberate: no cast here touches bit patterns. Each format's
value table is built by decoding every code from its definition (sign, biased exponent, mantissa),
and a cast looks the value up on the sorted table of non-negative finite values (numpy
``searchsorted``) and picks the nearest entry, comparing against the exact midpoint of its two
neighbours. Ties go to the even code (adjacent codes differ by one, so exactly one of them is even,
and an even code has an even mantissa: round-to-nearest-even).

Casts take float64 arrays (float32 values widened exactly, or any float64 value) and round once
from that exact value. Rule set (docs/NUMERICS.md, first paragraph): RNE, satfinite (every |x| above
the largest finite value, Inf included, becomes that value), signed zero kept (a negative value
that rounds to zero gives the negative-zero code), subnormals kept.
"""

from __future__ import annotations

import math

import numpy as np

FLT_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------- fp32 arithmetic
def as_f32(x) -> np.ndarray:
    """A float32 numpy array from a numpy array, a scalar, or a torch tensor (any float dtype is
    widened to fp32 exactly: bf16/fp16 -> fp32 is exact)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def f32(x) -> np.ndarray:
    """Round float64 values to fp32 (RNE; subnormals kept; overflow -> +-Inf as IEEE says).

    Every fp32 operation of the spec is modelled as ``f32(a64 OP b64)`` on the float64 widening of
    fp32 operands. For OP in {+, -, *, /} this is the correctly rounded fp32 result: a product of two
    24-bit significands is exact in float64, and for +, - and / the double rounding
    (float64 first, then fp32) is innocuous because 53 >= 2*24 + 2 (Figueroa, "When is double
    rounding innocuous?", 1995); fp32 subnormal results only have fewer bits, so the margin grows.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32)


def mul32(a, b) -> np.ndarray:
    """fp32(a * b) for fp32 operands."""
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        return f32(np.asarray(a, np.float64) * np.asarray(b, np.float64))


def div32(a, b) -> np.ndarray:
    """fp32(a / b) for fp32 operands (x/0 -> +-Inf, 0/0 -> NaN, as IEEE)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        return f32(np.asarray(a, np.float64) / np.asarray(b, np.float64))


def add32(a, b) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return f32(np.asarray(a, np.float64) + np.asarray(b, np.float64))


def sub32(a, b) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return f32(np.asarray(a, np.float64) - np.asarray(b, np.float64))


def amax(x, axis=None) -> np.ndarray:
    """max |x|, NaN-propagating (rust/core/API.md abs_max: NaN wins, then Inf). numpy's max propagates NaN."""
    return np.max(np.abs(np.asarray(x, np.float64)), axis=axis)


# ----------------------------------------------------------------------------- element formats
class MiniFloat:
    """A small float format defined by its field widths; decoded code by code, never bit-cast."""

    def __init__(self, name, exp_bits, man_bits, bias, *, ieee_specials, nan_codes, cast_nan_code):
        self.name = name
        self.exp_bits, self.man_bits, self.bias = exp_bits, man_bits, bias
        self.ieee_specials = ieee_specials  # all-ones exponent = Inf/NaN (E5M2)
        self.nan_codes = frozenset(nan_codes)  # extra NaN codes (E4M3fn: 0x7F, 0xFF)
        self.cast_nan_code = cast_nan_code
        self.nbits = 1 + exp_bits + man_bits
        self.sign_bit = 1 << (exp_bits + man_bits)
        # decode every code
        self.table = np.array([self._decode_one(c) for c in range(1 << self.nbits)], np.float64)
        pos = [(v, c) for c, v in enumerate(self.table) if c < self.sign_bit and math.isfinite(v)]
        pos.sort()
        self.values = np.array([v for v, _ in pos], np.float64)  # sorted non-negative finite values
        self.codes = np.array([c for _, c in pos], np.int64)
        assert np.all(np.diff(self.values) > 0), f"{name}: duplicate finite values"
        self.max = float(self.values[-1])

    def _decode_one(self, code: int) -> float:
        sign = -1.0 if code & self.sign_bit else 1.0
        e = (code >> self.man_bits) & ((1 << self.exp_bits) - 1)
        m = code & ((1 << self.man_bits) - 1)
        if code in self.nan_codes:
            return math.nan
        if self.ieee_specials and e == (1 << self.exp_bits) - 1:
            return sign * math.inf if m == 0 else math.nan
        if e == 0:  # subnormal: m/2^M * 2^(1-bias)
            return sign * math.ldexp(m, 1 - self.bias - self.man_bits)
        return sign * math.ldexp((1 << self.man_bits) + m, e - self.bias - self.man_bits)

    def decode(self, codes) -> np.ndarray:
        """codes (any integer array) -> float64 values."""
        return self.table[np.asarray(codes).astype(np.int64) & ((1 << self.nbits) - 1)]

    def cast(self, x) -> np.ndarray:
        """float64 values -> uint8 codes: RNE (ties to the even code), satfinite, signed zero kept."""
        x = np.asarray(x, np.float64)
        nan = np.isnan(x)
        neg = np.signbit(x)
        a = np.where(nan, 0.0, np.minimum(np.abs(x), self.max))  # satfinite: |x| > max -> max
        hi_i = np.searchsorted(self.values, a, side="left")  # values[hi_i-1] < a <= values[hi_i]
        lo_i = np.maximum(hi_i - 1, 0)
        lo, hi = self.values[lo_i], self.values[hi_i]
        mid = (lo + hi) / 2  # exact: both have a few significant bits
        lo_c, hi_c = self.codes[lo_i], self.codes[hi_i]
        even_c = np.where(lo_c % 2 == 0, lo_c, hi_c)
        code = np.where(a < mid, lo_c, np.where(a > mid, hi_c, even_c))
        code = np.where(neg, code | self.sign_bit, code)
        code = np.where(nan, self.cast_nan_code, code)
        return code.astype(np.uint8)


# E4M3 (float8_e4m3fn): bias 7, max 448, subnormals m*2^-9, no Inf, NaN = 0x7F/0xFF.
E4M3 = MiniFloat("e4m3", 4, 3, 7, ieee_specials=False, nan_codes=(0x7F, 0xFF), cast_nan_code=0x7F)
# E5M2 (float8_e5m2): bias 15, max 57344, IEEE Inf/NaN; a NaN input casts to 0x7F (rust/core/API.md).
E5M2 = MiniFloat("e5m2", 5, 2, 15, ieee_specials=True, nan_codes=(), cast_nan_code=0x7F)
# E2M1 (fp4): bias 1, values {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign; NaN -> 0 (rust/core/API.md; the
# quantizers never cast a NaN to E2M1).
E2M1 = MiniFloat("e2m1", 2, 1, 1, ieee_specials=False, nan_codes=(), cast_nan_code=0)

E4M3_MAX, E5M2_MAX, E2M1_MAX = E4M3.max, E5M2.max, E2M1.max
ELEMENTS = {"e4m3": E4M3, "e5m2": E5M2}


def cast_e4m3(x) -> np.ndarray:
    return E4M3.cast(x)


def decode_e4m3(codes) -> np.ndarray:
    return E4M3.decode(codes)


def cast_e5m2(x) -> np.ndarray:
    return E5M2.cast(x)


def decode_e5m2(codes) -> np.ndarray:
    return E5M2.decode(codes)


def cast_e2m1(x) -> np.ndarray:
    """4-bit codes in uint8 (bit 3 = sign). Ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4; above 5 -> 6 (docs/NUMERICS.md NVFP4 step 3)."""
    return E2M1.cast(x)


def decode_e2m1(codes) -> np.ndarray:
    """Low 4 bits of each code -> float64."""
    return E2M1.decode(np.asarray(codes).astype(np.int64) & 0xF)


def decode_e8m0(codes) -> np.ndarray:
    """E8M0 (float8_e8m0fnu): 2^(b-127); byte 0 = 2^-127 (no zero); 0xFF = NaN."""
    b = np.asarray(codes).astype(np.int64)
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b - 127))
