// deepwell's FP8 GEMM (fp8_gemm.cuh), what happens to a fragment after its MMAs: the promotion of
// each K-block's fp32 fragment into the running sum (docs/NUMERICS.md "FP8 block"), and the
// epilogue's rounding and staging of outputs through a warp's shared-memory slab.
#pragma once
#include "common.cuh"  // included by fp8_gemm.cuh after its GEMM_* constants

namespace deepwell {
namespace gemm_detail {

// Two adjacent outputs (columns c, c + 1) rounded to Out, one 4- or 8-byte store.
struct alignas(8) Pair {
    float lo, hi;
};

// Promotion of one K-block's fragment: acc += part * (sa * sb), one fused multiply-add per element
// (the CPU reference's order: docs/NUMERICS.md "FP8 block"). sa0 / sa1: the scales of the
// fragment's two rows; SB = 0: sb_tile, the B tile's scale; SB = 1: sbs, the stage's 128 column scales.
template <int SB>
__device__ __forceinline__ void promote(float (&acc)[64], const float (&part)[64], float sa0, float sa1, float sb_tile,
                                        const float* sbs, int frag_col) {
    if (SB == 0) {
        const float s0 = sa0 * sb_tile, s1 = sa1 * sb_tile;
#pragma unroll
        for (int jn = 0; jn < 16; ++jn) {
            acc[4 * jn + 0] = __fmaf_rn(part[4 * jn + 0], s0, acc[4 * jn + 0]);
            acc[4 * jn + 1] = __fmaf_rn(part[4 * jn + 1], s0, acc[4 * jn + 1]);
            acc[4 * jn + 2] = __fmaf_rn(part[4 * jn + 2], s1, acc[4 * jn + 2]);
            acc[4 * jn + 3] = __fmaf_rn(part[4 * jn + 3], s1, acc[4 * jn + 3]);
        }
    } else {
#pragma unroll
        for (int jn = 0; jn < 16; ++jn) {
            const Pair sbc = *reinterpret_cast<const Pair*>(sbs + 8 * jn + frag_col);
            acc[4 * jn + 0] = __fmaf_rn(part[4 * jn + 0], sa0 * sbc.lo, acc[4 * jn + 0]);
            acc[4 * jn + 1] = __fmaf_rn(part[4 * jn + 1], sa0 * sbc.hi, acc[4 * jn + 1]);
            acc[4 * jn + 2] = __fmaf_rn(part[4 * jn + 2], sa1 * sbc.lo, acc[4 * jn + 2]);
            acc[4 * jn + 3] = __fmaf_rn(part[4 * jn + 3], sa1 * sbc.hi, acc[4 * jn + 3]);
        }
    }
}

// The wide tile's promotion (SB = 0): fragment column groups jn < SPLIT (8 columns each) lie in
// B's first 128-column scale tile (scales s0_lo, s1_lo of the fragment's two rows), the rest in
// the second. The same fused multiply-add per element as `promote`: the same bits.
// `part` holds the column groups [JN0, JN0 + N / 4) of the sum (a half of the tile's columns).
template <int SPLIT, int JN0 = 0, int N, int NA>
__device__ __forceinline__ void promote_split(float (&acc)[NA], const float (&part)[N], float s0_lo, float s1_lo,
                                              float s0_hi, float s1_hi) {
#pragma unroll
    for (int jn = 0; jn < N / 4; ++jn) {
        const int c = JN0 + jn;
        const float s0 = c < SPLIT ? s0_lo : s0_hi, s1 = c < SPLIT ? s1_lo : s1_hi;
        acc[4 * c + 0] = __fmaf_rn(part[4 * jn + 0], s0, acc[4 * c + 0]);
        acc[4 * c + 1] = __fmaf_rn(part[4 * jn + 1], s0, acc[4 * c + 1]);
        acc[4 * c + 2] = __fmaf_rn(part[4 * jn + 2], s1, acc[4 * c + 2]);
        acc[4 * c + 3] = __fmaf_rn(part[4 * jn + 3], s1, acc[4 * c + 3]);
    }
}

template <class Out>
__device__ __forceinline__ void store_pair(void* out, int64_t i, float lo, float hi);
template <>
__device__ __forceinline__ void store_pair<F32>(void* out, int64_t i, float lo, float hi) {
    *reinterpret_cast<Pair*>(static_cast<float*>(out) + i) = Pair{lo, hi};
}
template <>
__device__ __forceinline__ void store_pair<BF16>(void* out, int64_t i, float lo, float hi) {
    uint32_t w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));  // RNE; hi in the upper half
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(out) + i) = w;
}
template <>
__device__ __forceinline__ void store_pair<F16>(void* out, int64_t i, float lo, float hi) {
    uint32_t w;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(out) + i) = w;
}

// The epilogue's staging slab of one warp: GEMM_EPI_ROWS x GEMM_EPI_COLS outputs of type Out,
// rows of ROW_BYTES, each row's 16-byte chunks XOR-swizzled by the row (rows < 8). The fragment's
// writes (8 rows x one chunk per instruction) and the row-wise 16-byte reads are then both free of
// bank conflicts.
template <class Out>
struct Slab {
    static constexpr int ROW_BYTES = GEMM_EPI_COLS * Bytes<Out>::N;  // 128 or 256
    static constexpr int CHUNKS = ROW_BYTES / 16;                    // 16-byte chunks per row
    static constexpr int PER_CHUNK = 16 / Bytes<Out>::N;             // outputs per chunk
    // Element index (in Outs) of (row, col) in the slab.
    __device__ static __forceinline__ int at(int row, int col) {
        const int byte = col * Bytes<Out>::N;
        return (row * ROW_BYTES + (((byte >> 4) ^ row) << 4) + (byte & 15)) / Bytes<Out>::N;
    }
};

// Copies one staged slab to out[out0 + r * cols + c] for rows row0 + [0, 8) below row_end and
// columns col0 + [0, 64) below cols, in whole 16-byte chunks: each 8 (fp32: 16) lanes write a
// whole 128-byte (256-byte) row segment. cols % 8 == 0 (checked by Rust) keeps every chunk whole
// and aligned.
template <class Out>
__device__ __forceinline__ void store_slab(const uint8_t* slab, void* out, int64_t out0, int64_t row0, int64_t row_end,
                                           int64_t col0, int64_t cols, int lane) {
    using L = Slab<Out>;
#pragma unroll
    for (int i = 0; i < GEMM_EPI_ROWS * L::CHUNKS / 32; ++i) {
        const int q = lane + 32 * i, row = q / L::CHUNKS, c = q % L::CHUNKS;
        const uint4 v = *reinterpret_cast<const uint4*>(slab + L::at(row, c * L::PER_CHUNK) * Bytes<Out>::N);
        const int64_t r = row0 + row, col = col0 + c * L::PER_CHUNK;
        if (r < row_end && col < cols)
            *reinterpret_cast<uint4*>(static_cast<uint8_t*>(out) + (out0 + r * cols + col) * Bytes<Out>::N) = v;
    }
}

}  // namespace gemm_detail
}  // namespace deepwell
