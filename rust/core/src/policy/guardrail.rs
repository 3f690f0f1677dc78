//! Guardrails: when a quantized layer's run-time statistics say it should fall back to bf16
//! (docs/DESIGN.md "Precision policy": "a layer that overflows or produces non-finite values falls back
//! to BF16 (and the plan records why)").
//!
//! The counters are collected on the device per layer and step; this module only decides. A layer
//! falls back when any of these holds (all that hold are named in the reason):
//! - its input or its output holds a non-finite value (`*_nonfinite > 0`);
//! - an amax is NaN or ±Inf (a non-finite value the counters missed; amax is NaN-propagating);
//! - the fraction of quantized elements that hit the format's max, `saturated / numel`, is
//!   **strictly above** `saturation_threshold` (exactly at the threshold is accepted).
//!
//! With `numel == 0` the saturated fraction is taken as 0.

/// Guardrail thresholds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardrailConfig {
    /// Largest accepted fraction of elements that hit the format's max (default 1e-3).
    pub saturation_threshold: f64,
}

impl Default for GuardrailConfig {
    fn default() -> Self {
        GuardrailConfig { saturation_threshold: 1e-3 }
    }
}

/// One layer's run-time statistics over the quantized tensors of a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LayerStats {
    /// NaN or ±Inf elements in the layer's input.
    pub input_nonfinite: u64,
    /// NaN or ±Inf elements in the layer's output.
    pub output_nonfinite: u64,
    /// Quantized elements that saturated to the element format's max magnitude.
    pub saturated: u64,
    /// Quantized elements counted.
    pub numel: u64,
    /// amax of the input (NaN-propagating).
    pub amax_input: f32,
    /// amax of the output (NaN-propagating).
    pub amax_output: f32,
}

impl LayerStats {
    /// `saturated / numel`, 0 when nothing was counted.
    pub fn saturated_fraction(&self) -> f64 {
        if self.numel == 0 {
            0.0
        } else {
            self.saturated as f64 / self.numel as f64
        }
    }
}

/// A guardrail's verdict: run this layer in bf16 from now on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    /// Why, naming the counts that tripped.
    pub reason: String,
}

/// Whether `stats` trips a guardrail (rules in the module docs); `None` means keep the recipe.
pub fn check(stats: &LayerStats, cfg: &GuardrailConfig) -> Option<Fallback> {
    let mut why = Vec::new();
    if stats.input_nonfinite > 0 {
        why.push(format!("{} non-finite input values", stats.input_nonfinite));
    }
    if stats.output_nonfinite > 0 {
        why.push(format!("{} non-finite output values", stats.output_nonfinite));
    }
    if !stats.amax_input.is_finite() {
        why.push(format!("input amax {}", stats.amax_input));
    }
    if !stats.amax_output.is_finite() {
        why.push(format!("output amax {}", stats.amax_output));
    }
    let frac = stats.saturated_fraction();
    if frac > cfg.saturation_threshold {
        why.push(format!(
            "{} of {} elements saturated ({:.4}% > {:.4}%)",
            stats.saturated,
            stats.numel,
            frac * 100.0,
            cfg.saturation_threshold * 100.0
        ));
    }
    if why.is_empty() {
        return None;
    }
    Some(Fallback { reason: format!("guardrail: {}: bf16 fallback", why.join(", ")) })
}
