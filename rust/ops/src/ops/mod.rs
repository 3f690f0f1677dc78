//! The op catalogue: every kernel this library registers, one module per op family (the same stems
//! as `cuda/*.cuh`, `torch_ops/deepwell/ops/*.py`, `tests/test_*.py` and `rust/core/src/*.rs`).
//! Each family has `mod.rs` (specs and argument checks), `cpu.rs` (the reference) and `cuda.rs`.

pub mod fp8_block;
pub mod linear;
pub mod mxfp8;
pub mod nvfp4;
pub mod swizzle;

use deepwell_gpu::KernelSpec;

use crate::kernel::Kernel;

pub fn all_kernels() -> Vec<Kernel> {
    let mut k = Vec::new();
    k.extend(mxfp8::kernels());
    k.extend(nvfp4::kernels());
    k.extend(fp8_block::kernels());
    k.extend(swizzle::kernels());
    k.extend(linear::kernels());
    k
}

/// Every CUDA kernel specialization the ops can launch.
pub fn all_cuda_specs() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    v.extend(mxfp8::cuda_specs());
    v.extend(nvfp4::cuda_specs());
    v.extend(fp8_block::cuda_specs());
    v.extend(swizzle::cuda_specs());
    v.extend(linear::cuda_specs());
    v
}
