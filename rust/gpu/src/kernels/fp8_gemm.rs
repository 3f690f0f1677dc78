//! cuda/fp8_gemm.cuh: keys, shared memory and launch geometry of deepwell's sm_90a block-scaled
//! FP8 GEMM (a persistent kernel: one CTA per SM walking the output tiles).

use super::{Arg, Family, Float, Geometry, Wave};

/// Threads per CTA (fp8_gemm.cuh `GEMM_THREADS`: two math warpgroups and one load warpgroup); the
/// 192-row tile's CTA has a third math warpgroup (`Fp8Gemm::threads`).
pub const THREADS: u32 = 384;
/// Output columns and K per tile (`GEMM_BLOCK_N`, `GEMM_BLOCK_K`); rows per tile are 128 * waves.
pub const BLOCK_N: u64 = 128;
pub const BLOCK_K: u64 = 128;
/// Columns of the wide tile (`GEMM_WIDE_N`: 128 rows x 192 columns).
pub const WIDE_N: u64 = 192;
/// Pipeline depth per wave count (`GEMM_STAGES_W1`, `GEMM_STAGES_W2`) and of the wide tile
/// (`GEMM_STAGES_WIDE`).
pub const STAGES_W1: u64 = 6;
pub const STAGES_W2: u64 = 4;
pub const STAGES_WIDE: u64 = 5;
/// Pipeline depth of the 192-row tile (`GEMM_STAGES_WG3`).
pub const STAGES_WG3: u64 = 4;
/// Bytes of the epilogue's staging slab per math warp (`GEMM_EPI_SLAB`: 8 rows x 64 fp32 columns).
pub const EPI_SLAB: u64 = 2048;

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
    /// 1 or 2 row waves of 128 per CTA's tile.
    pub waves: u8,
    pub b_scales: BScales,
    pub grouping: Grouping,
    /// CTAs per cluster (the kernel's `CLUSTER`): 1, or 2 with `waves` 1, the two CTAs taking the
    /// two 128-row halves of a 256-row tile and sharing its B by TMA multicast.
    pub cluster: u8,
    /// 192 columns per tile instead of 128 (the kernel's `BN`): with `waves` 1, `cluster` 1,
    /// `Tile128` B scales and a dense GEMM only.
    pub wide: bool,
    /// The wide tile's K-blocks multiplied as two 96-column halves, A from registers, the first
    /// half promoted while the second's MMAs run (the kernel's `HALVES`).
    pub halves: bool,
    /// Math warpgroups of 64 rows per wave (the kernel's `MATH_WGS`): 2, or 3 for the 192-row tile
    /// (with `waves` 1, `cluster` 1, 128 columns, `Tile128` B scales and a dense GEMM only).
    pub math_wgs: u8,
}

/// The tile shapes a launch can take: (waves, cluster).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileShape {
    /// 128 rows per tile, one CTA (the promotion of each K-block overlaps the next one's MMAs).
    Rows128,
    /// 256 rows per tile, one CTA (two waves of 128; B read once per 256 rows).
    Rows256,
    /// 256 rows per tile, a cluster of two CTAs of 128 rows each sharing B.
    Pair128,
    /// 128 rows x 192 columns, one CTA (dense GEMMs against a weight's 128x128 tile scales).
    Wide192,
    /// `Wide192` multiplied in two 96-column halves, the first promoted under the second's MMAs.
    Wide192Halves,
    /// 192 rows per tile, one CTA of three math warpgroups of 64 rows (dense GEMMs against a
    /// weight's 128x128 tile scales).
    Rows192,
}

impl TileShape {
    pub const ALL: [TileShape; 6] = [
        TileShape::Rows128,
        TileShape::Rows256,
        TileShape::Pair128,
        TileShape::Wide192,
        TileShape::Wide192Halves,
        TileShape::Rows192,
    ];

    /// The kernel of this shape for a launch of `grouping` with `b_scales` into `out`.
    pub fn kernel(self, out: Float, b_scales: BScales, grouping: Grouping) -> Fp8Gemm {
        let base = Fp8Gemm { out, waves: 1, b_scales, grouping, cluster: 1, wide: false, halves: false, math_wgs: 2 };
        match self {
            TileShape::Rows128 => base,
            TileShape::Rows256 => Fp8Gemm { waves: 2, ..base },
            TileShape::Pair128 => Fp8Gemm { cluster: 2, ..base },
            TileShape::Wide192 => Fp8Gemm { wide: true, ..base },
            TileShape::Wide192Halves => Fp8Gemm { wide: true, halves: true, ..base },
            TileShape::Rows192 => Fp8Gemm { math_wgs: 3, ..base },
        }
    }

    /// Whether a launch of `grouping` with `b_scales` can take this shape (the wide tile and the
    /// 192-row one are dense against tile scales only).
    pub fn serves(self, grouping: Grouping, b_scales: BScales) -> bool {
        let dense_only = matches!(self, TileShape::Wide192 | TileShape::Wide192Halves | TileShape::Rows192);
        !dense_only || (grouping == Grouping::Dense && b_scales == BScales::Tile128)
    }
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
        let args = vec![
            Arg::Float(self.out),
            Arg::Int(self.waves),
            Arg::Int(sb),
            Arg::Int(grouping),
            Arg::Int(self.cluster),
            Arg::Int(self.block_n() as u8),
            Arg::Int(u8::from(self.halves)),
            Arg::Int(self.math_wgs),
        ];
        ("fp8_block_gemm", args)
    }

    /// Output columns of one tile.
    pub fn block_n(self) -> u64 {
        if self.wide {
            WIDE_N
        } else {
            BLOCK_N
        }
    }

    /// A's rows one CTA's tile covers (the box of A's copies): waves of 64 rows per math warpgroup.
    pub fn block_m(self) -> u64 {
        self.wave_rows() * u64::from(self.waves)
    }

    /// Rows of one wave (`GemmSmem::WAVE_ROWS`): 64 per math warpgroup.
    pub fn wave_rows(self) -> u64 {
        64 * u64::from(self.math_wgs)
    }

    /// Threads per CTA (fp8_gemm.cuh `gemm_threads`): the math warpgroups and the load one.
    pub fn threads(self) -> u32 {
        128 * (u32::from(self.math_wgs) + 1)
    }

    /// Rows of one tile of the walk (a cluster's tile when clustered).
    pub fn tile_rows(self) -> u64 {
        self.block_m() * u64::from(self.cluster)
    }

    /// Rows of B one CTA copies per stage (the box of B's copies): half the tile's 128 when a
    /// cluster of 2 shares it.
    pub fn b_box_rows(self) -> u64 {
        self.block_n() / u64::from(self.cluster)
    }

    /// The tile shape for a launch of `sizes` on `sms` multiprocessors: 256 rows (B read once per
    /// 256 rows: a third less shared-memory traffic per FLOP) when that still gives every SM a
    /// tile and, for row groups, the average group is long enough that the partial last tile of
    /// each group wastes little; else 128. A K-grouped wgrad's rows are a weight's output
    /// features, whole in every group, so only the tile count decides. A dense GEMM with 1x128
    /// B scales (a wgrad) takes its 256-row tiles as 2-CTA clusters: measured on the H100
    /// (bench_gemm --tiles, two runs), 0.97-1.11x the one-CTA 256-row tile at the four
    /// dense wgrad shapes, while clusters were no gain elsewhere (dense fprop 0.94-1.07x, grouped
    /// fprop 0.70-0.93x, grouped wgrad 0.84-1.08x). The 128 x 192 tiles (`Wide192`, `Wide192Halves`)
    /// are never chosen: on the H200 (bench_gemm --rounds 3) they ran 0.91-1.02x the
    /// 256-row tile at the ten dense fprop / dgrad shapes of the training steps; nor is the 192-row
    /// tile of three math warpgroups (`Rows192`: 0.84-0.94x the 256-row tile, same run, same
    /// shapes; docs/DESIGN.md "deepwell's FP8 GEMM"). They stay for `fp8_gemm_tile` to force.
    pub fn shape_for(grouping: Grouping, b_scales: BScales, s: GemmSizes, sms: u32) -> TileShape {
        let matrices = if grouping == Grouping::K { s.groups.max(1) } else { 1 };
        let tiles_256 = matrices * s.rows.div_ceil(256) * s.cols.div_ceil(BLOCK_N);
        // Measured on the H100 (bench_gemm): 256-row tiles win for groups of 577
        // rows on average (E128: 883 vs 816 TFLOP/s) and more; below 256 most of a tile is padding.
        let long_groups = match grouping {
            Grouping::Dense | Grouping::K => true,
            Grouping::Rows => s.rows >= 256 * s.groups.max(1),
        };
        if !long_groups || tiles_256 < u64::from(sms) {
            TileShape::Rows128
        } else if grouping == Grouping::Dense && b_scales == BScales::Row1x128 {
            TileShape::Pair128
        } else {
            TileShape::Rows256
        }
    }

    /// Dynamic shared memory of one CTA (fp8_gemm.cuh `GemmSmem`, plus 1024 bytes to align its base).
    pub fn smem_bytes(self) -> u64 {
        let block_m = self.block_m();
        let stages = if self.math_wgs == 3 {
            STAGES_WG3
        } else if self.wide {
            STAGES_WIDE
        } else if self.waves == 2 {
            STAGES_W2
        } else {
            STAGES_W1
        };
        let data = stages * (block_m + self.block_n()) * BLOCK_K;
        let sa = stages * u64::from(self.waves) * (self.sa_box() * 4).div_ceil(128) * 128;
        let sb = if self.b_scales == BScales::Row1x128 { stages * BLOCK_N * 4 } else { 0 };
        let barriers = (2 * stages * 8).div_ceil(128) * 128;
        let math_warps = 4 * u64::from(self.math_wgs);
        1024 + data + sa + sb + barriers + math_warps * EPI_SLAB
    }

    /// Floats of A's scales one copy moves per wave (`GemmSmem::SA_WAVE`): one per row, 4 more for
    /// row groups, which start at any row while a copy starts at a multiple of 4 (16 bytes).
    pub fn sa_box(self) -> u64 {
        self.wave_rows() + if self.grouping == Grouping::Rows { 4 } else { 0 }
    }

    /// Output tiles of a launch; for `Grouping::Rows` an upper bound (each group may end in a
    /// partial tile), the kernel stops at the real count it reads from the offsets.
    pub fn tiles(self, s: GemmSizes) -> u64 {
        let n_tiles = s.cols.div_ceil(self.block_n());
        let m_tiles = s.rows.div_ceil(self.tile_rows());
        match self.grouping {
            Grouping::Dense => m_tiles * n_tiles,
            Grouping::Rows => (m_tiles + s.groups) * n_tiles,
            Grouping::K => s.groups * m_tiles * n_tiles,
        }
    }
}

impl Family for Fp8Gemm {
    type Sizes = GemmSizes;

    /// Persistent: one CTA per SM (one cluster per tile at most), each cluster looping over tiles
    /// t, t + clusters, ... A clustered grid is a whole number of clusters (an odd SM left idle).
    fn geometry(self, s: GemmSizes, wave: Wave) -> Geometry {
        let cluster = u64::from(self.cluster);
        let clusters = self.tiles(s).clamp(1, (u64::from(wave.sms) / cluster).max(1));
        Geometry {
            grid: (clusters * cluster) as u32,
            block: self.threads(),
            smem: self.smem_bytes() as u32,
            cluster: self.cluster.into(),
            resident: false,
        }
    }
}

/// Every specialization the GEMM ops launch: dense and grouped-rows GEMMs in every tile shape
/// (dense with either B layout, row groups against weights, K-grouped wgrads); each for every
/// output type.
pub fn all() -> Vec<Fp8Gemm> {
    let mut v = Vec::new();
    for out in Float::ALL {
        for shape in TileShape::ALL {
            for (b_scales, grouping) in [
                (BScales::Tile128, Grouping::Dense),
                (BScales::Row1x128, Grouping::Dense),
                (BScales::Tile128, Grouping::Rows),
                (BScales::Row1x128, Grouping::K),
            ] {
                if shape.serves(grouping, b_scales) {
                    v.push(shape.kernel(out, b_scales, grouping));
                }
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::{cuh_int, H100};
    use super::*;
    use crate::kernels::KernelId;
    use crate::sources::Header;

    #[test]
    fn constants_match_the_header() {
        for (name, mirror) in [
            ("GEMM_THREADS", u64::from(THREADS)),
            ("GEMM_BLOCK_N", BLOCK_N),
            ("GEMM_BLOCK_K", BLOCK_K),
            ("GEMM_STAGES_W1", STAGES_W1),
            ("GEMM_STAGES_W2", STAGES_W2),
            ("GEMM_WIDE_N", WIDE_N),
            ("GEMM_STAGES_WIDE", STAGES_WIDE),
            ("GEMM_STAGES_WG3", STAGES_WG3),
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
        let w2 = TileShape::Rows256.kernel(Float::BF16, BScales::Tile128, Grouping::Dense);
        assert_eq!(w2.smem_bytes(), 1024 + 4 * 48 * 1024 + 4 * 256 * 4 + 128 + 8 * 2048);
        let rows = Fp8Gemm { waves: 1, grouping: Grouping::Rows, ..w2 };
        assert_eq!(rows.smem_bytes(), 1024 + 6 * 32 * 1024 + 6 * 640 + 128 + 8 * 2048);
        let wide = Fp8Gemm { waves: 1, wide: true, ..w2 };
        assert_eq!(wide.smem_bytes(), 1024 + 5 * (128 + 192) * 128 + 5 * 512 + 128 + 8 * 2048);
        // 192 rows: 4 stages of 40 KiB, 192 scales a stage, 12 math warps' slabs.
        let wg3 = Fp8Gemm { waves: 1, math_wgs: 3, ..w2 };
        assert_eq!(wg3.smem_bytes(), 1024 + 4 * (192 + 128) * 128 + 4 * 768 + 128 + 12 * 2048);
    }

    #[test]
    fn the_192_row_tile_has_three_math_warpgroups() {
        let k = TileShape::Rows192.kernel(Float::BF16, BScales::Tile128, Grouping::Dense);
        assert_eq!((k.waves, k.cluster, k.wide, k.math_wgs), (1, 1, false, 3));
        assert_eq!((k.block_m(), k.tile_rows(), k.sa_box(), k.b_box_rows(), k.threads()), (192, 192, 192, 128, 512));
        let sizes = GemmSizes { rows: 16384, cols: 4096, k: 4096, groups: 1 };
        // 16384 rows: 85 whole tiles of 192 and one of 64.
        assert_eq!(k.tiles(sizes), 86 * 32);
        assert_eq!(k.geometry(sizes, H100).block, 512);
        assert!(TileShape::Rows192.serves(Grouping::Dense, BScales::Tile128));
        for (g, b) in
            [(Grouping::Dense, BScales::Row1x128), (Grouping::Rows, BScales::Tile128), (Grouping::K, BScales::Row1x128)]
        {
            assert!(!TileShape::Rows192.serves(g, b), "{g:?} {b:?}");
        }
        assert_eq!(all().iter().filter(|k| k.math_wgs == 3).count(), Float::ALL.len());
        assert!(KernelId::Fp8Gemm(k).name_expression().ends_with("<deepwell::BF16, 1, 0, 0, 1, 128, 0, 3>"));
    }

    #[test]
    fn the_wide_tile_serves_dense_weight_gemms_only() {
        let wide = TileShape::Wide192;
        let kernel = |t: TileShape| {
            let k = t.kernel(Float::BF16, BScales::Tile128, Grouping::Dense);
            (k.waves, k.cluster, k.wide, k.halves)
        };
        assert_eq!(kernel(wide), (1, 1, true, false));
        assert_eq!(kernel(TileShape::Wide192Halves), (1, 1, true, true));
        assert!(wide.serves(Grouping::Dense, BScales::Tile128));
        for (g, b) in
            [(Grouping::Dense, BScales::Row1x128), (Grouping::Rows, BScales::Tile128), (Grouping::K, BScales::Row1x128)]
        {
            assert!(!wide.serves(g, b), "{g:?} {b:?}");
        }
        let k = TileShape::Wide192.kernel(Float::BF16, BScales::Tile128, Grouping::Dense);
        // 4096 columns: 21 whole tiles of 192 and one of 64; B's box is the tile's 192 rows.
        assert_eq!(k.tiles(GemmSizes { rows: 16384, cols: 4096, k: 4096, groups: 1 }), 128 * 22);
        assert_eq!((k.block_n(), k.b_box_rows()), (192, 192));
        assert_eq!(all().iter().filter(|k| k.wide).count(), 2 * Float::ALL.len());
    }

    #[test]
    fn persistent_grids() {
        let k = TileShape::Rows256.kernel(Float::BF16, BScales::Tile128, Grouping::Dense);
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
        // A cluster's tile is 256 rows; its grid a whole number of clusters.
        let pair = Fp8Gemm { waves: 1, cluster: 2, ..k };
        assert_eq!(pair.tiles(big), 64 * 32);
        assert_eq!(
            pair.geometry(big, H100),
            Geometry { grid: 132, block: 384, smem: pair.smem_bytes() as u32, cluster: 2, resident: false }
        );
        assert_eq!(pair.geometry(big, Wave { sms: 127, ..H100 }).grid, 126);
        assert_eq!(pair.geometry(small, H100).grid, 4); // two 256-row pair tiles of 128 columns
        assert_eq!(pair.b_box_rows(), 64);
        let dense = |rows, cols| GemmSizes { rows, cols, k: 4096, groups: 1 };
        let (tile, row) = (BScales::Tile128, BScales::Row1x128);
        let shape = Fp8Gemm::shape_for;
        assert_eq!(shape(Grouping::Dense, tile, dense(16384, 4096), 132), TileShape::Rows256);
        assert_eq!(shape(Grouping::Dense, tile, dense(2048, 1024), 132), TileShape::Rows128);
        // A dense wgrad pairs its 256-row tiles in clusters; too few tiles keep 128 rows.
        assert_eq!(shape(Grouping::Dense, row, dense(4096, 16384), 132), TileShape::Pair128);
        assert_eq!(shape(Grouping::Dense, row, dense(2048, 1024), 132), TileShape::Rows128);
        let experts = |rows, groups| GemmSizes { rows, cols: 1408, k: 2048, groups };
        assert_eq!(shape(Grouping::Rows, tile, experts(65536, 128), 132), TileShape::Rows256);
        assert_eq!(shape(Grouping::Rows, tile, experts(65536, 512), 132), TileShape::Rows128);
        // Wgrads: every expert's (rows, cols) output counts; few tiles keep 128 rows.
        let wgrad = |rows, cols, groups| GemmSizes { rows, cols, k: 65536, groups };
        assert_eq!(shape(Grouping::K, row, wgrad(2816, 2048, 64), 132), TileShape::Rows256);
        assert_eq!(shape(Grouping::K, row, wgrad(512, 256, 8), 132), TileShape::Rows128);
    }
}
