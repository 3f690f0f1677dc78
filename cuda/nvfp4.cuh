// NVFP4 kernels: global amax, quantize (1x16 or 16x16 scales, RNE or stochastic, optional
// 16-point Hadamard) and dequantize. Bit-exact twins of rust/core/src/nvfp4.rs, hadamard.rs and
// rng.rs (docs/NUMERICS.md "NVFP4"); the launch contract is cuda/INTERFACE.md.
//
// fp32 order (docs/NUMERICS.md NVFP4 steps 1-4, as nvfp4.rs computes it). Every multiply/add is an
// explicit __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn, so no a*b+c is ever contracted into an FMA
// that would skip a rounding the reference performs (whatever --fmad says).
//   S_enc = min(2688 / g, FLT_MAX), g = |global amax|; g = 0, Inf or NaN -> 1.  S_dec = 1 / S_enc.
//   sb    = e4m3(block_amax * (S_enc * fp32(1/6)))
//   enc   = min(1 / (float(sb) * S_dec), FLT_MAX);  q = e2m1(x * enc)
//   x'    = (e2m1(q) * float(sb)) * S_dec
// A block (1x16, or the whole 16x16 tile) holding NaN or Inf gets scale 0x7F (E4M3 NaN) and data
// nibbles 0 (nvfp4.rs `Ctx::block`), so it dequantizes to NaN.
//
// Memory access: 16-byte vector loads/stores when the base pointers are aligned (checked at run
// time; a block is 32 or 64 bytes of input and 8 of data, so every block start is then aligned
// too), scalar accesses otherwise, with the same results. Data and dequantized output are laid out
// so that a warp's store instruction covers whole 32-byte sectors (partial-sector writes cost L2
// bandwidth).
#pragma once
#include "common.cuh"

namespace deepwell {
namespace nvfp4_detail {

constexpr int BLOCK = 16;  // elements per NVFP4 block (and tile side for Block2D)

// CTAs of THREADS per SM that the register use must allow (__launch_bounds__' second argument).
// Rust's grid is up to 8 CTAs per SM and every CTA of a grid-stride loop gets the same work, so
// CTAs that do not fit at once run as a second, partial wave. RNE: all of an SM's threads (2048 on
// sm_90/sm_100/sm_103, 1536 on sm_120 and others), i.e. 32 (40) registers, no spills. Stochastic:
// compute-bound (splitmix64 per element), where a partial wave still keeps the SM busy; a looser
// bound (40 / 64 registers) avoids the spills the tight one causes.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000 || __CUDA_ARCH__ == 1030)
constexpr int MIN_CTAS = 2048 / THREADS, MIN_CTAS_SR = 6;
#else
constexpr int MIN_CTAS = 1536 / THREADS, MIN_CTAS_SR = 4;
#endif

// fp32(1/6) = 0x3E2AAAAB, the value of Rust's f32 `1.0 / 6.0`, written as that float's exact
// decimal expansion so that no constant folding is involved.
constexpr float ONE_SIXTH = 0.16666667163372039794921875f;

// ---------------------------------------------------------------------------------------------
// Element access by tag. A block is loaded as raw 32-bit words (WORDS per 16 elements; 16-bit
// types hold element 2i in the low half, the lower address), then widened exactly to fp32.

template <class T> struct Elem;
template <> struct Elem<F32> {
    static constexpr int BYTES = 4;
    static __device__ __forceinline__ float widen(uint32_t w) { return __uint_as_float(w); }
    static __device__ __forceinline__ uint32_t narrow(float v) { return __float_as_uint(v); }
};
template <> struct Elem<BF16> {
    static constexpr int BYTES = 2;
    static __device__ __forceinline__ float widen(uint32_t h) { return BF16::from_bits(static_cast<uint16_t>(h)); }
    static __device__ __forceinline__ uint32_t narrow(float v) { return BF16::to_bits(v); }
};
template <> struct Elem<F16> {
    static constexpr int BYTES = 2;
    static __device__ __forceinline__ float widen(uint32_t h) { return F16::from_bits(static_cast<uint16_t>(h)); }
    static __device__ __forceinline__ uint32_t narrow(float v) { return F16::to_bits(v); }
};
template <class T> constexpr int WORDS = BLOCK * Elem<T>::BYTES / 4;

// w = raw words of x[e0 .. e0+16). `vec`: x is 16-byte aligned. All loads issue before any use.
template <class In>
__device__ __forceinline__ void load_raw(const void* x, int64_t e0, bool vec, uint32_t w[WORDS<In>]) {
    const char* base = static_cast<const char*>(x) + e0 * Elem<In>::BYTES;
    if (vec) {
        const uint4* p = reinterpret_cast<const uint4*>(base);
        uint4 q[WORDS<In> / 4];
#pragma unroll
        for (int j = 0; j < WORDS<In> / 4; ++j) q[j] = p[j];
#pragma unroll
        for (int j = 0; j < WORDS<In> / 4; ++j) {
            w[4 * j] = q[j].x;
            w[4 * j + 1] = q[j].y;
            w[4 * j + 2] = q[j].z;
            w[4 * j + 3] = q[j].w;
        }
    } else if constexpr (Elem<In>::BYTES == 4) {
#pragma unroll
        for (int i = 0; i < BLOCK; ++i) w[i] = reinterpret_cast<const uint32_t*>(base)[i];
    } else {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(base);
#pragma unroll
        for (int i = 0; i < BLOCK / 2; ++i) w[i] = p[2 * i] | (static_cast<uint32_t>(p[2 * i + 1]) << 16);
    }
}

template <class In>
__device__ __forceinline__ void widen16(const uint32_t w[WORDS<In>], float v[BLOCK]) {
#pragma unroll
    for (int i = 0; i < WORDS<In>; ++i) {
        if constexpr (Elem<In>::BYTES == 4) {
            v[i] = Elem<In>::widen(w[i]);
        } else {
            v[2 * i] = Elem<In>::widen(w[i] & 0xFFFFu);
            v[2 * i + 1] = Elem<In>::widen(w[i] >> 16);
        }
    }
}

// NaN-propagating amax (fp32 magnitude bits; integer order = float order, NaN > Inf) of the raw
// block. bf16/fp16 magnitudes order like their fp32 widenings (exact and monotonic), so the max is
// taken on packed halves (max.u16x2, sm_90+) and widened once.
template <class In>
__device__ __forceinline__ uint32_t amax_raw(const uint32_t w[WORDS<In>]) {
    if constexpr (Elem<In>::BYTES == 4) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < BLOCK; ++i) m = max(m, w[i] & 0x7FFFFFFFu);
        return m;
    } else {
        uint32_t m2 = 0;
#pragma unroll
        for (int i = 0; i < BLOCK / 2; ++i) asm("max.u16x2 %0, %1, %2;" : "=r"(m2) : "r"(m2), "r"(w[i] & 0x7FFF7FFFu));
        return abs_bits(Elem<In>::widen(max(m2 & 0xFFFFu, m2 >> 16)));
    }
}

__device__ __forceinline__ uint32_t amax16(const float v[BLOCK]) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) m = max(m, abs_bits(v[i]));
    return m;
}

// ---------------------------------------------------------------------------------------------
// hadamard16 (hadamard.rs): butterflies h = 1, 2, 4, 8, each (a, b) -> (a + b, a - b), then
// v[i] *= 0.25 * s[i] (0.25 * s is exactly ±0.25: one rounding, as in Rust). Fully unrolled, so
// v stays in registers.
__device__ __forceinline__ void hadamard16(float v[BLOCK]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int h = 1 << s;
#pragma unroll
        for (int j = 0; j < BLOCK; ++j) {
            if ((j & h) == 0) {
                const float a = v[j], b = v[j + h];
                v[j] = __fadd_rn(a, b);
                v[j + h] = __fsub_rn(a, b);
            }
        }
    }
    // HADAMARD_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]: bit i set = -1.
    constexpr uint32_t NEG = 0xD7E8u;
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) v[i] = __fmul_rn(v[i], ((NEG >> i) & 1u) ? -0.25f : 0.25f);
}

// Loads one block as fp32 (Hadamard-transformed when asked) and returns its amax bits.
template <class In, int Hadamard>
__device__ __forceinline__ uint32_t load_block(const void* x, int64_t e0, bool vec, float v[BLOCK]) {
    uint32_t w[WORDS<In>];
    load_raw<In>(x, e0, vec, w);
    widen16<In>(w, v);
    if constexpr (Hadamard) {
        hadamard16(v);
        return amax16(v);
    } else {
        return amax_raw<In>(w);
    }
}

// ---------------------------------------------------------------------------------------------
// E2M1 casts (formats.rs f32_to_e2m1, rng.rs e2m1_stochastic). Codes: bit 3 = sign, magnitudes
// 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

// RNE + satfinite magnitude code of |y| for y not NaN. The E2M1 grid has quantum q = 0.5 below 2,
// 1 in [2, 4) and 2 from 4 on; rounding |y| to a multiple of q, ties to the even multiple (= even
// mantissa bit), is E2M1's RNE, ties included: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
// 3.5->4, 5->4. The FPU does that rounding: |y| + M with M = q * 2^23 has ulp q, so
// bits(|y| + M) - bits(M) = j quanta. Region (0, 1, 2 for q = 0.5, 1, 2) = exponent of
// clamp(|y|, 1, 4), M = 2^22 << region. Code = j + 2 * region (region 1: j in {2,3,4} -> 4,5,6;
// region 2: j = 2, 3 -> 6, 7), capped at 7 (|y| >= 7 gives j >= 4; Inf a huge j). Checked
// against formats.rs for all 2^32 inputs.
__device__ __forceinline__ uint32_t e2m1_magnitude_rne(float y) {
    const float a = fabsf(y);
    const uint32_t ex = __float_as_uint(fminf(fmaxf(a, 1.0f), 4.0f)) & 0x7F800000u;  // 1.0, 2.0 or 4.0
    const uint32_t m = ex + (22u << 23);
    const uint32_t j = __float_as_uint(__fadd_rn(a, __uint_as_float(m))) - m;
    return min(j + ((ex - 0x3F800000u) >> 22), 7u);
}

// f32_to_e2m1 for every fp32 input: sign kept (-0 -> 0x8), NaN -> 0.
__device__ __forceinline__ uint32_t f32_to_e2m1(float x) {
    const uint32_t bits = __float_as_uint(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0u;
    return e2m1_magnitude_rne(x) | ((bits >> 28) & 0x8u);
}

// rng.rs e2m1_stochastic: |v| >= 6 -> 6; else lo <= |v| < hi adjacent grid points, result hi if
// u < t, t = (|v| - lo) / (hi - lo), u = (bits >> 8) * 2^-24; sign kept, NaN -> 0. In Rust every
// step of t is exact (Sterbenz subtraction, power-of-two divisor), so u < t is a comparison of
// exact rationals, evaluated here without the float ops:
//   |v| in [1, 6): lo = |v| cut to one mantissa bit, code (bits >> 22) - 252, and
//                  t = (low 22 mantissa bits) / 2^22, so u < t <=> r < low22 * 4;
//   |v| in [0.5, 1): lo = 0.5, t = 2|v| - 1 = mantissa / 2^23, so u < t <=> r < mantissa * 2;
//   |v| < 0.5: lo = 0, t = 2|v| (exact, subnormals too), compared in fp32 like Rust.
// Checked against rng.rs for all 2^32 v, each with random bits and the bits at u = t and just below.
__device__ __forceinline__ uint32_t e2m1_stochastic(float v, uint32_t rbits) {
    const uint32_t bits = __float_as_uint(v);
    const uint32_t sign = (bits >> 28) & 0x8u;
    const uint32_t a = bits & 0x7FFFFFFFu;
    const uint32_t r = rbits >> 8;
    if (a > 0x7F800000u) return 0u;          // NaN
    if (a >= 0x40C00000u) return sign | 7u;  // |v| >= 6, Inf included
    uint32_t lo, up;
    if (a >= 0x3F800000u) {
        lo = (a >> 22) - 252u;
        up = r < ((a & 0x3FFFFFu) << 2);
    } else if (a >= 0x3F000000u) {
        lo = 1u;
        up = r < ((a & 0x7FFFFFu) << 1);
    } else {
        lo = 0u;
        up = __fmul_rn(static_cast<float>(r), 5.9604644775390625e-08f) < __fmul_rn(__uint_as_float(a), 2.0f);
    }
    return sign | (lo + up);
}

// rng.rs sr_bits: splitmix64 at state seed + (index + 1) * GOLDEN, upper 32 bits. Callers step the
// state by GOLDEN per element (the same sum mod 2^64).
constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;
__device__ __forceinline__ uint32_t splitmix_hi(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<uint32_t>(z >> 32);
}

// E2M1 code -> fp32 (exact; -0 keeps its sign). Magnitude codes >= 2 are normal with bits
// 0x3F000000 + c * 2^22; code 1 is 0.5.
__device__ __forceinline__ float e2m1_to_f32(uint32_t c) {
    const uint32_t m = c & 7u;
    const uint32_t mag = m >= 2 ? 0x3F000000u + (m << 22) : (m == 1 ? 0x3F000000u : 0u);
    return __uint_as_float(mag | ((c & 8u) << 28));
}

// ---------------------------------------------------------------------------------------------
// Scales (nvfp4.rs nvfp4_encode_scale, Ctx).

struct TensorScale {
    float sb_factor;  // S_enc * fp32(1/6)
    float s_dec;      // 1 / S_enc
};

__device__ __forceinline__ TensorScale tensor_scale(const unsigned int* amax_bits) {
    const float g = __uint_as_float(*amax_bits & 0x7FFFFFFFu);
    const float s_enc = (g == 0.0f || !is_finite_amax(g)) ? 1.0f : fminf(__fdiv_rn(2688.0f, g), FLT_MAX_F);
    return {__fmul_rn(s_enc, ONE_SIXTH), __fdiv_rn(1.0f, s_enc)};
}

// enc for every finite block scale byte (0x00..0x7E: amax * factor >= +0, satfinite), as nvfp4.rs's
// Ctx::enc table: one division per byte per CTA instead of one per block. Caller syncs.
__device__ __forceinline__ void fill_enc_table(float* tab, float s_dec) {
    if (threadIdx.x < 127) {
        tab[threadIdx.x] = fminf(__fdiv_rn(1.0f, __fmul_rn(e4m3_to_f32(threadIdx.x), s_dec)), FLT_MAX_F);
    }
}

// Scale byte of a block from its amax bits; 0x7F (and no enc) for a block holding NaN or Inf. A
// finite amax gives a finite product (or +Inf, which satfinite maps to 0x7E), never 0x7F.
__device__ __forceinline__ uint32_t block_scale(uint32_t amax, float sb_factor, const float* tab, float& enc) {
    if (amax >= 0x7F800000u) return 0x7Fu;
    const uint32_t sb = f32_to_e4m3(__fmul_rn(__uint_as_float(amax), sb_factor));
    enc = tab[sb];
    return sb;
}

// 16 codes packed into 8 bytes (element 2i in the low nibble of byte i) as 2 little-endian words.
// `index` is the flat element index of v[0] (the stochastic bits' counter). enc is finite and
// > 0 and v finite, so y = v * enc is never NaN and keeps v's sign (the RNE path skips the NaN test).
template <int Stochastic>
__device__ __forceinline__ uint2 encode16(const float v[BLOCK], float enc, uint64_t seed, int64_t index) {
    uint32_t w[2] = {0u, 0u};
    uint64_t z = seed + (static_cast<uint64_t>(index) + 1ull) * GOLDEN;
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) {
        const float y = __fmul_rn(v[i], enc);
        uint32_t q;
        if constexpr (Stochastic) {
            q = e2m1_stochastic(y, splitmix_hi(z));
            z += GOLDEN;
        } else {
            q = e2m1_magnitude_rne(y) | ((__float_as_uint(y) >> 28) & 0x8u);
        }
        w[i / 8] |= q << (4 * (i % 8));
    }
    return make_uint2(w[0], w[1]);
}

// Stores 8 packed bytes at data + byte0 (one 8-byte store when `vec`).
__device__ __forceinline__ void store8(uint8_t* data, int64_t byte0, bool vec, uint2 w) {
    if (vec) {
        *reinterpret_cast<uint2*>(data + byte0) = w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) data[byte0 + i] = static_cast<uint8_t>((i < 4 ? w.x : w.y) >> (8 * (i % 4)));
    }
}

// Quantizes one block given its amax and stores data and scale byte.
template <int Stochastic>
__device__ __forceinline__ void quantize_store(const float v[BLOCK], uint32_t amax, float sb_factor, const float* tab,
                                               uint64_t seed, int64_t e0, uint8_t* data, bool vec_out, uint8_t* scale) {
    float enc = 0.0f;
    const uint32_t sb = block_scale(amax, sb_factor, tab, enc);
    const uint2 w = sb == 0x7Fu ? make_uint2(0u, 0u) : encode16<Stochastic>(v, enc, seed, e0);
    store8(data, e0 / 2, vec_out, w);
    scale[e0 / BLOCK] = static_cast<uint8_t>(sb);
}

// a / b for non-negative 64-bit values, with the cheap 32-bit divide when both fit.
__device__ __forceinline__ int64_t div64(int64_t a, int64_t b) {
    if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    return a / b;
}

}  // namespace nvfp4_detail

// ---------------------------------------------------------------------------------------------
// Global amax (nvfp4.rs nvfp4_global_amax): NaN-propagating max |x| as fp32 bits, of the
// Hadamard-transformed values when Hadamard = 1. One 16-element block per thread per grid-stride
// step (THREADS blocks per CTA: rust/gpu/src/kernels/nvfp4.rs sizes the grid); warp max by
// shuffles, one atomicMax per warp into the word Rust zeroed. With Hadamard = 0 a tail of n % 16
// elements is read one by one (Rust never passes one: k % 16 == 0); with Hadamard = 1 it is ignored.
template <class In, int Hadamard>
__global__ void __launch_bounds__(THREADS) nvfp4_amax(const void* x, int64_t n, unsigned int* amax_bits) {
    using namespace nvfp4_detail;
    const int64_t n_blocks = n / BLOCK;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    const bool vec = aligned(x, 16);
    uint32_t m = 0;
    for (int64_t b = tid; b < n_blocks; b += stride) {
        if constexpr (Hadamard) {
            float v[BLOCK];
            m = max(m, load_block<In, 1>(x, b * BLOCK, vec, v));
        } else {
            uint32_t w[WORDS<In>];
            load_raw<In>(x, b * BLOCK, vec, w);
            m = max(m, amax_raw<In>(w));
        }
    }
    if constexpr (!Hadamard) {
        for (int64_t i = n_blocks * BLOCK + tid; i < n; i += stride) m = max(m, abs_bits(In::load(x, i)));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(amax_bits, m);
}

// Quantize (nvfp4.rs nvfp4_quantize). x (rows, k), k % 16 == 0; data (rows, k/2); scale (rows, k/16).
// Grid: rust/gpu/src/kernels/nvfp4.rs (THREADS blocks per CTA, or one Block2D unit). S_dec is
// written by thread 0 of block 0 (also when the tensor is empty).
//  Block2D = 0: one thread per 1x16 block, grid-stride over rows*k/16 blocks; a warp stores 256
//    contiguous data bytes and 32 scale bytes.
//  Block2D = 1 (rows % 16 == 0; a partial last strip would be skipped, never overrun): a CTA
//    quantizes a unit of 16 rows x 16 tiles (256 columns): thread t owns row t / 16 of tile t % 16,
//    so each warp row stores 128 contiguous data bytes. Tile amax: the two rows of a warp combine
//    by one shuffle, the 8 warps through shared memory (double-buffered, one barrier per unit).
//    Grid-stride over units, (rows / 16) * ceil(k / 256) of them; tiles past k / 16 idle.
template <class In, int Block2D, int Stochastic, int Hadamard>
__global__ void __launch_bounds__(THREADS, Stochastic ? nvfp4_detail::MIN_CTAS_SR : nvfp4_detail::MIN_CTAS)
    nvfp4_quantize(const void* x, const unsigned int* amax_bits, uint8_t* data,
                                                          uint8_t* scale, float* s_dec, int64_t rows, int64_t k,
                                                          uint64_t seed) {
    using namespace nvfp4_detail;
    __shared__ float enc_tab[128];
    const TensorScale ts = tensor_scale(amax_bits);
    if (blockIdx.x == 0 && threadIdx.x == 0) *s_dec = ts.s_dec;
    fill_enc_table(enc_tab, ts.s_dec);
    __syncthreads();
    const bool vec_in = aligned(x, 16), vec_out = aligned(data, 8);

    if constexpr (!Block2D) {
        const int64_t n_blocks = rows * k / BLOCK;
        const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
        for (int64_t b = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; b < n_blocks; b += stride) {
            float v[BLOCK];
            const uint32_t m = load_block<In, Hadamard>(x, b * BLOCK, vec_in, v);
            quantize_store<Stochastic>(v, m, ts.sb_factor, enc_tab, seed, b * BLOCK, data, vec_out, scale);
        }
    } else {
        __shared__ uint32_t part[2][THREADS / 32][16];  // [parity][warp][tile]: amax of the warp's 2 rows
        const int64_t nb = k / BLOCK;                   // tiles per 16-row strip
        const int64_t groups = (nb + 15) / 16;          // units per strip
        const int64_t units = (rows / BLOCK) * groups;
        const int rr = threadIdx.x / 16, tt = threadIdx.x % 16, warp = threadIdx.x / 32;
        // Unit u = strip * groups + g, stepped by gridDim.x without a division per step.
        const int64_t step_s = div64(gridDim.x, max(groups, int64_t{1})), step_g = gridDim.x - step_s * groups;
        int64_t strip = div64(blockIdx.x, max(groups, int64_t{1})), g = blockIdx.x - strip * groups;
        int par = 0;
        for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
            const int64_t cb = g * 16 + tt, r = strip * BLOCK + rr;
            const bool valid = cb < nb;
            const int64_t e0 = r * k + cb * BLOCK;  // flat index of this thread's first element
            float v[BLOCK];
            uint32_t m = 0;
            if (valid) m = load_block<In, Hadamard>(x, e0, vec_in, v);
            m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));  // rows 2w and 2w+1 of the same tile
            if ((threadIdx.x & 16) == 0) part[par][warp][tt] = m;
            __syncthreads();
#pragma unroll
            for (int i = 0; i < THREADS / 32; ++i) m = max(m, part[par][i][tt]);
            if (valid) quantize_store<Stochastic>(v, m, ts.sb_factor, enc_tab, seed, e0, data, vec_out, scale);
            par ^= 1;
            strip += step_s;
            g += step_g;
            if (g >= groups) {
                g -= groups;
                ++strip;
            }
        }
    }
}

// Dequantize (nvfp4.rs nvfp4_dequantize): out = Out((e2m1(q) * float(sb)) * S_dec), left to right
// in fp32. One thread per 16-byte chunk of output (4 fp32 or 8 bf16/fp16 elements, i.e. 2 or 4
// data bytes of one block), consecutive threads on consecutive chunks, so every warp store covers
// 512 contiguous bytes. Grid-stride over chunks (THREADS per CTA: rust/gpu/src/kernels/nvfp4.rs).
template <class Out>
__global__ void __launch_bounds__(THREADS) nvfp4_dequantize(const uint8_t* data, const uint8_t* scale,
                                                            const float* s_dec, void* out, int64_t rows, int64_t k) {
    using namespace nvfp4_detail;
    constexpr int E = 16 / Elem<Out>::BYTES;  // elements per chunk
    const float sd = *s_dec;
    const int64_t n_chunks = rows * k / E;    // k % 16 == 0, so chunks never straddle blocks
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    const bool vec = aligned(out, 16) && aligned(data, E / 2);
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; c < n_chunks; c += stride) {
        const int64_t e0 = c * E;
        const float f = e4m3_to_f32(scale[e0 / BLOCK]);
        uint32_t codes;
        if (vec) {
            codes = E == 4 ? reinterpret_cast<const uint16_t*>(data)[c] : reinterpret_cast<const uint32_t*>(data)[c];
        } else {
            codes = 0;
#pragma unroll
            for (int i = 0; i < E / 2; ++i) codes |= static_cast<uint32_t>(data[e0 / 2 + i]) << (8 * i);
        }
        float y[E];
#pragma unroll
        for (int i = 0; i < E; ++i) y[i] = __fmul_rn(__fmul_rn(e2m1_to_f32(codes >> (4 * i)), f), sd);
        if (vec) {
            uint32_t u[4];
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                if constexpr (E == 4) {
                    u[t] = Elem<Out>::narrow(y[t]);
                } else {  // element 2t in the low half (lower address)
                    u[t] = Elem<Out>::narrow(y[2 * t]) | (Elem<Out>::narrow(y[2 * t + 1]) << 16);
                }
            }
            reinterpret_cast<uint4*>(out)[c] = make_uint4(u[0], u[1], u[2], u[3]);
        } else {
#pragma unroll
            for (int i = 0; i < E; ++i) Out::store(out, e0 + i, y[i]);
        }
    }
}

}  // namespace deepwell
