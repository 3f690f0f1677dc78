//! cuda/fp8_gemm.cuh: keys, shared memory and launch geometry of deepwell's sm_90a block-scaled
//! FP8 GEMM (a persistent kernel: one CTA per SM walking the output tiles).

use super::{Arg, Family, Float, Geometry, Wave};

/// Threads per CTA (fp8_gemm.cuh `GEMM_THREADS`: two math warpgroups and one load warpgroup).
pub const THREADS: u32 = 384;
/// Output columns and K per tile (`GEMM_BLOCK_N`, `GEMM_BLOCK_K`); rows per tile are 128 * waves.
pub const BLOCK_N: u64 = 128;
pub const BLOCK_K: u64 = 128;
/// Pipeline depth per wave count (`GEMM_STAGES_W1`, `GEMM_STAGES_W2`).
pub const STAGES_W1: u64 = 6;
pub const STAGES_W2: u64 = 4;
/// Bytes of the epilogue's staging slab per math warp (`GEMM_EPI_SLAB`: 8 rows x 64 fp32 columns).
pub const EPI_SLAB: u64 = 2048;
/// Math warps (two warpgroups), each with its own slab.
const MATH_WARPS: u64 = 8;

/// How B's scales are laid out (the kernel's `SB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BScales {
    /// One scale per 128x128 tile of B, (groups, cols/128, K/128) row-major: a weight (fprop, dgrad).
    Tile128,
    /// One scale per 128 elements of each B row, M-major (K/128, cols): wgrad's x.
    Row1x128,
}

/// Which GEMMs one launch computes (the kernel's `GROUPING`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Grouping {
    /// One GEMM.
    Dense,
    /// A's rows cut into groups by offsets, group g against B's g-th (cols, K) block: MoE forward / dgrad.
    Rows,
    /// K cut into groups by offsets, one output matrix per group: MoE wgrad.
    K,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Gemm {
    pub out: Float,
    /// 1 or 2 row waves of 128 per tile.
    pub waves: u8,
    pub b_scales: BScales,
    pub grouping: Grouping,
}

/// The sizes of one launch: A is (rows, k) (for `Grouping::Rows`, all groups' rows), the output
/// (rows, cols) per group.
#[derive(Clone, Copy, Debug)]
pub struct GemmSizes {
    pub rows: u64,
    pub cols: u64,
    pub k: u64,
    pub groups: u64,
}

impl Fp8Gemm {
    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        let sb = match self.b_scales {
            BScales::Tile128 => 0,
            BScales::Row1x128 => 1,
        };
        let grouping = match self.grouping {
            Grouping::Dense => 0,
            Grouping::Rows => 1,
            Grouping::K => 2,
        };
        ("fp8_block_gemm", vec![Arg::Float(self.out), Arg::Int(self.waves), Arg::Int(sb), Arg::Int(grouping)])
    }

    pub fn block_m(self) -> u64 {
        128 * u64::from(self.waves)
    }

    /// Rows per tile for a launch of `sizes` on `sms` multiprocessors: 256 (B read once per 256
    /// rows: a third less shared-memory traffic per FLOP) when that still gives every SM a tile
    /// and, for row groups, the average group is long enough that the partial last tile of each
    /// group wastes little; else 128. A K-grouped wgrad's rows are a weight's output features,
    /// whole in every group, so only the tile count decides.
    pub fn waves_for(grouping: Grouping, s: GemmSizes, sms: u32) -> u8 {
        let matrices = if grouping == Grouping::K { s.groups.max(1) } else { 1 };
        let tiles_256 = matrices * s.rows.div_ceil(256) * s.cols.div_ceil(BLOCK_N);
        // Measured on the H100 (bench_gemm, 2026-11-26): 256-row tiles win for groups of 577
        // rows on average (E128: 883 vs 816 TFLOP/s) and more; below 256 most of a tile is padding.
        let long_groups = match grouping {
            Grouping::Dense | Grouping::K => true,
            Grouping::Rows => s.rows >= 256 * s.groups.max(1),
        };
        if long_groups && tiles_256 >= u64::from(sms) {
            2
        } else {
            1
        }
    }

    /// Dynamic shared memory of one CTA (fp8_gemm.cuh `GemmSmem`, plus 1024 bytes to align its base).
    pub fn smem_bytes(self) -> u64 {
        let block_m = self.block_m();
        let stages = if self.waves == 2 { STAGES_W2 } else { STAGES_W1 };
        let data = stages * (block_m + BLOCK_N) * BLOCK_K;
        let sa = stages * u64::from(self.waves) * (self.sa_box() * 4).div_ceil(128) * 128;
        let sb = if self.b_scales == BScales::Row1x128 { stages * BLOCK_N * 4 } else { 0 };
        let barriers = (2 * stages * 8).div_ceil(128) * 128;
        1024 + data + sa + sb + barriers + MATH_WARPS * EPI_SLAB
    }

    /// Floats of A's scales one copy moves per 128-row wave (`GemmSmem::SA_WAVE`): 4 more for row
    /// groups, which start at any row while a copy starts at a multiple of 4 (16 bytes).
    pub fn sa_box(self) -> u64 {
        if self.grouping == Grouping::Rows {
            132
        } else {
            128
        }
    }

    /// Output tiles of a launch; for `Grouping::Rows` an upper bound (each group may end in a
    /// partial tile), the kernel stops at the real count it reads from the offsets.
    pub fn tiles(self, s: GemmSizes) -> u64 {
        let n_tiles = s.cols.div_ceil(BLOCK_N);
        let m_tiles = s.rows.div_ceil(self.block_m());
        match self.grouping {
            Grouping::Dense => m_tiles * n_tiles,
            Grouping::Rows => (m_tiles + s.groups) * n_tiles,
            Grouping::K => s.groups * m_tiles * n_tiles,
        }
    }
}

impl Family for Fp8Gemm {
    type Sizes = GemmSizes;

    /// Persistent: one CTA per SM (at most one per tile), each looping over tiles t, t + grid, ...
    fn geometry(self, s: GemmSizes, wave: Wave) -> Geometry {
        let grid = self.tiles(s).clamp(1, u64::from(wave.sms.max(1))) as u32;
        Geometry { grid, block: THREADS, smem: self.smem_bytes() as u32 }
    }
}

/// Every specialization the GEMM ops launch: dense and grouped-rows GEMMs in both tile heights
/// (dense with either B layout, row groups against weights, K-grouped wgrads); each for every
/// output type.
pub fn all() -> Vec<Fp8Gemm> {
    let mut v = Vec::new();
    for out in Float::ALL {
        for waves in [1, 2] {
            for b_scales in [BScales::Tile128, BScales::Row1x128] {
                v.push(Fp8Gemm { out, waves, b_scales, grouping: Grouping::Dense });
            }
        }
        for waves in [1, 2] {
            v.push(Fp8Gemm { out, waves, b_scales: BScales::Tile128, grouping: Grouping::Rows });
        }
        for waves in [1, 2] {
            v.push(Fp8Gemm { out, waves, b_scales: BScales::Row1x128, grouping: Grouping::K });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::{cuh_int, H100};
    use super::*;
    use crate::sources::Header;

    #[test]
    fn constants_match_the_header() {
        for (name, mirror) in [
            ("GEMM_THREADS", u64::from(THREADS)),
            ("GEMM_BLOCK_N", BLOCK_N),
            ("GEMM_BLOCK_K", BLOCK_K),
            ("GEMM_STAGES_W1", STAGES_W1),
            ("GEMM_STAGES_W2", STAGES_W2),
            ("GEMM_EPI_SLAB", EPI_SLAB),
        ] {
            assert_eq!(cuh_int(Header::Fp8Gemm, name), mirror, "{name}");
        }
    }

    #[test]
    fn shared_memory_fits_an_h100_block() {
        // 227 KiB per block on sm_90.
        for k in all() {
            assert!(k.smem_bytes() <= 232_448, "{k:?}: {}", k.smem_bytes());
        }
        let w2 = Fp8Gemm { out: Float::BF16, waves: 2, b_scales: BScales::Tile128, grouping: Grouping::Dense };
        assert_eq!(w2.smem_bytes(), 1024 + 4 * 48 * 1024 + 4 * 256 * 4 + 128 + 8 * 2048);
        let rows = Fp8Gemm { waves: 1, grouping: Grouping::Rows, ..w2 };
        assert_eq!(rows.smem_bytes(), 1024 + 6 * 32 * 1024 + 6 * 640 + 128 + 8 * 2048);
    }

    #[test]
    fn persistent_grids() {
        let k = Fp8Gemm { out: Float::BF16, waves: 2, b_scales: BScales::Tile128, grouping: Grouping::Dense };
        let big = GemmSizes { rows: 16384, cols: 4096, k: 4096, groups: 1 };
        assert_eq!(k.tiles(big), 64 * 32);
        assert_eq!(k.geometry(big, H100).grid, 132);
        assert_eq!(k.geometry(big, H100).block, 384);
        let small = GemmSizes { rows: 200, cols: 256, k: 128, groups: 1 };
        assert_eq!(k.geometry(small, H100).grid, 2);
        let rows = Fp8Gemm { waves: 1, grouping: Grouping::Rows, ..k };
        assert_eq!(rows.tiles(GemmSizes { rows: 1000, cols: 256, k: 128, groups: 8 }), (8 + 8) * 2);
        let kg = Fp8Gemm { waves: 1, b_scales: BScales::Row1x128, grouping: Grouping::K, ..k };
        assert_eq!(kg.tiles(GemmSizes { rows: 256, cols: 384, k: 4096, groups: 4 }), 4 * 2 * 3);
        let dense = |rows, cols| GemmSizes { rows, cols, k: 4096, groups: 1 };
        assert_eq!(Fp8Gemm::waves_for(Grouping::Dense, dense(16384, 4096), 132), 2);
        assert_eq!(Fp8Gemm::waves_for(Grouping::Dense, dense(2048, 1024), 132), 1);
        let experts = |rows, groups| GemmSizes { rows, cols: 1408, k: 2048, groups };
        assert_eq!(Fp8Gemm::waves_for(Grouping::Rows, experts(65536, 128), 132), 2);
        assert_eq!(Fp8Gemm::waves_for(Grouping::Rows, experts(65536, 512), 132), 1);
        // Wgrads: every expert's (rows, cols) output counts; few tiles keep 128 rows.
        let wgrad = |rows, cols, groups| GemmSizes { rows, cols, k: 65536, groups };
        assert_eq!(Fp8Gemm::waves_for(Grouping::K, wgrad(2816, 2048, 64), 132), 2);
        assert_eq!(Fp8Gemm::waves_for(Grouping::K, wgrad(512, 256, 8), 132), 1);
    }
}
