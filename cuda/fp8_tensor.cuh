// FP8 with one fp32 scale per tensor (current scaling): cast, cast with a transposed copy, and
// dequantize. Contract: docs/NUMERICS.md "FP8 tensor"; bit-exact twin of rust/core/src/fp8_tensor.rs.
// Signatures and launch shapes: INTERFACE.md "fp8_tensor.cuh" (THREADS = 256, any grid size works).
//
//   amax  = NaN-propagating max |x| over the tensor: nvfp4.cuh's nvfp4_amax<In, 0>, as fp32 bits
//           in a word Rust zeroed (the same reduction; no host synchronisation).
//   scale = __fdiv_rn(MAX, amax) (MAX = 448 for E4M3, 57344 for E5M2; amax 0/Inf/NaN -> 1,
//           Inf scale -> FLT_MAX), rounded down to a power of two (bits & 0xFF800000);
//   q     = cast_rne_satfinite(__fmul_rn(x, scale));  scale_inv = __fdiv_rn(1, scale).
// With one scale, the transposed copy is exactly the codes transposed (NUMERICS.md "Transposes").
//
// Work per CTA and loop iteration (rust/gpu/src/kernels/fp8_tensor.rs mirrors it; grid capped at one wave):
//   cast:            THREADS chunks of 16 bytes of input
//   cast_transposed: one 64 x 64 tile (TILE)
//   dequantize:      THREADS elements
#pragma once
#include "fp8_block.cuh"

namespace deepwell {
namespace fp8_tensor_detail {

constexpr int TILE = 64;
// Bytes per row of the shared byte tile: 72 = 18 words, so the 4 row groups a warp reads in the
// transposed store start 8 banks apart and the column gather is conflict-free.
constexpr int PITCH = 72;

// The tensor's scale from its amax bits (rust fp8_tensor_scale).
template <int Elem> __device__ __forceinline__ float tensor_scale(const unsigned int* amax_bits) {
    const float amax = __uint_as_float(*amax_bits & 0x7FFFFFFFu);
    if (amax == 0.0f || !is_finite_amax(amax)) return 1.0f;
    float s = __fdiv_rn(Fp8<Elem>::MAX, amax);
    if (abs_bits(s) == 0x7F800000u) s = FLT_MAX_F;  // tiny (subnormal) amax
    return __uint_as_float(__float_as_uint(s) & 0xFF800000u);
}

// Chunk I/O: fp8_block.cuh's `load_chunk` (16 bytes of input at element i, or its first nv
// elements one by one) and `store_chunk` (V codes as one store, or the first nv bytes).
using fp8_block_detail::load_chunk;
using fp8_block_detail::store_chunk;

// The V elements times the scale, cast, packed 4 per word in element order.
template <class In, int Elem, int V>
__device__ __forceinline__ void encode(const uint32_t (&w)[4], float scale, uint32_t (&out)[V / 4]) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
        const uint32_t lo = Fp8<Elem>::encode2(__fmul_rn(widen<In>(w, j), scale), __fmul_rn(widen<In>(w, j + 1), scale));
        const uint32_t hi =
            Fp8<Elem>::encode2(__fmul_rn(widen<In>(w, j + 2), scale), __fmul_rn(widen<In>(w, j + 3), scale));
        out[j >> 2] = lo | (hi << 16);
    }
}

}  // namespace fp8_tensor_detail

// =============================================================================================
// Kernels (INTERFACE.md "fp8_tensor.cuh"). Elem: 0 = E4M3, 1 = E5M2 (common.cuh Fp8<Elem>).

// x (n elements, contiguous) -> data (n codes). Block 0's thread 0 writes scale_inv.
template <class In, int Elem>
__global__ void __launch_bounds__(THREADS)
    fp8_tensor_cast(const void* x, int64_t n, const unsigned int* amax_bits, uint8_t* data, float* scale_inv) {
    using namespace fp8_tensor_detail;
    constexpr int V = 16 / Bytes<In>::N;
    const float scale = tensor_scale<Elem>(amax_bits);
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.0f, scale);
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    const int64_t chunks = n / V;
    const bool vec = aligned(x, 16) && aligned(data, V);
    for (int64_t c = tid; c < chunks; c += stride) {
        uint32_t w[4], out[V / 4];
        if (vec) {
            load_chunk<In, true>(x, c * V, V, w);
            encode<In, Elem, V>(w, scale, out);
            store_chunk<V, true>(data + c * V, out, V);
        } else {
            load_chunk<In, false>(x, c * V, V, w);
            encode<In, Elem, V>(w, scale, out);
            store_chunk<V, false>(data + c * V, out, V);
        }
    }
    for (int64_t i = chunks * V + tid; i < n; i += stride) data[i] = Fp8<Elem>::encode(__fmul_rn(In::load(x, i), scale));
}

// x (m, k) -> col_data (k, m) = the codes transposed, and with ROWS = 1 also row_data (m, k).
// Per 64 x 64 tile: each thread loads S chunks of V elements (a warp reads whole 128-byte row
// segments), encodes them, stores the row codes and puts them in the shared byte tile; after a
// barrier each thread gathers 16 bytes of one tile column (4 threads per column) and writes them
// as one 16-byte store of col_data where the run is whole and aligned. A second barrier guards the
// tile before the next iteration rewrites it. Any m, k (partial edge tiles, scalar edges).
template <class In, int Elem, int ROWS>
__global__ void __launch_bounds__(THREADS)
    fp8_tensor_cast_transposed(const void* x, int64_t m, int64_t k, const unsigned int* amax_bits,
                               uint8_t* row_data, uint8_t* col_data, float* scale_inv) {
    using namespace fp8_tensor_detail;
    constexpr int V = 16 / Bytes<In>::N, L = TILE / V, RS = THREADS / L, S = TILE / RS;
    __shared__ __align__(16) uint8_t tile[TILE * PITCH];
    const float scale = tensor_scale<Elem>(amax_bits);
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.0f, scale);
    const bool vec = k % V == 0 && aligned(x, 16) && (!ROWS || aligned(row_data, V));
    const int li = threadIdx.x % L, rsub = threadIdx.x / L;
    const int j = threadIdx.x >> 2, g = threadIdx.x & 3;  // transposed store: tile column, row group
    const int64_t row_tiles = (m + TILE - 1) / TILE, col_tiles = (k + TILE - 1) / TILE;
    for (int64_t t = blockIdx.x; t < row_tiles * col_tiles; t += gridDim.x) {
        const int64_t r0 = (t / col_tiles) * TILE, c0 = (t % col_tiles) * TILE, c = c0 + li * V;
        const int nv = static_cast<int>(max(static_cast<int64_t>(0), min(static_cast<int64_t>(V), k - c)));
#pragma unroll
        for (int s = 0; s < S; ++s) {
            const int row = rsub + s * RS;
            const int64_t r = r0 + row;
            const bool live = r < m && nv > 0;
            uint32_t w[4] = {0, 0, 0, 0}, out[V / 4];
            if (live && vec && nv == V) load_chunk<In, true>(x, r * k + c, V, w);
            else if (live) load_chunk<In, false>(x, r * k + c, nv, w);
            encode<In, Elem, V>(w, scale, out);
            if (ROWS && live) {
                if (vec && nv == V) store_chunk<V, true>(row_data + r * k + c, out, V);
                else store_chunk<V, false>(row_data + r * k + c, out, nv);
            }
            uint32_t* dst = reinterpret_cast<uint32_t*>(tile + row * PITCH + li * V);
#pragma unroll
            for (int q = 0; q < V / 4; ++q) dst[q] = out[q];
        }
        __syncthreads();
        const int64_t col = c0 + j, r = r0 + g * 16;
        if (col < k && r < m) {
            uint32_t b[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 16; ++i) b[i >> 2] |= static_cast<uint32_t>(tile[(g * 16 + i) * PITCH + j]) << (8 * (i & 3));
            uint8_t* p = col_data + col * m + r;
            if (r + 16 <= m && aligned(p, 16)) {
                *reinterpret_cast<uint4*>(p) = make_uint4(b[0], b[1], b[2], b[3]);
            } else {
                for (int i = 0; i < 16 && r + i < m; ++i) p[i] = static_cast<uint8_t>(b[i >> 2] >> (8 * (i & 3)));
            }
        }
        __syncthreads();
    }
}

// data (n codes) -> out = Out(decode(q) * scale_inv).
template <class Out, int Elem>
__global__ void __launch_bounds__(THREADS)
    fp8_tensor_dequantize(const uint8_t* data, int64_t n, const float* scale_inv, void* out) {
    const float s = *scale_inv;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * THREADS)
        Out::store(out, i, __fmul_rn(Fp8<Elem>::decode(data[i]), s));
}

}  // namespace deepwell
