//! deepwell-core: deepwell's number formats, CPU reference quantizers and precision policy: no torch,
//! no CUDA.
//!
//! Every function is bit-exact to `docs/NUMERICS.md`, the contract the CUDA kernels meet too;
//! each module's docs restate the rules it implements. All arithmetic is fp32 on the exactly
//! widened input; element casts are round-to-nearest-even with saturation to the finite range,
//! signed zero kept, subnormals never flushed.
//!
//! | module | what |
//! |---|---|
//! | [`formats`] | scalar codecs: E4M3, E5M2, E2M1, E8M0, the NaN-propagating amax |
//! | [`mxfp8`] | MXFP8 (1x32 blocks, E8M0 scales; rceil and floor rules) |
//! | [`nvfp4`] | NVFP4 (1x16 / 16x16 blocks, E4M3 block scale, fp32 tensor scale) |
//! | [`fp8_block`] | FP8 with fp32 scales per 1x128 / 128x128 block |
//! | [`fp8_tensor`] | FP8 with one fp32 scale per tensor from its current amax (E4M3, E5M2 gradients) |
//! | [`hadamard`], [`rng`] | NVFP4's random Hadamard transform and stochastic rounding |
//! | [`math`] | `exp_f32`: e^x from IEEE operations only, the same bits on the CPU and the GPU |
//! | [`swiglu`] | SwiGLU silu(gate) * up and its gradient, on that `exp_f32` |
//! | [`swizzle`] | Blackwell's 128x4 scale-tile layout and its inverse |
//! | [`shape`] | the (outer, k, inner) view that quantizes along any dim without a transpose |
//! | [`policy`] | per-layer precision decisions and the GEMM dispatch table (recipe x arch x pass) |
//!
//! Special values (project decisions, detailed in each module): amax is NaN-propagating (NaN
//! wins over Inf); an MXFP8 block holding NaN/Inf gets scale 0xFF and NaN elements; an NVFP4
//! block holding NaN/Inf gets block scale 0x7F (E4M3 NaN) and data 0, and a global amax of
//! 0/Inf/NaN gives `S_enc = 1`; an FP8 block with amax 0/Inf/NaN gets scale 1.
//!
//! Slice lengths and shapes are preconditions (the FFI layer validates them first): they are
//! checked with `assert!` and a message naming the operation; nothing is indexed out of bounds.
//! Quantizers run on rayon's global pool.

pub mod element;
pub mod error;
pub mod formats;
pub mod fp8_block;
pub mod fp8_tensor;
pub mod hadamard;
pub mod math;
pub mod moe;
pub mod mxfp8;
pub mod nvfp4;
pub mod policy;
pub mod rng;
pub mod shape;
pub mod swiglu;
pub mod swizzle;
mod tiles;

pub use element::Element;
pub use error::{CoreError, Result};
pub use formats::{
    abs_max, e2m1_to_f32, e4m3_to_f32, e5m2_to_f32, e8m0_to_f32, exp2i, f32_to_e2m1, f32_to_e4m3, f32_to_e5m2,
    E2M1_MAX, E4M3_MAX, E5M2_MAX,
};
pub use fp8_block::{fp8_block_dequantize, fp8_block_quantize, fp8_block_scale, fp8_scale};
pub use fp8_tensor::{fp8_tensor_amax, fp8_tensor_dequantize, fp8_tensor_quantize, fp8_tensor_scale};
pub use hadamard::{hadamard16, HADAMARD_SIGNS};
pub use mxfp8::{mxfp8_dequantize, mxfp8_quantize, mxfp8_scale_byte, Fp8Elem, ScaleMode, MX_BLOCK};
pub use nvfp4::{nvfp4_dequantize, nvfp4_encode_scale, nvfp4_global_amax, nvfp4_quantize, Nvfp4Options, NVFP4_BLOCK};
pub use rng::{e2m1_stochastic, sr_bits};
pub use shape::Dims3;
pub use swizzle::{swizzle_offset, swizzle_scales, swizzled_len, unswizzle_scales};
