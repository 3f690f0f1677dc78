//! The precision policy (policy/*.rs): every rule, every arch. The GEMM dispatch table:
//! tests/dispatch.rs; the guardrails' thresholds: tests/guardrail.rs.

use deepwell_core::policy::*;
use deepwell_core::CoreError;

mod common;
use common::archs::*;

/// A mid-model MLP site of a 24-site model, 4096 -> 14336.
fn mlp() -> LayerInfo {
    site("layers.3.mlp.up_proj", "Linear", Role::Mlp, 7, 24, 4096, 14336)
}

fn site(name: &str, ty: &str, role: Role, index: usize, count: usize, i: usize, o: usize) -> LayerInfo {
    LayerInfo {
        name: name.to_string(),
        module_type: ty.to_string(),
        role,
        index,
        count,
        in_features: i,
        out_features: o,
    }
}

fn fixed(r: Recipe) -> Policy {
    Policy { precision: Precision::Fixed(r), ..Policy::default() }
}

// ---------------------------------------------------------------- recipes, arch, auto

#[test]
fn policy_defaults() {
    let p = Policy::default();
    assert_eq!(p.precision, Precision::Auto);
    assert!(p.first_last_bf16);
    assert_eq!(p.min_features, 512);
    assert!(p.name_overrides.is_empty() && p.type_overrides.is_empty());
}

#[test]
fn native_recipes_per_arch() {
    use Recipe::*;
    let table: [(Arch, &[Recipe]); 13] = [
        (HOPPER, &[Fp8Block, Fp8Tensor, Bf16]),
        (B200, &[Mxfp8, Nvfp4, Fp8Tensor, Bf16]),
        (B300, &[Mxfp8, Nvfp4, Fp8Tensor, Bf16]),
        (RTX5090, &[Mxfp8, Nvfp4, Fp8Tensor, Bf16]),
        (SPARK, &[Mxfp8, Nvfp4, Fp8Tensor, Bf16]),
        (ADA, &[Fp8Tensor, Bf16]),
        (A100, &[Bf16]),
        (Arch::sm(8, 6), &[Bf16]),
        (Arch::sm(7, 0), &[Bf16]),
        (THOR, &[Bf16]),
        (Arch::sm(10, 1), &[Bf16]),
        (Arch::sm(13, 0), &[Bf16]),
        (CPU, &[]),
    ];
    for (arch, want) in table {
        assert_eq!(native_recipes(arch), want, "{arch}");
        for r in Recipe::ALL {
            assert_eq!(is_native(r, arch), want.contains(&r), "{r} on {arch}");
            assert_eq!(is_emulated(r, arch), r != Bf16 && !want.contains(&r), "{r} on {arch}");
            assert_eq!(why_not_native(r, arch).is_empty(), !is_emulated(r, arch), "{r} on {arch}");
        }
    }
}

#[test]
fn auto_on_each_arch() {
    for (arch, want, says) in [
        (B200, Recipe::Mxfp8, "fastest native recipe on sm_100 (datacenter Blackwell)"),
        (B300, Recipe::Mxfp8, "sm_103"),
        (RTX5090, Recipe::Mxfp8, "sm_120 (consumer Blackwell)"),
        (SPARK, Recipe::Mxfp8, "sm_121"),
        (HOPPER, Recipe::Fp8Block, "fp8_block is the fastest native recipe on sm_90 (Hopper)"),
        (ADA, Recipe::Bf16, "sm_89 (Ada) has no native block-scaled recipe"),
        (A100, Recipe::Bf16, "sm_80 (pre-Ada GPU)"),
        (THOR, Recipe::Bf16, "sm_110 (unvalidated GPU)"),
        (CPU, Recipe::Bf16, "cpu (CPU) has no native"),
    ] {
        let (r, reason) = auto_recipe(arch);
        assert_eq!(r, want, "{arch}");
        assert!(reason.starts_with("auto: "), "{reason}");
        assert!(reason.contains(says), "{arch}: {reason}");
        // The same through the policy, on a site no other rule touches.
        let d = decide(&Policy::default(), &mlp(), arch);
        assert_eq!((d.recipe, d.emulated, d.rule), (want, false, Rule::Precision), "{arch}");
        assert!(d.reason.starts_with(&reason), "{arch}: {}", d.reason);
    }
}

#[test]
fn parse_errors_are_core_errors() {
    assert!(matches!("e4m3".parse::<Recipe>(), Err(CoreError::UnknownMode { what: "recipe", .. })));
    assert_eq!("wgrad".parse::<Pass>(), Ok(Pass::Wgrad));
    assert!("bwd".parse::<Pass>().is_err());
    assert_eq!("lm_head".parse::<Role>(), Ok(Role::LmHead));
    for r in Role::ALL {
        assert_eq!(r.as_str().parse::<Role>(), Ok(r));
    }
    assert!("head".parse::<Role>().is_err());
    assert_eq!("sm_90a".parse::<Arch>(), Ok(HOPPER));
}

// ---------------------------------------------------------------- default rules

#[test]
fn roles_kept_in_bf16() {
    for (role, says) in [
        (Role::Embedding, "embeddings stay bf16 by policy"),
        (Role::Norm, "norms stay bf16 by policy"),
        (Role::Router, "router gates stay bf16 by policy"),
        (Role::LmHead, "LM head (logits) stays bf16 by policy"),
    ] {
        for arch in [HOPPER, B200, CPU] {
            let d = decide(&fixed(Recipe::Mxfp8), &site("x", "Linear", role, 5, 24, 4096, 4096), arch);
            assert_eq!((d.recipe, d.emulated, d.rule), (Recipe::Bf16, false, Rule::Role));
            assert_eq!(d.reason, says);
        }
    }
    for role in [Role::Attention, Role::Mlp, Role::Experts, Role::Other] {
        let d = decide(&fixed(Recipe::Mxfp8), &site("x", "Linear", role, 5, 24, 4096, 4096), B200);
        assert_eq!((d.recipe, d.rule), (Recipe::Mxfp8, Rule::Precision), "{role:?}");
    }
}

#[test]
fn first_and_last_sites() {
    let p = fixed(Recipe::Fp8Block);
    let at = |i, n| decide(&p, &site("x", "Linear", Role::Attention, i, n, 4096, 4096), HOPPER);
    let d = at(0, 24);
    assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::FirstLast));
    assert_eq!(d.reason, "first GEMM site (1 of 24): bf16 by policy (first_last_bf16)");
    let d = at(23, 24);
    assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::FirstLast));
    assert_eq!(d.reason, "last GEMM site (24 of 24): bf16 by policy (first_last_bf16)");
    let d = at(0, 1);
    assert!(d.reason.starts_with("first and last GEMM site (1 of 1)"), "{}", d.reason);
    for i in [1, 12, 22] {
        assert_eq!(at(i, 24).recipe, Recipe::Fp8Block, "site {i}");
    }
    // count 0 = unknown position: no first/last rule.
    assert_eq!(at(0, 0).recipe, Recipe::Fp8Block);
    // Switched off.
    let off = Policy { first_last_bf16: false, ..p.clone() };
    let d = decide(&off, &site("x", "Linear", Role::Mlp, 0, 24, 4096, 4096), HOPPER);
    assert_eq!((d.recipe, d.rule), (Recipe::Fp8Block, Rule::Precision));
    // Role comes before position.
    let d = decide(&p, &site("lm_head", "Linear", Role::LmHead, 23, 24, 4096, 4096), HOPPER);
    assert_eq!(d.rule, Rule::Role);
}

#[test]
fn divisibility_guard() {
    for (r, block, arch) in [(Recipe::Mxfp8, 32, B200), (Recipe::Nvfp4, 16, B200), (Recipe::Fp8Block, 128, HOPPER)] {
        let d = decide(&fixed(r), &site("x", "Linear", Role::Mlp, 3, 9, 100 * 64 + 4, 4096), arch);
        assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::BlockDivisibility), "{r}");
        assert_eq!(d.reason, format!("K=6404 not divisible by {block} ({r} block): bf16"));
        // out_features is dgrad's K.
        let d = decide(&fixed(r), &site("x", "Linear", Role::Mlp, 3, 9, 4096, 4100), arch);
        assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::BlockDivisibility), "{r}");
        assert!(d.reason.starts_with("out_features=4100 (dgrad's K) not divisible"), "{}", d.reason);
    }
    // The brief's example, with min_features off so only divisibility can fire.
    let p = Policy { min_features: 0, ..fixed(Recipe::Mxfp8) };
    let d = decide(&p, &site("x", "Linear", Role::Mlp, 3, 9, 100, 64), B200);
    assert_eq!(d.reason, "K=100 not divisible by 32 (mxfp8 block): bf16");
    // 1x16 fits where 1x32 does not.
    let d = decide(&fixed(Recipe::Nvfp4), &site("x", "Linear", Role::Mlp, 3, 9, 4112, 4096), B200);
    assert_eq!(d.recipe, Recipe::Nvfp4);
    // bf16 has no blocks: the guard never fires.
    let d = decide(&fixed(Recipe::Bf16), &site("x", "Linear", Role::Mlp, 3, 9, 100, 100), B200);
    assert_eq!((d.recipe, d.rule, d.reason.as_str()), (Recipe::Bf16, Rule::Precision, "policy precision bf16"));
}

#[test]
fn min_features_guard() {
    let p = fixed(Recipe::Mxfp8);
    let d = decide(&p, &site("x", "Linear", Role::Mlp, 3, 9, 256, 4096), B200);
    assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::MinFeatures));
    assert_eq!(d.reason, "in_features=256 < min_features=512: too small to gain: bf16");
    let d = decide(&p, &site("x", "Linear", Role::Mlp, 3, 9, 4096, 480), B200);
    assert_eq!(d.reason, "out_features=480 < min_features=512: too small to gain: bf16");
    // Exactly at the minimum is large enough.
    assert_eq!(decide(&p, &site("x", "Linear", Role::Mlp, 3, 9, 512, 512), B200).recipe, Recipe::Mxfp8);
    // 0 disables the guard.
    let p0 = Policy { min_features: 0, ..p };
    assert_eq!(decide(&p0, &site("x", "Linear", Role::Mlp, 3, 9, 32, 32), B200).recipe, Recipe::Mxfp8);
}

#[test]
fn divisibility_is_checked_before_size() {
    let d = decide(&fixed(Recipe::Mxfp8), &site("x", "Linear", Role::Mlp, 3, 9, 100, 100), B200);
    assert_eq!(d.rule, Rule::BlockDivisibility);
}

#[test]
fn emulated_flags_and_reasons() {
    for (r, arch, emulated, says) in [
        (Recipe::Mxfp8, B200, false, "policy precision mxfp8; native on sm_100"),
        (Recipe::Nvfp4, SPARK, false, "native on sm_121"),
        (Recipe::Fp8Block, HOPPER, false, "native on sm_90"),
        (Recipe::Mxfp8, HOPPER, true, "emulated on this device (sm_90: cuBLASLt VEC32_UE8M0 (MXFP8) needs CC 10.0+)"),
        (Recipe::Nvfp4, HOPPER, true, "VEC16_UE4M3 (NVFP4) needs CC 10.0+"),
        (Recipe::Fp8Block, B200, true, "blockwise 1x128/128x128 scaling is sm_90 only"),
        (Recipe::Fp8Block, ADA, true, "needs CC 9.0"),
        (Recipe::Mxfp8, A100, true, "emulated on this device"),
        (Recipe::Mxfp8, THOR, true, "sm_110 is not in deepwell's validated table"),
        (Recipe::Nvfp4, CPU, true, "the CPU has no low-precision GEMM (reference path)"),
        (Recipe::Bf16, CPU, false, "policy precision bf16"),
    ] {
        let d = decide(&fixed(r), &mlp(), arch);
        assert_eq!((d.recipe, d.emulated), (r, emulated), "{r} on {arch}");
        assert!(d.reason.contains(says), "{r} on {arch}: {}", d.reason);
        assert_eq!(d.reason.contains("emulated"), emulated, "{}", d.reason);
    }
}

// ---------------------------------------------------------------- overrides

#[test]
fn name_override_by_glob() {
    let p = Policy {
        name_overrides: vec![
            ("layers.*.mlp.*".to_string(), Recipe::Nvfp4),
            ("layers.3.*".to_string(), Recipe::Fp8Block),
        ],
        ..fixed(Recipe::Mxfp8)
    };
    // First matching glob wins, even though the second matches too.
    let d = decide(&p, &mlp(), B200);
    assert_eq!((d.recipe, d.rule, d.emulated), (Recipe::Nvfp4, Rule::NameOverride, false));
    assert_eq!(d.reason, "name override \"layers.*.mlp.*\" -> nvfp4; native on sm_100");
    let attn = site("layers.3.attn.q_proj", "Linear", Role::Attention, 4, 24, 4096, 4096);
    let d = decide(&p, &attn, B200);
    assert_eq!((d.recipe, d.emulated), (Recipe::Fp8Block, true));
    assert!(d.reason.starts_with("name override \"layers.3.*\" -> fp8_block; emulated"), "{}", d.reason);
    // No match: defaults.
    let other = site("layers.4.attn.q_proj", "Linear", Role::Attention, 5, 24, 4096, 4096);
    assert_eq!(decide(&p, &other, B200).rule, Rule::Precision);
    // `?` and literal names.
    let p = Policy { name_overrides: vec![("layers.?.attn.q_proj".to_string(), Recipe::Bf16)], ..fixed(Recipe::Mxfp8) };
    let d = decide(&p, &attn, B200);
    assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::NameOverride));
    assert_eq!(d.reason, "name override \"layers.?.attn.q_proj\" -> bf16");
    let wide = site("layers.13.attn.q_proj", "Linear", Role::Attention, 5, 24, 4096, 4096);
    assert_eq!(decide(&p, &wide, B200).recipe, Recipe::Mxfp8);
}

#[test]
fn type_override() {
    let p = Policy {
        type_overrides: vec![("Conv1D".to_string(), Recipe::Mxfp8), ("GroupedExperts".to_string(), Recipe::Nvfp4)],
        ..fixed(Recipe::Fp8Block)
    };
    let d = decide(&p, &site("h.3.mlp.c_fc", "Conv1D", Role::Mlp, 7, 24, 768, 3072), HOPPER);
    assert_eq!((d.recipe, d.rule, d.emulated), (Recipe::Mxfp8, Rule::TypeOverride, true));
    assert!(d.reason.starts_with("type override \"Conv1D\" -> mxfp8; emulated on this device"), "{}", d.reason);
    let d = decide(&p, &site("layers.1.moe.experts", "GroupedExperts", Role::Experts, 3, 24, 2048, 1408), B200);
    assert_eq!((d.recipe, d.rule), (Recipe::Nvfp4, Rule::TypeOverride));
    // Exact, case-sensitive type names.
    let d = decide(&p, &site("x", "conv1d", Role::Mlp, 7, 24, 768, 3072), HOPPER);
    assert_eq!((d.recipe, d.rule), (Recipe::Fp8Block, Rule::Precision));
}

#[test]
fn precedence() {
    let p = Policy {
        name_overrides: vec![("lm_head".to_string(), Recipe::Mxfp8), ("layers.0.*".to_string(), Recipe::Mxfp8)],
        type_overrides: vec![("Linear".to_string(), Recipe::Nvfp4)],
        ..fixed(Recipe::Fp8Block)
    };
    // Name beats type.
    let head = site("lm_head", "Linear", Role::LmHead, 23, 24, 4096, 128_256);
    let d = decide(&p, &head, B200);
    assert_eq!((d.recipe, d.rule), (Recipe::Mxfp8, Rule::NameOverride), "{}", d.reason);
    // A name override beats the first-site rule.
    let first = site("layers.0.attn.q_proj", "Linear", Role::Attention, 0, 24, 4096, 4096);
    assert_eq!(decide(&p, &first, B200).rule, Rule::NameOverride);
    // The type override beats roles, position and min_features.
    let router = site("layers.1.moe.gate", "Linear", Role::Router, 0, 24, 4096, 64);
    let d = decide(&p, &router, B200);
    assert_eq!((d.recipe, d.rule), (Recipe::Nvfp4, Rule::TypeOverride), "{}", d.reason);
    // Roles beat first/last, and first/last beats the guards.
    let p2 = fixed(Recipe::Mxfp8);
    let norm = site("norm", "RMSNorm", Role::Norm, 0, 24, 100, 100);
    assert_eq!(decide(&p2, &norm, B200).rule, Rule::Role);
    let first_small = site("x", "Linear", Role::Mlp, 0, 24, 100, 100);
    assert_eq!(decide(&p2, &first_small, B200).rule, Rule::FirstLast);
}

#[test]
fn override_respects_block_divisibility() {
    let p = Policy {
        name_overrides: vec![("*.odd".to_string(), Recipe::Fp8Block)],
        type_overrides: vec![("Odd".to_string(), Recipe::Mxfp8)],
        ..Policy::default()
    };
    let d = decide(&p, &site("layers.2.odd", "Linear", Role::Mlp, 5, 24, 4160, 4096), HOPPER);
    assert_eq!((d.recipe, d.emulated, d.rule), (Recipe::Bf16, false, Rule::BlockDivisibility));
    assert_eq!(
        d.reason,
        "name override \"*.odd\" -> fp8_block, but K=4160 not divisible by 128 (fp8_block block): bf16"
    );
    let d = decide(&p, &site("x", "Odd", Role::Mlp, 5, 24, 4096, 1000), B200);
    assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::BlockDivisibility));
    assert!(d.reason.starts_with("type override \"Odd\" -> mxfp8, but out_features=1000"), "{}", d.reason);
    // An override to bf16 always applies.
    let p = Policy { name_overrides: vec![("*".to_string(), Recipe::Bf16)], ..Policy::default() };
    let d = decide(&p, &site("x", "Linear", Role::Mlp, 5, 24, 100, 100), HOPPER);
    assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::NameOverride));
}

// ---------------------------------------------------------------- MoE experts under auto (rule 9)

#[test]
fn auto_keeps_bf16_experts_where_fp8_is_predicted_slower() {
    // bench_moe's layers (8192 tokens) on sm_90: fp8_block measured 1.12x bf16 at Mixtral shapes,
    // 0.85x at E64, 0.69x at E128 (benchmarks/results/bench_moe-NVIDIA_H200-2026-11-26.log).
    let expert = |d: usize, f: usize| site("moe.experts.gate_up_proj", "DeepwellMoE", Role::Experts, 1, 3, d, 2 * f);
    let auto = Policy::default();
    let mixtral = decide_experts(&auto, &expert(4096, 14336), HOPPER, 8, Some(8192 * 2));
    assert_eq!((mixtral.recipe, mixtral.rule), (Recipe::Fp8Block, Rule::Precision));
    for (d, f, e) in [(2048, 1408, 64), (2048, 768, 128)] {
        let fine = decide_experts(&auto, &expert(d, f), HOPPER, e, Some(8192 * 8));
        assert_eq!((fine.recipe, fine.rule), (Recipe::Bf16, Rule::ExpertTokens), "E{e}");
        assert!(fine.reason.starts_with("auto: fp8_block predicted"), "{}", fine.reason);
        // A recipe the user names is kept, and so is the policy's decision without a token count.
        let forced = decide_experts(&fixed(Recipe::Fp8Block), &expert(d, f), HOPPER, e, Some(8192 * 8));
        assert_eq!(forced.recipe, Recipe::Fp8Block);
        assert_eq!(decide_experts(&auto, &expert(d, f), HOPPER, e, None), decide(&auto, &expert(d, f), HOPPER));
    }
    // Where auto already says bf16 (the CPU), nothing is priced.
    assert_eq!(decide_experts(&auto, &expert(2048, 1408), CPU, 64, Some(65536)).rule, Rule::Precision);
}

// ---------------------------------------------------------------- dense sites under auto (rule 10)

#[test]
fn auto_keeps_bf16_dense_sites_where_fp8_is_predicted_slower() {
    let auto = Policy::default();
    let at = |i: usize, o: usize| site("layers.1.self_attn.k_proj", "Linear", Role::Attention, 5, 21, i, o);
    // The d=1024 Mixtral-style model of bench_moe (16k rows a step): its attention projections.
    for (i, o) in [(1024, 512), (1024, 1024)] {
        let d = decide_dense(&auto, &at(i, o), HOPPER, Some(16384));
        assert_eq!((d.recipe, d.rule), (Recipe::Bf16, Rule::DenseTokens), "{i}x{o}: {}", d.reason);
        assert!(d.reason.starts_with("auto: fp8_block predicted") && d.reason.contains("16384 rows"), "{}", d.reason);
        // The user's fixed recipe stands; without the rows, rules 1-8 alone decide.
        assert_eq!(decide_dense(&fixed(Recipe::Fp8Block), &at(i, o), HOPPER, Some(16384)).recipe, Recipe::Fp8Block);
        assert_eq!(decide_dense(&auto, &at(i, o), HOPPER, None), decide(&auto, &at(i, o), HOPPER));
    }
    // bench_train_step's LLaMA shapes (0.95B: d=2048, SwiGLU 5632; 8B: d=4096, 14336) at 8192 rows
    // keep fp8_block: the plans their measurements were taken with.
    for (i, o) in [(2048, 2048), (2048, 5632), (5632, 2048), (4096, 4096), (4096, 14336), (14336, 4096)] {
        let d = decide_dense(&auto, &at(i, o), HOPPER, Some(8192));
        assert_eq!((d.recipe, d.rule), (Recipe::Fp8Block, Rule::Precision), "{i}x{o}: {}", d.reason);
    }
    // The rule is the cost model's verdict, nothing else: over a grid of shapes and row counts,
    // FP8 is kept exactly where `step_ms` predicts it faster.
    for tokens in [128, 1024, 4096, 16384, 65536] {
        for i in [512, 1024, 2048, 4096] {
            for o in [512, 1024, 4096, 14336] {
                let d = decide_dense(&auto, &at(i, o), HOPPER, Some(tokens));
                let site = cost::SiteCost { tokens, in_features: i, out_features: o, recipe: Recipe::Fp8Block };
                let (ms, bf16_ms) = cost::step_ms(&[site], HOPPER);
                assert_eq!(d.recipe == Recipe::Fp8Block, ms < bf16_ms, "{tokens} rows, {i}x{o}: {}", d.reason);
            }
        }
    }
    // Where auto already says bf16 (the CPU), nothing is priced.
    assert_eq!(decide_dense(&auto, &at(1024, 512), CPU, Some(16384)).rule, Rule::Precision);
}

// ---------------------------------------------------------------- every reason names its rule

#[test]
fn every_reason_names_its_rule() {
    let marker = |rule: Rule| match rule {
        Rule::NameOverride => "name override",
        Rule::TypeOverride => "type override",
        Rule::Role => "by policy",
        Rule::FirstLast => "GEMM site",
        Rule::Precision => "precision",
        Rule::BlockDivisibility => "not divisible by",
        Rule::MinFeatures => "too small to gain",
        Rule::ExpertTokens => "too few to gain",
        Rule::DenseTokens => "rows: too small to gain",
    };
    let policies = [
        Policy::default(),
        Policy { precision: Precision::Auto, min_features: 0, ..Policy::default() },
        fixed(Recipe::Mxfp8),
        fixed(Recipe::Nvfp4),
        fixed(Recipe::Fp8Block),
        fixed(Recipe::Bf16),
        Policy {
            name_overrides: vec![("*.q_proj".to_string(), Recipe::Fp8Block)],
            type_overrides: vec![("Conv1D".to_string(), Recipe::Nvfp4)],
            ..fixed(Recipe::Mxfp8)
        },
    ];
    let mut seen = std::collections::HashSet::new();
    let dims = [(4096, 4096), (100, 4096), (4096, 100), (256, 4096), (4160, 4096)];
    for policy in &policies {
        for arch in [HOPPER, B200, RTX5090, ADA, THOR, CPU] {
            for role in Role::ALL {
                for (index, count) in [(0, 24), (5, 24), (23, 24)] {
                    for (i, o) in dims {
                        for (name, ty) in [("layers.1.attn.q_proj", "Linear"), ("h.1.mlp", "Conv1D")] {
                            let layer = site(name, ty, role, index, count, i, o);
                            let d = decide(policy, &layer, arch);
                            assert!(!d.reason.is_empty());
                            // Auto's reason names the precision rule as "auto: ...".
                            let names = d.reason.contains(marker(d.rule))
                                || (d.rule == Rule::Precision && d.reason.starts_with("auto: "));
                            assert!(names, "{:?}: {}", d.rule, d.reason);
                            assert_eq!(d.reason.contains("emulated"), d.emulated, "{}", d.reason);
                            seen.insert(d.rule);
                        }
                    }
                }
            }
        }
    }
    assert_eq!(seen.len(), 7, "every rule of `decide` fired: {seen:?}");
    let fine = site("moe.experts.gate_up_proj", "DeepwellMoE", Role::Experts, 1, 3, 2048, 2816);
    let d = decide_experts(&Policy::default(), &fine, HOPPER, 64, Some(65536));
    assert!(d.rule == Rule::ExpertTokens && d.reason.contains(marker(d.rule)), "{}", d.reason);
    let small = site("layers.1.self_attn.k_proj", "Linear", Role::Attention, 5, 21, 1024, 512);
    let d = decide_dense(&Policy::default(), &small, HOPPER, Some(16384));
    assert!(d.rule == Rule::DenseTokens && d.reason.contains(marker(d.rule)), "{}", d.reason);
}
