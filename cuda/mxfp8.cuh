// MXFP8 kernels: quantize along the last dim, along any other dim, rows + columns in one pass, and
// dequantize. Contract: docs/NUMERICS.md "MXFP8"; bit-exact twin of rust/core/src/mxfp8.rs.
// Signatures and launch shapes: INTERFACE.md "mxfp8.cuh" (THREADS = 256, any grid size works).
//
// Per block of 32 (docs/NUMERICS.md MXFP8 steps 1-5):
//   amax = NaN-propagating max |x|;  e = mx_scale_byte<Mode, Elem>(amax)  (rceil or floor);
//   q = cast_rne_satfinite(x * 2^(127-e))  (__fmul_rn, multiplier from mx_inv_scale);
//   a block holding NaN/Inf gets e = 0xFF and every element byte Fp8<Elem>::NAN_CODE (step 5).
//
// Every kernel checks pointer alignment once (a grid-uniform branch) and runs either the vector
// path (16-byte loads, 4/8/16-byte stores) or the same index arithmetic with scalar accesses, so
// views with any storage offset are correct.
//
// Work per CTA and loop iteration (rust/gpu/src/kernels/mxfp8.rs mirrors it; grid capped at one wave):
//   rows:    THREADS / 4 * ROWS_UNROLL = 256 blocks of 32 (8192 elements)
//   cols:    THREADS items, an item = 32 rows x MX_COLS_V = 4 inner positions (vector path) or 1
//   rowcol:  one 128 x 128 tile (RC_TILE)
//   dequant: THREADS * DQ_UNROLL pieces of 16 / sizeof(Out) elements (8192 for 16-bit out, 4096 for fp32)
#pragma once
#include "common.cuh"

namespace deepwell {
namespace mxfp8_detail {

// ---------------------------------------------------------------------------------------------
// Raw element I/O (words and `widen` live in common.cuh): half the registers for 16-bit inputs.

// Raw bits of element i, zero-extended (scalar path).
template <class In> __device__ __forceinline__ uint32_t ld_bits(const void* p, int64_t i) {
    if constexpr (Bytes<In>::N == 4) return __float_as_uint(static_cast<const float*>(p)[i]);
    else return static_cast<const uint16_t*>(p)[i];
}

// WORDS 32-bit words from p (aligned to 16 bytes when WORDS >= 4, else to 4 * WORDS).
// ld.global.nc: nothing these kernels read is written while they run.
template <int WORDS>
__device__ __forceinline__ void ld_words(const void* p, uint32_t* w) {
    const char* c = static_cast<const char*>(p);
    if constexpr (WORDS >= 4) {
        static_assert(WORDS % 4 == 0, "16-byte pieces");
#pragma unroll
        for (int k = 0; k < WORDS / 4; ++k)
            asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                : "=r"(w[4 * k]), "=r"(w[4 * k + 1]), "=r"(w[4 * k + 2]), "=r"(w[4 * k + 3])
                : "l"(c + 16 * k));
    } else if constexpr (WORDS == 2) {
        asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(c));
    } else {
        static_assert(WORDS == 1, "load size");
        asm("ld.global.nc.u32 %0, [%1];" : "=r"(w[0]) : "l"(c));
    }
}

// N elements starting at element i into N * size / 4 words: VEC, one aligned vector load;
// otherwise element loads (any alignment).
template <class In, int N, bool VEC>
__device__ __forceinline__ void load_chunk(const void* x, int64_t i, uint32_t* w) {
    constexpr int WORDS = N * Bytes<In>::N / 4;
    if constexpr (VEC) {
        ld_words<WORDS>(static_cast<const char*>(x) + i * Bytes<In>::N, w);
    } else {
#pragma unroll
        for (int k = 0; k < (WORDS > 0 ? WORDS : 1); ++k) w[k] = 0;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const uint32_t b = ld_bits<In>(x, i + j);
            if constexpr (Bytes<In>::N == 4) w[j] = b;
            else w[j >> 1] |= b << (16 * (j & 1));
        }
    }
}

// WORDS words of fp8 bytes to p (VEC: aligned to the store width), else byte by byte.
template <int WORDS, bool VEC>
__device__ __forceinline__ void store_bytes(uint8_t* p, const uint32_t* w) {
    if constexpr (VEC) {
        if constexpr (WORDS % 4 == 0) {
#pragma unroll
            for (int k = 0; k < WORDS / 4; ++k)
                reinterpret_cast<uint4*>(p)[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
        } else if constexpr (WORDS == 2) {
            *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
        } else {
            static_assert(WORDS == 1, "store size");
            *reinterpret_cast<uint32_t*>(p) = w[0];
        }
    } else {
#pragma unroll
        for (int j = 0; j < 4 * WORDS; ++j) p[j] = static_cast<uint8_t>(w[j >> 2] >> (8 * (j & 3)));
    }
}

// Four fp8 codes, element order = byte order.
template <int Elem>
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d) {
    return static_cast<uint32_t>(Fp8<Elem>::encode2(a, b)) | (static_cast<uint32_t>(Fp8<Elem>::encode2(c, d)) << 16);
}

// docs/NUMERICS.md MXFP8 step 5: bytes of a non-finite block become the NaN code. `mask` has 0xFF in
// every byte that belongs to such a block.
template <int Elem>
__device__ __forceinline__ uint32_t nan_fix(uint32_t w, uint32_t mask) {
    constexpr uint32_t NAN4 = 0x01010101u * Fp8<Elem>::NAN_CODE;
    return (w & ~mask) | (NAN4 & mask);
}


// ---------------------------------------------------------------------------------------------
// Rows: 4 lanes per block of 32 (8 contiguous elements = one 16-byte bf16 load each), amax by two
// xor-shuffles inside the 4-lane group. A CTA covers 64 blocks per unroll step; UNROLL steps are
// loaded before any is used, so each thread has 4 (16-bit input) or 8 (fp32) 16-byte loads in
// flight. For each step the warp reads 512 (1024) contiguous bytes and writes 256.

constexpr int ROWS_UNROLL = 4;

template <class In, int Mode, int Elem, bool VEC>
__device__ __forceinline__ void rows_body(const void* x, uint8_t* data, uint8_t* scale, int64_t n_blocks) {
    constexpr int W = 8 * Bytes<In>::N / 4;  // words per 8-element chunk
    constexpr int GROUPS = THREADS / 4;
    constexpr int PER_CTA = GROUPS * ROWS_UNROLL;
    const int g = threadIdx.x >> 2, q = threadIdx.x & 3;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * PER_CTA; base < n_blocks;
         base += static_cast<int64_t>(gridDim.x) * PER_CTA) {
        uint32_t raw[ROWS_UNROLL][W];
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u) {
            const int64_t b = base + u * GROUPS + g;
            if (b < n_blocks) {
                load_chunk<In, 8, VEC>(x, b * 32 + q * 8, raw[u]);
            } else {
#pragma unroll
                for (int k = 0; k < W; ++k) raw[u][k] = 0;
            }
        }
        uint8_t my_scale = 0;
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u) {
            const int64_t b = base + u * GROUPS + g;
            float v[8];
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                v[j] = widen<In>(raw[u], j);
                amax = abs_max(amax, v[j]);
            }
            // All lanes shuffle (a group is valid or not as a whole, so amax stays per block).
            amax = abs_max(amax, __shfl_xor_sync(FULL_MASK, amax, 1));
            amax = abs_max(amax, __shfl_xor_sync(FULL_MASK, amax, 2));
            const uint8_t s = mx_scale_byte<Mode, Elem>(amax);
            const float f = mx_inv_scale(s);  // unused bytes for s == 0xFF are replaced below
            const uint32_t mask = s == 0xFF ? 0xFFFFFFFFu : 0u;
            uint32_t out[2];
            out[0] = nan_fix<Elem>(encode4<Elem>(__fmul_rn(v[0], f), __fmul_rn(v[1], f), __fmul_rn(v[2], f),
                                                 __fmul_rn(v[3], f)), mask);
            out[1] = nan_fix<Elem>(encode4<Elem>(__fmul_rn(v[4], f), __fmul_rn(v[5], f), __fmul_rn(v[6], f),
                                                 __fmul_rn(v[7], f)), mask);
            if (b < n_blocks) store_bytes<2, VEC>(data + b * 32 + q * 8, out);
            if (u == q) my_scale = s;  // lane q stores the scale of step q: one store per lane
        }
        const int64_t bq = base + q * GROUPS + g;
        if (bq < n_blocks) scale[bq] = my_scale;
    }
}

// ---------------------------------------------------------------------------------------------
// Columns: x viewed as (outer * k, inner); a slab is 32 consecutive rows (one kb of one o), whose
// block for column i is x[slab rows, i] and whose scales are scale[slab * inner + i]. An item is
// (slab, V consecutive columns); consecutive threads take consecutive items, so every row access
// of a warp is contiguous along inner. The thread loads all 32 rows before using any (32 loads of
// 4 * V bytes in flight), keeps them raw in registers, and writes V bytes per row.

constexpr int MX_COLS_V = 4;

template <class In, int Mode, int Elem, int V, bool VEC>
__device__ __forceinline__ void cols_body(const void* x, uint8_t* data, uint8_t* scale, int64_t outer, int64_t k,
                                          int64_t inner) {
    static_assert(VEC ? V == MX_COLS_V : V == 1, "vector path: V columns; scalar path: one");
    constexpr int W = (V * Bytes<In>::N + 3) / 4;  // raw words per row
    const int64_t per_slab = inner / V;
    const int64_t items = outer * (k / 32) * per_slab;
    for (int64_t it = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; it < items;
         it += static_cast<int64_t>(gridDim.x) * THREADS) {
        const int64_t slab = it / per_slab;
        const int64_t col = (it - slab * per_slab) * V;
        const int64_t e0 = slab * 32 * inner + col;  // element (row 0 of the slab, col)
        uint32_t raw[32][W];
#pragma unroll
        for (int r = 0; r < 32; ++r) load_chunk<In, V, VEC>(x, e0 + r * inner, raw[r]);
        float amax[V];
#pragma unroll
        for (int j = 0; j < V; ++j) amax[j] = 0.0f;
#pragma unroll
        for (int r = 0; r < 32; ++r)
#pragma unroll
            for (int j = 0; j < V; ++j) amax[j] = abs_max(amax[j], widen<In>(raw[r], j));
        float f[V];
        uint32_t s_word = 0, mask = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const uint8_t s = mx_scale_byte<Mode, Elem>(amax[j]);
            f[j] = mx_inv_scale(s);
            s_word |= static_cast<uint32_t>(s) << (8 * j);
            if (s == 0xFF) mask |= 0xFFu << (8 * j);
        }
        // Store addresses from a fresh base and stride (hidden from CSE by an empty asm):
        // otherwise the 32 load offsets stay alive as 64-bit registers until the stores.
        uint8_t* drow = data + e0;
        int64_t dstride = inner;
        asm volatile("" : "+l"(drow), "+l"(dstride));
#pragma unroll
        for (int r = 0; r < 32; ++r, drow += dstride) {
            if constexpr (V == 4) {
                const uint32_t out = nan_fix<Elem>(
                    encode4<Elem>(__fmul_rn(widen<In>(raw[r], 0), f[0]), __fmul_rn(widen<In>(raw[r], 1), f[1]),
                                  __fmul_rn(widen<In>(raw[r], 2), f[2]), __fmul_rn(widen<In>(raw[r], 3), f[3])),
                    mask);
                store_bytes<1, VEC>(drow, &out);
            } else {
                const uint32_t out = Fp8<Elem>::encode(__fmul_rn(widen<In>(raw[r], 0), f[0]));
                *drow = static_cast<uint8_t>(nan_fix<Elem>(out, mask));
            }
        }
        if constexpr (V == 4) store_bytes<1, VEC>(scale + slab * inner + col, &s_word);
        else scale[slab * inner + col] = static_cast<uint8_t>(s_word);
    }
}

// ---------------------------------------------------------------------------------------------
// Tile walk order. Row strips (ct fastest) keep the reads and the natural-layout writes of the
// CTAs running together contiguous. With a transposed output, bands of BAND tile-rows walked
// column-major make those CTAs cover ~16 x 16 tiles instead, so the (k, m) output (row stride m)
// gets ~2 KiB runs per row instead of 128 bytes. Measured on H100, bf16: the transposed copy
// gains 3-5 points of copy bandwidth at m = 16384 / 32768, the natural one loses 6, so only
// ColT = 1 uses bands.
constexpr int BAND = 16;
template <bool Banded>
__device__ __forceinline__ void tile_coords(int64_t t, int64_t row_tiles, int64_t col_tiles, int64_t& rt,
                                            int64_t& ct) {
    if constexpr (Banded) {
        const int64_t band = t / (BAND * col_tiles), r_start = band * BAND;
        const int64_t h = min(static_cast<int64_t>(BAND), row_tiles - r_start);  // last band may be short
        const int64_t idx = t - band * BAND * col_tiles;
        rt = r_start + idx % h;
        ct = idx / h;
    } else {
        rt = t / col_tiles;
        ct = t - rt * col_tiles;
    }
}

// ---------------------------------------------------------------------------------------------
// Transposed output through the byte tile of common.cuh (`tswz`, `transpose_4x16`).

// out[(c0 + c) * ld + r0 + r] = tile byte (r, c) for r0 + r < nrows, c0 + c < ncols (nrows a
// multiple of 16, ncols of 4). Thread: columns 4cg..4cg+3 x rows 16rg..16rg+15, 4x4 byte blocks
// transposed with prmt. The 8 lanes of a column cover its 128 rows, so every 16-byte store
// instruction of a warp writes 4 whole 128-byte lines. Warps w with the same w % 2 handle the
// columns 64 * (w % 2)..+64, the half that the same warps write in rowcol_body.
template <bool VEC>
__device__ __forceinline__ void transpose_store(const uint32_t* tile, uint8_t* out, int64_t ld, int64_t r0,
                                                int64_t c0, int64_t nrows, int64_t ncols) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rg = lane & 7;
    const int cg = (warp & 1) * 16 + (warp >> 1) * 4 + (lane >> 3);
    uint32_t col[4][4];  // col[j][g]: rows 4g..4g+3 of column 4cg + j
    transpose_4x16(tile, rg, cg, col);
    if (r0 + rg * 16 >= nrows) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (c0 + cg * 4 + j >= ncols) break;
        store_bytes<4, VEC>(out + (c0 + cg * 4 + j) * ld + r0 + rg * 16, col[j]);
    }
}

// ---------------------------------------------------------------------------------------------
// Rows + columns in one read of x (m, k), 128 x 128 tiles (m, k multiples of 32: the row and
// column blocks of a partial tile are whole or absent). Warp w owns the 32-row block w / 2 and the
// 64 columns 64 * (w % 2)..; lane (rr, li) holds the 16-byte chunks at rows rr + RR * s (s < S),
// columns V * li..V * li + V. Each warp load instruction reads RR rows x 128 contiguous bytes.
//  - Row block (32 columns) = BL adjacent lanes: xor-shuffles 1..BL/2 (as rows_body).
//  - Column block (the warp's 32 rows) = the lanes with the same li: xor-shuffles LW..16.
// Both copies come from registers. ColT = 0 stores the column copy like the row copy (natural
// layout, no shared memory, no barrier). ColT = 1 writes its bytes into the shared byte tile and
// transpose_store sends them to the (k, m) output as whole lines, one iteration later: the byte
// tile is double-buffered (one barrier per tile) and the transposed stores of tile t overlap the
// loads of tile t + gridDim.x.

template <class In> struct RcGeo {
    static constexpr int V = 16 / Bytes<In>::N;  // elements per 16-byte chunk (8 or 4)
    static constexpr int LW = 64 / V;            // lanes across a warp's 64 columns (8 or 16)
    static constexpr int RR = 32 / LW;           // rows per warp step (4 or 2)
    static constexpr int S = 32 / RR;            // steps = rows per thread (8 or 16)
    static constexpr int BL = 32 / V;            // lanes per 32-column row block (4 or 8)
};
constexpr int RC_TILE = 128;

template <class In, int Mode, int Elem, int ColT, bool VEC>
__device__ __forceinline__ void rowcol_body(const void* x, int64_t m, int64_t k, uint8_t* row_data,
                                            uint8_t* row_scale, uint8_t* col_data, uint8_t* col_scale,
                                            uint32_t* tile) {
    using G = RcGeo<In>;
    constexpr int V = G::V, LW = G::LW, RR = G::RR, S = G::S, BL = G::BL, VW = V / 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int li = lane % LW, rr = lane / LW, q = li % BL;
    const int cl = 64 * (warp & 1) + V * li;  // chunk column in the tile
    const int rl = 32 * (warp >> 1);          // first row of the warp's block in the tile
    const int64_t row_tiles = (m + RC_TILE - 1) / RC_TILE, col_tiles = (k + RC_TILE - 1) / RC_TILE;
    const int64_t tiles = row_tiles * col_tiles, ks = k / 32, ms = m / 32;
    // The chunks of tile t (zeros outside x).
    uint32_t raw[S][4];
    auto load_tile = [&](int64_t t) {
        int64_t rt, ct;
        tile_coords<ColT == 1>(t, row_tiles, col_tiles, rt, ct);
        const int64_t rb = rt * RC_TILE + rl, c = ct * RC_TILE + cl;
#pragma unroll
        for (int s = 0; s < S; ++s) {
            if (rb < m && c < k) {
                load_chunk<In, V, VEC>(x, (rb + rr + RR * s) * k + c, raw[s]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) raw[s][i] = 0;
            }
        }
    };
    // Load policy, measured on H100: fp32 tiles (~165 registers either way) gain from loading the
    // next tile as soon as the registers are free; for 16-bit inputs that costs ~45 registers
    // and half the occupancy, so they load at the top of each iteration.
    constexpr bool EARLY = Bytes<In>::N == 4;
    constexpr int TW = RC_TILE * RC_TILE / 4;  // words per byte tile
    if constexpr (EARLY) {
        if (blockIdx.x < tiles) load_tile(blockIdx.x);
    }
    // ColT = 1 pipeline: tile t's column bytes go to byte tile `buf`; they are transposed out in
    // the next iteration, after that iteration's loads are issued (or after the loop).
    int buf = 0;
    int64_t prev_r0 = -1, prev_c0 = 0;
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x, buf ^= 1) {
        int64_t rt, ct;
        tile_coords<ColT == 1>(t, row_tiles, col_tiles, rt, ct);
        const int64_t r0 = rt * RC_TILE, c0 = ct * RC_TILE;
        const int64_t rb = r0 + rl, c = c0 + cl;  // block's first row, chunk's first column
        const bool ok = rb < m && c < k;          // uniform over every shuffle group
        if constexpr (!EARLY) load_tile(t);
        if constexpr (ColT == 1) {
            if (prev_r0 >= 0) transpose_store<VEC>(tile + (buf ^ 1) * TW, col_data, m, prev_r0, prev_c0, m, k);
        }

        // Row blocks. Lane q of a block group stores the scale bytes of steps q, q + BL, ...
        uint8_t keep[S / BL];
#pragma unroll
        for (int s = 0; s < S; ++s) {
            float v[V];
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                v[j] = widen<In>(raw[s], j);
                amax = abs_max(amax, v[j]);
            }
#pragma unroll
            for (int o = 1; o < BL; o <<= 1) amax = abs_max(amax, __shfl_xor_sync(FULL_MASK, amax, o));
            const uint8_t sb = mx_scale_byte<Mode, Elem>(amax);
            const float f = mx_inv_scale(sb);
            const uint32_t mask = sb == 0xFF ? 0xFFFFFFFFu : 0u;
            uint32_t out[VW];
#pragma unroll
            for (int i = 0; i < VW; ++i)
                out[i] = nan_fix<Elem>(encode4<Elem>(__fmul_rn(v[4 * i], f), __fmul_rn(v[4 * i + 1], f),
                                                     __fmul_rn(v[4 * i + 2], f), __fmul_rn(v[4 * i + 3], f)), mask);
            if (ok) store_bytes<VW, VEC>(row_data + (rb + rr + RR * s) * k + c, out);
            if (s % BL == q) keep[s / BL] = sb;
        }
        if (ok) {
#pragma unroll
            for (int i = 0; i < S / BL; ++i) row_scale[(rb + rr + RR * (i * BL + q)) * ks + c / 32] = keep[i];
        }

        // Column blocks. Re-widen from the raw words instead of keeping the row pass's floats
        // alive (an empty asm hides the values from CSE): half the registers for 16-bit inputs.
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(raw[s][i]));
        float camax[V];
        column_amax<In>(raw, camax);
        float f[V];
        uint32_t mask[VW];
#pragma unroll
        for (int i = 0; i < VW; ++i) mask[i] = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) {
#pragma unroll
            for (int o = LW; o < 32; o <<= 1) camax[j] = abs_max(camax[j], __shfl_xor_sync(FULL_MASK, camax[j], o));
            const uint8_t sb = mx_scale_byte<Mode, Elem>(camax[j]);
            f[j] = mx_inv_scale(sb);
            if (sb == 0xFF) mask[j >> 2] |= 0xFFu << (8 * (j & 3));
            if (ok && j % RR == rr) {  // the RR lanes of a column share its V scale stores
                if constexpr (ColT == 1) col_scale[(c + j) * ms + rb / 32] = sb;
                else col_scale[(rb / 32) * k + c + j] = sb;
            }
        }
#pragma unroll
        for (int s = 0; s < S; ++s) {
            uint32_t out[VW];
#pragma unroll
            for (int i = 0; i < VW; ++i)
                out[i] = nan_fix<Elem>(encode4<Elem>(__fmul_rn(widen<In>(raw[s], 4 * i), f[4 * i]),
                                                     __fmul_rn(widen<In>(raw[s], 4 * i + 1), f[4 * i + 1]),
                                                     __fmul_rn(widen<In>(raw[s], 4 * i + 2), f[4 * i + 2]),
                                                     __fmul_rn(widen<In>(raw[s], 4 * i + 3), f[4 * i + 3])),
                                       mask[i]);
            if constexpr (ColT == 1) {
                const int r = rl + rr + RR * s;
                uint32_t* dst = tile + buf * TW + r * 32 + ((cl / 4) ^ tswz(r));
                if constexpr (VW == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(out[0], out[1]);
                else *dst = out[0];
            } else {
                if (ok) store_bytes<VW, VEC>(col_data + (rb + rr + RR * s) * k + c, out);
            }
        }
        if constexpr (EARLY) {
            if (t + gridDim.x < tiles) load_tile(t + gridDim.x);
        }
        if constexpr (ColT == 1) {
            // Byte tile b: written in iteration i, barrier i, read in iteration i + 1, written
            // again in iteration i + 2 after barrier i + 1, which every reader has passed. Each
            // 64-column half is written and read by the same 4 warps: a 128-thread named barrier
            // per half (ids 1, 2; __syncthreads is id 0).
            asm volatile("bar.sync %0, 128;" ::"r"(1 + (warp & 1)) : "memory");
            prev_r0 = r0, prev_c0 = c0;
        }
    }
    if constexpr (ColT == 1) {
        if (prev_r0 >= 0) transpose_store<VEC>(tile + (buf ^ 1) * TW, col_data, m, prev_r0, prev_c0, m, k);
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantize: out = Out(decode(q) * e8m0(s)), the product in fp32 (docs/NUMERICS.md MXFP8 step 4).
// Element e of the (outer * k, inner) view has row = e / inner, i = e % inner and scale
// scale[(row / 32) * inner + i] (k % 32 == 0, so row / 32 = o * k/32 + kk/32). Vector path: a
// thread piece is P = 16 / sizeof(Out) elements (P fp8 bytes in, one 16-byte store out), pieces
// of a warp are consecutive, so each store instruction writes 512 contiguous bytes; DQ_UNROLL
// pieces per thread in flight. Needs inner == 1 (one scale byte per piece) or inner % P == 0
// (P scale bytes, one load).

constexpr int DQ_UNROLL = 4;

// Two fp8 codes (low byte first) decoded exactly.
template <int Elem> __device__ __forceinline__ void decode2(uint32_t two, float& lo, float& hi) {
    if constexpr (Elem == 0) {
        uint32_t h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(two & 0xFFFF)));
        lo = F16::from_bits(static_cast<uint16_t>(h2 & 0xFFFF));
        hi = F16::from_bits(static_cast<uint16_t>(h2 >> 16));
    } else {
        lo = F16::from_bits(static_cast<uint16_t>((two & 0xFF) << 8));  // E5M2 = top byte of fp16
        hi = F16::from_bits(static_cast<uint16_t>(two & 0xFF00));
    }
}



template <class Out, int Elem>
__device__ __forceinline__ void dequant_vec(const uint8_t* data, const uint8_t* scale, void* out, int64_t n,
                                            int64_t inner) {
    constexpr int P = 16 / Bytes<Out>::N, PW = P / 4;
    const int64_t pieces = n / P;  // n % 32 == 0
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * THREADS * DQ_UNROLL + threadIdx.x; base < pieces;
         base += static_cast<int64_t>(gridDim.x) * THREADS * DQ_UNROLL) {
        uint32_t d[DQ_UNROLL][PW], s[DQ_UNROLL][PW];
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            const int64_t pc = base + u * THREADS, e = pc * P;
#pragma unroll
            for (int i = 0; i < PW; ++i) d[u][i] = s[u][i] = 0;
            if (pc >= pieces) continue;
            ld_words<PW>(data + e, d[u]);
            if (inner == 1) {
                s[u][0] = scale[e >> 5];
            } else {
                const int64_t row = div_nn(e, inner);
                ld_words<PW>(scale + (row >> 5) * inner + (e - row * inner), s[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < DQ_UNROLL; ++u) {
            const int64_t pc = base + u * THREADS;
            if (pc >= pieces) continue;
            const float f1 = e8m0_to_f32(static_cast<uint8_t>(s[u][0]));  // inner == 1: the piece's scale
            float y[P];
#pragma unroll
            for (int j = 0; j < P; j += 2) {
                float lo, hi;
                decode2<Elem>(d[u][j >> 2] >> (8 * (j & 3)), lo, hi);
                const uint32_t sw = s[u][j >> 2] >> (8 * (j & 3));
                y[j] = __fmul_rn(lo, inner == 1 ? f1 : e8m0_to_f32(static_cast<uint8_t>(sw)));
                y[j + 1] = __fmul_rn(hi, inner == 1 ? f1 : e8m0_to_f32(static_cast<uint8_t>(sw >> 8)));
            }
            store_piece<Out>(out, pc * P, y);
        }
    }
}

template <class Out, int Elem>
__device__ __forceinline__ void dequant_scalar(const uint8_t* data, const uint8_t* scale, void* out, int64_t n,
                                               int64_t inner) {
    for (int64_t e = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; e < n;
         e += static_cast<int64_t>(gridDim.x) * THREADS) {
        int64_t si = e >> 5;
        if (inner != 1) {
            const int64_t row = div_nn(e, inner);
            si = (row >> 5) * inner + (e - row * inner);
        }
        Out::store(out, e, __fmul_rn(Fp8<Elem>::decode(data[e]), e8m0_to_f32(scale[si])));
    }
}

}  // namespace mxfp8_detail

// =============================================================================================
// Kernels (INTERFACE.md "mxfp8.cuh").

template <class In, int Mode, int Elem>
__global__ void __launch_bounds__(THREADS)
    mxfp8_quantize_rows(const void* x, uint8_t* data, uint8_t* scale, int64_t n_blocks) {
    using namespace mxfp8_detail;
    if (aligned(x, 16) && aligned(data, 8)) rows_body<In, Mode, Elem, true>(x, data, scale, n_blocks);
    else rows_body<In, Mode, Elem, false>(x, data, scale, n_blocks);
}

template <class In, int Mode, int Elem>
__global__ void __launch_bounds__(THREADS) mxfp8_quantize_cols(const void* x, uint8_t* data, uint8_t* scale,
                                                               int64_t outer, int64_t k, int64_t inner) {
    using namespace mxfp8_detail;
    if (inner % MX_COLS_V == 0 && aligned(x, MX_COLS_V * Bytes<In>::N) && aligned(data, 4) && aligned(scale, 4))
        cols_body<In, Mode, Elem, MX_COLS_V, true>(x, data, scale, outer, k, inner);
    else
        cols_body<In, Mode, Elem, 1, false>(x, data, scale, outer, k, inner);
}

template <class In, int Mode, int Elem, int ColT>
__global__ void __launch_bounds__(THREADS)
    mxfp8_quantize_rowcol(const void* x, int64_t m, int64_t k, uint8_t* row_data, uint8_t* row_scale,
                          uint8_t* col_data, uint8_t* col_scale) {
    using namespace mxfp8_detail;
    // The transposed copy's two 128 x 128 byte tiles (32 KiB), one allocation for both paths.
    __shared__ __align__(16) uint32_t tile[ColT ? 2 * RC_TILE * RC_TILE / 4 : 1];
    if (aligned(x, 16) && aligned(row_data, 8) && aligned(col_data, ColT ? 16 : 8))
        rowcol_body<In, Mode, Elem, ColT, true>(x, m, k, row_data, row_scale, col_data, col_scale, tile);
    else
        rowcol_body<In, Mode, Elem, ColT, false>(x, m, k, row_data, row_scale, col_data, col_scale, tile);
}

template <class Out, int Elem>
__global__ void __launch_bounds__(THREADS) mxfp8_dequantize(const uint8_t* data, const uint8_t* scale, void* out,
                                                            int64_t outer, int64_t k, int64_t inner) {
    using namespace mxfp8_detail;
    const int64_t n = outer * k * inner;
    constexpr unsigned P = 16 / Bytes<Out>::N;  // elements per vector piece
    if ((inner == 1 || (inner % P == 0 && aligned(scale, P))) && aligned(data, P) && aligned(out, 16))
        dequant_vec<Out, Elem>(data, scale, out, n, inner);
    else
        dequant_scalar<Out, Elem>(data, scale, out, n, inner);
}

}  // namespace deepwell
