//! Kernel identity and launch geometry (cuda/INTERFACE.md). A kernel is one template
//! specialization named by a typed key (`KernelId`: a closed enum per family with small typed
//! template arguments; Copy, and a few bytes to hash on every launch). The NVRTC name expression
//! string is made from the key only when compiling, for the disk-cache key and for reports.
//!
//! Each family module holds its key, the list of its specializations (`all`) and `geometry`: a pure
//! function from the kernel's sizes to its grid, mirroring how much work one CTA covers per
//! grid-stride iteration in the .cuh (constants cited there and pinned by the tests below).

pub mod fp8_block;
pub mod fp8_gemm;
pub mod fp8_tensor;
pub mod linear;
pub mod moe;
pub mod mxfp8;
pub mod nvfp4;
pub mod swiglu;
pub mod swizzle;

use crate::arch::grid_blocks;
use crate::sources::Header;

pub use fp8_block::{Block, Fp8Block};
pub use fp8_gemm::Fp8Gemm;
pub use fp8_tensor::Fp8Tensor;
pub use linear::LinearEpilogue;
pub use moe::Moe;
pub use mxfp8::Mxfp8;
pub use nvfp4::Nvfp4;
pub use swiglu::Swiglu;
pub use swizzle::Swizzle;

/// Threads per CTA of every kernel but the FP8 GEMM's (cuda/common.cuh:14 `THREADS`, each kernel's
/// `__launch_bounds__`; fp8_gemm.cuh has its own, `fp8_gemm::THREADS`).
pub const THREADS: u32 = 256;
const T: u64 = THREADS as u64;

/// A float element type's template tag (cuda/common.cuh `F32`, `BF16`, `F16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Float {
    F32,
    BF16,
    F16,
}

impl Float {
    pub const ALL: [Float; 3] = [Float::F32, Float::BF16, Float::F16];

    fn tag(self) -> &'static str {
        match self {
            Float::F32 => "deepwell::F32",
            Float::BF16 => "deepwell::BF16",
            Float::F16 => "deepwell::F16",
        }
    }

    /// Bytes per element (cuda/common.cuh `Bytes<T>::N`).
    pub fn bytes(self) -> u64 {
        match self {
            Float::F32 => 4,
            Float::BF16 | Float::F16 => 2,
        }
    }
}

/// `KernelId`, one variant per family's key, with `From<key> for KernelId` and the key's
/// `template()` for each: the one list of families.
macro_rules! kernel_ids {
    ($($variant:ident($key:ty)),*) => {
        /// One kernel: a template specialization of one family's header.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum KernelId {
            $($variant($key)),*
        }

        impl KernelId {
            /// The kernel's template name and arguments, as its family's key gives them.
            fn template(self) -> (&'static str, Vec<Arg>) {
                match self {
                    $(KernelId::$variant(k) => k.template()),*
                }
            }
        }

        $(
            impl From<$key> for KernelId {
                fn from(k: $key) -> KernelId {
                    KernelId::$variant(k)
                }
            }
        )*
    };
}
kernel_ids!(
    Mxfp8(Mxfp8),
    Fp8Block(Fp8Block),
    Fp8Tensor(Fp8Tensor),
    Nvfp4(Nvfp4),
    Swizzle(Swizzle),
    Linear(LinearEpilogue),
    Moe(Moe),
    Fp8Gemm(Fp8Gemm),
    Swiglu(Swiglu)
);

impl KernelId {
    pub fn header(self) -> Header {
        match self {
            KernelId::Mxfp8(_) => Header::Mxfp8,
            KernelId::Fp8Block(k) => k.header(),
            KernelId::Fp8Tensor(_) => Header::Fp8Tensor,
            KernelId::Nvfp4(_) => Header::Nvfp4,
            KernelId::Swizzle(_) => Header::Swizzle,
            KernelId::Linear(_) => Header::Linear,
            KernelId::Moe(_) => Header::Moe,
            KernelId::Fp8Gemm(_) => Header::Fp8Gemm,
            KernelId::Swiglu(_) => Header::Swiglu,
        }
    }

    /// The NVRTC name expression, e.g. `deepwell::mxfp8_quantize_rows<deepwell::BF16, 0, 0>`.
    pub fn name_expression(self) -> String {
        let (template, args) = self.template();
        let args: Vec<String> = args.iter().map(Arg::to_string).collect();
        format!("deepwell::{template}<{}>", args.join(", "))
    }

    /// Whether the kernel takes dynamic shared memory that, with its static arrays, may pass 48 KiB
    /// (it opts in at load).
    pub fn dynamic_smem(self) -> bool {
        matches!(self, KernelId::Fp8Gemm(_) | KernelId::Swiglu(Swiglu::Rowcol { .. }))
    }

    /// The whole translation unit NVRTC compiles: the header; NVRTC instantiates the template
    /// named by the name expression.
    pub fn translation_unit(self) -> String {
        format!("#include \"{}\"\n", self.header().file_name())
    }
}

/// A template argument: a float tag or an `int` (cuda/INTERFACE.md: booleans and enums are ints).
#[derive(Clone, Copy)]
enum Arg {
    Float(Float),
    Int(u8),
}

impl std::fmt::Display for Arg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arg::Float(t) => f.write_str(t.tag()),
            Arg::Int(i) => write!(f, "{i}"),
        }
    }
}

/// Every kernel deepwell can launch (for `python -m deepwell.kernels --compile-all`).
pub fn all() -> Vec<KernelId> {
    let mut v: Vec<KernelId> = mxfp8::all().into_iter().map(KernelId::Mxfp8).collect();
    v.extend(nvfp4::all().into_iter().map(KernelId::Nvfp4));
    v.extend(fp8_block::all().into_iter().map(KernelId::Fp8Block));
    v.extend(fp8_tensor::all().into_iter().map(KernelId::Fp8Tensor));
    v.extend(swizzle::all().into_iter().map(KernelId::Swizzle));
    v.extend(linear::all().into_iter().map(KernelId::Linear));
    v.extend(moe::all().into_iter().map(KernelId::Moe));
    v.extend(fp8_gemm::all().into_iter().map(KernelId::Fp8Gemm));
    v.extend(swiglu::all().into_iter().map(KernelId::Swiglu));
    v
}

/// How many CTAs are resident at once: `per_sm` of THREADS threads on each of `sms` SMs.
#[derive(Clone, Copy, Debug)]
pub struct Wave {
    pub sms: u32,
    pub per_sm: u32,
}

/// A 1-D launch. `smem` is dynamic shared memory: every kernel's shared memory is static, so 0.
/// `cluster`: CTAs per thread-block cluster (1: no clusters); the grid is then a multiple of it,
/// and the launcher may cut a persistent grid to the clusters that fit at once.
/// `resident`: the launcher cuts the grid to the CTAs that fit at once (the kernel's occupancy as
/// the driver computes it from its registers and shared memory, times the SMs). For grid-stride
/// kernels whose CTAs fetch their next unit while they work on this one: `Wave` caps a grid by
/// thread count alone (8 CTAs of 256 threads per SM), and where registers let fewer fit, the
/// CTAs past them ran one unit each, in later waves, with nothing fetched ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub grid: u32,
    pub block: u32,
    pub smem: u32,
    pub cluster: u32,
    pub resident: bool,
}

impl Wave {
    /// A grid-stride launch over `work` units, `per_cta` per CTA per iteration: enough CTAs to
    /// cover the work once, capped at one wave (the loops cover the rest), at least one.
    pub fn cover(self, work: u64, per_cta: u64) -> Geometry {
        let grid = grid_blocks(work, per_cta, self.sms, self.per_sm);
        Geometry { grid, block: THREADS, smem: 0, cluster: 1, resident: false }
    }

    /// `cover`, its grid then cut by the launcher to the CTAs that fit at once (`Geometry::resident`).
    pub fn cover_resident(self, work: u64, per_cta: u64) -> Geometry {
        Geometry { resident: true, ..self.cover(work, per_cta) }
    }

    /// The dequantize kernels of mxfp8.cuh and fp8_block.cuh (the same loops): on the vector path
    /// a CTA covers THREADS * DQ_UNROLL pieces of 16 / sizeof(Out) elements per iteration
    /// (`dequant_vec` of mxfp8.cuh and fp8_block.cuh), on the scalar path THREADS elements
    /// (`dequant_scalar`).
    fn dequantize(self, out: Float, numel: u64, vector: bool) -> Geometry {
        let p = 16 / out.bytes();
        if vector {
            self.cover(numel / p, T * DQ_UNROLL)
        } else {
            self.cover(numel, T)
        }
    }
}

/// Pieces per thread of `dequant_vec` in both mxfp8.cuh and fp8_block.cuh (`DQ_UNROLL`).
const DQ_UNROLL: u64 = 4;

/// A family of kernels: its key converts to `KernelId` and sizes its own launches.
pub trait Family: Copy + Into<KernelId> {
    /// The sizes the family's kernels take (the kernel arguments that set the work).
    type Sizes: Copy;
    fn geometry(self, sizes: Self::Sizes, wave: Wave) -> Geometry;
}

/// A (rows, cols) matrix: the sizes of the NVFP4, swizzle and epilogue kernels.
#[derive(Clone, Copy, Debug)]
pub struct Matrix {
    pub rows: u64,
    pub cols: u64,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The value of `constexpr int NAME = <n>;` in `header`'s source, so the tests pin the Rust
    /// mirrors of per-CTA work to the kernels' own constants.
    pub fn cuh_int(header: Header, name: &str) -> u64 {
        let pat = format!("constexpr int {name} = ");
        let src = header.source();
        let at = src.find(&pat).unwrap_or_else(|| panic!("{name} not in {}", header.file_name())) + pat.len();
        let digits: String = src[at..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or_else(|_| panic!("{name} in {} is not a literal", header.file_name()))
    }

    pub const H100: Wave = Wave { sms: 132, per_sm: 8 };

    #[test]
    fn every_kernel_is_distinct_and_named_like_interface_md() {
        let all = all();
        // + moe.cuh's 7 routing / permutation and 9 value-move kernels, fp8_tensor.cuh's 24, fp8_gemm.cuh's 45,
        // swiglu.cuh's 6 elementwise and 12 fused quantizers
        assert_eq!(all.len(), 131 + 7 + 9 + 24 + 45 + 6 + 12);
        let names: std::collections::HashSet<String> = all.iter().map(|k| k.name_expression()).collect();
        assert_eq!(names.len(), all.len());
        let rows =
            KernelId::Mxfp8(Mxfp8::Rows { input: Float::BF16, mode: mxfp8::Mode::Rceil, elem: mxfp8::Fp8::E4M3 });
        assert_eq!(rows.name_expression(), "deepwell::mxfp8_quantize_rows<deepwell::BF16, 0, 0>");
        assert_eq!(KernelId::Swizzle(Swizzle::Unswizzle).name_expression(), "deepwell::unswizzle_scales<0>");
        assert_eq!(rows.translation_unit(), "#include \"mxfp8.cuh\"\n");
    }

    /// Every Rust mirror of a per-CTA work constant equals the kernel's own.
    #[test]
    fn constants_match_the_headers() {
        let mirrors = [
            (Header::Common, "THREADS", T),
            (Header::Mxfp8, "ROWS_UNROLL", mxfp8::ROWS_UNROLL),
            (Header::Mxfp8, "MX_COLS_V", mxfp8::MX_COLS_V),
            (Header::Mxfp8, "RC_TILE", mxfp8::RC_TILE),
            (Header::Mxfp8, "DQ_UNROLL", DQ_UNROLL),
            (Header::Fp8Block, "TILE", fp8_block::TILE),
            (Header::Fp8Block, "DQ_UNROLL", DQ_UNROLL),
            (Header::Fp8Tensor, "TILE", fp8_tensor::TILE),
            (Header::Nvfp4, "BLOCK", nvfp4::BLOCK),
        ];
        for (header, name, mirror) in mirrors {
            assert_eq!(cuh_int(header, name), mirror, "{} {name}", header.file_name());
        }
        // The headers' own summaries of the work per CTA, which the geometry follows.
        for (header, summary) in [
            (Header::Mxfp8, "rows:    THREADS / 4 * ROWS_UNROLL = 256 blocks of 32"),
            (Header::Mxfp8, "rowcol:  one 128 x 128 tile (RC_TILE)"),
            (Header::Fp8Block, "quantize, rowcol: one 128 x 128 tile"),
            (Header::Fp8Tensor, "cast_transposed: one 64 x 64 tile (TILE)"),
            (Header::Nvfp4, "quantizes a unit of 16 rows x 16 tiles (256 columns)"),
        ] {
            assert!(header.source().contains(summary), "{}: {summary}", header.file_name());
        }
        assert_eq!(T / 4 * mxfp8::ROWS_UNROLL, 256);
    }

    #[test]
    fn cover_is_grid_blocks() {
        assert_eq!(H100.cover(0, 256), Geometry { grid: 1, block: 256, smem: 0, cluster: 1, resident: false });
        assert!(H100.cover_resident(1000, 256).resident && H100.cover_resident(1000, 256).grid == 4);
        assert_eq!(H100.cover(1000, 256).grid, 4);
        assert_eq!(H100.cover(1 << 40, 1).grid, 132 * 8);
    }
}
