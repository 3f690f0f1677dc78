// Blackwell block-scale layout: 128x4 tiles (docs/NUMERICS.md "Transposes and layouts";
// rust/core/src/swizzle.rs). A (rows, cols) byte matrix is padded with 0 to
// (round_up(rows, 128), round_up(cols, 4)) and stored tile by tile, row-major over tiles; inside a
// tile, row r lives in 32-row band (r % 128) / 32 and each 16-byte line holds rows r, r+32, r+64,
// r+96 (4 scale columns each):
//   offset(r, c) = ((r / 128) * ceil(cols / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4
// One thread per destination byte, grid-stride (INTERFACE.md). The kernels are templates only so
// that Rust names them like every other kernel: `deepwell::swizzle_scales<0>` (the int is unused).
#pragma once
#include "common.cuh"

namespace deepwell {
namespace swizzle_detail {

// a / b for non-negative 64-bit values, with the cheap 32-bit divide when both fit.
__device__ __forceinline__ int64_t div64(int64_t a, int64_t b) {
    if (((a | b) >> 32) == 0) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    return a / b;
}

}  // namespace swizzle_detail

// dst (swizzled, round_up(rows, 128) * round_up(cols, 4) bytes) <- src (rows, cols) row-major.
// Destination byte d is decoded back to (r, c): tile t = d / 512 is tile row t / ceil(cols/4),
// tile column t % ceil(cols/4); inside the tile, byte o = d % 512 is row (o % 16) / 4 * 32 + o / 16,
// column o % 4. Padding (r >= rows or c >= cols) gets 0.
template <int Unused = 0>
__global__ void __launch_bounds__(THREADS) swizzle_scales(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols) {
    using namespace swizzle_detail;
    const int64_t tiles_c = (cols + 3) / 4;
    const int64_t total = ((rows + 127) / 128) * 128 * tiles_c * 4;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    for (int64_t d = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; d < total; d += stride) {
        const int64_t t = d >> 9;
        const int o = static_cast<int>(d & 511);
        const int64_t tr = div64(t, tiles_c), tc = t - tr * tiles_c;
        const int64_t r = tr * 128 + ((o & 15) >> 2) * 32 + (o >> 4);
        const int64_t c = tc * 4 + (o & 3);
        dst[d] = (r < rows && c < cols) ? src[r * cols + c] : static_cast<uint8_t>(0);
    }
}

// dst (rows, cols) row-major <- src (swizzled): dst[r * cols + c] = src[offset(r, c)].
template <int Unused = 0>
__global__ void __launch_bounds__(THREADS) unswizzle_scales(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols) {
    using namespace swizzle_detail;
    const int64_t tiles_c = (cols + 3) / 4;
    const int64_t total = rows * cols;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; i < total; i += stride) {
        const int64_t r = div64(i, cols), c = i - r * cols;
        const int64_t off = ((r >> 7) * tiles_c + (c >> 2)) * 512 + (r & 31) * 16 + ((r & 127) >> 5) * 4 + (c & 3);
        dst[i] = src[off];
    }
}

}  // namespace deepwell
