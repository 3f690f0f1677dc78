//! cuda/moe.cuh: keys and launch geometry of the MoE router, permutation and value-move kernels.

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
    /// `moe_gather_rows<In>`: one thread per 16-byte chunk (or element) of an output row.
    GatherRows { input: Float },
    /// `moe_sum_slots<In>`: one thread per 16-byte chunk (or element) of an output row.
    SumSlots { input: Float },
    /// `moe_slot_dots<In>`: one warp per slot.
    SlotDots { input: Float },
}

impl Moe {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        match self {
            Moe::RouteSelect { input } => ("moe_route_select", vec![Arg::Float(input)]),
            Moe::ExpertScan { mode } => ("moe_expert_scan", vec![Arg::Int(mode as u8)]),
            Moe::Offsets => ("moe_offsets", vec![Arg::Int(0)]),
            Moe::GatherRows { input } => ("moe_gather_rows", vec![Arg::Float(input)]),
            Moe::SumSlots { input } => ("moe_sum_slots", vec![Arg::Float(input)]),
            Moe::SlotDots { input } => ("moe_slot_dots", vec![Arg::Float(input)]),
        }
    }
}

/// Tokens and experts of a launch. The value moves count their work in `tokens`: the items
/// (output rows x chunks per row, [`MoeSizes::items`]) of the gather and the sums, the slots of the
/// dots; `experts` is unused there.
#[derive(Clone, Copy, Debug)]
pub struct MoeSizes {
    pub tokens: u64,
    pub experts: u64,
}

impl MoeSizes {
    /// The sizes of `moe_gather_rows` / `moe_sum_slots` over `rows` output rows of `d` elements:
    /// one item per 16-byte chunk on the vector path (`vector`: d is a multiple of the chunk and
    /// the pointers are aligned, as the kernel decides), per element otherwise (moe.cuh `MoeVec`).
    pub fn items(input: Float, rows: u64, d: u64, vector: bool) -> MoeSizes {
        let per_row = if vector { d / (16 / input.bytes()) } else { d };
        MoeSizes { tokens: rows * per_row, experts: 0 }
    }
}

impl Family for Moe {
    type Sizes = MoeSizes;

    /// moe.cuh's **Per CTA**: THREADS / 32 tokens (select), one expert (scan), everything (offsets),
    /// THREADS items (gather, sums), THREADS / 32 slots (dots).
    fn geometry(self, s: MoeSizes, wave: Wave) -> Geometry {
        match self {
            Moe::RouteSelect { .. } | Moe::SlotDots { .. } => wave.cover(s.tokens, T / 32),
            Moe::GatherRows { .. } | Moe::SumSlots { .. } => wave.cover(s.tokens, T),
            Moe::ExpertScan { .. } => wave.cover(s.experts, 1),
            Moe::Offsets => wave.cover(1, 1),
        }
    }
}

pub fn all() -> Vec<Moe> {
    let mut v: Vec<Moe> = Float::ALL.iter().map(|&input| Moe::RouteSelect { input }).collect();
    v.extend([Scan::Capacity, Scan::Count, Scan::Place].map(|mode| Moe::ExpertScan { mode }));
    v.push(Moe::Offsets);
    for input in Float::ALL {
        v.extend([Moe::GatherRows { input }, Moe::SumSlots { input }, Moe::SlotDots { input }]);
    }
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
        // E64 d2048 bf16: 65536 rows of 256 chunks cap at one wave; 8192 x 8 slots in CTAs of 8.
        let items = MoeSizes::items(Float::BF16, 65536, 2048, true);
        assert_eq!(items.tokens, 65536 * 256);
        assert_eq!(MoeSizes::items(Float::F32, 3, 20, true).tokens, 15);
        assert_eq!(MoeSizes::items(Float::BF16, 3, 20, false).tokens, 60);
        assert_eq!(Moe::SumSlots { input: Float::BF16 }.geometry(items, H100).grid, 132 * 8);
        assert_eq!(g(Moe::GatherRows { input: Float::F16 }, 1000, 0), 4);
        assert_eq!(g(Moe::SlotDots { input: Float::F32 }, 8192 * 8, 64), 132 * 8);
        assert_eq!(g(Moe::SlotDots { input: Float::F32 }, 20, 64), 3);
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
        // The dots' reduction order; rust/ops/src/ops/moe/combine_cpu.rs `DOT_CHUNK` repeats it.
        assert_eq!(cuh_int(Header::Moe, "MOE_DOT_CHUNK"), 8);
        assert!(Header::Moe.source().contains("**Per CTA:** one expert."));
        assert!(Header::Moe.source().contains("**Per CTA:** THREADS / 32 = 8 tokens."));
        assert!(Header::Moe.source().contains("**Per CTA:** THREADS items; rows * ceil(d / V) items"));
        assert!(Header::Moe.source().contains("**Per CTA:** THREADS items; tokens * ceil(d / V) items."));
        assert!(Header::Moe.source().contains("**Per CTA:** THREADS / 32 = 8 slots."));
        let k = KernelId::Moe(Moe::SlotDots { input: Float::BF16 });
        assert_eq!(k.name_expression(), "deepwell::moe_slot_dots<deepwell::BF16>");
    }
}
