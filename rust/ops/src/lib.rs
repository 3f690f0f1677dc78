//! deepwell's shared library: registers `torch.ops.deepwell.*` kernels with PyTorch's dispatcher
//! through the LibTorch stable C ABI, with no link-time dependency on torch or CUDA.
//!
//! Layout (docs/DESIGN.md "How Rust reaches PyTorch"):
//! - `abi/`      the shim function table, resolved at load time from the libtorch torch loaded;
//! - `tensor`    owning tensor handles; `stack` decodes boxed arguments; `kernel` is the
//!   trampoline and the one raising function (the audited FFI seam);
//! - `aten`      calling ATen ops (GEMMs, casts, copies) through the dispatcher;
//! - `check`     argument validation with messages naming op, argument, expectation and value;
//! - `host`      CPU views of tensor memory for the reference kernels; `host_time` spans timing
//!   an op's host work (off by default);
//! - `cuda`      torch's stream, contiguous inputs and launch contexts for the CUDA kernels;
//! - `ops/`      one module per op family, each with its specs and kernels;
//! - `capi`      the one C function Python calls (`deepwell_call`: JSON in, JSON out), dispatching
//!   to the entries each module lists in its `ENTRIES` (`entry`: what an entry is);
//! - `register`  loading (kernel registration, compile-all); `policy` the planner and guardrail entries.
//!
//! The maths lives in `deepwell-core`; this crate only validates, allocates and routes.

pub mod abi;
pub mod aten;
pub mod capi;
pub mod check;
pub mod cuda;
pub mod dtype;
pub mod entry;
pub mod error;
pub mod gemm;
pub mod host;
pub mod host_time;
pub mod kernel;
pub mod ops;
pub mod policy;
pub mod register;
pub mod stack;
pub mod tensor;
