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
//   fp8_block_swiglu_quantize_rowcol<In, MM, BACKWARD>  fp8_block_quantize_rowcol of h or of
//                        d_gate_up, made from the inputs inside fp8_block_transpose.cuh's pass
// Work per CTA and loop iteration: THREADS chunks of 16 / sizeof(In) elements of h (the vector path:
// f a multiple of the chunk, every pointer 16-byte aligned), else THREADS elements; the fused
// quantizers: one 128 x 128 tile of the quantized matrix, or (backward, 16-bit In) a gate tile + up
// tile pair.
#pragma once
#include "common.cuh"
#include "fp8_block_transpose.cuh"

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

// ---------------------------------------------------------------------------------------------
// The fused quantizers' sources for fp8_block_transpose.cuh's pass (its Src interface):
//   SwigluSrc:     h = swiglu(gate_up), k = f, from gate_up (m, 2f): each chunk made from the gate's
//                  and up's chunks, h rounded to In exactly as swiglu_forward writes it.
//   SwigluBackSrc: d_gate_up = swiglu_backward(gate_up, dh), k = 2f, from gate_up (m, 2f) and dh
//                  (m, f): a gate-half chunk from the gate, up and dh chunks, an up-half chunk from
//                  the gate and dh chunks. PAIRED (16-bit In): one walk step makes both tiles of a
//                  column pair (`make_pair`); fp32: the walk takes the pair's two tiles one after the
//                  other (`column_tile`), so the second reads gate and dh from L2.
// f % 128 == 0 (Rust checks it), so a tile lies wholly in one half and every chunk is whole.
// On the vector path both sources copy their chunks into shared memory asynchronously (ASYNC: a
// ring of 4 steps, 3 in flight, across tile boundaries), so no register waits for memory; off it
// they fetch GROUP steps at a time into registers. CTAs per SM: the forward 4, the backward 2 (128
// registers a thread; its pair's second tile and its ring take 80 KiB of shared memory).
// Measured on the H100 (benchmarks/profile_swiglu.py): at 2 CTAs and registers only, both kernels
// were latency-bound (DRAM 41-46%, SM 46-51% busy under Nsight Compute, ncu-swiglu-*); the forward
// at 4 CTAs took 0.167 / 0.379 ms against 0.194 / 0.438 (8192 rows, f 5632 / 14336), the backward
// at 3 or 4 CTAs 3-36% longer (results/swiglu-variants-*). The ring then, against registers (same
// process, results/swiglu-async-*): forward 0.168 / 0.367 / 0.697 ms against 0.167 / 0.384 / 0.743
// (f 5632, 14336, and Mixtral's 16384 x 14336), backward 0.291 / 0.613 / 1.165 against 0.295 /
// 0.675 / 1.308; the forward ring at 2 or 3 CTAs and a 2-step backward ring were slower.

// A chunk of an In tensor at element i for the transposing pass (fp8_block.cuh's load: one 16-byte
// load on the vector path, element loads otherwise).
template <class In, bool VEC> __device__ __forceinline__ void fetch_chunk(const void* p, int64_t i, uint32_t (&w)[4]) {
    fp8_block_detail::load_chunk<In, VEC>(p, i, Chunk<In>::V, w);
}

// A chunk copied into / read back from a thread's ring slot (`transposed_tiles`' ASYNC path): chunk
// j of a step at slot[j * THREADS].
__device__ __forceinline__ void copy_chunk(uint4* slot, int j, const char* p) {
    fp8_block_detail::cp_async16(slot + j * THREADS, p);
}
__device__ __forceinline__ void read_chunk(const uint4* slot, int j, uint32_t (&w)[4]) {
    const uint4 v = slot[j * THREADS];
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
}

template <class In> struct SwigluSrc {
    static constexpr bool PREFETCH = false, PAIRED = false, ASYNC = true;
    static constexpr int GROUP = 2;  // steps fetched at once off the vector path (transposed_tiles)
    static constexpr int STAGES = 4, CHUNKS = 2;  // the ring (rust/gpu/src/kernels/swiglu.rs)
    const void* gate_up;
    int64_t f;
    struct Fetch {
        uint32_t g[4], u[4];
    };
    __device__ void fetch_async(int64_t r, int64_t c, uint4* slot) const {
        copy_chunk(slot, 0, at<In>(gate_up, r * 2 * f + c));
        copy_chunk(slot, 1, at<In>(gate_up, r * 2 * f + f + c));
    }
    __device__ void read(const uint4* slot, int64_t, Fetch& t) const {
        read_chunk(slot, 0, t.g);
        read_chunk(slot, 1, t.u);
    }
    __device__ bool aligned16() const { return aligned(gate_up, 16); }
    __device__ int64_t column_tile(int64_t ct, int64_t) const { return ct; }
    template <bool VEC> __device__ void fetch(int64_t r, int64_t c, Fetch& t) const {
        fetch_chunk<In, VEC>(gate_up, r * 2 * f + c, t.g);
        fetch_chunk<In, VEC>(gate_up, r * 2 * f + f + c, t.u);
    }
    __device__ void make(const Fetch& t, int64_t, uint32_t (&w)[4]) const {
        forward_chunk<In>(t.g, t.u, w);
    }
};

template <class In> struct SwigluBackSrc {
    static constexpr bool PREFETCH = false, ASYNC = true;
    static constexpr int GROUP = Bytes<In>::N == 4 ? 2 : 4;
    static constexpr int STAGES = 4, CHUNKS = 3;  // the ring (rust/gpu/src/kernels/swiglu.rs)
    // 16-bit inputs: each walk step makes the gate tile and the up tile of one column pair, from
    // one read of gate, up and dh and one sigmoid per element (the up tile waits in shared memory);
    // fp32 (whose 64 KiB tile would not fit beside the rest) walks the two one after the other.
    static constexpr bool PAIRED = Bytes<In>::N == 2;
    const void* gate_up;
    const void* dh;
    int64_t f;
    struct Fetch {
        uint32_t g[4], u[4], d[4];
    };
    __device__ bool aligned16() const { return aligned(gate_up, 16) && aligned(dh, 16); }
    // Unpaired: walk column ct -> pair ct / 2, its gate tile (even ct) or up tile (odd ct).
    __device__ int64_t column_tile(int64_t ct, int64_t col_tiles) const {
        return PAIRED ? ct : (ct & 1) * (col_tiles / 2) + (ct >> 1);
    }
    template <bool VEC> __device__ void fetch(int64_t r, int64_t c, Fetch& t) const {
        const bool gate = c < f;
        const int64_t cc = gate ? c : c - f;
        fetch_chunk<In, VEC>(gate_up, r * 2 * f + cc, t.g);
        if (gate) fetch_chunk<In, VEC>(gate_up, r * 2 * f + f + cc, t.u);
        fetch_chunk<In, VEC>(dh, r * f + cc, t.d);
    }
    __device__ void fetch_async(int64_t r, int64_t c, uint4* slot) const {
        const bool gate = c < f;
        const int64_t cc = gate ? c : c - f;
        copy_chunk(slot, 0, at<In>(gate_up, r * 2 * f + cc));
        if (gate) copy_chunk(slot, 1, at<In>(gate_up, r * 2 * f + f + cc));
        copy_chunk(slot, 2, at<In>(dh, r * f + cc));
    }
    __device__ void read(const uint4* slot, int64_t c, Fetch& t) const {
        read_chunk(slot, 0, t.g);
        if (c < f) read_chunk(slot, 1, t.u);  // an up-half step (unpaired) copied no up chunk
        read_chunk(slot, 2, t.d);
    }
    __device__ void make(const Fetch& t, int64_t c, uint32_t (&w)[4]) const {
        if (c < f)
            backward_chunk<In, true>(t.g, t.u, t.d, w);
        else
            backward_chunk<In, false>(t.g, t.u, t.d, w);
    }
    __device__ void make_pair(const Fetch& t, uint32_t (&gate)[4], uint32_t (&up)[4]) const {
        backward_chunks<In>(t.g, t.u, t.d, gate, up);
    }
};

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

// rowcol of h = swiglu(gate_up) (BACKWARD = 0; gate_up (m, 2f), outputs as rowcol's of an (m, f)
// matrix) or of d_gate_up = swiglu_backward(gate_up, dh) (BACKWARD = 1; dh (m, f), outputs as
// rowcol's of an (m, 2f) matrix), without writing h or d_gate_up: the same bytes and scales as
// fp8_block_quantize_rowcol of swiglu_forward's / swiglu_backward's output.
template <class In, int MM, int BACKWARD>
__global__ void __launch_bounds__(THREADS, BACKWARD ? 2 : 4)
    fp8_block_swiglu_quantize_rowcol(const void* gate_up, const void* dh, int64_t m, int64_t f, int pow2,
                                     uint8_t* row_data, float* row_scale_inv, uint8_t* col_data,
                                     float* col_scale_inv) {
    using namespace fp8_block_detail;
    using namespace swiglu_detail;
    // Dynamic shared memory: the pair's up tile (SwigluBackSrc::PAIRED), then the copies' ring.
    extern __shared__ uint4 swiglu_dynamic[];
    if constexpr (BACKWARD) {
        constexpr int second = SwigluBackSrc<In>::PAIRED ? TILE * TILE * Bytes<In>::N / 16 : 0;  // in uint4s
        transposing_pass<In, ROWCOL, MM>(SwigluBackSrc<In>{gate_up, dh, f}, m, 2 * f, pow2, row_data, row_scale_inv,
                                         col_data, col_scale_inv, swiglu_dynamic, swiglu_dynamic + second);
    } else {
        transposing_pass<In, ROWCOL, MM>(SwigluSrc<In>{gate_up, f}, m, f, pow2, row_data, row_scale_inv, col_data,
                                         col_scale_inv, nullptr, swiglu_dynamic);
    }
}

}  // namespace deepwell
