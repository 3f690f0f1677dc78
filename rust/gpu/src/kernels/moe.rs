//! cuda/moe.cuh: keys and launch geometry of the MoE router and permutation kernels.

use super::{Arg, Family, Float, Geometry, Wave, T};

/// The prefix-count modes of `moe_expert_scan` (moe.cuh `SCAN_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scan {
    Capacity = 0,
    Count = 1,
    Place = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Moe {
    /// `moe_route_select<In>`: one warp per token.
    RouteSelect { input: Float },
    /// `moe_expert_scan<Mode>`: one CTA per expert.
    ExpertScan { mode: Scan },
    /// `moe_offsets<0>`: one thread.
    Offsets,
}

impl Moe {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        match self {
            Moe::RouteSelect { input } => ("moe_route_select", vec![Arg::Float(input)]),
            Moe::ExpertScan { mode } => ("moe_expert_scan", vec![Arg::Int(mode as u8)]),
            Moe::Offsets => ("moe_offsets", vec![Arg::Int(0)]),
        }
    }
}

/// Tokens and experts of a launch.
#[derive(Clone, Copy, Debug)]
pub struct MoeSizes {
    pub tokens: u64,
    pub experts: u64,
}

impl Family for Moe {
    type Sizes = MoeSizes;

    /// moe.cuh's **Per CTA**: THREADS / 32 tokens (select), one expert (scan), everything (offsets).
    fn geometry(self, s: MoeSizes, wave: Wave) -> Geometry {
        match self {
            Moe::RouteSelect { .. } => wave.cover(s.tokens, T / 32),
            Moe::ExpertScan { .. } => wave.cover(s.experts, 1),
            Moe::Offsets => wave.cover(1, 1),
        }
    }
}

pub fn all() -> Vec<Moe> {
    let mut v: Vec<Moe> = Float::ALL.iter().map(|&input| Moe::RouteSelect { input }).collect();
    v.extend([Scan::Capacity, Scan::Count, Scan::Place].map(|mode| Moe::ExpertScan { mode }));
    v.push(Moe::Offsets);
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::{cuh_int, H100};
    use super::super::KernelId;
    use super::*;
    use crate::sources::Header;

    #[test]
    fn geometry_follows_the_work_per_cta() {
        let g = |k: Moe, tokens, experts| k.geometry(MoeSizes { tokens, experts }, H100).grid;
        assert_eq!(g(Moe::RouteSelect { input: Float::F32 }, 8192, 64), 1024); // CTAs of 8 tokens
        assert_eq!(g(Moe::RouteSelect { input: Float::F32 }, 1 << 20, 64), 132 * 8); // one wave
        assert_eq!(g(Moe::RouteSelect { input: Float::F32 }, 100, 64), 13);
        assert_eq!(g(Moe::ExpertScan { mode: Scan::Place }, 8192, 64), 64);
        assert_eq!(g(Moe::ExpertScan { mode: Scan::Count }, 8192, 4096), 132 * 8);
        assert_eq!(g(Moe::Offsets, 8192, 64), 1);
    }

    #[test]
    fn names_and_modes_match_the_header() {
        let k = KernelId::Moe(Moe::ExpertScan { mode: Scan::Place });
        assert_eq!(k.name_expression(), "deepwell::moe_expert_scan<2>");
        for (name, mode) in
            [("SCAN_CAPACITY", Scan::Capacity), ("SCAN_COUNT", Scan::Count), ("SCAN_PLACE", Scan::Place)]
        {
            assert_eq!(cuh_int(Header::Moe, name), mode as u64);
        }
        assert!(Header::Moe.source().contains("**Per CTA:** one expert."));
        assert!(Header::Moe.source().contains("**Per CTA:** THREADS / 32 = 8 tokens."));
    }
}
