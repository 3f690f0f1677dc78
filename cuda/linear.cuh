// The linear layers' GEMM epilogue (rust/ops/src/gemm/epilogue.rs; CPU twin in the same file):
//   out[r, c] = Out( (y[r, c] * (ga * gb)) + bias[c] )
// y is the fp32 GEMM result. `ga`/`gb` are the per-tensor decode scales of NVFP4 operands (device
// pointers to one float each, both null when the recipe has none): cuBLASLt applies them as the
// GEMM's alpha after accumulation, and so does this. `bias` is null when there is none. Each step
// rounds to fp32 in this order (--fmad=false: no fused multiply-add), then once to Out (RNE).
#pragma once
#include "common.cuh"

namespace deepwell {

// One thread per element, grid-stride; y row-major (rows, cols), out likewise, bias (cols).
template <class Out, class Bias>
__global__ void __launch_bounds__(THREADS) linear_epilogue(const float* y, const float* ga, const float* gb,
                                                           const void* bias, void* out, int64_t rows, int64_t cols) {
    const float alpha = ga ? ga[0] * gb[0] : 1.0f;
    const int64_t n = rows * cols;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * THREADS;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x; i < n; i += stride) {
        float v = y[i];
        if (ga) v = v * alpha;
        if (bias) v = v + Bias::load(bias, i % cols);
        Out::store(out, i, v);
    }
}

}  // namespace deepwell
