//! cuda/fp8_block.cuh and its transposing pass, cuda/fp8_block_transpose.cuh: keys and launch geometry.

use super::{Arg, Family, Float, Geometry, Wave};
use crate::sources::Header;

/// The block shape (template `BR`, `BC`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Block {
    /// 1 x 128: along the last dim.
    Row,
    /// 128 x 1: along the rows.
    Col,
    /// 128 x 128.
    Tile,
}

impl Block {
    pub const ALL: [Block; 3] = [Block::Row, Block::Col, Block::Tile];

    /// (BR, BC).
    pub fn shape(self) -> (u8, u8) {
        match self {
            Block::Row => (1, 128),
            Block::Col => (128, 1),
            Block::Tile => (128, 128),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Block {
    /// `m_major` (1x128 only): scales stored M-major (template `MM`), as cuBLASLt reads them.
    Quantize {
        input: Float,
        block: Block,
        m_major: bool,
    },
    /// `m_major`: both scale tensors stored M-major (template `MM`), as cuBLASLt reads them.
    Rowcol {
        input: Float,
        m_major: bool,
    },
    /// One half of a transposing pass (`fp8_block_quantize_transposed`).
    Transposed {
        input: Float,
        out: Transposed,
    },
    Dequantize {
        out: Float,
        block: Block,
    },
}

/// What `fp8_block_quantize_transposed` writes of x (m, k) (template `MODE`,
/// cuda/fp8_block_transpose.cuh `TransposedOut`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transposed {
    /// x^T (k, m) in 1x128 blocks along m: rowcol's column copy alone, its (k, m/128) scales
    /// stored M-major as (m/128, k) (`COLS` = 1).
    Cols,
    /// x^T (k, m) in 128x128 blocks: fp8_block_quantize(x, 128, 128) transposed (`TILE_T` = 2).
    TileT,
}

impl Transposed {
    pub const ALL: [Transposed; 2] = [Transposed::Cols, Transposed::TileT];

    fn mode(self) -> u8 {
        match self {
            Transposed::Cols => 1,
            Transposed::TileT => 2,
        }
    }
}

/// x (batch, rows, cols); Rowcol takes x (m, k) as (1, m, k). `aligned`: every pointer argument
/// is 16-byte aligned (when false the geometry assumes the scalar paths, see mxfp8::Sizes).
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub batch: u64,
    pub rows: u64,
    pub cols: u64,
    pub aligned: bool,
}

// Per-CTA work, mirrored from cuda/fp8_block.cuh (the tests parse the originals).
/// Side of the tile a CTA quantizes per iteration, in quantize_tiles and transposed_tiles
/// (fp8_block.cuh `TILE`, `quantize_tiles`; fp8_block_transpose.cuh `transposed_tiles`).
pub(super) const TILE: u64 = 128;

impl Fp8Block {
    /// The header that defines the kernel: the transposing pass's own for rowcol and its halves.
    pub(super) fn header(self) -> Header {
        match self {
            Fp8Block::Rowcol { .. } | Fp8Block::Transposed { .. } => Header::Fp8BlockTranspose,
            Fp8Block::Quantize { .. } | Fp8Block::Dequantize { .. } => Header::Fp8Block,
        }
    }

    pub(super) fn template(self) -> (&'static str, Vec<Arg>) {
        use Arg::{Float as F, Int as I};
        match self {
            Fp8Block::Quantize { input, block, m_major } => {
                let (br, bc) = block.shape();
                ("fp8_block_quantize", vec![F(input), I(br), I(bc), I(m_major as u8)])
            }
            Fp8Block::Rowcol { input, m_major } => ("fp8_block_quantize_rowcol", vec![F(input), I(m_major as u8)]),
            Fp8Block::Transposed { input, out } => ("fp8_block_quantize_transposed", vec![F(input), I(out.mode())]),
            Fp8Block::Dequantize { out, block } => {
                let (br, bc) = block.shape();
                ("fp8_block_dequantize", vec![F(out), I(br), I(bc)])
            }
        }
    }
}

impl Family for Fp8Block {
    type Sizes = Sizes;

    fn geometry(self, s: Sizes, wave: Wave) -> Geometry {
        let n = s.batch * s.rows * s.cols;
        match self {
            // One TILE x TILE tile of the (nrows, ncols) view per CTA, partial edge tiles included
            // (fp8_block.cuh `fp8_block_quantize`, `quantize_tiles`): 1 x 128 blocks view the flat tensor as
            // (n / 128, 128).
            Fp8Block::Quantize { block, .. } => {
                let (nrows, ncols) = if block == Block::Row { (n / TILE, TILE) } else { (s.batch * s.rows, s.cols) };
                wave.cover(nrows.div_ceil(TILE) * ncols.div_ceil(TILE), 1)
            }
            // Whole tiles only (m, k multiples of 128; `transposed_tiles`), each CTA loading its next
            // tile while it quantizes and stores this one: as many CTAs as fit at once.
            Fp8Block::Rowcol { .. } | Fp8Block::Transposed { .. } => {
                wave.cover_resident((s.rows / TILE) * (s.cols / TILE), 1)
            }
            // The vector path needs cols % (16 / sizeof(Out)) == 0 (fp8_block.cuh `fp8_block_dequantize`).
            Fp8Block::Dequantize { out, .. } => wave.dequantize(out, n, s.aligned && s.cols % (16 / out.bytes()) == 0),
        }
    }
}

/// Every specialization the FP8-block ops launch.
pub fn all() -> Vec<Fp8Block> {
    let mut v = Vec::new();
    for input in Float::ALL {
        for block in Block::ALL {
            v.push(Fp8Block::Quantize { input, block, m_major: false });
            v.push(Fp8Block::Dequantize { out: input, block });
        }
        v.push(Fp8Block::Quantize { input, block: Block::Row, m_major: true });
        v.push(Fp8Block::Rowcol { input, m_major: false });
        v.push(Fp8Block::Rowcol { input, m_major: true });
        for out in Transposed::ALL {
            v.push(Fp8Block::Transposed { input, out });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::super::tests::H100;
    use super::*;

    fn grid(k: Fp8Block, batch: u64, rows: u64, cols: u64) -> u32 {
        k.geometry(Sizes { batch, rows, cols, aligned: true }, H100).grid
    }

    fn quantize(block: Block) -> Fp8Block {
        Fp8Block::Quantize { input: Float::BF16, block, m_major: false }
    }

    #[test]
    fn quantize_covers_one_tile_per_cta() {
        for block in Block::ALL {
            assert_eq!(grid(quantize(block), 1, 128, 128), 1, "{block:?}");
            assert_eq!(grid(quantize(block), 1, 1024, 1024), 64, "{block:?}");
            assert_eq!(grid(quantize(block), 1, 16384, 4096), 132 * 8, "{block:?}");
        }
        // 1 x 128 on a tensor smaller than a tile: the flat (1, 128) view is one partial tile.
        assert_eq!(grid(quantize(Block::Row), 1, 1, 128), 1);
        // 128 x 1 with a partial column tile: (2 x 128 rows) x ceil(200 / 128) tiles.
        assert_eq!(grid(quantize(Block::Col), 2, 128, 200), 4);
        // 1 x 128: (8, 128, 384) is 3072 rows of 128 = 24 tile rows.
        assert_eq!(grid(quantize(Block::Row), 8, 128, 384), 24);
    }

    #[test]
    fn rowcol_covers_one_tile_per_cta() {
        let cols = Fp8Block::Transposed { input: Float::BF16, out: Transposed::Cols };
        let tile_t = Fp8Block::Transposed { input: Float::F32, out: Transposed::TileT };
        for k in [Fp8Block::Rowcol { input: Float::BF16, m_major: false }, cols, tile_t] {
            assert_eq!(grid(k, 1, 128, 128), 1);
            assert_eq!(grid(k, 1, 1024, 512), 32);
            assert_eq!(grid(k, 1, 16384, 4096), 132 * 8);
        }
    }

    #[test]
    fn dequantize_pieces() {
        let bf16 = Fp8Block::Dequantize { out: Float::BF16, block: Block::Row };
        let f32 = Fp8Block::Dequantize { out: Float::F32, block: Block::Tile };
        assert_eq!(grid(bf16, 1, 1, 128), 1);
        assert_eq!(grid(bf16, 1, 64, 4096), 32);
        assert_eq!(grid(f32, 1, 64, 4096), 64);
        assert_eq!(grid(bf16, 1, 128, 12), 6); // cols % 8 != 0: scalar, 1536 elements
        let unaligned = bf16.geometry(Sizes { batch: 1, rows: 64, cols: 4096, aligned: false }, H100);
        assert_eq!(unaligned.grid, 1024); // scalar: 262144 elements, 256 per CTA
        assert_eq!(grid(f32, 4, 16384, 4096), 132 * 8);
    }
}
