//! Kernel sources are data inside the crate (docs/DESIGN.md "Conventions"): every header of ../../cuda, embedded
//! at build time and indexed by a closed enum. A kernel is one template specialization of one
//! header (`kernels::KernelId`), named by an NVRTC name expression; the translation unit is one line.

/// The kernel headers (one per op family, plus the shared helpers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Header {
    Common,
    Mxfp8,
    Fp8Block,
    Fp8BlockTranspose,
    Fp8Tensor,
    Nvfp4,
    Swizzle,
    Linear,
    Moe,
    Sm90,
    Fp8Gemm,
    Fp8GemmSchedule,
    Fp8GemmEpilogue,
    Swiglu,
}

impl Header {
    pub const ALL: [Header; 14] = [
        Header::Common,
        Header::Mxfp8,
        Header::Fp8Block,
        Header::Fp8BlockTranspose,
        Header::Fp8Tensor,
        Header::Nvfp4,
        Header::Swizzle,
        Header::Linear,
        Header::Moe,
        Header::Sm90,
        Header::Fp8Gemm,
        Header::Fp8GemmSchedule,
        Header::Fp8GemmEpilogue,
        Header::Swiglu,
    ];

    pub fn file_name(self) -> &'static str {
        match self {
            Header::Common => "common.cuh",
            Header::Mxfp8 => "mxfp8.cuh",
            Header::Fp8Block => "fp8_block.cuh",
            Header::Fp8BlockTranspose => "fp8_block_transpose.cuh",
            Header::Fp8Tensor => "fp8_tensor.cuh",
            Header::Nvfp4 => "nvfp4.cuh",
            Header::Swizzle => "swizzle.cuh",
            Header::Linear => "linear.cuh",
            Header::Moe => "moe.cuh",
            Header::Sm90 => "sm90.cuh",
            Header::Fp8Gemm => "fp8_gemm.cuh",
            Header::Fp8GemmSchedule => "fp8_gemm_schedule.cuh",
            Header::Fp8GemmEpilogue => "fp8_gemm_epilogue.cuh",
            Header::Swiglu => "swiglu.cuh",
        }
    }

    pub fn source(self) -> &'static str {
        match self {
            Header::Common => include_str!("../../../cuda/common.cuh"),
            Header::Mxfp8 => include_str!("../../../cuda/mxfp8.cuh"),
            Header::Fp8Block => include_str!("../../../cuda/fp8_block.cuh"),
            Header::Fp8BlockTranspose => include_str!("../../../cuda/fp8_block_transpose.cuh"),
            Header::Fp8Tensor => include_str!("../../../cuda/fp8_tensor.cuh"),
            Header::Nvfp4 => include_str!("../../../cuda/nvfp4.cuh"),
            Header::Swizzle => include_str!("../../../cuda/swizzle.cuh"),
            Header::Linear => include_str!("../../../cuda/linear.cuh"),
            Header::Moe => include_str!("../../../cuda/moe.cuh"),
            Header::Sm90 => include_str!("../../../cuda/sm90.cuh"),
            Header::Fp8Gemm => include_str!("../../../cuda/fp8_gemm.cuh"),
            Header::Fp8GemmSchedule => include_str!("../../../cuda/fp8_gemm_schedule.cuh"),
            Header::Fp8GemmEpilogue => include_str!("../../../cuda/fp8_gemm_epilogue.cuh"),
            Header::Swiglu => include_str!("../../../cuda/swiglu.cuh"),
        }
    }
}
