// Mixture-of-Experts routing and permutation (docs/DESIGN.md "MoE"): bit-exact twins of
// rust/core/src/moe/router.rs (`route`, `capacity`, `apply_capacity`) and permute.rs
// (`permutation(..).padded_to(..)`). Deterministic: no float atomics, no data race; every value is
// computed in the reference's order with IEEE round-to-nearest intrinsics (no fma contraction).
//
// Kernels (cuda/INTERFACE.md "moe.cuh"):
//   moe_route_select<In>   one thread per token: scores, bias, groups, top-K and the plain top-K
//   moe_expert_scan<Mode>  one CTA per expert: a prefix count over the T·K assignments in flat
//                          order (capacity / counts / placement)
//   moe_offsets<0>         one thread: the groups' start rows
#pragma once
#include "common.cuh"

namespace deepwell {

constexpr int MOE_MAX_EXPERTS = 512;

namespace moe_detail {

// exp_f32 of rust/core/src/moe/router.rs, operation for operation.
__device__ __forceinline__ float exp_f32(float x) {
    const float LOG2E = 1.4426950408889634f;
    const float LN2_HI = 0.693145751953125f;
    const float LN2_LO = 1.428606765330187e-6f;
    if (x != x) return x;
    if (x > 88.72284f) return __int_as_float(0x7F800000);
    if (x < -103.97208f) return 0.0f;
    const float n = rintf(__fmul_rn(x, LOG2E));
    const float r = __fmaf_rn(-n, LN2_LO, __fmaf_rn(-n, LN2_HI, x));
    float p = 0.0001984127f;
    p = __fmaf_rn(p, r, 0.0013888889f);
    p = __fmaf_rn(p, r, 0.008333334f);
    p = __fmaf_rn(p, r, 0.041666668f);
    p = __fmaf_rn(p, r, 0.16666667f);
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    const int ni = static_cast<int>(n);
    const int a = ni / 2, b = ni - ni / 2;  // C++ and Rust both truncate toward zero
    return __fmul_rn(__fmul_rn(p, __int_as_float((a + 127) << 23)), __int_as_float((b + 127) << 23));
}

// The reference's order: non-NaN first, then value descending, then index ascending.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
    const bool na = va != va, nb = vb != vb;
    if (na != nb) return nb;
    if (!na && va != vb) return va > vb;
    return ia < ib;
}

// The index of the best of v[0..n) not yet taken (bit i of `taken`), by `better`.
__device__ __forceinline__ int best_free(const float* v, int n, const uint32_t* taken) {
    int best = -1;
    for (int i = 0; i < n; ++i) {
        if ((taken[i >> 5] >> (i & 31)) & 1u) continue;
        if (best < 0 || better(v[i], i, v[best], best)) best = i;
    }
    return best;
}

}  // namespace moe_detail

// Per token t (one thread): s = softmax(l_t) (max, then exp(l - max), summed in expert order, then
// divided) or sigmoid(l_t) = 1 / (1 + exp(-l)); choice = s + bias; with n_group > 0, groups of
// E / n_group scored by the sum of their best two (best first), the best `kept` groups stay and the
// others become -inf; experts[t, :] = the top-K of choice, best first; plain[t, :] = the top-K of s
// (the Switch loss's f_e). logits (T, E) contiguous, bias fp32 (E) or null, E <= MOE_MAX_EXPERTS.
// **Per CTA:** THREADS tokens.
template <class In>
__global__ void __launch_bounds__(THREADS) moe_route_select(const void* logits, const float* bias, int* experts, int* plain,
                                                            int64_t tokens, int num_experts, int top_k, int sigmoid,
                                                            int n_group, int kept) {
    using namespace moe_detail;
    float s[MOE_MAX_EXPERTS];
    float c[MOE_MAX_EXPERTS];
    uint32_t taken[MOE_MAX_EXPERTS / 32];
    const int e_n = num_experts, words = (num_experts + 31) / 32;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; t < tokens; t += stride) {
        const int64_t row = t * e_n;
        if (sigmoid) {
            for (int e = 0; e < e_n; ++e) {
                const float v = In::load(logits, row + e);
                s[e] = __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-v)));
            }
        } else {
            float mx = __int_as_float(0xFF800000);
            for (int e = 0; e < e_n; ++e) mx = fmaxf(mx, In::load(logits, row + e));
            float sum = 0.0f;
            for (int e = 0; e < e_n; ++e) {
                s[e] = exp_f32(__fsub_rn(In::load(logits, row + e), mx));
                sum = __fadd_rn(sum, s[e]);
            }
            for (int e = 0; e < e_n; ++e) s[e] = __fdiv_rn(s[e], sum);
        }
        for (int e = 0; e < e_n; ++e) c[e] = bias ? __fadd_rn(s[e], bias[e]) : s[e];
        if (n_group > 0) {
            const int size = e_n / n_group;
            float gs[MOE_MAX_EXPERTS / 2];
            for (int g = 0; g < n_group; ++g) {
                // The group's best two (size >= 2), in the reference's order.
                for (int w = 0; w < (size + 31) / 32; ++w) taken[w] = 0u;
                const int b0 = best_free(c + g * size, size, taken);
                taken[b0 >> 5] |= 1u << (b0 & 31);
                const int b1 = best_free(c + g * size, size, taken);
                gs[g] = __fadd_rn(c[g * size + b0], c[g * size + b1]);
            }
            uint32_t gtaken[MOE_MAX_EXPERTS / 64];
            for (int w = 0; w < (n_group + 31) / 32; ++w) gtaken[w] = 0u;
            for (int j = 0; j < kept; ++j) {
                const int g = best_free(gs, n_group, gtaken);
                gtaken[g >> 5] |= 1u << (g & 31);
            }
            for (int g = 0; g < n_group; ++g) {
                if ((gtaken[g >> 5] >> (g & 31)) & 1u) continue;
                for (int e = g * size; e < (g + 1) * size; ++e) c[e] = __int_as_float(0xFF800000);
            }
        }
        for (int w = 0; w < words; ++w) taken[w] = 0u;
        for (int j = 0; j < top_k; ++j) {
            const int e = best_free(c, e_n, taken);
            taken[e >> 5] |= 1u << (e & 31);
            experts[t * top_k + j] = e;
        }
        for (int w = 0; w < words; ++w) taken[w] = 0u;
        for (int j = 0; j < top_k; ++j) {
            const int e = best_free(s, e_n, taken);
            taken[e >> 5] |= 1u << (e & 31);
            plain[t * top_k + j] = e;
        }
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

}  // namespace deepwell
