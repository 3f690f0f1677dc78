// deepwell's FP8 GEMM (fp8_gemm.cuh), the tile schedule: which output tile a persistent CTA takes
// next, in grouped raster order, and for MoE's row groups (found by a warp prefix sum over the
// offsets, no host sync) and K groups (each group's K-blocks).
#pragma once
#include "common.cuh"  // included by fp8_gemm.cuh after its GEMM_* constants

namespace deepwell {
namespace gemm_detail {

// One output tile of the persistent loop: where its rows and B rows start, which K-blocks it sums.
struct Job {
    int64_t group;     // GROUPING 2: the output matrix; GROUPING 1: B's group
    int64_t row0;      // first row of A (and of out) of the tile
    int64_t row_end;   // rows >= row_end are not written (end of A or of the row group)
    int64_t col0;      // first output column (= first row of B within its group)
    int64_t b_row0;    // first row of B
    int64_t b_k0;      // B's K coordinate of the group's first element
    int kb0, kb1;      // K-blocks [kb0, kb1)
    bool bad;          // GROUPING 2 with misaligned offsets: write NaN
};

// Tile `l` of a (m_tiles x n_tiles) grid in grouped raster order: GEMM_GROUP_M row-tiles at a time,
// row-tiles fastest, so consecutive CTAs share B's column-tile in L2.
__device__ __forceinline__ void raster(int64_t l, int64_t m_tiles, int64_t n_tiles, int64_t& mt, int64_t& nt) {
    const int64_t per_group = GEMM_GROUP_M * n_tiles;
    const int64_t first = (l / per_group) * GEMM_GROUP_M;
    const int64_t height = m_tiles - first < GEMM_GROUP_M ? m_tiles - first : GEMM_GROUP_M;
    const int64_t in_group = l % per_group;
    mt = first + in_group % height;
    nt = in_group / height;
}

__device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The job of tile `t`, or false when t is past the last tile. Warp-collective for GROUPING 1 (all
// 32 lanes call it with the same t): the row groups' tile counts are prefix-summed 32 at a time.
template <int BLOCK_M, int GROUPING, int BN>
__device__ __forceinline__ bool job_of(int64_t t, const int* offsets, int64_t rows, int64_t cols, int64_t k,
                                       int groups, int64_t b_group_rows, int64_t b_group_k, Job& j) {
    const int64_t n_tiles = ceil_div(cols, BN);
    const int kb_total = static_cast<int>(k / GEMM_BLOCK_K);
    j.bad = false;
    int64_t mt, nt;
    if (GROUPING == 1) {
        const int lane = threadIdx.x % 32;
        int64_t before = 0;
        for (int e0 = 0; e0 < groups; e0 += 32) {
            const int e = e0 + lane;
            int64_t start = 0, len = 0;
            if (e < groups) {
                // Clamped into A: offsets the CPU reference refuses stay in bounds here.
                start = min(max(static_cast<int64_t>(offsets[e]), int64_t(0)), rows);
                len = min(max(static_cast<int64_t>(offsets[e + 1]), start), rows) - start;
            }
            const int64_t tiles = ceil_div(len, BLOCK_M) * n_tiles;
            int64_t incl = tiles;
#pragma unroll
            for (int d = 1; d < 32; d *= 2) {
                const int64_t v = __shfl_up_sync(FULL_MASK, incl, d);
                if (lane >= d) incl += v;
            }
            const int64_t chunk = __shfl_sync(FULL_MASK, incl, 31);
            if (t < before + chunk) {
                const int hit = __ffs(__ballot_sync(FULL_MASK, before + incl > t)) - 1;
                const int64_t first_tile = before + __shfl_sync(FULL_MASK, incl - tiles, hit);
                const int64_t g_start = __shfl_sync(FULL_MASK, start, hit);
                const int64_t g_len = __shfl_sync(FULL_MASK, len, hit);
                raster(t - first_tile, ceil_div(g_len, BLOCK_M), n_tiles, mt, nt);
                j.group = e0 + hit;
                j.row0 = g_start + mt * BLOCK_M;
                j.row_end = g_start + g_len;
                j.col0 = nt * BN;
                j.b_row0 = j.group * b_group_rows + j.col0;
                j.b_k0 = j.group * b_group_k;
                j.kb0 = 0;
                j.kb1 = kb_total;
                return true;
            }
            before += chunk;
        }
        return false;
    }
    const int64_t m_tiles = ceil_div(rows, BLOCK_M);
    const int64_t per_matrix = m_tiles * n_tiles;
    const int64_t matrices = GROUPING == 2 ? groups : 1;
    if (t >= per_matrix * matrices) return false;
    j.group = t / per_matrix;
    raster(t % per_matrix, m_tiles, n_tiles, mt, nt);
    j.row0 = mt * BLOCK_M;
    j.row_end = rows;
    j.col0 = nt * BN;
    j.b_row0 = j.col0;
    j.b_k0 = 0;
    j.kb0 = 0;
    j.kb1 = kb_total;
    if (GROUPING == 2) {
        const int lo = offsets[j.group], hi = offsets[j.group + 1];
        j.bad = lo % GEMM_BLOCK_K != 0 || hi % GEMM_BLOCK_K != 0 || hi < lo || lo < 0 || hi > k;
        j.kb0 = j.bad ? 0 : lo / GEMM_BLOCK_K;
        j.kb1 = j.bad ? 0 : hi / GEMM_BLOCK_K;
    }
    return true;
}

}  // namespace gemm_detail
}  // namespace deepwell
