// FP8 block-scaled kernels (DeepSeek-V3 style; Hopper's block-scaled GEMM): quantize in 1x128,
// 128x1 or 128x128 blocks, rows + transposed columns in one pass (the pass takes a source: swiglu.cuh
// feeds it SwiGLU's output and gradient computed on the way), and dequantize.
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
//   quantize, rowcol: one 128 x 128 tile (quantize (1,128) tiles the flat tensor as (n/128, 128))
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

// cp.async (sm_80+; PTX ISA "cp.async"): a 16-byte global -> shared copy that holds no register while
// in flight. A thread reads back only the slots it filled itself, so its own wait_group orders the
// copy before the read: no barrier.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    uint32_t a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
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
// Transposed output through the byte tile of common.cuh (`tswz`, `transpose_4x16`).

// out[(c0 + c) * ld + r0 + r] = tile byte (r, c), r, c < 128. Thread: columns 4cg..4cg+3 x rows
// 16rg..16rg+15, 4x4 byte blocks transposed with prmt. The 8 lanes of a column cover its 128
// rows, so every 16-byte store instruction of a warp writes 4 whole 128-byte lines.
template <bool VEC>
__device__ __forceinline__ void transpose_store(const uint32_t* tile, uint8_t* out, int64_t ld, int64_t r0,
                                                int64_t c0) {
    const int lane = threadIdx.x & 31, rg = lane & 7, cg = (threadIdx.x >> 5) * 4 + (lane >> 3);
    uint32_t col[4][4];  // col[j][g]: rows 4g..4g+3 of column 4cg + j
    transpose_4x16(tile, rg, cg, col);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint8_t* p = out + (c0 + cg * 4 + j) * ld + r0 + rg * 16;
        if constexpr (VEC) {
            *reinterpret_cast<uint4*>(p) = make_uint4(col[j][0], col[j][1], col[j][2], col[j][3]);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) p[i] = static_cast<uint8_t>(col[j][i >> 2] >> (8 * (i & 3)));
        }
    }
}

// What one transposing pass reads (`transposed_tiles`' Src): the chunks of the (m, k) matrix it
// quantizes, fetched (`fetch(row, col, Fetch&)`) and then made into the In chunks the quantizer
// sees (`make(fetched, col, chunk)`). PREFETCH: the next tile's loads fly while this tile is stored;
// else GROUP steps are fetched and made at a time at the top of each tile. PAIRED: each walk step
// makes column tiles ct and ct + k/256 (`make_pair`, the second through `s_second`); `column_tile`
// maps the walk's column to the tile's. ASYNC (computed sources, vector path): each step's CHUNKS
// 16-byte chunks are copied into a ring of STAGES step slots in shared memory (`fetch_async(row,
// col, slot)`, read back by `read(slot, col, Fetch&)`) STAGES - 1 steps ahead of their use, across tile boundaries, so that loads fly
// while the thread computes and while its CTA quantizes and stores the tile. PlainSrc reads x
// (m, k) itself; swiglu.cuh's sources make SwiGLU's output and gradient from its inputs.
template <class In> struct PlainSrc {
    static constexpr bool PREFETCH = true, PAIRED = false, ASYNC = false;
    const void* x;
    int64_t k;
    struct Fetch {
        uint32_t w[4];
    };
    __device__ bool aligned16() const { return aligned(x, 16); }
    __device__ int64_t column_tile(int64_t ct, int64_t) const { return ct; }
    template <bool VEC> __device__ void fetch(int64_t r, int64_t c, Fetch& f) const {
        load_chunk<In, VEC>(x, r * k + c, Geo<In>::V, f.w);
    }
    __device__ void make(const Fetch& f, int64_t, uint32_t (&w)[4]) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = f.w[i];
    }
};

// An ASYNC source's ring (step slots, chunks per step); 1 and 0 for the others, which have none.
template <class Src> __device__ constexpr int ring_stages() {
    if constexpr (Src::ASYNC) return Src::STAGES;
    else return 1;
}
template <class Src> __device__ constexpr int ring_chunks() {
    if constexpr (Src::ASYNC) return Src::CHUNKS;
    else return 0;
}

// What one transposing pass over x (m, k) writes (the `transposed_tiles` template argument):
//   ROWCOL: 1x128 row blocks (row_data, row_scale_inv) and the transposed 1x128 column blocks
//           (col_data (k, m), col_scale_inv (k, m/128));
//   COLS:   the transposed column blocks alone (a wgrad operand: x or dy along the tokens);
//   TILE_T: x^T in 128x128 blocks (col_data (k, m), col_scale_inv (k/128, m/128)): the tile's scale
//           is shared by both orientations, so this is exactly fp8_block_quantize(x, 128, 128)
//           transposed, bytes and scales (docs/NUMERICS.md "Transposes"): the dgrad copy of W.
enum TransposedOut { ROWCOL = 0, COLS = 1, TILE_T = 2 };

// One read of x (m, k), 128 x 128 tiles, rows and/or transposed columns as MODE says. MM = 1
// writes the 1x128 scales M-major, the layout cuBLASLt's blockwise GEMM reads (row scales
// (k/128, m) for the logical (m, k/128), column scales (m/128, k) for (k, m/128)); TILE_T's
// scales ignore it.
//  1. Load the tile's chunks (as in quantize_tiles).
//  2. Row blocks (1 x 128 = a tile row; ROWCOL only): shuffle reduce over L lanes, quantize, store
//     row_data.
//  3. Column amax: per thread over its S rows, across the warp by shuffles, across warps through
//     s_part; threads 0..127 compute the column scales (s_scale, col_scale_inv). TILE_T: the tile
//     amax instead (warp reduce, then the 8 warps' partials in s_part, as quantize_tiles (128,128)).
//  4. Quantize the register chunks with the column scales into the shared byte tile (row = x row).
//  5. transpose_store: whole 128-byte lines of col_data (k, m).
// Three barriers per tile (B1 after step 3's partials, B2 after the scales, B3 after the bytes;
// TILE_T has no B2: every thread reads s_part between B1 and B3, and it is rewritten after B3).
// Every shared buffer is rewritten only behind a barrier that all its readers have passed:
// s_part is read before B2, rewritten before the next B1; s_scale is read before B3, rewritten
// after the next B1; the byte tile is read after B3, rewritten after the next B2 (> next B1).
// The next tile's loads are issued before B3, so they overlap the barrier and transpose_store.

template <class In, bool VEC, int MODE, int MM, class Src>
__device__ __forceinline__ void transposed_tiles(const Src& src, int64_t m, int64_t k, int pow2, uint8_t* row_data,
                                                 float* row_scale_inv, uint8_t* col_data, float* col_scale_inv,
                                                 float* s_part, float* s_scale, uint32_t* s_bytes, uint4* s_second,
                                                 uint4* s_ring) {
    using G = Geo<In>;
    constexpr int V = G::V, L = G::L, RS = G::RS, S = G::S;
    const int li = threadIdx.x % L, rsub = threadIdx.x / L;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row_tiles = m / TILE, col_tiles = k / TILE;
    // A PAIRED source makes two tiles per walk step: column tiles ct and ct + col_tiles / 2.
    const int64_t walk_cols = Src::PAIRED ? col_tiles / 2 : col_tiles, tiles = row_tiles * walk_cols;
    // Walk step t's place: its band-walk position, then the source's column order.
    auto place = [&](int64_t t, int64_t& rt, int64_t& ct) {
        band_tile(t, row_tiles, walk_cols, rt, ct);
        ct = src.column_tile(ct, col_tiles);
    };
    // PlainSrc (PREFETCH): the next tile's chunks load while this tile is stored (the kernel holds
    // ~80 registers for 16-bit inputs even so). Computed sources: fetched and made at the top of
    // the tile, GROUP steps at a time, so that two CTAs fit an SM and one computes while the other
    // waits for memory (holding a whole tile's fetched inputs took 160-248 registers, one CTA per
    // SM, and ran at 20-38% of copy bandwidth: bench_swiglu-*-2026-11-27).
    typename Src::Fetch fetched[Src::PREFETCH ? S : 1];
    uint32_t raw[S][4];
    auto load_tile = [&](int64_t t) {
        int64_t rt, ct;
        place(t, rt, ct);
#pragma unroll
        for (int s = 0; s < S; ++s) src.template fetch<VEC>(rt * TILE + rsub + s * RS, ct * TILE + li * V, fetched[s]);
    };

    // Steps 2-5 for the tile (rt, ct) whose chunks are in `raw`; `t` is the walk step (PREFETCH
    // sources issue the next step's loads before the last barrier).
    auto quantize_tile = [&](int64_t t, int64_t rt, int64_t ct) {
        const int64_t r0 = rt * TILE, c0 = ct * TILE, c = c0 + li * V;

        // 2. Row blocks.
#pragma unroll
        for (int s = 0; s < (MODE == ROWCOL ? S : 0); ++s) {
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
            store_chunk<V, VEC>(row_data + r * k + c, out, V);
            if (li == 0) row_scale_inv[MM ? ct * m + r : r * col_tiles + ct] = __fdiv_rn(1.0f, scale);
        }

        // 3. Column scales (TILE_T: the tile's scale).
        float camax[V];
        column_amax<In>(raw, camax);
        float f[V];
        if constexpr (MODE == TILE_T) {
            float a = 0.0f;
#pragma unroll
            for (int j = 0; j < V; ++j) a = abs_max(a, camax[j]);
            a = row_reduce<32>(a);
            if (lane == 0) s_part[warp] = a;
            __syncthreads();
            a = 0.0f;
#pragma unroll
            for (int w = 0; w < THREADS / 32; ++w) a = abs_max(a, s_part[w]);
            const float scale = block_scale(a, pow2);
            if (threadIdx.x == 0) col_scale_inv[ct * row_tiles + rt] = __fdiv_rn(1.0f, scale);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = scale;
        } else {
            const float scale = tile_column_scales<L>(camax, warp, lane, li, pow2, s_part, s_scale);
            if (threadIdx.x < TILE)
                col_scale_inv[MM ? rt * k + c0 + threadIdx.x : (c0 + threadIdx.x) * row_tiles + rt] =
                    __fdiv_rn(1.0f, scale);
#pragma unroll
            for (int j = 0; j < V; ++j) f[j] = s_scale[li * V + j];
        }

        // 4. Column-quantized bytes into the shared byte tile.
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int row = rsub + s * RS;
            uint32_t out[V / 4];
            encode_chunk<In, V>(raw[s], f, out);
            uint32_t* dst = s_bytes + row * 32 + ((li * V / 4) ^ tswz(row));
            if constexpr (V == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(out[0], out[1]);
            else *dst = out[0];
        }
        if constexpr (Src::PREFETCH)
            if (t + gridDim.x < tiles) load_tile(t + gridDim.x);
        __syncthreads();

        // 5. Transposed, coalesced stores.
        transpose_store<VEC>(s_bytes, col_data, m, r0, c0);
    };

    // Step s's chunk into raw[s] (PAIRED: the second tile's chunk waits in this thread's own slots
    // of s_second; consecutive threads, consecutive 16 bytes: no bank conflicts, no barrier).
    auto make_step = [&](const typename Src::Fetch& fetched_step, int s, int64_t c) {
        if constexpr (Src::PAIRED) {
            uint32_t second[4];
            src.make_pair(fetched_step, raw[s], second);
            s_second[s * THREADS + threadIdx.x] = make_uint4(second[0], second[1], second[2], second[3]);
        } else {
            src.make(fetched_step, c, raw[s]);
        }
    };
    // ASYNC: step s of the tile at (rt, ct) is copied into ring slot s % STAGES (S % STAGES == 0,
    // so a step's slot is the same in every tile), one commit group per step even when no tile is
    // left (the wait counts groups).
    constexpr bool ASYNC = Src::ASYNC && VEC;
    constexpr int STAGES = ring_stages<Src>(), AHEAD = STAGES - 1;
    static_assert(!ASYNC || (S % STAGES == 0 && AHEAD >= 1), "ring slots repeat every tile");
    auto slot = [&](int s) { return s_ring + (s % STAGES) * ring_chunks<Src>() * THREADS + threadIdx.x; };
    auto fetch_async = [&](bool live, int64_t rt, int64_t ct, int s) {
        if constexpr (ASYNC) {
            if (live) src.fetch_async(rt * TILE + rsub + s * RS, ct * TILE + li * V, slot(s));
            cp_async_commit();
        }
    };
    int64_t next_rt = 0, next_ct = 0;  // ASYNC: the next tile's place, found when its copies start
    if constexpr (ASYNC) {
        const bool live = blockIdx.x < tiles;
        if (live) place(blockIdx.x, next_rt, next_ct);
#pragma unroll
        for (int s = 0; s < AHEAD; ++s) fetch_async(live, next_rt, next_ct, s);
    }

    if constexpr (Src::PREFETCH)
        if (blockIdx.x < tiles) load_tile(blockIdx.x);
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        int64_t rt, ct;
        if constexpr (ASYNC) rt = next_rt, ct = next_ct;
        else place(t, rt, ct);
        const int64_t r0 = rt * TILE, c = ct * TILE + li * V;
        if constexpr (Src::PREFETCH) {
#pragma unroll
            for (int s = 0; s < S; ++s) src.make(fetched[s], c, raw[s]);
        } else if constexpr (ASYNC) {
            const bool next_live = t + gridDim.x < tiles;
            if (next_live) place(t + gridDim.x, next_rt, next_ct);
#pragma unroll
            for (int s = 0; s < S; ++s) {
                cp_async_wait<AHEAD - 1>();  // step s landed (the groups after it may still fly)
                typename Src::Fetch fetched_step;
                src.read(slot(s), c, fetched_step);
                // Step s + AHEAD goes to the slot step s - 1 used, which this thread has consumed.
                if (s + AHEAD < S) fetch_async(true, rt, ct, s + AHEAD);
                else fetch_async(next_live, next_rt, next_ct, s + AHEAD - S);
                make_step(fetched_step, s, c);
            }
        } else {
            constexpr int GR = Src::GROUP;
#pragma unroll
            for (int s0 = 0; s0 < S; s0 += GR) {
                typename Src::Fetch fg[GR];
#pragma unroll
                for (int i = 0; i < GR; ++i) src.template fetch<VEC>(r0 + rsub + (s0 + i) * RS, c, fg[i]);
#pragma unroll
                for (int i = 0; i < GR; ++i) make_step(fg[i], s0 + i, c);
            }
        }
        quantize_tile(t, rt, ct);
        if constexpr (Src::PAIRED) {
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const uint4 w = s_second[s * THREADS + threadIdx.x];
                raw[s][0] = w.x, raw[s][1] = w.y, raw[s][2] = w.z, raw[s][3] = w.w;
            }
            quantize_tile(t, rt, ct + col_tiles / 2);
        }
    }
}

// One transposing pass over src's (m, k) matrix: its shared memory, and the vector path where
// every pointer allows it.
// `s_second`: a PAIRED source's second tile (dynamic shared memory, TILE * TILE * sizeof(In) bytes:
// with it the static arrays would pass the 48 KiB a block may hold statically), else null.
// `s_ring`: an ASYNC source's STAGES * CHUNKS * THREADS 16-byte slots (dynamic), else null.
template <class In, int MODE, int MM, class Src>
__device__ __forceinline__ void transposing_pass(const Src& src, int64_t m, int64_t k, int pow2, uint8_t* row_data,
                                                 float* row_scale_inv, uint8_t* col_data, float* col_scale_inv,
                                                 uint4* s_second = nullptr, uint4* s_ring = nullptr) {
    __shared__ float s_part[(THREADS / 32) * TILE];
    __shared__ float s_scale[TILE];
    __shared__ __align__(16) uint32_t s_bytes[TILE * TILE / 4];
    if (src.aligned16() && (MODE != ROWCOL || aligned(row_data, Geo<In>::V)) && aligned(col_data, 16))
        transposed_tiles<In, true, MODE, MM>(src, m, k, pow2, row_data, row_scale_inv, col_data, col_scale_inv, s_part,
                                             s_scale, s_bytes, s_second, s_ring);
    else
        transposed_tiles<In, false, MODE, MM>(src, m, k, pow2, row_data, row_scale_inv, col_data, col_scale_inv,
                                              s_part, s_scale, s_bytes, s_second, s_ring);
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

template <class In, int MM>
__global__ void __launch_bounds__(THREADS)
    fp8_block_quantize_rowcol(const void* x, int64_t m, int64_t k, int pow2, uint8_t* row_data,
                              float* row_scale_inv, uint8_t* col_data, float* col_scale_inv) {
    using namespace fp8_block_detail;
    transposing_pass<In, ROWCOL, MM>(PlainSrc<In>{x, k}, m, k, pow2, row_data, row_scale_inv, col_data, col_scale_inv);
}

// The transposed half of rowcol alone (MODE COLS, scales M-major) or x^T in 128x128 blocks
// (MODE TILE_T).
template <class In, int MODE>
__global__ void __launch_bounds__(THREADS)
    fp8_block_quantize_transposed(const void* x, int64_t m, int64_t k, int pow2, uint8_t* col_data,
                                  float* col_scale_inv) {
    using namespace fp8_block_detail;
    static_assert(MODE == COLS || MODE == TILE_T, "MODE");
    transposing_pass<In, MODE, 1>(PlainSrc<In>{x, k}, m, k, pow2, nullptr, nullptr, col_data, col_scale_inv);
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
