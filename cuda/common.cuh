// Shared device helpers: element loads/stores, the format casts and the scale rules.
// Bit-exact twins of rust/core/src/formats.rs (see that file for the reasoning behind each rule);
// docs/NUMERICS.md is the contract. No CUDA toolkit headers: NVRTC sees only deepwell's files.
#pragma once

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

namespace deepwell {

constexpr int THREADS = 256;
constexpr float FLT_MAX_F = 3.40282346638528859812e+38f;

// ---------------------------------------------------------------------------------------------
// Element types of float tensors. bf16/fp16 travel as raw 16-bit patterns.

struct F32 {
    static __device__ __forceinline__ float load(const void* p, int64_t i) {
        return static_cast<const float*>(p)[i];
    }
    static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
        static_cast<float*>(p)[i] = v;
    }
};

struct BF16 {
    static __device__ __forceinline__ float from_bits(uint16_t h) {
        return __uint_as_float(static_cast<uint32_t>(h) << 16);  // exact widening
    }
    static __device__ __forceinline__ uint16_t to_bits(float v) {
        uint16_t h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));  // RNE, NaN stays NaN
        return h;
    }
    static __device__ __forceinline__ float load(const void* p, int64_t i) {
        return from_bits(static_cast<const uint16_t*>(p)[i]);
    }
    static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
        static_cast<uint16_t*>(p)[i] = to_bits(v);
    }
};

struct F16 {
    static __device__ __forceinline__ float from_bits(uint16_t h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));  // exact widening
        return f;
    }
    static __device__ __forceinline__ uint16_t to_bits(float v) {
        uint16_t h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));  // RNE, saturates to Inf per IEEE
        return h;
    }
    static __device__ __forceinline__ float load(const void* p, int64_t i) {
        return from_bits(static_cast<const uint16_t*>(p)[i]);
    }
    static __device__ __forceinline__ void store(void* p, int64_t i, float v) {
        static_cast<uint16_t*>(p)[i] = to_bits(v);
    }
};

// ---------------------------------------------------------------------------------------------
// Raw element words for vectorized kernels: inputs stay as 32-bit words (two bf16/fp16 or one fp32
// per word, element 2i in the low half) and are widened exactly when used.

constexpr unsigned FULL_MASK = 0xFFFFFFFFu;  // all lanes of a warp, for __shfl_xor_sync

template <class T> struct Bytes;
template <> struct Bytes<F32> { static constexpr int N = 4; };
template <> struct Bytes<BF16> { static constexpr int N = 2; };
template <> struct Bytes<F16> { static constexpr int N = 2; };

template <class In> __device__ __forceinline__ float widen(const uint32_t* w, int j);
template <> __device__ __forceinline__ float widen<F32>(const uint32_t* w, int j) {
    return __uint_as_float(w[j]);
}
template <> __device__ __forceinline__ float widen<BF16>(const uint32_t* w, int j) {
    return __uint_as_float((j & 1) ? (w[j >> 1] & 0xFFFF0000u) : (w[j >> 1] << 16));
}
template <> __device__ __forceinline__ float widen<F16>(const uint32_t* w, int j) {
    return F16::from_bits(static_cast<uint16_t>((j & 1) ? (w[j >> 1] >> 16) : (w[j >> 1] & 0xFFFFu)));
}

// Quotient for non-negative operands; 32-bit division when both fit (the usual case).
__device__ __forceinline__ int64_t div_nn(int64_t a, int64_t b) {
    if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    return a / b;
}

// True when p is a multiple of a (a power of two): kernels pick their vector path with it.
__device__ __forceinline__ bool aligned(const void* p, unsigned a) {
    return (reinterpret_cast<uint64_t>(p) & (a - 1)) == 0;
}

// ---------------------------------------------------------------------------------------------
// Exact powers of two and the NaN-propagating amax.

// 2^e from bits for e in [-149, 127] (fp32 subnormals included); clamped outside, as in Rust.
__device__ __forceinline__ float exp2i(int e) {
    e = max(-149, min(127, e));
    return e >= -126 ? __uint_as_float(static_cast<uint32_t>(e + 127) << 23)
                     : __uint_as_float(1u << (e + 149));
}

// max of |x| on magnitude bits: integer order = float order for non-negative floats, and every NaN
// pattern orders above Inf, so NaN wins, then Inf (the amax rule of every format).
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }
__device__ __forceinline__ float abs_max(float acc, float x) {
    return __uint_as_float(max(abs_bits(acc), abs_bits(x)));
}
__device__ __forceinline__ bool is_finite_amax(float amax) { return abs_bits(amax) < 0x7F800000u; }

// ---------------------------------------------------------------------------------------------
// FP8 element casts (RNE, satfinite, NaN -> 0x7F): the hardware instruction is the definition the
// CPU reference reproduces. The x2 forms put the first operand in the upper byte.

__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return static_cast<uint8_t>(r & 0xFF);
}
__device__ __forceinline__ uint8_t f32_to_e5m2(float x) {
    uint16_t r;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return static_cast<uint8_t>(r & 0xFF);
}
// Two at once: returns lo | hi << 8 (lo = element i, hi = element i+1 in memory order).
__device__ __forceinline__ uint16_t f32x2_to_e4m3x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ uint16_t f32x2_to_e5m2x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Decodes are exact: every E4M3 and E5M2 value is an fp16 value.
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(b)));
    return F16::from_bits(static_cast<uint16_t>(h2 & 0xFFFF));
}
__device__ __forceinline__ float e5m2_to_f32(uint8_t b) {
    return F16::from_bits(static_cast<uint16_t>(b) << 8);  // E5M2 is the top byte of fp16
}

// Element format of MXFP8 data: 0 = E4M3 (max 448, emax 8), 1 = E5M2 (max 57344, emax 15).
template <int Elem> struct Fp8;
template <> struct Fp8<0> {
    static constexpr float MAX = 448.0f;
    static constexpr int EMAX = 8;
    static constexpr uint8_t NAN_CODE = 0x7F;
    static __device__ __forceinline__ uint8_t encode(float x) { return f32_to_e4m3(x); }
    static __device__ __forceinline__ uint16_t encode2(float lo, float hi) { return f32x2_to_e4m3x2(lo, hi); }
    static __device__ __forceinline__ float decode(uint8_t b) { return e4m3_to_f32(b); }
};
template <> struct Fp8<1> {
    static constexpr float MAX = 57344.0f;
    static constexpr int EMAX = 15;
    static constexpr uint8_t NAN_CODE = 0x7F;
    static __device__ __forceinline__ uint8_t encode(float x) { return f32_to_e5m2(x); }
    static __device__ __forceinline__ uint16_t encode2(float lo, float hi) { return f32x2_to_e5m2x2(lo, hi); }
    static __device__ __forceinline__ float decode(uint8_t b) { return e5m2_to_f32(b); }
};

// ---------------------------------------------------------------------------------------------
// E8M0 scales (docs/NUMERICS.md "MXFP8" steps 2-4).

__device__ __forceinline__ float e8m0_to_f32(uint8_t b) {
    if (b == 0xFF) return __uint_as_float(0x7FFFFFFFu);
    return exp2i(static_cast<int>(b) - 127);  // byte 0 -> 2^-127, an fp32 subnormal
}

// rceil: d = amax * fp32(1/max) (a multiply); e = biased exponent of d, +1 when the mantissa is
// non-zero (for fp32-subnormal d: +1 only when mantissa > 0x400000, i.e. d > 2^-127); cap 254.
template <int Elem>
__device__ __forceinline__ uint8_t e8m0_rceil(float amax) {
    const float d = __fmul_rn(amax, 1.0f / Fp8<Elem>::MAX);
    const uint32_t bits = __float_as_uint(d);
    const uint32_t exp = bits >> 23, mant = bits & 0x7FFFFFu;
    uint32_t e = exp;
    if (exp == 0) {
        e = mant > 0x400000u ? 1u : 0u;
    } else if (mant != 0) {
        e += 1;
    }
    return static_cast<uint8_t>(min(e, 254u));
}

// floor (OCP MX v1.0): e = clamp(floor(log2(amax)) - emax, -127, 127) + 127; amax 0 -> 0.
template <int Elem>
__device__ __forceinline__ uint8_t e8m0_floor(float amax) {
    const uint32_t bits = __float_as_uint(amax);
    if (bits == 0) return 0;
    const int exp = static_cast<int>(bits >> 23);
    // Unbiased floor(log2): normal -> exp - 127; subnormal -> position of the leading mantissa bit.
    const int lg = exp != 0 ? exp - 127 : (31 - __clz(bits & 0x7FFFFFu)) - 149;
    return static_cast<uint8_t>(max(-127, min(127, lg - Fp8<Elem>::EMAX)) + 127);
}

// The scale byte of a block from its amax: 0xFF for a block holding NaN or Inf.
template <int Mode, int Elem>
__device__ __forceinline__ uint8_t mx_scale_byte(float amax) {
    if (!is_finite_amax(amax)) return 0xFF;
    return Mode == 0 ? e8m0_rceil<Elem>(amax) : e8m0_floor<Elem>(amax);
}

// The element multiplier 2^(127 - e) for a finite scale byte (e = 254 -> 2^-127, e = 0 -> 2^127).
__device__ __forceinline__ float mx_inv_scale(uint8_t e) { return exp2i(127 - static_cast<int>(e)); }

// ---------------------------------------------------------------------------------------------
// Byte-tile transpose for the one-pass kernels with a transposed column copy (mxfp8.cuh,
// fp8_block.cuh). The tile is 128 rows x 128 bytes in shared memory, 32 words per row; word w of
// row r sits at r * 32 + (w ^ tswz(r)). The XOR keeps every access on 32 distinct banks: writers
// (a half-warp or warp storing one row, or rows r, r + 1 with r even) see a permutation of the
// row's words, and the readers below (8 row groups x 4 word columns) get XOR 4 * group.
__device__ __forceinline__ int tswz(int r) { return (((r >> 4) & 7) << 2) ^ ((r & 1) << 4); }

// The thread owning row group rg (rows 16rg..16rg+15) and word column cg (bytes 4cg..4cg+3) gets
// col[j][g] = rows 16rg + 4g .. +3 of byte column 4cg + j, packed in row order (4x4 byte blocks
// transposed with prmt), ready for 16-byte stores along the transposed output's rows.
__device__ __forceinline__ void transpose_4x16(const uint32_t* tile, int rg, int cg, uint32_t (&col)[4][4]) {
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = tile[(rg * 16 + i) * 32 + (cg ^ tswz(rg * 16 + i))];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const uint32_t a = __byte_perm(w[4 * g], w[4 * g + 1], 0x5140);      // byte 0, 1 of rows 0, 1
        const uint32_t b = __byte_perm(w[4 * g + 2], w[4 * g + 3], 0x5140);  // byte 0, 1 of rows 2, 3
        const uint32_t c = __byte_perm(w[4 * g], w[4 * g + 1], 0x7362);      // byte 2, 3 of rows 0, 1
        const uint32_t d = __byte_perm(w[4 * g + 2], w[4 * g + 3], 0x7362);
        col[0][g] = __byte_perm(a, b, 0x5410);
        col[1][g] = __byte_perm(a, b, 0x7632);
        col[2][g] = __byte_perm(c, d, 0x5410);
        col[3][g] = __byte_perm(c, d, 0x7632);
    }
}

// Column amaxes of the S chunks a thread holds as raw words (V elements each): camax[j] is the
// NaN-propagating max |x| of element j over the chunks (mxfp8.cuh and fp8_block.cuh column blocks).
template <class In, int S, int V, int W>
__device__ __forceinline__ void column_amax(const uint32_t (&raw)[S][W], float (&camax)[V]) {
#pragma unroll
    for (int j = 0; j < V; ++j) camax[j] = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s)
#pragma unroll
        for (int j = 0; j < V; ++j) camax[j] = abs_max(camax[j], widen<In>(raw[s], j));
}

// ---------------------------------------------------------------------------------------------
// Vector stores of dequantized results (mxfp8.cuh, fp8_block.cuh dequantize kernels).

// Two results as one word of Out (RNE like Out::store; element order = memory order).
template <class Out> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<BF16>(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // RNE, as BF16::store
    return r;
}
template <> __device__ __forceinline__ uint32_t pack2<F16>(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // RNE, as F16::store
    return r;
}

// 16 bytes of Out (16 / sizeof(Out) results) to out + e * sizeof(Out), 16-byte aligned.
template <class Out> __device__ __forceinline__ void store_piece(void* out, int64_t e, const float* y) {
    if constexpr (Bytes<Out>::N == 4)
        *reinterpret_cast<uint4*>(static_cast<float*>(out) + e) =
            make_uint4(__float_as_uint(y[0]), __float_as_uint(y[1]), __float_as_uint(y[2]), __float_as_uint(y[3]));
    else
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + e) =
            make_uint4(pack2<Out>(y[0], y[1]), pack2<Out>(y[2], y[3]), pack2<Out>(y[4], y[5]), pack2<Out>(y[6], y[7]));
}

// ---------------------------------------------------------------------------------------------
// e^x from IEEE multiplies, adds and fmas only: `exp_f32` of rust/core/src/math.rs, operation for
// operation, so the router's scores (moe.cuh) and SwiGLU (swiglu.cuh) match the CPU reference bit
// for bit (CUDA's expf and libm's differ by an ulp at times).
__device__ __forceinline__ float exp_f32(float x) {
    const float LOG2E = __int_as_float(0x3fb8aa3b);
    const float LN2_HI = __int_as_float(0x3f317200);
    const float LN2_LO = __int_as_float(0x35bfbe8e);
    if (x != x) return x;
    if (x > 88.72284f) return __int_as_float(0x7F800000);
    if (x < -103.97208f) return 0.0f;
    const float n = rintf(__fmul_rn(x, LOG2E));
    const float r = __fmaf_rn(-n, LN2_LO, __fmaf_rn(-n, LN2_HI, x));
    float p = 0.0001984127f;
    p = __fmaf_rn(p, r, 0.0013888889f);
    p = __fmaf_rn(p, r, 0.008333334f);
    p = __fmaf_rn(p, r, 0.041666668f);
    p = __fmaf_rn(p, r, 0.16666667f);
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    const int ni = static_cast<int>(n);
    const int a = ni / 2, b = ni - ni / 2;  // C++ and Rust both truncate toward zero
    return __fmul_rn(__fmul_rn(p, __int_as_float((a + 127) << 23)), __int_as_float((b + 127) << 23));
}

}  // namespace deepwell
