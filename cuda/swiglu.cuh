// SwiGLU, silu(gate) * up, and its gradient (docs/NUMERICS.md "SwiGLU"): bit-exact twins of
// rust/core/src/swiglu.rs, operation for operation: fp32 on the exactly widened inputs, the sigmoid
// from common.cuh's exp_f32, IEEE round-to-nearest intrinsics (no fma contraction), one rounding to
// the element type at the end.
//
// Layout (Hugging Face's fused experts): gate_up (rows, 2f) holds each row's f gate values, then
// its f up values; h and dh are (rows, f).
//
// Kernels (INTERFACE.md "swiglu.cuh"; THREADS threads, any grid size):
//   swiglu_forward<In>   h = silu(gate) * up
//   swiglu_backward<In>  d_gate_up = [dgate | dup] for the gradient dh
// Work per CTA and loop iteration: THREADS chunks of 16 / sizeof(In) elements of h (the vector path:
// f a multiple of the chunk, every pointer 16-byte aligned), else THREADS elements.
// The chunk helpers below also feed fp8_block.cuh's fused SwiGLU quantizers.
#pragma once
#include "common.cuh"

namespace deepwell {
namespace swiglu_detail {

// 1 / (1 + e^-g): __frcp_rn is the correctly rounded reciprocal, the same value as IEEE division
// (Rust's `1.0 / x`), and cheaper than __fdiv_rn.
__device__ __forceinline__ float sigmoid(float g) { return __frcp_rn(__fadd_rn(1.0f, exp_f32(-g))); }

// h = (g * sigmoid(g)) * u.
__device__ __forceinline__ float forward(float g, float u) { return __fmul_rn(__fmul_rn(g, sigmoid(g)), u); }

// du = dh * (g * s); dg = ((dh * u) * s) * (1 + g * (1 - s)), s = sigmoid(g).
__device__ __forceinline__ void backward(float g, float u, float dh, float& dg, float& du) {
    const float s = sigmoid(g);
    du = __fmul_rn(dh, __fmul_rn(g, s));
    dg = __fmul_rn(__fmul_rn(__fmul_rn(dh, u), s), __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
}

// A 16-byte chunk (V = 16 / sizeof(In) elements) travels as 4 words, element order = memory order.
template <class In> struct Chunk {
    static constexpr int V = 16 / Bytes<In>::N;
};

// V fp32 results rounded to In, packed into a chunk's words.
template <class In> __device__ __forceinline__ void pack_chunk(const float* y, uint32_t (&w)[4]) {
    if constexpr (Bytes<In>::N == 4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = __float_as_uint(y[j]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = pack2<In>(y[2 * j], y[2 * j + 1]);
    }
}

// h's chunk from the gate's and up's chunks at the same column.
template <class In>
__device__ __forceinline__ void forward_chunk(const uint32_t (&g)[4], const uint32_t (&u)[4], uint32_t (&h)[4]) {
    constexpr int V = Chunk<In>::V;
    float y[V];
#pragma unroll
    for (int j = 0; j < V; ++j) y[j] = forward(widen<In>(g, j), widen<In>(u, j));
    pack_chunk<In>(y, h);
}

// The gate's (GATE) or up's gradient chunk from the gate, up and dh chunks at the same column
// (up's gradient does not read u).
template <class In, bool GATE>
__device__ __forceinline__ void backward_chunk(const uint32_t (&g)[4], const uint32_t (&u)[4],
                                               const uint32_t (&dh)[4], uint32_t (&out)[4]) {
    constexpr int V = Chunk<In>::V;
    float y[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        float dg, du;
        backward(widen<In>(g, j), GATE ? widen<In>(u, j) : 0.0f, widen<In>(dh, j), dg, du);
        y[j] = GATE ? dg : du;
    }
    pack_chunk<In>(y, out);
}

// Both gradient chunks from one sigmoid per element.
template <class In>
__device__ __forceinline__ void backward_chunks(const uint32_t (&g)[4], const uint32_t (&u)[4], const uint32_t (&dh)[4],
                                                uint32_t (&dgate)[4], uint32_t (&dup)[4]) {
    constexpr int V = Chunk<In>::V;
    float yg[V], yu[V];
#pragma unroll
    for (int j = 0; j < V; ++j) backward(widen<In>(g, j), widen<In>(u, j), widen<In>(dh, j), yg[j], yu[j]);
    pack_chunk<In>(yg, dgate);
    pack_chunk<In>(yu, dup);
}

__device__ __forceinline__ void load16(const void* p, uint32_t (&w)[4]) {
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}
__device__ __forceinline__ void store16(void* p, const uint32_t (&w)[4]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Byte address of element i of an In tensor.
template <class In> __device__ __forceinline__ const char* at(const void* p, int64_t i) {
    return static_cast<const char*>(p) + i * Bytes<In>::N;
}
template <class In> __device__ __forceinline__ char* at(void* p, int64_t i) {
    return static_cast<char*>(p) + i * Bytes<In>::N;
}

}  // namespace swiglu_detail

// =============================================================================================
// Kernels (INTERFACE.md "swiglu.cuh").

template <class In>
__global__ void __launch_bounds__(THREADS) swiglu_forward(const void* gate_up, void* h, int64_t rows, int64_t f) {
    using namespace swiglu_detail;
    constexpr int V = Chunk<In>::V;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    if (f % V == 0 && aligned(gate_up, 16) && aligned(h, 16)) {
        const int64_t per_row = f / V, chunks = rows * per_row;
        for (int64_t p = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; p < chunks; p += stride) {
            const int64_t r = div_nn(p, per_row), c = (p - r * per_row) * V;
            uint32_t g[4], u[4], y[4];
            load16(at<In>(gate_up, r * 2 * f + c), g);
            load16(at<In>(gate_up, r * 2 * f + f + c), u);
            forward_chunk<In>(g, u, y);
            store16(at<In>(h, r * f + c), y);
        }
    } else {
        for (int64_t e = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; e < rows * f; e += stride) {
            const int64_t r = div_nn(e, f), c = e - r * f;
            In::store(h, e, forward(In::load(gate_up, r * 2 * f + c), In::load(gate_up, r * 2 * f + f + c)));
        }
    }
}

template <class In>
__global__ void __launch_bounds__(THREADS)
    swiglu_backward(const void* gate_up, const void* dh, void* d_gate_up, int64_t rows, int64_t f) {
    using namespace swiglu_detail;
    constexpr int V = Chunk<In>::V;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    if (f % V == 0 && aligned(gate_up, 16) && aligned(dh, 16) && aligned(d_gate_up, 16)) {
        const int64_t per_row = f / V, chunks = rows * per_row;
        for (int64_t p = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; p < chunks; p += stride) {
            const int64_t r = div_nn(p, per_row), c = (p - r * per_row) * V;
            uint32_t g[4], u[4], d[4], dg[4], du[4];
            load16(at<In>(gate_up, r * 2 * f + c), g);
            load16(at<In>(gate_up, r * 2 * f + f + c), u);
            load16(at<In>(dh, r * f + c), d);
            backward_chunks<In>(g, u, d, dg, du);
            store16(at<In>(d_gate_up, r * 2 * f + c), dg);
            store16(at<In>(d_gate_up, r * 2 * f + f + c), du);
        }
    } else {
        for (int64_t e = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; e < rows * f; e += stride) {
            const int64_t r = div_nn(e, f), c = e - r * f;
            float dg, du;
            backward(In::load(gate_up, r * 2 * f + c), In::load(gate_up, r * 2 * f + f + c), In::load(dh, e), dg, du);
            In::store(d_gate_up, r * 2 * f + c, dg);
            In::store(d_gate_up, r * 2 * f + f + c, du);
        }
    }
}

}  // namespace deepwell
