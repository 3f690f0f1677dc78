//! Mixture-of-Experts maths (docs/DESIGN.md "MoE"), CPU references: the router (`router`) and the
//! token permutation with its weighted combine (`permute`). The module, the CUDA kernels and the
//! grouped GEMMs follow in rust/ops.

pub mod permute;
pub mod router;

pub use permute::{combine, group_offsets, permutation, place, static_rows, Permutation};
pub use router::{apply_capacity, capacity, route, Groups, RouterConfig, RouterError, Routing, ScoreFn};
