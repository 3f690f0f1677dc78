//! The MoE router's maths, CPU reference.
//!
//! For T tokens and E experts, from router logits `l` (T, E):
//! 1. scores `s` = softmax(l) over E, or sigmoid(l), in fp32;
//! 2. selection scores `c` = s + expert bias (aux-loss-free balancing, arXiv:2408.15664: the bias
//!    changes which experts are chosen, never the weights);
//! 3. group-limited routing (DeepSeek-V3): the E experts form G groups of E/G; a group's score is
//!    the sum of its top-2 selection scores; only the best `groups_kept` groups stay, the others are
//!    masked to -inf (upstream DeepSeek; Hugging Face's 0.0 mask lets a negative bias pick a masked
//!    expert, huggingface/transformers#45440);
//! 4. top-K of `c` per token, ties broken by (score descending, expert index ascending) — the
//!    order torch.topk and Transformer Engine's fused router use — so routing is deterministic;
//! 5. weights `w` = the chosen experts' `s`; renormalised to sum 1 (w / (Σw + 1e-20)) when asked, then
//!    multiplied by `scale`;
//! 6. capacity: with a capacity factor cf, each expert keeps at most C = ceil(T·K/E · cf) (token,
//!    slot) assignments, the earliest in flat order t·K + k ("position" dropping, Switch/GShard);
//!    a dropped assignment has weight 0 and the others are not renormalised (Megatron). None:
//!    dropless;
//! 7. losses returned for the caller to add: the Switch load-balancing loss E · Σ_e f_e · P_e with
//!    f_e = (tokens routed to e by a plain top-K of the scores) / (T·K) and P_e = mean_t p_{t,e},
//!    p the scores normalised over E (Megatron's `switch_load_balancing_loss_func`; multiply by the
//!    coefficient yourself), and the router z-loss mean_t (logsumexp_e l_{t,e})² (ST-MoE,
//!    arXiv:2202.08906).

use std::cmp::Ordering;

use crate::math::exp_f32;

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFn {
    Softmax,
    Sigmoid,
}

/// Group-limited routing: `groups` groups of E/groups experts, the best `kept` of them eligible.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    pub groups: usize,
    pub kept: usize,
}

/// The router's configuration (the knobs of Mixtral, Qwen-MoE, DeepSeek-V3 and torchtitan).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    pub experts: usize,
    pub top_k: usize,
    pub score: ScoreFn,
    /// Renormalise the K chosen weights to sum 1.
    pub renormalize: bool,
    /// Multiplies the final weights (DeepSeek-V3's routed_scaling_factor).
    pub scale: f32,
    pub groups: Option<Groups>,
    /// Capacity factor; None routes every token (dropless).
    pub capacity_factor: Option<f32>,
}

/// What the router decides for T tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// K: assignments per token.
    pub top_k: usize,
    /// (T, K) chosen experts, per token in score order (best first).
    pub experts: Vec<usize>,
    /// (T, K) weights; 0 for an assignment dropped by capacity.
    pub weights: Vec<f32>,
    /// (T, K) whether the assignment was dropped by capacity.
    pub dropped: Vec<bool>,
    /// Kept assignments per expert (E).
    pub counts: Vec<usize>,
    /// Tokens per expert under a plain top-K of the scores (no bias, groups or capacity): the f_e of
    /// the Switch load-balancing loss (Megatron's `compute_routing_scores_for_aux_loss`).
    pub lb_counts: Vec<usize>,
    /// The Switch load-balancing loss (unweighted) and the router z-loss.
    pub aux_loss: f32,
    pub z_loss: f32,
}

/// A configuration the router cannot run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("router: {0}")]
pub struct RouterError(pub String);

impl RouterConfig {
    fn check(&self, logits: usize) -> Result<usize, RouterError> {
        let e = self.experts;
        let fail = |m: String| Err(RouterError(m));
        if e == 0 || self.top_k == 0 || self.top_k > e {
            return fail(format!("top_k must be in 1..={e} (experts), got {}", self.top_k));
        }
        if logits % e != 0 {
            return fail(format!("{logits} logits are not a whole number of rows of {e} experts"));
        }
        if let Some(g) = self.groups {
            if g.groups == 0 || e % g.groups != 0 || e / g.groups < 2 {
                return fail(format!("{e} experts do not split into {} groups of at least 2", g.groups));
            }
            if g.kept == 0 || g.kept > g.groups || g.kept * (e / g.groups) < self.top_k {
                return fail(format!(
                    "keeping {} of {} groups leaves fewer than top_k={} experts",
                    g.kept, g.groups, self.top_k
                ));
            }
        }
        if self.capacity_factor.is_some_and(|cf| !(cf > 0.0 && cf.is_finite())) {
            return fail(format!("capacity_factor must be a positive number, got {:?}", self.capacity_factor));
        }
        Ok(logits / e)
    }
}

fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = row.iter().map(|&v| exp_f32(v - max)).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|&v| v / sum).collect()
}

fn logsumexp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + row.iter().map(|&v| (v - max).exp()).sum::<f32>().ln()
}

/// Indices of the `k` largest values, by (value descending, index ascending); NaN sorts last.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| {
        let (va, vb) = (values[a], values[b]);
        va.is_nan().cmp(&vb.is_nan()).then_with(|| vb.partial_cmp(&va).unwrap_or(Ordering::Equal)).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

fn scores(row: &[f32], f: ScoreFn) -> Vec<f32> {
    match f {
        ScoreFn::Softmax => softmax(row),
        ScoreFn::Sigmoid => row.iter().map(|&v| 1.0 / (1.0 + exp_f32(-v))).collect(),
    }
}

/// The per-expert capacity C = ceil(T·K/E · cf) of `tokens` tokens, None when dropless.
pub fn capacity(tokens: usize, cfg: &RouterConfig) -> Option<usize> {
    cfg.capacity_factor.map(|cf| ((tokens * cfg.top_k) as f64 / cfg.experts as f64 * cf as f64).ceil() as usize)
}

/// "Position" dropping: walks the assignments in flat order t·K + k and drops those that find
/// their expert already holding `capacity` of them; (dropped per assignment, kept per expert).
pub fn apply_capacity(experts: &[usize], num_experts: usize, capacity: Option<usize>) -> (Vec<bool>, Vec<usize>) {
    let mut counts = vec![0usize; num_experts];
    let mut dropped = vec![false; experts.len()];
    for (slot, &x) in experts.iter().enumerate() {
        if capacity.is_some_and(|c| counts[x] >= c) {
            dropped[slot] = true;
        } else {
            counts[x] += 1;
        }
    }
    (dropped, counts)
}

/// Routes T tokens: `logits` is (T, E) row-major, `bias` (E) the aux-loss-free expert bias.
pub fn route(logits: &[f32], bias: Option<&[f32]>, cfg: &RouterConfig) -> Result<Routing, RouterError> {
    let t = cfg.check(logits.len())?;
    let (e, k) = (cfg.experts, cfg.top_k);
    if bias.is_some_and(|b| b.len() != e) {
        return Err(RouterError(format!("the expert bias must have {e} entries")));
    }
    let mut experts = Vec::with_capacity(t * k);
    let mut weights = Vec::with_capacity(t * k);
    let (mut plain_counts, mut mean_p, mut z) = (vec![0usize; e], vec![0f32; e], 0f32);
    for row in logits.chunks(e) {
        let s = scores(row, cfg.score);
        let mut choice: Vec<f32> = match bias {
            Some(b) => s.iter().zip(b).map(|(v, b)| v + b).collect(),
            None => s.clone(),
        };
        if let Some(g) = cfg.groups {
            let size = e / g.groups;
            let group_score: Vec<f32> =
                choice.chunks(size).map(|grp| top_k(grp, 2).iter().map(|&i| grp[i]).sum()).collect();
            let kept = top_k(&group_score, g.kept);
            for (gi, grp) in choice.chunks_mut(size).enumerate() {
                if !kept.contains(&gi) {
                    grp.fill(f32::NEG_INFINITY);
                }
            }
        }
        let chosen = top_k(&choice, k);
        let mut w: Vec<f32> = chosen.iter().map(|&i| s[i]).collect();
        if cfg.renormalize {
            let sum: f32 = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|v| *v /= sum);
        }
        w.iter_mut().for_each(|v| *v *= cfg.scale);
        experts.extend_from_slice(&chosen);
        weights.extend_from_slice(&w);
        // The aux loss sees the scores normalised over all experts and a plain top-K of them.
        let sum: f32 = s.iter().sum();
        s.iter().enumerate().for_each(|(i, v)| mean_p[i] += v / sum / t as f32);
        top_k(&s, k).iter().for_each(|&i| plain_counts[i] += 1);
        z += logsumexp(row).powi(2) / t as f32;
    }
    let (dropped, counts) = apply_capacity(&experts, e, capacity(t, cfg));
    for (w, &d) in weights.iter_mut().zip(&dropped) {
        if d {
            *w = 0.0;
        }
    }
    let aux_loss =
        e as f32 * plain_counts.iter().zip(&mean_p).map(|(&c, &p)| c as f32 / (t * k) as f32 * p).sum::<f32>();
    Ok(Routing { top_k: k, experts, weights, dropped, counts, lb_counts: plain_counts, aux_loss, z_loss: z })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(experts: usize, top_k: usize) -> RouterConfig {
        RouterConfig {
            experts,
            top_k,
            score: ScoreFn::Softmax,
            renormalize: true,
            scale: 1.0,
            groups: None,
            capacity_factor: None,
        }
    }

    #[test]
    fn mixtral_style_top2_renormalised() {
        let logits = [1.0, 3.0, 2.0, 0.0];
        let r = route(&logits, None, &cfg(4, 2)).unwrap();
        assert_eq!(r.experts, vec![1, 2]);
        // softmax then renormalise over the two chosen: e^3 / (e^3 + e^2).
        let w1 = (3f32.exp()) / (3f32.exp() + 2f32.exp());
        assert!((r.weights[0] - w1).abs() < 1e-6 && (r.weights[0] + r.weights[1] - 1.0).abs() < 1e-6);
        assert_eq!(r.counts, vec![0, 1, 1, 0]);
    }

    #[test]
    fn ties_go_to_the_lower_expert_index() {
        let r = route(&[0.5, 0.5, 0.5, 0.5], None, &cfg(4, 2)).unwrap();
        assert_eq!(r.experts, vec![0, 1]);
    }

    #[test]
    fn the_bias_changes_selection_not_weights() {
        let mut c = cfg(4, 1);
        c.score = ScoreFn::Sigmoid;
        c.renormalize = false;
        let logits = [2.0, 1.0, 0.0, -1.0];
        let r = route(&logits, Some(&[0.0, 0.0, 0.0, 10.0]), &c).unwrap();
        assert_eq!(r.experts, vec![3]);
        assert!((r.weights[0] - 1.0 / (1.0 + 1f32.exp())).abs() < 1e-6); // sigmoid(-1), unbiased
    }

    #[test]
    fn group_limited_routing_masks_whole_groups() {
        // 2 groups of 2: group 0 = {0.9, 0.1} (top-2 sum 1.0), group 1 = {0.6, 0.6} (1.2).
        let mut c = cfg(4, 1);
        c.score = ScoreFn::Sigmoid;
        c.groups = Some(Groups { groups: 2, kept: 1 });
        let logit = |p: f32| (p / (1.0 - p)).ln();
        let r = route(&[logit(0.9), logit(0.1), logit(0.6), logit(0.6)], None, &c).unwrap();
        assert_eq!(r.experts, vec![2]); // the best expert (0) is in the dropped group
    }

    #[test]
    fn capacity_drops_the_latest_assignments_without_renormalising() {
        let mut c = cfg(2, 1);
        c.capacity_factor = Some(1.0); // C = ceil(4 * 1 / 2) = 2
        let logits = [5.0, 0.0, 5.0, 0.0, 5.0, 0.0, 0.0, 5.0];
        let r = route(&logits, None, &c).unwrap();
        assert_eq!(r.experts, vec![0, 0, 0, 1]);
        assert_eq!(r.dropped, vec![false, false, true, false]);
        assert_eq!(r.weights[2], 0.0);
        assert_eq!(r.counts, vec![2, 1]);
    }

    #[test]
    fn balanced_routing_has_aux_loss_one() {
        // Uniform scores and counts: E * sum_e (1/E)(1/E) = 1.
        let logits = [1.0, 0.0, 0.0, 1.0];
        let r = route(&logits, None, &cfg(2, 1)).unwrap();
        assert!((r.aux_loss - 1.0).abs() < 1e-6, "{}", r.aux_loss);
        let expect_z = (1f32.exp() + 1.0).ln().powi(2);
        assert!((r.z_loss - expect_z).abs() < 1e-5);
    }

    #[test]
    fn bad_configurations_are_refused() {
        assert!(route(&[0.0; 4], None, &cfg(4, 5)).is_err());
        assert!(route(&[0.0; 6], None, &cfg(4, 1)).is_err());
        let mut c = cfg(4, 2);
        c.groups = Some(Groups { groups: 4, kept: 1 });
        assert!(route(&[0.0; 4], None, &c).is_err());
        c.groups = None;
        c.capacity_factor = Some(f32::NAN);
        assert!(route(&[0.0; 4], None, &c).is_err());
    }
}
