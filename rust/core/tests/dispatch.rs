//! The GEMM dispatch table (policy/dispatch.rs): every table cell, every arch, and the kernel each
//! pass of a linear layer gets. The per-site precision rules: tests/policy.rs.

use deepwell_core::policy::*;

mod common;
use common::archs::*;

fn aligned(pass: Pass) -> GemmShape {
    GemmShape::linear(pass, 8192, 4096, 14336)
}

#[test]
fn shapes_per_pass() {
    assert_eq!(GemmShape::linear(Pass::Fprop, 8, 3, 5), GemmShape { m: 8, n: 5, k: 3 });
    assert_eq!(GemmShape::linear(Pass::Dgrad, 8, 3, 5), GemmShape { m: 8, n: 3, k: 5 });
    assert_eq!(GemmShape::linear(Pass::Wgrad, 8, 3, 5), GemmShape { m: 5, n: 3, k: 8 });
}

#[test]
fn every_table_cell() {
    use GemmBackend::*;
    use ScalingType::*;
    let blk = |b| ScaledMmBlockwise { a: BlockWise1x128, b };
    let emu = |recipe| Emulated { recipe };
    let gpus = [HOPPER, B200, B300, RTX5090, SPARK, ADA, A100, Arch::sm(7, 5), THOR, Arch::sm(13, 0)];
    for arch in gpus.into_iter().chain([CPU]) {
        let fam = arch.family();
        let blackwell = matches!(fam, ArchFamily::Blackwell | ArchFamily::BlackwellConsumer);
        for pass in Pass::ALL {
            for recipe in Recipe::ALL {
                let want = match recipe {
                    Recipe::Bf16 if arch == CPU => CpuMatmul,
                    Recipe::Bf16 => CublasBf16,
                    Recipe::Fp8Block if fam == ArchFamily::Hopper && pass == Pass::Wgrad => blk(BlockWise1x128),
                    Recipe::Fp8Block if fam == ArchFamily::Hopper => blk(BlockWise128x128),
                    Recipe::Mxfp8 if blackwell => ScaledMmMx { block: BlockWise1x32 },
                    Recipe::Nvfp4 if blackwell => ScaledMmMx { block: BlockWise1x16 },
                    Recipe::Fp8Tensor if blackwell || matches!(fam, ArchFamily::Hopper | ArchFamily::Ada) => {
                        ScaledMmTensorwise
                    }
                    r => emu(r),
                };
                let c = gemm_backend(recipe, arch, pass, aligned(pass));
                assert_eq!(c.backend, want, "{recipe} {pass} on {arch}");
                assert_eq!(c.emulated, matches!(want, Emulated { .. }), "{recipe} {pass} on {arch}");
                assert_eq!(c.emulated, is_emulated(recipe, arch));
                let tag = if c.emulated {
                    "emulated"
                } else if recipe == Recipe::Bf16 {
                    "bf16"
                } else {
                    "native"
                };
                assert!(c.reason.contains(tag), "{}", c.reason);
                assert!(c.reason.contains(&arch.to_string()), "{}", c.reason);
                assert!(!c.backend.describe().is_empty());
            }
        }
    }
}

#[test]
fn describe_lines() {
    use GemmBackend::*;
    use ScalingType::*;
    assert_eq!(CublasBf16.describe(), "bf16 torch.matmul (cuBLAS)");
    assert_eq!(CpuMatmul.describe(), "torch.matmul on CPU");
    assert_eq!(
        ScaledMmBlockwise { a: BlockWise1x128, b: BlockWise128x128 }.describe(),
        "cuBLASLt FP8 blockwise 1x128 x 128x128 (called directly, fp32 scales)"
    );
    assert!(ScaledMmMx { block: BlockWise1x32 }.describe().starts_with("cuBLASLt MXFP8 block-scaled 1x32"));
    assert!(ScaledMmMx { block: BlockWise1x16 }.describe().starts_with("cuBLASLt NVFP4 block-scaled 1x16"));
    assert!(Emulated { recipe: Recipe::Mxfp8 }.describe().starts_with("mxfp8 emulated"));
    // torch.nn.functional.ScalingType's integers.
    let codes: Vec<i64> =
        [BlockWise1x16, BlockWise1x32, BlockWise1x128, BlockWise128x128].iter().map(|s| s.torch_code()).collect();
    assert_eq!(codes, [2, 3, 4, 5]);
}

#[test]
fn k_not_divisible_runs_unquantized() {
    // wgrad's K is the token count.
    let s = GemmShape::linear(Pass::Wgrad, 1000, 4096, 4096);
    let c = gemm_backend(Recipe::Fp8Block, HOPPER, Pass::Wgrad, s);
    assert_eq!((c.backend, c.emulated), (GemmBackend::CublasBf16, false));
    assert_eq!(c.reason, "fp8_block wgrad: K=1000 not divisible by 128: unquantized bf16 GEMM");
    let c = gemm_backend(Recipe::Mxfp8, CPU, Pass::Wgrad, GemmShape::linear(Pass::Wgrad, 48, 64, 64));
    assert_eq!((c.backend, c.emulated), (GemmBackend::CpuMatmul, false));
    // Emulated recipes need whole blocks too.
    let c = gemm_backend(Recipe::Mxfp8, HOPPER, Pass::Fprop, GemmShape { m: 64, n: 64, k: 48 });
    assert_eq!(c.backend, GemmBackend::CublasBf16);
}

#[test]
fn kernel_shape_rules_fall_back_to_emulation() {
    let emu = |r| GemmBackend::Emulated { recipe: r };
    for (r, arch, shape, says) in [
        // sm_90 blockwise: M % 4 (M-major 1x128 scales), N % 16 (_scaled_mm_v2).
        (Recipe::Fp8Block, HOPPER, GemmShape { m: 8190, n: 4096, k: 4096 }, "M=8190 not a multiple of 4"),
        (Recipe::Fp8Block, HOPPER, GemmShape { m: 8192, n: 4100, k: 4096 }, "N=4100 not a multiple of 16"),
        (Recipe::Mxfp8, B200, GemmShape { m: 8192, n: 1000, k: 4096 }, "N=1000 not a multiple of 16"),
        // NVFP4 packs two codes per byte: K % 32 for _scaled_mm_v2's 16-byte check.
        (Recipe::Nvfp4, B200, GemmShape { m: 8192, n: 4096, k: 4112 }, "K=4112 not a multiple of 32"),
    ] {
        let c = gemm_backend(r, arch, Pass::Fprop, shape);
        assert_eq!((c.backend, c.emulated), (emu(r), true), "{r} {shape:?}");
        assert!(c.reason.contains(says), "{}", c.reason);
        assert!(c.reason.contains("emulated on"), "{}", c.reason);
    }
    // Any M works for the MX modes (scales are padded to 128 rows).
    let c = gemm_backend(Recipe::Mxfp8, B200, Pass::Fprop, GemmShape { m: 7, n: 4096, k: 4096 });
    assert!(!c.emulated);
    // M % 4 holds at the boundary; wgrad's 1x128 x 1x128 has no K % 512 rule.
    let c = gemm_backend(Recipe::Fp8Block, HOPPER, Pass::Wgrad, GemmShape { m: 4, n: 16, k: 128 });
    assert!(!c.emulated);
    let c = gemm_backend(Recipe::Fp8Block, HOPPER, Pass::Dgrad, GemmShape { m: 4, n: 16, k: 512 });
    assert!(!c.emulated);
}

#[test]
fn deepwell_gemm_takes_the_tile_shapes_cublaslt_refuses() {
    // cuBLASLt wants the 128x128 weight scales' leading dim K/128 16-byte aligned (K % 512, measured
    // on the H100); deepwell's sm_90a kernel takes any K % 128, fprop and dgrad alike.
    let ours = GemmBackend::Fp8BlockGemm { b: ScalingType::BlockWise128x128 };
    for pass in [Pass::Fprop, Pass::Dgrad] {
        let c = gemm_backend(Recipe::Fp8Block, HOPPER, pass, GemmShape { m: 8192, n: 4096, k: 2816 });
        assert_eq!((c.backend, c.emulated), (ours, false), "{pass}");
        assert!(c.reason.contains("native on sm_90") && c.reason.contains("deepwell FP8 GEMM"), "{}", c.reason);
    }
    let c = gemm_backend(Recipe::Fp8Block, HOPPER, Pass::Fprop, GemmShape { m: 8192, n: 4096, k: 4096 });
    assert!(matches!(c.backend, GemmBackend::ScaledMmBlockwise { .. }), "cuBLASLt where it takes the shape");
    // The fprop / dgrad shapes of the training steps, (M, K, N): cuBLASLt's block mode measured
    // 1.03-1.12x deepwell's kernel at each on the H200 (docs/BASELINES.md "deepwell on the H200").
    for (m, k, n) in [
        (16384, 4096, 4096),
        (16384, 4096, 14336),
        (16384, 14336, 4096),
        (8192, 4096, 14336),
        (8192, 14336, 4096),
        (8192, 2048, 5632),
        (8192, 5632, 2048),
        (8192, 2048, 2048),
        (4096, 7168, 2048),
        (4096, 2048, 7168),
    ] {
        for pass in [Pass::Fprop, Pass::Dgrad] {
            let c = gemm_backend(Recipe::Fp8Block, HOPPER, pass, GemmShape { m, n, k });
            assert!(matches!(c.backend, GemmBackend::ScaledMmBlockwise { .. }), "{m}x{k}x{n} {pass}");
        }
    }
    // Its M-major scales have the same M % 4 rule as cuBLASLt's.
    let c = gemm_backend(Recipe::Fp8Block, HOPPER, Pass::Fprop, GemmShape { m: 8190, n: 4096, k: 384 });
    assert!(c.emulated);
    // sm_90a only.
    let c = gemm_backend(Recipe::Fp8Block, B200, Pass::Fprop, GemmShape { m: 8192, n: 4096, k: 2816 });
    assert!(c.emulated);
}

#[test]
fn every_backend_reason_names_recipe_and_pass() {
    for arch in [HOPPER, B200, ADA, CPU] {
        for recipe in Recipe::ALL {
            for pass in Pass::ALL {
                for shape in [aligned(pass), GemmShape { m: 6, n: 40, k: 96 }, GemmShape { m: 8, n: 16, k: 100 }] {
                    let c = gemm_backend(recipe, arch, pass, shape);
                    assert!(c.reason.contains(recipe.as_str()) && c.reason.contains(pass.as_str()), "{}", c.reason);
                }
            }
        }
    }
}
