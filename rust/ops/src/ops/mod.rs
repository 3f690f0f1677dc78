//! The op catalogue: every kernel this library registers, one module per op family (the same stems
//! as `cuda/*.cuh`, `torch_ops/deepwell/ops/*.py`, `tests/test_*.py` and `rust/core/src/*.rs`).
//! Each family has `mod.rs` (specs and argument checks), `cpu.rs` (the reference) and `cuda.rs`.

pub mod fp8_block;
pub mod linear;
pub mod mxfp8;
pub mod nvfp4;
pub mod swizzle;

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
