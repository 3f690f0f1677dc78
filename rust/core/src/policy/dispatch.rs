//! The GEMM dispatch table: which kernel runs each pass of a GEMM site on which device
//! ([`gemm_backend`]; passes and shapes in [`super::gemm`]).

use super::arch::{is_native, why_not_native, Arch, ArchFamily};
use super::gemm::{GemmShape, Pass, ScalingType};
use super::recipe::Recipe;

/// The kernel that runs one GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmBackend {
    /// bf16 `torch.matmul` on CUDA (cuBLAS).
    CublasBf16,
    /// `torch.matmul` on the CPU (bf16 recipe on the reference device).
    CpuMatmul,
    /// cuBLASLt FP8 with fp32 block scales (sm_90): the call `aten::_scaled_mm_v2` makes, made by
    /// deepwell itself (rust/ops/src/gemm/cublaslt.rs), through aten where that path declines.
    ScaledMmBlockwise {
        /// Scaling of operand A (always 1x128 along K).
        a: ScalingType,
        /// Scaling of operand B: 128x128 for the weight (fprop, dgrad), 1x128 for x (wgrad).
        b: ScalingType,
    },
    /// deepwell's own block-scaled FP8 GEMM for sm_90a (cuda/fp8_gemm.cuh: TMA, wgmma, per-block
    /// fp32 promotion), on the same operands as `ScaledMmBlockwise`: the fp8_block passes whose
    /// shape cuBLASLt refuses (fprop / dgrad with K % 512 != 0), and MoE's grouped GEMMs.
    Fp8BlockGemm {
        /// Scaling of operand B: 128x128 (a weight) or 1x128.
        b: ScalingType,
    },
    /// cuBLASLt FP8 with one fp32 scale per operand (sm_89+), called as `ScaledMmBlockwise` is:
    /// E4M3 x E4M3 (fprop), E5M2 x E4M3 (dgrad, wgrad: the gradient is operand A).
    ScaledMmTensorwise,
    /// cuBLASLt block-scaled MX / NV GEMM via `aten::_scaled_mm_v2`, both operands with this
    /// scaling, scales swizzled `SWIZZLE_32_4_4` (sm_100/103/120/121).
    ScaledMmMx {
        /// `BlockWise1x32` (MXFP8) or `BlockWise1x16` (NVFP4).
        block: ScalingType,
    },
    /// Exact emulation: quantize with the recipe, dequantize, then a bf16 GEMM (fp32 on CPU).
    Emulated {
        /// The recipe whose numerics are reproduced.
        recipe: Recipe,
    },
}

impl GemmBackend {
    /// One line for printing a plan.
    pub fn describe(&self) -> String {
        match *self {
            GemmBackend::CublasBf16 => "bf16 torch.matmul (cuBLAS)".to_string(),
            GemmBackend::CpuMatmul => "torch.matmul on CPU".to_string(),
            GemmBackend::ScaledMmBlockwise { a, b } => {
                format!("cuBLASLt FP8 blockwise {} x {} (called directly, fp32 scales)", a.block(), b.block())
            }
            GemmBackend::Fp8BlockGemm { b } => {
                format!("deepwell FP8 GEMM 1x128 x {} (sm_90a wgmma kernel, fp32 scales)", b.block())
            }
            GemmBackend::ScaledMmTensorwise => {
                "cuBLASLt FP8 per-tensor scales (called directly, fp32 scales)".to_string()
            }
            GemmBackend::ScaledMmMx { block } => {
                let what = if block == ScalingType::BlockWise1x16 { "NVFP4" } else { "MXFP8" };
                format!("cuBLASLt {what} block-scaled {} (aten::_scaled_mm_v2, swizzled scales)", block.block())
            }
            GemmBackend::Emulated { recipe } => {
                format!("{recipe} emulated: quantize, dequantize, bf16 GEMM (fp32 on CPU)")
            }
        }
    }

    /// `describe`, naming the precision the GEMM really runs in on `arch`: an emulated GEMM reads
    /// bf16 operands on a GPU and fp32 ones on the CPU.
    pub fn describe_on(&self, arch: Arch) -> String {
        match (*self, arch.family()) {
            (GemmBackend::Emulated { recipe }, ArchFamily::Cpu) => {
                format!("{recipe} emulated: quantize, dequantize, fp32 GEMM")
            }
            (GemmBackend::Emulated { recipe }, _) => format!("{recipe} emulated: quantize, dequantize, bf16 GEMM"),
            (backend, _) => backend.describe(),
        }
    }
}

/// One pass's dispatch decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmChoice {
    /// The kernel.
    pub backend: GemmBackend,
    /// True when the recipe's numerics are emulated rather than run natively.
    pub emulated: bool,
    /// Why (names the recipe, the device and the rule that decided).
    pub reason: String,
}

fn plain_matmul(arch: Arch) -> GemmBackend {
    if arch.0.is_none() {
        GemmBackend::CpuMatmul
    } else {
        GemmBackend::CublasBf16
    }
}

/// The first shape rule of the native kernel that `s` breaks, if any.
fn kernel_misfit(recipe: Recipe, s: GemmShape) -> Option<String> {
    // aten::_scaled_mm_v2 checks mat_a.size(1) % 16 and both mat_b dims % 16 on its storage
    // dtype, i.e. K and N multiples of 16 elements (fp4 packs two per byte: K % 32).
    let k_align = if recipe == Recipe::Nvfp4 { 32 } else { 16 };
    if s.k % k_align != 0 {
        return Some(format!("K={} not a multiple of {k_align} (_scaled_mm_v2)", s.k));
    }
    if s.n % 16 != 0 {
        return Some(format!("N={} not a multiple of 16 (_scaled_mm_v2)", s.n));
    }
    // Blockwise on sm_90: the 1x128 scale of A is M-major with leading dimension M, which
    // cuBLASLt wants 16-byte aligned: M a multiple of 4 (docs/DESIGN.md "GEMM backends").
    if recipe == Recipe::Fp8Block && s.m % 4 != 0 {
        return Some(format!("M={} not a multiple of 4 (cuBLASLt VEC128 scales)", s.m));
    }
    None
}

/// Whether cuBLASLt's 128x128 weight scales (fprop, dgrad) are refused: their leading dimension
/// K/128 must be 16-byte aligned, K a multiple of 512 (measured on the H100 with torch 2.11: K=256
/// is refused with "scale_b must have shape 4 x 2"). deepwell's kernel has no such rule.
fn cublaslt_refuses_tiles(pass: Pass, s: GemmShape) -> bool {
    pass != Pass::Wgrad && s.k % 512 != 0
}

/// Chooses the kernel for one pass of a GEMM site.
///
/// | recipe | pass | sm_90 (Hopper) | sm_100/103, sm_120/121 (Blackwell) | sm_89, older, unvalidated | CPU |
/// |---|---|---|---|---|---|
/// | bf16 | all | `CublasBf16` | `CublasBf16` | `CublasBf16` | `CpuMatmul` |
/// | fp8_block | fprop | `ScaledMmBlockwise { a: 1x128, b: 128x128 }`; K % 512 != 0: `Fp8BlockGemm { b: 128x128 }` | `Emulated` | `Emulated` | `Emulated` |
/// | fp8_block | dgrad | as fprop | `Emulated` | `Emulated` | `Emulated` |
/// | fp8_block | wgrad | `ScaledMmBlockwise { a: 1x128, b: 1x128 }` | `Emulated` | `Emulated` | `Emulated` |
/// | mxfp8 | all | `Emulated` | `ScaledMmMx { block: 1x32 }` | `Emulated` | `Emulated` |
/// | nvfp4 | all | `Emulated` | `ScaledMmMx { block: 1x16 }` | `Emulated` | `Emulated` |
/// | fp8_tensor | all | `ScaledMmTensorwise` | `ScaledMmTensorwise` | sm_89: `ScaledMmTensorwise`, else `Emulated` | `Emulated` |
///
/// Shape rules, checked in this order for a low-precision recipe:
/// 1. `K % block != 0` (32 / 16 / 128): the operands cannot be quantized along K, so the pass runs
///    unquantized (`CublasBf16` / `CpuMatmul`, `emulated = false`). For fprop and dgrad the layer
///    policy has already kept such layers in bf16; wgrad's K is the token count, known per call.
/// 2. A native cell whose kernel rejects the shape becomes `Emulated` (exact, same numerics):
///    `_scaled_mm_v2` needs K and N multiples of 16 (nvfp4: K % 32, two codes per byte), and the
///    sm_90 blockwise mode needs M % 4 (its 1x128 scales are M-major, 16-byte aligned;
///    docs/DESIGN.md "GEMM backends"; deepwell's kernel reads the same scales with TMA, same rule).
/// 3. sm_90 fprop / dgrad with K % 512 != 0, which cuBLASLt refuses (the 128x128 weight scales'
///    leading dimension K/128 must be 16-byte aligned), run on deepwell's kernel (`Fp8BlockGemm`).
///    Where cuBLASLt takes the shape it stays: measured faster than deepwell's kernel on dense
///    GEMMs (benchmarks/bench_gemm.py: 1.10-1.48x on the H100; on the H200, medians of three
///    rounds timed in turn, 1.03-1.12x over deepwell's best tile shape at the ten fprop / dgrad
///    shapes of the training steps, docs/BASELINES.md "deepwell on the H200"); deepwell's kernel serves the
///    shapes cuBLASLt refuses and MoE's grouped GEMMs, which cuBLASLt has no block-scaled form of.
///
/// Why these cells: cuBLASLt allows VEC128 x BLK128x128 and VEC128 x VEC128 but never
/// BLK128x128 x BLK128x128, and wgrad's operands (dy, x) are both 1x128 (cuBLAS docs, "Narrow precision");
/// dgrad reuses the weight's 128x128 tiles, whose transpose is exact (docs/NUMERICS.md "Transposes and layouts").
pub fn gemm_backend(recipe: Recipe, arch: Arch, pass: Pass, shape: GemmShape) -> GemmChoice {
    let Some(block) = recipe.block_k() else {
        let backend = plain_matmul(arch);
        return GemmChoice {
            backend,
            emulated: false,
            reason: format!("bf16 {pass} on {arch}: {}", backend.describe()),
        };
    };
    if shape.k % block != 0 {
        return GemmChoice {
            backend: plain_matmul(arch),
            emulated: false,
            reason: format!("{recipe} {pass}: K={} not divisible by {block}: unquantized bf16 GEMM", shape.k),
        };
    }
    let emulated = |why: String| GemmChoice {
        backend: GemmBackend::Emulated { recipe },
        emulated: true,
        reason: format!("{recipe} {pass} emulated on {arch}: {why}"),
    };
    if !is_native(recipe, arch) {
        return emulated(why_not_native(recipe, arch));
    }
    if let Some(why) = kernel_misfit(recipe, shape) {
        return emulated(why);
    }
    let backend = match (recipe, arch.family(), pass) {
        (Recipe::Fp8Block, ArchFamily::Hopper, Pass::Wgrad) => {
            GemmBackend::ScaledMmBlockwise { a: ScalingType::BlockWise1x128, b: ScalingType::BlockWise1x128 }
        }
        (Recipe::Fp8Block, ArchFamily::Hopper, _) if cublaslt_refuses_tiles(pass, shape) => {
            GemmBackend::Fp8BlockGemm { b: ScalingType::BlockWise128x128 }
        }
        (Recipe::Fp8Block, ArchFamily::Hopper, _) => {
            GemmBackend::ScaledMmBlockwise { a: ScalingType::BlockWise1x128, b: ScalingType::BlockWise128x128 }
        }
        (Recipe::Mxfp8, _, _) => GemmBackend::ScaledMmMx { block: ScalingType::BlockWise1x32 },
        (Recipe::Nvfp4, _, _) => GemmBackend::ScaledMmMx { block: ScalingType::BlockWise1x16 },
        (Recipe::Fp8Tensor, _, _) => GemmBackend::ScaledMmTensorwise,
        // is_native() holds, so no other cell is reachable; emulation is the safe answer.
        _ => return emulated("no native kernel in the table".to_string()),
    };
    GemmChoice { backend, emulated: false, reason: format!("{recipe} {pass} native on {arch}: {}", backend.describe()) }
}
