//! The quantized-GEMM layer the GEMM ops build on (the linear layers today, MoE's grouped GEMMs
//! next): operands quantized by a recipe into the form a GEMM backend reads, and the GEMM itself.
//! Which backend runs each pass is `deepwell_core::policy::gemm_backend`'s decision.
//!
//! | file | what |
//! |---|---|
//! | `operand.rs` | `Form` (what a backend reads) and `Operand` (a GEMM operand in that form) |
//! | `quantize.rs` | how each recipe quantizes each operand of each pass (`along_k`, `along_m`, the weight's and the gradient's pairs) |
//! | `quantizers.rs` | the op families' typed quantizers with the options training uses |
//! | `run.rs` | one GEMM `A @ B^T`: cuBLASLt's FP8 GEMM, `_scaled_mm_v2`, cuBLAS bf16, or fp32 on the CPU |
//! | `cublaslt.rs` | cuBLASLt's FP8 GEMM called directly, each shape's descriptors and algorithm cached (`_scaled_mm_v2` without its per-call setup) |
//! | `fp8_gemm.rs` | deepwell's sm_90a block-scaled FP8 GEMM (fp8_block), dense and grouped |
//! | `epilogue.rs` | NVFP4's alpha, the bias and the output cast after an fp32 GEMM |
//! | `scaled_mm_model.rs` | a CPU model of `_scaled_mm_v2`, to run native paths' arguments anywhere |

pub mod cublaslt;
pub mod epilogue;
pub mod fp8_gemm;
pub mod operand;
pub mod quantize;
pub mod quantizers;
pub mod run;
pub mod scaled_mm_model;

pub use operand::{Form, Operand};
pub use quantize::Role;
