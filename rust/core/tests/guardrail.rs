//! The guardrails' fallback rule (policy/guardrail.rs): the saturation threshold and the
//! non-finite checks, with the reasons they give.

use deepwell_core::policy::*;

fn stats(saturated: u64, numel: u64) -> LayerStats {
    LayerStats { saturated, numel, amax_input: 3.5, amax_output: 10.0, ..LayerStats::default() }
}

#[test]
fn guardrail_saturation_threshold() {
    let cfg = GuardrailConfig::default();
    assert_eq!(cfg.saturation_threshold, 1e-3);
    assert_eq!(check(&stats(0, 1_000_000), &cfg), None);
    // Exactly at the threshold: accepted.
    assert_eq!(check(&stats(1_000, 1_000_000), &cfg), None);
    assert_eq!(check(&stats(1, 1_000), &cfg), None);
    // Just above: falls back, naming the counts.
    let f = check(&stats(1_001, 1_000_000), &cfg).expect("above the threshold");
    assert_eq!(f.reason, "guardrail: 1001 of 1000000 elements saturated (0.1001% > 0.1000%): bf16 fallback");
    assert!(check(&stats(2, 1_000), &cfg).is_some());
    // A custom threshold, and nothing counted.
    let strict = GuardrailConfig { saturation_threshold: 0.0 };
    assert!(check(&stats(1, u64::MAX), &strict).is_some());
    assert_eq!(check(&stats(0, 0), &strict), None);
}

#[test]
fn guardrail_non_finite() {
    let cfg = GuardrailConfig::default();
    let s = LayerStats { input_nonfinite: 3, ..stats(0, 4096) };
    assert_eq!(check(&s, &cfg).unwrap().reason, "guardrail: 3 non-finite input values: bf16 fallback");
    let s = LayerStats { output_nonfinite: 1, ..stats(0, 4096) };
    assert_eq!(check(&s, &cfg).unwrap().reason, "guardrail: 1 non-finite output values: bf16 fallback");
    // Everything that trips is named.
    let s = LayerStats { input_nonfinite: 2, output_nonfinite: 5, amax_output: f32::NAN, ..stats(10, 4096) };
    let r = check(&s, &cfg).unwrap().reason;
    for part in ["2 non-finite input", "5 non-finite output", "output amax NaN", "10 of 4096 elements saturated"] {
        assert!(r.contains(part), "{r}");
    }
    // A non-finite amax alone trips it.
    let s = LayerStats { amax_input: f32::INFINITY, ..stats(0, 4096) };
    assert_eq!(check(&s, &cfg).unwrap().reason, "guardrail: input amax inf: bf16 fallback");
    // Every fallback's reason names the rule that made it.
    let f = check(&LayerStats { output_nonfinite: 1, ..stats(0, 1) }, &GuardrailConfig::default());
    assert!(f.unwrap().reason.starts_with("guardrail: "));
}
