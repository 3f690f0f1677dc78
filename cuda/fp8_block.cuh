// FP8 block-scaled kernels (DeepSeek-V3 style; Hopper's block-scaled GEMM): quantize in 1x128,
// 128x1 or 128x128 blocks, and dequantize; the helpers here also serve the pass that writes rows +
// transposed columns from one read (fp8_block_transpose.cuh).
// Contract: docs/NUMERICS.md "FP8 block"; bit-exact twin of rust/core/src/fp8_block.rs.
// Signatures and launch shapes: INTERFACE.md "fp8_block.cuh" (THREADS = 256, any grid size works).
//
// Per block (docs/NUMERICS.md "FP8 block"):
//   amax = NaN-propagating max |x|;  scale = __fdiv_rn(448, amax)  (amax 0/Inf/NaN -> 1,
//   Inf scale -> FLT_MAX, pow2 -> bits & 0xFF800000);  scale_inv = __fdiv_rn(1, scale);
//   q = cast_e4m3_rne_satfinite(__fmul_rn(x, scale)).  Dequantize: Out(e4m3(q) * scale_inv).
//
// Every kernel checks pointer alignment once (a grid-uniform branch) and runs either the vector
// path (16-byte loads) or the same index arithmetic with scalar accesses, so views with any
// storage offset are correct.
//
// Work per CTA and loop iteration (rust/gpu/src/kernels/fp8_block.rs mirrors it; grid capped at one wave):
//   quantize, rowcol: one 128 x 128 tile (quantize (1,128) tiles the flat tensor as (n/128, 128);
//                     rowcol in fp8_block_transpose.cuh)
//   dequantize:       THREADS * DQ_UNROLL pieces of 16 / sizeof(Out) elements (8192 for 16-bit out,
//                     4096 for fp32)
#pragma once
#include "common.cuh"

namespace deepwell {
namespace fp8_block_detail {

constexpr int TILE = 128;

// ---------------------------------------------------------------------------------------------
// Raw element I/O (words and `widen` live in common.cuh).

__device__ __forceinline__ uint4 ld_nc16(const void* p) {
    uint4 v;  // ld.global.nc: nothing these kernels read is written while they run
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The 16-byte chunk (V = 16 / sizeof elements) at element i. VEC: one aligned 16-byte load;
// otherwise element loads of the first `nv` elements (the rest read as 0, which no amax sees).
template <class In, bool VEC>
__device__ __forceinline__ void load_chunk(const void* x, int64_t i, int nv, uint32_t (&w)[4]) {
    if constexpr (VEC) {
        const uint4 v = ld_nc16(static_cast<const char*>(x) + i * Bytes<In>::N);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
        constexpr int V = 16 / Bytes<In>::N;
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (j >= nv) break;
            if constexpr (Bytes<In>::N == 4) w[j] = __float_as_uint(static_cast<const float*>(x)[i + j]);
            else w[j >> 1] |= static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i + j]) << (16 * (j & 1));
        }
    }
}

// V fp8 bytes (V / 4 words) to p. VEC: one 8- or 4-byte store; otherwise the first nv bytes.
template <int V, bool VEC>
__device__ __forceinline__ void store_chunk(uint8_t* p, const uint32_t* w, int nv) {
    if constexpr (VEC) {
        if constexpr (V == 8) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
        else *reinterpret_cast<uint32_t*>(p) = w[0];
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (j < nv) p[j] = static_cast<uint8_t>(w[j >> 2] >> (8 * (j & 3)));
    }
}

// docs/NUMERICS.md "FP8 block": the quantization scale of a block (rust fp8_block_scale).
__device__ __forceinline__ float block_scale(float amax, int pow2) {
    if (amax == 0.0f || !is_finite_amax(amax)) return 1.0f;  // amax is |.|: +0, finite, Inf or NaN
    float s = __fdiv_rn(448.0f, amax);                        // correctly rounded, like Rust's `/`
    if (abs_bits(s) == 0x7F800000u) s = FLT_MAX_F;            // tiny (subnormal) amax
    if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);  // round down to 2^k
    return s;
}

// V elements of a chunk times their scales, cast to E4M3, packed 4 per word (element order = byte order).
template <class In, int V>
__device__ __forceinline__ void encode_chunk(const uint32_t (&w)[4], const float* f, uint32_t* out) {
#pragma unroll
    for (int j = 0; j < V; j += 4)
        out[j >> 2] =
            static_cast<uint32_t>(f32x2_to_e4m3x2(__fmul_rn(widen<In>(w, j), f[j]), __fmul_rn(widen<In>(w, j + 1), f[j + 1]))) |
            (static_cast<uint32_t>(f32x2_to_e4m3x2(__fmul_rn(widen<In>(w, j + 2), f[j + 2]),
                                                   __fmul_rn(widen<In>(w, j + 3), f[j + 3])))
             << 16);
}


// Tile geometry: a 128 x 128 tile is read as 16-byte chunks. L lanes cover a tile row (16 for
// 16-bit inputs, 32 for fp32), so a warp instruction reads 512 contiguous bytes (2 rows of 256 or
// 1 of 512); RS rows per step over the CTA, S steps, S independent 16-byte loads per thread.
template <class In> struct Geo {
    static constexpr int V = 16 / Bytes<In>::N;  // elements per chunk
    static constexpr int L = TILE / V;           // lanes per tile row
    static constexpr int RS = THREADS / L;       // rows per step
    static constexpr int S = TILE / RS;          // steps
};

// Max over the L lanes of one tile row (they are L consecutive lanes of one warp).
template <int L> __device__ __forceinline__ float row_reduce(float a) {
#pragma unroll
    for (int o = 1; o < L; o <<= 1) a = abs_max(a, __shfl_xor_sync(FULL_MASK, a, o));
    return a;
}
// Max over the lanes of a warp that hold the same columns (lane, lane ^ L, ...).
template <int L> __device__ __forceinline__ float col_reduce_warp(float a) {
#pragma unroll
    for (int o = L; o < 32; o <<= 1) a = abs_max(a, __shfl_xor_sync(FULL_MASK, a, o));
    return a;
}

// The column scales of a TILE-column tile from each thread's column amaxes (camax: V columns at
// li * V): a warp reduction over the L-lane groups, then threads 0..TILE-1 combine the warps'
// partials (s_part) into the scale of their column (s_scale). Returns that scale to threads
// 0..TILE-1 (0 to the others); ends with a barrier, so s_scale is complete for every thread.
template <int L, int V>
__device__ __forceinline__ float tile_column_scales(float (&camax)[V], int warp, int lane, int li, int pow2,
                                                    float* s_part, float* s_scale) {
#pragma unroll
    for (int j = 0; j < V; ++j) camax[j] = col_reduce_warp<L>(camax[j]);
    if (lane < L) {
#pragma unroll
        for (int j = 0; j < V; ++j) s_part[warp * TILE + li * V + j] = camax[j];
    }
    __syncthreads();
    float scale = 0.0f;
    if (threadIdx.x < TILE) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) a = abs_max(a, s_part[w * TILE + threadIdx.x]);
        scale = block_scale(a, pow2);
        s_scale[threadIdx.x] = scale;
    }
    __syncthreads();
    return scale;
}

// ---------------------------------------------------------------------------------------------
// Tile walk order of rowcol: bands of BAND tile-rows walked column-major, so the CTAs running
// together cover ~16 x 16 tiles and the transposed (k, m) output (row stride m) gets ~2 KiB runs
// per row instead of 128 bytes. Measured on H100, bf16: 68% -> 75% of copy bandwidth at
// 16384 x 14336, 75% -> 77% at 32768 x 4096, unchanged at 8192 x 8192.
constexpr int BAND = 16;
__device__ __forceinline__ void band_tile(int64_t t, int64_t row_tiles, int64_t col_tiles, int64_t& rt,
                                          int64_t& ct) {
    const int64_t band = t / (BAND * col_tiles), r_start = band * BAND;
    const int64_t h = min(static_cast<int64_t>(BAND), row_tiles - r_start);  // last band may be short
    const int64_t idx = t - band * BAND * col_tiles;
    rt = r_start + idx % h;
    ct = idx / h;
}

// ---------------------------------------------------------------------------------------------
// Quantize: x viewed as (nrows, ncols), 128 x 128 tiles, one per CTA iteration.
//  (1,128):   view (n/128, 128): a block is a tile row; reduce over its L lanes with shuffles.
//  (128,1):   view (batch*rows, cols): a block is a tile column; per-thread max over its S rows,
//             shuffle across the warp's lanes of that column, then across the 8 warps in shared
//             memory; threads 0..127 finish one column each. Partial last column tile allowed.
//  (128,128): the tile is the block: warp reduce, then 8 partials in shared memory (two buffers
//             by tile parity, so the next tile's writes never race this tile's reads).
// Elements are quantized from the registers loaded once.

template <class In, int BR, int BC, bool VEC, int MM>
__device__ __forceinline__ void quantize_tiles(const void* x, uint8_t* data, float* scale_inv, int64_t nrows,
                                               int64_t ncols, int64_t cols, int pow2, float* s_part,
                                               float* s_scale) {
    using G = Geo<In>;
    constexpr int V = G::V, L = G::L, RS = G::RS, S = G::S;
    const int li = threadIdx.x % L, rsub = threadIdx.x / L;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row_tiles = (nrows + TILE - 1) / TILE, col_tiles = (ncols + TILE - 1) / TILE;
    const int64_t tiles = row_tiles * col_tiles;
    int parity = 0;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x, parity ^= 1) {
        const int64_t rt = t / col_tiles, ct = t - rt * col_tiles;
        const int64_t r0 = rt * TILE, c = ct * TILE + li * V;  // this thread's first column
        const int nv = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(V), ncols - c)));
        uint32_t raw[S][4];
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int64_t r = r0 + rsub + s * RS;
            if (r < nrows && nv > 0) {
                load_chunk<In, VEC>(x, r * ncols + c, nv, raw[s]);
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k) raw[s][k] = 0;
            }
        }
        if constexpr (BR == 1) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int64_t r = r0 + rsub + s * RS;
                float amax = 0.0f;
#pragma unroll
                for (int j = 0; j < V; ++j) amax = abs_max(amax, widen<In>(raw[s], j));
                const float scale = block_scale(row_reduce<L>(amax), pow2);
                float f[V];
#pragma unroll
                for (int j = 0; j < V; ++j) f[j] = scale;
                uint32_t out[V / 4];
                encode_chunk<In, V>(raw[s], f, out);
                if (r < nrows) {
                    store_chunk<V, VEC>(data + r * ncols + c, out, nv);
                    // Block index = view row r = (row, k-block); MM: stored M-major (k-block, row).
                    if (li == 0) {
                        const int64_t kb = cols / TILE;
                        scale_inv[MM ? (r % kb) * (nrows / kb) + r / kb : r] = __fdiv_rn(1.0f, scale);
                    }
                }
            }
        } else {
            float camax[V];
            column_amax<In>(raw, camax);
            float f[V];
            if constexpr (BC == 1) {
                const float scale = tile_column_scales<L>(camax, warp, lane, li, pow2, s_part, s_scale);
                const int64_t col = ct * TILE + threadIdx.x;
                if (threadIdx.x < TILE && col < ncols) scale_inv[rt * ncols + col] = __fdiv_rn(1.0f, scale);
#pragma unroll
                for (int j = 0; j < V; ++j) f[j] = s_scale[li * V + j];
            } else {
                float a = 0.0f;
#pragma unroll
                for (int j = 0; j < V; ++j) a = abs_max(a, camax[j]);
                a = row_reduce<32>(a);
                if (lane == 0) s_part[parity * 8 + warp] = a;
                __syncthreads();
                a = 0.0f;
#pragma unroll
                for (int w = 0; w < THREADS / 32; ++w) a = abs_max(a, s_part[parity * 8 + w]);
                const float scale = block_scale(a, pow2);
                if (threadIdx.x == 0) scale_inv[rt * col_tiles + ct] = __fdiv_rn(1.0f, scale);
#pragma unroll
                for (int j = 0; j < V; ++j) f[j] = scale;
            }
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const int64_t r = r0 + rsub + s * RS;  // < nrows: nrows % 128 == 0 here
                uint32_t out[V / 4];
                encode_chunk<In, V>(raw[s], f, out);
                if (nv > 0) store_chunk<V, VEC>(data + r * ncols + c, out, nv);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantize: element (R, c) of the (batch*rows, cols) view uses scale_inv[(R/BR)*(cols/BC) + c/BC]
// (rows % BR == 0, so R/BR = b*(rows/BR) + r/BR). Vector path: a thread piece is
// P = 16 / sizeof(Out) elements (P fp8 bytes in, one 16-byte store out), pieces of a warp are
// consecutive, so each store instruction writes 512 contiguous bytes; DQ_UNROLL pieces per thread
// in flight. Needs cols % P == 0.

constexpr int DQ_UNROLL = 4;


// Two E4M3 codes (low byte first) decoded exactly through f16x2.
__device__ __forceinline__ void e4m3x2_to_f32(uint32_t two, float& lo, float& hi) {
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(two & 0xFFFF)));
    lo = F16::from_bits(static_cast<uint16_t>(h2 & 0xFFFF));
    hi = F16::from_bits(static_cast<uint16_t>(h2 >> 16));
}


template <class Out, int BR, int BC>
__device__ __forceinline__ void dequant_vec(const uint8_t* data, const float* scale_inv, void* out, int64_t n,
                                            int64_t ncols) {
    constexpr int P = 16 / Bytes<Out>::N, NS = BC == 1 ? P : 1;
    const int64_t pieces = n / P;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * THREADS * DQ_UNROLL + threadIdx.x; base < pieces;
         base += static_cast<int64_t>(gridDim.x) * THREADS * DQ_UNROLL) {
        uint32_t d[DQ_UNROLL][2];
        float sc[DQ_UNROLL][NS];
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            const int64_t pc = base + u * THREADS, e = pc * P;
            d[u][0] = d[u][1] = 0;
#pragma unroll
            for (int j = 0; j < NS; ++j) sc[u][j] = 0.0f;
            if (pc >= pieces) continue;
            if constexpr (P == 8) {
                asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(d[u][0]), "=r"(d[u][1]) : "l"(data + e));
            } else {
                asm("ld.global.nc.u32 %0, [%1];" : "=r"(d[u][0]) : "l"(data + e));
            }
            if constexpr (BR == 1) {
                sc[u][0] = scale_inv[e >> 7];  // cols % 128 == 0: blocks tile the flat tensor
            } else {
                const int64_t R = div_nn(e, ncols), cc = e - R * ncols;
                if constexpr (BC == TILE) {
                    sc[u][0] = scale_inv[(R >> 7) * (ncols >> 7) + (cc >> 7)];
                } else {
#pragma unroll
                    for (int k = 0; k < P / 4; ++k) {
                        const uint4 v = ld_nc16(scale_inv + (R >> 7) * ncols + cc + 4 * k);
                        sc[u][4 * k] = __uint_as_float(v.x), sc[u][4 * k + 1] = __uint_as_float(v.y);
                        sc[u][4 * k + 2] = __uint_as_float(v.z), sc[u][4 * k + 3] = __uint_as_float(v.w);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            const int64_t pc = base + u * THREADS;
            if (pc >= pieces) continue;
            float y[P];
#pragma unroll
            for (int j = 0; j < P; j += 2) {
                float lo, hi;
                e4m3x2_to_f32(d[u][j >> 2] >> (8 * (j & 3)), lo, hi);
                y[j] = __fmul_rn(lo, sc[u][BC == 1 ? j : 0]);
                y[j + 1] = __fmul_rn(hi, sc[u][BC == 1 ? j + 1 : 0]);
            }
            store_piece<Out>(out, pc * P, y);
        }
    }
}

template <class Out, int BR, int BC>
__device__ __forceinline__ void dequant_scalar(const uint8_t* data, const float* scale_inv, void* out, int64_t n,
                                               int64_t ncols) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; e < n;
         e += static_cast<int64_t>(gridDim.x) * THREADS) {
        const int64_t R = div_nn(e, ncols), cc = e - R * ncols;
        const float s = scale_inv[(R / BR) * (ncols / BC) + cc / BC];
        Out::store(out, e, __fmul_rn(e4m3_to_f32(data[e]), s));
    }
}

}  // namespace fp8_block_detail

// =============================================================================================
// Kernels (INTERFACE.md "fp8_block.cuh").

// MM = 1 ((1,128) only): the scales stored M-major, (cols/128, batch*rows), as cuBLASLt reads them.
template <class In, int BR, int BC, int MM>
__global__ void __launch_bounds__(THREADS)
    fp8_block_quantize(const void* x, uint8_t* data, float* scale_inv, int64_t batch, int64_t rows, int64_t cols,
                       int pow2) {
    using namespace fp8_block_detail;
    static_assert((BR == 1 && BC == 128) || (BR == 128 && BC == 1) || (BR == 128 && BC == 128), "block shape");
    static_assert(MM == 0 || BR == 1, "M-major scales are for 1x128 blocks");
    constexpr int V = Geo<In>::V;
    // (1,128) blocks tile the flat tensor: view it as (n / 128, 128).
    const int64_t nrows = BR == 1 ? batch * rows * cols / TILE : batch * rows;
    const int64_t ncols = BR == 1 ? TILE : cols;
    __shared__ float s_part[BC == 1 ? (THREADS / 32) * TILE : 16];
    __shared__ float s_scale[BC == 1 ? TILE : 1];
    if (ncols % V == 0 && aligned(x, 16) && aligned(data, V))
        quantize_tiles<In, BR, BC, true, MM>(x, data, scale_inv, nrows, ncols, cols, pow2, s_part, s_scale);
    else
        quantize_tiles<In, BR, BC, false, MM>(x, data, scale_inv, nrows, ncols, cols, pow2, s_part, s_scale);
}

template <class Out, int BR, int BC>
__global__ void __launch_bounds__(THREADS)
    fp8_block_dequantize(const uint8_t* data, const float* scale_inv, void* out, int64_t batch, int64_t rows,
                         int64_t cols) {
    using namespace fp8_block_detail;
    const int64_t n = batch * rows * cols;
    constexpr unsigned P = 16 / Bytes<Out>::N;  // elements per vector piece
    if (cols % P == 0 && aligned(data, P) && aligned(out, 16) && (BC != 1 || aligned(scale_inv, 16)))
        dequant_vec<Out, BR, BC>(data, scale_inv, out, n, cols);
    else
        dequant_scalar<Out, BR, BC>(data, scale_inv, out, n, cols);
}

}  // namespace deepwell
