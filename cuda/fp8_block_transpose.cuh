// fp8_block's transposing pass (fp8_block.cuh's quantizer, docs/NUMERICS.md "FP8 block"): one read of
// an (m, k) matrix in 128 x 128 tiles writes its 1x128 row blocks and its transposed 1x128 column
// blocks (rowcol: Hopper's TN GEMM needs both), the column blocks alone, or x^T in 128x128 blocks.
// What it reads is a source (`Src`): PlainSrc reads x itself; swiglu.cuh's sources compute
// SwiGLU's output and gradient on the way. Signatures and launch shapes: INTERFACE.md
// "fp8_block_transpose.cuh" (THREADS = 256, one tile per CTA and loop iteration, any grid size).
#pragma once
#include "fp8_block.cuh"

namespace deepwell {
namespace fp8_block_detail {

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
    // PlainSrc (PREFETCH): the next tile's chunks load while this tile is stored (a CTA loops over
    // tiles where its grid is cut to the CTAs resident at once: `Geometry::resident`). Computed
    // sources: fetched and made at the top of the tile, GROUP steps at a time, so that two CTAs fit
    // an SM and one computes while the other waits for memory (holding a whole tile's fetched
    // inputs took 160-248 registers, one CTA per SM, and ran at 20-38% of copy bandwidth:
    // benchmarks/bench_swiglu.py).
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

}  // namespace fp8_block_detail

// =============================================================================================
// Kernels (INTERFACE.md "fp8_block_transpose.cuh").

// Three CTAs per SM: at the default bound the pass held 125 registers a thread, two CTAs per SM
// (Nsight Compute on the H200), its DRAM 33% busy and each warp issuing every ~8 cycles. Bounded to
// 80 it runs 9-10% faster from 8192 x 5632 up (3.3-3.5 TB/s of its least traffic against
// 3.0-3.1), 2-4% at 8192 x 2048; at four CTAs (64 registers) it spills and ran slower than at two
// (docs/BASELINES.md "deepwell on the H200").
template <class In, int MM>
__global__ void __launch_bounds__(THREADS, 3)
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

}  // namespace deepwell
