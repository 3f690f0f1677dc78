//! deepwell's CUDA runtime (no torch here; the ops crate hands over streams and device pointers).
//!
//! - `sources`  the kernel headers of ../../cuda as embedded data;
//! - `kernels`  typed kernel keys (one template specialization each) and each family's pure
//!   launch geometry, unit-tested without a GPU;
//! - `nvrtc`    NVRTC loaded from torch's wheel, compiling a spec to a cubin for an exact arch;
//! - `tma`      tensor maps for Hopper's bulk tensor copies (the FP8 GEMM's operands);
//! - `cache`    the content-addressed, atomically written on-disk cache of cubins;
//! - `device`   per-device primary context, module table and launches on the caller's stream;
//! - `arch`     pure decisions (arch strings, grid sizes), unit-tested without a GPU.

pub mod arch;
pub mod cache;
pub mod device;
pub mod error;
pub mod kernels;
pub mod nvrtc;
pub mod sources;
pub mod tma;

pub use device::{
    compile_all, configure, device, leave_sms_to_collectives, sms_left_to_collectives, Config, Device, Params,
};
pub use error::{GpuError, Result};
pub use kernels::{Family, Geometry, KernelId, Wave};
pub use sources::Header;
