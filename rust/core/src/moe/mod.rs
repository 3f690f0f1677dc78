//! Mixture-of-Experts maths (docs/DESIGN.md "MoE"): the router. Permutation and grouped GEMMs
//! follow in rust/ops.

pub mod router;

pub use router::{route, Groups, RouterConfig, RouterError, Routing, ScoreFn};
