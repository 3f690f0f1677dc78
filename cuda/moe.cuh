// Mixture-of-Experts routing and permutation (docs/DESIGN.md "MoE"): bit-exact twins of
// rust/core/src/moe/router.rs (`route`, `capacity`, `apply_capacity`) and permute.rs
// (`permutation(..).padded_to(..)`). Deterministic: no float atomics, no data race; every value is
// computed in the reference's order with IEEE round-to-nearest intrinsics (no fma contraction).
//
// Kernels (cuda/INTERFACE.md "moe.cuh"):
//   moe_route_select<In>   one warp per token: scores, bias, groups, top-K and the plain top-K
//   moe_expert_scan<Mode>  one CTA per expert: a prefix count over the T·K assignments in flat
//                          order (capacity / counts / placement)
//   moe_offsets<0>         one thread: the groups' start rows
//   moe_gather_rows<In>    per (row, chunk): dispatch's gather, combine's weighted d_rows
//   moe_sum_slots<In>      per (token, chunk): Σ_k in k order (combine, dispatch's backward)
//   moe_slot_dots<In>      one warp per slot: combine's d_weights, a fixed-shape dot product
#pragma once
#include "common.cuh"

namespace deepwell {

constexpr int MOE_MAX_EXPERTS = 512;

namespace moe_detail {

// The reference's order: non-NaN first, then value descending, then index ascending.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
    const bool na = va != va, nb = vb != vb;
    if (na != nb) return nb;
    if (!na && va != vb) return va > vb;
    return ia < ib;
}

}  // namespace moe_detail

// The best (by `better`) of the warp's candidates: lane l offers (v, i) (i < 0: none); every lane
// gets the winner's index. `better` is a total order, so the result does not depend on the lanes.
__device__ __forceinline__ int warp_best(float v, int i) {
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xFFFFFFFFu, v, off);
        const int oi = __shfl_xor_sync(0xFFFFFFFFu, i, off);
        if (oi >= 0 && (i < 0 || moe_detail::better(ov, oi, v, i))) {
            v = ov;
            i = oi;
        }
    }
    return i;
}

// The top `k` of v[0..n) (shared memory, the warp's), best first, into out[0..k) (lane 0 writes);
// `taken` is the warp's scratch bit mask of n bits.
__device__ __forceinline__ void warp_top_k(const float* v, int n, int k, uint32_t* taken, int* out) {
    const int lane = threadIdx.x & 31;
    for (int w = lane; w < (n + 31) / 32; w += 32) taken[w] = 0u;
    __syncwarp();
    for (int j = 0; j < k; ++j) {
        float bv = 0.0f;
        int bi = -1;
        for (int e = lane; e < n; e += 32) {
            if ((taken[e >> 5] >> (e & 31)) & 1u) continue;
            if (bi < 0 || moe_detail::better(v[e], e, bv, bi)) {
                bv = v[e];
                bi = e;
            }
        }
        const int best = warp_best(bv, bi);
        if (lane == 0) {
            taken[best >> 5] |= 1u << (best & 31);
            out[j] = best;
        }
        __syncwarp();
    }
}

// Per token t (one warp; its scores staged in shared memory): s = softmax(l_t) (the max, then
// exp(l - max) per expert, summed by lane 0 in expert order, then divided) or sigmoid(l_t) =
// 1 / (1 + exp(-l)); choice c = s + bias; with n_group > 0, groups of E / n_group scored by the sum
// of their best two (best first), the best `kept` groups stay and the others become -inf (lane 0,
// in the reference's order); experts[t, :] = the top-K of c, best first; plain[t, :] = the top-K
// of s (the Switch loss's f_e). logits (T, E) contiguous, bias fp32 (E) or null,
// E <= MOE_MAX_EXPERTS. **Per CTA:** THREADS / 32 = 8 tokens.
template <class In>
__global__ void __launch_bounds__(THREADS) moe_route_select(const void* logits, const float* bias, int* experts, int* plain,
                                                            int64_t tokens, int num_experts, int top_k, int sigmoid,
                                                            int n_group, int kept) {
    using namespace moe_detail;
    constexpr int WARPS = THREADS / 32;
    __shared__ float sh_s[WARPS][MOE_MAX_EXPERTS];
    __shared__ float sh_c[WARPS][MOE_MAX_EXPERTS];
    __shared__ uint32_t sh_taken[WARPS][MOE_MAX_EXPERTS / 32];
    __shared__ float sh_g[WARPS][MOE_MAX_EXPERTS / 2];  // group scores (groups hold >= 2 experts)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* s = sh_s[warp];
    float* c = sh_c[warp];
    uint32_t* taken = sh_taken[warp];
    const int e_n = num_experts;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * WARPS;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * WARPS + warp; t < tokens; t += stride) {
        const int64_t row = t * e_n;
        if (sigmoid) {
            for (int e = lane; e < e_n; e += 32) s[e] = __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-In::load(logits, row + e))));
        } else {
            float mx = __int_as_float(0xFF800000);  // fmaxf ignores NaN, as Rust's f32::max: any order
            for (int e = lane; e < e_n; e += 32) mx = fmaxf(mx, In::load(logits, row + e));
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
            for (int e = lane; e < e_n; e += 32) s[e] = exp_f32(__fsub_rn(In::load(logits, row + e), mx));
            __syncwarp();
            float sum = 0.0f;
            if (lane == 0) {
                for (int e = 0; e < e_n; ++e) sum = __fadd_rn(sum, s[e]);
            }
            sum = __shfl_sync(0xFFFFFFFFu, sum, 0);
            for (int e = lane; e < e_n; e += 32) s[e] = __fdiv_rn(s[e], sum);
        }
        for (int e = lane; e < e_n; e += 32) c[e] = bias ? __fadd_rn(s[e], bias[e]) : s[e];
        __syncwarp();
        if (n_group > 0 && lane == 0) {
            const int size = e_n / n_group;
            float* gs = sh_g[warp];
            for (int g = 0; g < n_group; ++g) {
                const float* v = c + g * size;
                int b0 = 0;
                for (int i = 1; i < size; ++i)
                    if (better(v[i], i, v[b0], b0)) b0 = i;
                int b1 = b0 == 0 ? 1 : 0;
                for (int i = 0; i < size; ++i)
                    if (i != b0 && better(v[i], i, v[b1], b1)) b1 = i;
                gs[g] = __fadd_rn(v[b0], v[b1]);
            }
            uint32_t keep[MOE_MAX_EXPERTS / 64];
            for (int w = 0; w < (n_group + 31) / 32; ++w) keep[w] = 0u;
            for (int j = 0; j < kept; ++j) {
                int best = -1;
                for (int g = 0; g < n_group; ++g) {
                    if ((keep[g >> 5] >> (g & 31)) & 1u) continue;
                    if (best < 0 || better(gs[g], g, gs[best], best)) best = g;
                }
                keep[best >> 5] |= 1u << (best & 31);
            }
            for (int g = 0; g < n_group; ++g) {
                if ((keep[g >> 5] >> (g & 31)) & 1u) continue;
                for (int e = g * size; e < (g + 1) * size; ++e) c[e] = __int_as_float(0xFF800000);
            }
        }
        __syncwarp();
        warp_top_k(c, e_n, top_k, taken, experts + t * top_k);
        warp_top_k(s, e_n, top_k, taken, plain + t * top_k);
    }
}

// Modes of moe_expert_scan.
constexpr int SCAN_CAPACITY = 0;  // dropped_out[s] = (rank of s among ids == e) >= capacity; counts[e] = kept
constexpr int SCAN_COUNT = 1;     // counts[e] = #{s : ids[s] == e, not dropped[s]}
constexpr int SCAN_PLACE = 2;     // row_of_slot / slot_of_row of the kept assignments, -1 elsewhere

// One CTA per expert e (grid-stride over experts) walks the n assignments in flat order, 256 at a
// time, and ranks those of expert e with a block-wide prefix count (warp ballots + a shared total
// per warp), so every rank is the reference's "earlier assignments of the same expert". ids out of
// [0, E) belong to no expert (treated as dropped). `dropped` may be null (nothing dropped);
// capacity < 0 is dropless. **Per CTA:** one expert.
template <int Mode>
__global__ void __launch_bounds__(THREADS) moe_expert_scan(const int* ids, const uint8_t* dropped, int64_t n, int num_experts,
                                                           int64_t capacity, const int* offsets, uint8_t* dropped_out,
                                                           int* counts, int* row_of_slot, int* slot_of_row) {
    __shared__ int warp_total[THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int e = blockIdx.x; e < num_experts; e += gridDim.x) {
        int64_t base = 0;
        for (int64_t start = 0; start < n; start += THREADS) {
            const int64_t s = start + threadIdx.x;
            const int id = s < n ? ids[s] : -1;
            const bool mine = id == e && !(dropped && dropped[s]);
            const unsigned ballot = __ballot_sync(0xFFFFFFFFu, mine);
            if (lane == 0) warp_total[warp] = __popc(ballot);
            __syncthreads();
            int64_t rank = base + __popc(ballot & ((1u << lane) - 1u));
            int64_t chunk = 0;
            for (int w = 0; w < THREADS / 32; ++w) {
                if (w < warp) rank += warp_total[w];
                chunk += warp_total[w];
            }
            if (Mode == SCAN_CAPACITY) {
                if (id == e) dropped_out[s] = (capacity >= 0 && rank >= capacity) ? 1 : 0;
            } else if (Mode == SCAN_PLACE) {
                if (mine) {
                    const int row = offsets[e] + static_cast<int>(rank);
                    row_of_slot[s] = row;
                    slot_of_row[row] = static_cast<int>(s);
                } else if (s < n && ((id == e && dropped && dropped[s]) || (e == 0 && (id < 0 || id >= num_experts)))) {
                    row_of_slot[s] = -1;
                }
            }
            base += chunk;
            __syncthreads();
        }
        if (Mode == SCAN_CAPACITY) {
            if (threadIdx.x == 0) counts[e] = static_cast<int>(capacity >= 0 && base > capacity ? capacity : base);
        } else if (Mode == SCAN_COUNT) {
            if (threadIdx.x == 0) counts[e] = static_cast<int>(base);
        } else {
            // Padding rows of the group (and, for the last expert, the spare rows up to R).
            for (int64_t r = offsets[e] + base + threadIdx.x; r < offsets[e + 1]; r += THREADS) slot_of_row[r] = -1;
        }
    }
}

// offsets[e] = Σ_{e' < e} round_up(counts[e'], align); offsets[E] = rows (the static buffer: the
// spare rows join the last group). **Per CTA:** everything (one thread).
template <int Unused = 0>
__global__ void __launch_bounds__(THREADS) moe_offsets(const int* counts, int num_experts, int64_t align, int64_t rows, int* offsets) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int64_t total = 0;
    for (int e = 0; e < num_experts; ++e) {
        offsets[e] = static_cast<int>(total);
        total += (counts[e] + align - 1) / align * align;
    }
    offsets[num_experts] = static_cast<int>(rows);
}

// ---------------------------------------------------------------------------------------------
// The value moves between token order and the expert-grouped buffer (torch_ops/deepwell/ops/moe.py
// moe_dispatch / moe_combine; CPU twins in rust/ops/src/ops/moe/combine_cpu.rs). Every output
// element is written once by one thread and sums run in k order: no atomics, the same bits every
// run. Products and sums are __fmul_rn / __fadd_rn, never a contracted fma, because the CPU
// reference rounds each product and each sum separately. An index outside [0, rows) (the CPU
// reference's error) reads as a dropped slot here: checking it on the device would need a host sync.

// Elements per chunk (one 16-byte vector) of the gather and the sums: 8 bf16/fp16 or 4 fp32.
template <class In> struct MoeVec {
    static constexpr int N = 16 / Bytes<In>::N;
};

// Elements per lane step of moe_slot_dots, for every dtype and both paths: the reduction order
// depends on it, and rust/ops/src/ops/moe/combine_cpu.rs `DOT_CHUNK` repeats it.
constexpr int MOE_DOT_CHUNK = 8;

namespace moe_detail {

// 16 bytes at element i of p (16-byte aligned), widened exactly to fp32.
template <class In> __device__ __forceinline__ void load_vec(const void* p, int64_t i, float* v) {
    const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const char*>(p) + i * Bytes<In>::N);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < MoeVec<In>::N; ++j) v[j] = widen<In>(w, j);
}

// n elements' raw bytes from element `from` of src to element `to` of dst (a copy keeps every bit,
// NaN payloads too); n * sizeof(In) is 16 (aligned) or one element.
template <class In> __device__ __forceinline__ void copy_bits(void* dst, int64_t to, const void* src, int64_t from, int n) {
    const char* s = static_cast<const char*>(src) + from * Bytes<In>::N;
    char* o = static_cast<char*>(dst) + to * Bytes<In>::N;
    if (n * Bytes<In>::N == 16)
        *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(s);
    else if (Bytes<In>::N == 4)
        *reinterpret_cast<uint32_t*>(o) = *reinterpret_cast<const uint32_t*>(s);
    else
        *reinterpret_cast<uint16_t*>(o) = *reinterpret_cast<const uint16_t*>(s);
}

// Stores v[0, n) at element i of p, each rounded once (RNE) to In (n = MoeVec<In>::N or 1).
template <class In> __device__ __forceinline__ void store_n(void* p, int64_t i, const float* v, int n) {
    if (n == 1)
        In::store(p, i, v[0]);
    else
        store_piece<In>(p, i, v);
}

}  // namespace moe_detail

// out (rows, d) of In: row r = src[index[r] / top_k] (weights null: a bit copy) or
// In(fp32(weights[index[r]]) · fp32(src[index[r] / top_k])) (one rounding), zero where index[r]
// is -1 (a padding row) or outside [0, src_rows · top_k). Dispatch: index = slot_of_row; combine's
// d_rows: src = grad (T, d), weights (T·K) fp32. Vector path (d % MoeVec<In>::N == 0, src and out
// 16-byte aligned): items are 16-byte chunks; scalar path: single elements.
// **Per CTA:** THREADS items; rows * ceil(d / V) items (V = MoeVec<In>::N or 1).
template <class In>
__global__ void __launch_bounds__(THREADS) moe_gather_rows(const void* src, const int* index, const float* weights,
                                                           void* out, int64_t rows, int64_t d, int64_t src_rows,
                                                           int64_t top_k) {
    constexpr int V = MoeVec<In>::N;
    const bool vec = d % V == 0 && aligned(src, 16) && aligned(out, 16);
    const int n = vec ? V : 1;
    const int64_t per_row = d / n, items = rows * per_row, limit = src_rows * top_k;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; i < items;
         i += static_cast<int64_t>(gridDim.x) * THREADS) {
        const int64_t r = i / per_row, e = (i - r * per_row) * n;
        const int64_t s = index[r];
        const bool valid = s >= 0 && s < limit;
        const int64_t from = (valid ? s / top_k : 0) * d + e, to = r * d + e;
        float v[V];
        if (valid && !weights) {
            moe_detail::copy_bits<In>(out, to, src, from, n);
            continue;
        }
        if (valid) {
            const float w = weights[s];
            if (vec) {
                moe_detail::load_vec<In>(src, from, v);
            } else {
                v[0] = In::load(src, from);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] = __fmul_rn(w, v[j]);
        } else {
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] = 0.0f;
        }
        moe_detail::store_n<In>(out, to, v, n);
    }
}

// out (tokens, d) of In: out[t] = In(Σ_k term_k) with the sum in fp32 in k order starting from
// -0.0 (the additive identity, so a single term passes unchanged), term_k = fp32(rows[r]) ·
// fp32(weights[t·K + k]) (weights null: fp32(rows[r]) alone) for r = row_of_slot[t·K + k], and +0.0
// for a dropped slot (r == -1 or outside [0, n_rows)). Combine's forward; dispatch's backward with
// null weights. Vector and scalar paths as moe_gather_rows (d % V, rows and out aligned).
// **Per CTA:** THREADS items; tokens * ceil(d / V) items.
template <class In>
__global__ void __launch_bounds__(THREADS) moe_sum_slots(const void* rows, const int* row_of_slot, const float* weights,
                                                         void* out, int64_t tokens, int top_k, int64_t d, int64_t n_rows) {
    constexpr int V = MoeVec<In>::N;
    const bool vec = d % V == 0 && aligned(rows, 16) && aligned(out, 16);
    const int n = vec ? V : 1;
    const int64_t per_row = d / n, items = tokens * per_row;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; i < items;
         i += static_cast<int64_t>(gridDim.x) * THREADS) {
        const int64_t t = i / per_row, e = (i - t * per_row) * n;
        float acc[V], x[V];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = -0.0f;
        for (int k = 0; k < top_k; ++k) {
            const int64_t slot = t * top_k + k;
            const int64_t r = row_of_slot[slot];
            if (r < 0 || r >= n_rows) {
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] = __fadd_rn(acc[j], 0.0f);
                continue;
            }
            if (vec) {
                moe_detail::load_vec<In>(rows, r * d + e, x);
            } else {
                x[0] = In::load(rows, r * d + e);
            }
            if (weights) {
                const float w = weights[slot];
#pragma unroll
                for (int j = 0; j < V; ++j) x[j] = __fmul_rn(x[j], w);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = __fadd_rn(acc[j], x[j]);
        }
        moe_detail::store_n<In>(out, t * d + e, acc, n);
    }
}

// out (slots) fp32: out[s] = dot(rows[row_of_slot[s]], grad[s / top_k]) over d, +0.0 for a dropped
// slot. One warp per slot s. The fixed reduction order (combine_cpu.rs `slot_dot` repeats it): lane l
// owns the chunks c ≡ l (mod 32) of MOE_DOT_CHUNK elements, c ascending, and sums
// fp32(row[j]) · fp32(grad[j]) (each product rounded, then the sum) into p_l from +0.0, j ascending;
// then p_l += p_{l + off} for off = 16, 8, 4, 2, 1 (lanes l < off; __shfl_down_sync), lane 0's p is
// the dot. Vector path (d % 8 == 0, rows and grad 16-byte aligned): each chunk is 16-byte loads;
// scalar path: element loads in the same order, so both give the same bits.
// **Per CTA:** THREADS / 32 = 8 slots.
template <class In>
__global__ void __launch_bounds__(THREADS) moe_slot_dots(const void* rows, const int* row_of_slot, const void* grad,
                                                         float* out, int64_t slots, int top_k, int64_t d, int64_t n_rows) {
    constexpr int C = MOE_DOT_CHUNK, V = MoeVec<In>::N;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool vec = d % C == 0 && aligned(rows, 16) && aligned(grad, 16);
    const int64_t chunks = (d + C - 1) / C;
    for (int64_t s = static_cast<int64_t>(blockIdx.x) * (THREADS / 32) + warp; s < slots;
         s += static_cast<int64_t>(gridDim.x) * (THREADS / 32)) {
        const int64_t r = row_of_slot[s];  // the same for the whole warp: no divergence
        if (r < 0 || r >= n_rows) {
            if (lane == 0) out[s] = 0.0f;
            continue;
        }
        const int64_t a = r * d, b = (s / top_k) * d;
        float p = 0.0f;
        for (int64_t c = lane; c < chunks; c += 32) {
            const int64_t e0 = c * C;
            if (vec) {
                float x[C], g[C];
#pragma unroll
                for (int h = 0; h < C; h += V) {
                    moe_detail::load_vec<In>(rows, a + e0 + h, x + h);
                    moe_detail::load_vec<In>(grad, b + e0 + h, g + h);
                }
#pragma unroll
                for (int j = 0; j < C; ++j) p = __fadd_rn(p, __fmul_rn(x[j], g[j]));
            } else {
                const int64_t e1 = e0 + C < d ? e0 + C : d;
                for (int64_t j = e0; j < e1; ++j) p = __fadd_rn(p, __fmul_rn(In::load(rows, a + j), In::load(grad, b + j)));
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) p = __fadd_rn(p, __shfl_down_sync(FULL_MASK, p, off));
        if (lane == 0) out[s] = p;
    }
}

}  // namespace deepwell
