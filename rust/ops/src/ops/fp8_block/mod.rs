//! `deepwell.fp8_block_quantize`, `fp8_block_quantize_rowcol` and `fp8_block_dequantize`
//! (docs/NUMERICS.md "FP8 block"). Schemas: torch_ops/deepwell/ops/fp8_block.py. Checks here, shared by
//! the CPU reference (`cpu.rs`, maths in rust/core/src/fp8_block.rs) and CUDA (`cuda.rs`,
//! cuda/fp8_block.cuh, cuda/fp8_block_transpose.cuh).
//!
//! Block shapes: 1x128 (activations and gradients along K), 128x1 (the same along M, for wgrad) and
//! 128x128 (weights). The tensor is viewed as (batch, rows, cols) with rows/cols its last two dims.

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::{copies_arg, run_on, run_one, Copies};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub use deepwell_gpu::kernels::fp8_block::Transposed;

pub static QUANTIZE: OpSpec = OpSpec {
    name: "fp8_block_quantize",
    args: &[("x", Kind::Tensor), ("block_rows", Kind::Int), ("block_cols", Kind::Int), ("pow2", Kind::Bool)],
    returns: 2,
};

pub static QUANTIZE_ROWCOL: OpSpec = OpSpec {
    name: "fp8_block_quantize_rowcol",
    args: &[("x", Kind::Tensor), ("pow2", Kind::Bool), ("m_major_scales", Kind::Bool), ("copies", Kind::Str)],
    returns: 4,
};

pub static QUANTIZE_TRANSPOSED: OpSpec =
    OpSpec { name: "fp8_block_quantize_transposed", args: &[("x", Kind::Tensor), ("pow2", Kind::Bool)], returns: 2 };

pub static DEQUANTIZE: OpSpec = OpSpec {
    name: "fp8_block_dequantize",
    args: &[
        ("data", Kind::Tensor),
        ("scale_inv", Kind::Tensor),
        ("block_rows", Kind::Int),
        ("block_cols", Kind::Int),
        ("out_dtype", Kind::OptScalarType),
    ],
    returns: 1,
};

pub fn kernels() -> Vec<Kernel> {
    [
        cpu_and_cuda!(QUANTIZE, quantize_boxed),
        cpu_and_cuda!(QUANTIZE_ROWCOL, quantize_rowcol_boxed),
        cpu_and_cuda!(QUANTIZE_TRANSPOSED, quantize_transposed_boxed),
        cpu_and_cuda!(DEQUANTIZE, dequantize_boxed),
    ]
    .concat()
}

// ---------------------------------------------------------------------------------------------
// The typed API: validates, then runs on `on` (the CPU reference or the CUDA kernels).

/// `fp8_block_quantize`: E4M3 with one fp32 scale per (block_rows, block_cols) block of the last two
/// dims, power-of-two scales when `pow2`; (data, scale_inv).
/// `scales`: `MMajor` (1x128 blocks only) stores the (batch*rows, cols/128) scales transposed.
pub fn quantize(
    op: Op,
    on: Backend,
    x: Tensor,
    block: (i64, i64),
    pow2: bool,
    scales: ScaleLayout,
) -> Result<[Tensor; 2]> {
    let mut q = Quantize::new(op, on, x, block, pow2)?;
    if scales == ScaleLayout::MMajor {
        if (q.g.br, q.g.bc) != (1, BLOCK as usize) {
            return Err(Error::Internal { op, msg: format!("M-major scales of {:?} blocks", (q.g.br, q.g.bc)) });
        }
        q.g.scale_shape = vec![(q.g.cols / q.g.bc) as i64, (q.g.batch * q.g.rows) as i64];
    }
    q.scales = scales;
    run_on(op, on, q, cpu::quantize, cuda::quantize)
}

/// `fp8_block_quantize_rowcol`: x (m, k) in 1x128 blocks along k and, transposed, along m, from one
/// read; [data (m, k), scale_inv (m, k/128), data (k, m), scale_inv (k, m/128)].
/// `scales`: how both scale tensors are stored (the torch op: `RowMajor` unless `m_major_scales`;
/// the GEMMs: `MMajor`, where the outputs are data (m, k), scales (k/128, m), data (k, m), scales
/// (m/128, k)).
pub fn quantize_rowcol(op: Op, on: Backend, x: Tensor, pow2: bool, scales: ScaleLayout) -> Result<[Tensor; 4]> {
    let q = QuantizeRowCol { scales, ..QuantizeRowCol::new(op, on, x, pow2)? };
    run_on(op, on, q, cpu::quantize_rowcol, cuda::quantize_rowcol)
}

/// `quantize_rowcol`'s outputs with only the copies `copies` names written, each left out an empty
/// tensor (the torch op's `copies`). `Rows` is `quantize(x, (1, 128))` and `Cols` is
/// `quantize_transposed(x, Cols)`: the same codes and scales as rowcol's (docs/NUMERICS.md "FP8
/// block"), for one read of x that writes half the bytes. x is checked as rowcol checks it.
pub fn quantize_copies(
    op: Op,
    on: Backend,
    x: Tensor,
    pow2: bool,
    scales: ScaleLayout,
    copies: Copies,
) -> Result<[Tensor; 4]> {
    let q = QuantizeRowCol::new(op, on, x, pow2)?;
    let none = |dtype| Tensor::empty(op, &[0], dtype, q.device);
    match copies {
        Copies::Both => quantize_rowcol(op, on, q.x, pow2, scales),
        Copies::Rows => {
            let (data, scale) = (none(DType::E4M3)?, none(DType::F32)?);
            let [rows, row_scale] = quantize(op, on, q.x, (1, BLOCK), pow2, scales)?;
            Ok([rows, row_scale, data, scale])
        }
        Copies::Cols => {
            let (data, scale) = (none(DType::E4M3)?, none(DType::F32)?);
            let [cols, col_scale] = quantize_transposed(op, on, q.x, Transposed::Cols, pow2)?;
            let col_scale = match scales {
                ScaleLayout::MMajor => col_scale,
                ScaleLayout::RowMajor => crate::aten::transpose_copy(op, &col_scale)?, // (k, m/128)
            };
            Ok([data, scale, cols, col_scale])
        }
    }
}

/// How a kernel stores 1x128 scales of logical shape (rows, cols / 128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// Row-major (rows, cols / 128): the torch ops' default layout.
    RowMajor,
    /// Stored transposed, (cols / 128, rows) row-major: the M-major layout cuBLASLt's blockwise
    /// GEMM reads; the logical scales are its `.t()` view.
    MMajor,
}

/// x (m, k) transposed and quantized in one read, without the row copy (the linear layers'
/// operands; the torch op `fp8_block_quantize_transposed` is `TileT`): `Cols` gives [data (k, m), scale_inv stored M-major as (m/128, k)],
/// rowcol's last two outputs with `ScaleLayout::MMajor`; `TileT` gives [data (k, m), scale_inv (k/128, m/128)], `quantize(x, (128, 128))`
/// transposed (docs/NUMERICS.md "Transposes": a 128x128 block's scale does not depend on the
/// orientation).
pub fn quantize_transposed(op: Op, on: Backend, x: Tensor, out: Transposed, pow2: bool) -> Result<[Tensor; 2]> {
    let q = QuantizeTransposed { q: QuantizeRowCol::new(op, on, x, pow2)?, out };
    run_on(op, on, q, cpu::quantize_transposed, cuda::quantize_transposed)
}

/// `fp8_block_dequantize`: data * scale_inv per block, in `out_dtype` (bf16 when None).
pub fn dequantize(
    op: Op,
    on: Backend,
    data: Tensor,
    scale_inv: Tensor,
    block: (i64, i64),
    out_dtype: Option<DType>,
) -> Result<Tensor> {
    let q = Dequantize::new(op, on, data, scale_inv, block, out_dtype)?;
    run_one(op, on, q, cpu::dequantize, cuda::dequantize)
}

// The dispatcher's entry points: the schema's arguments, then the typed call.

fn quantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, block, pow2) = (a.tensor("x")?, (a.int("block_rows")?, a.int("block_cols")?), a.bool("pow2")?);
    Ok(quantize(a.op(), on, x, block, pow2, ScaleLayout::RowMajor)?.into())
}

fn quantize_rowcol_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, pow2) = (a.tensor("x")?, a.bool("pow2")?);
    let scales = if a.bool("m_major_scales")? { ScaleLayout::MMajor } else { ScaleLayout::RowMajor };
    Ok(quantize_copies(a.op(), on, x, pow2, scales, copies_arg(a)?)?.into())
}

fn quantize_transposed_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, pow2) = (a.tensor("x")?, a.bool("pow2")?);
    Ok(quantize_transposed(a.op(), on, x, Transposed::TileT, pow2)?.into())
}

fn dequantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (data, scale_inv) = (a.tensor("data")?, a.tensor("scale_inv")?);
    let block = (a.int("block_rows")?, a.int("block_cols")?);
    let out_dtype = a.opt_scalar_type("out_dtype")?;
    Ok(vec![dequantize(a.op(), on, data, scale_inv, block, out_dtype)?])
}

/// The supported block shapes (DeepSeek-V3 / Transformer Engine Float8BlockScaling).
const BLOCKS: [(i64, i64); 3] = [(1, 128), (128, 1), (128, 128)];
const BLOCK: i64 = 128;

/// (batch, rows, cols, block_rows, block_cols) of a validated tensor, and its scale's shape.
struct Geometry {
    batch: usize,
    rows: usize,
    cols: usize,
    br: usize,
    bc: usize,
    scale_shape: Vec<i64>,
}

fn geometry(op: Op, arg: &'static str, t: &Tensor, br: i64, bc: i64) -> Result<Geometry> {
    if !BLOCKS.contains(&(br, bc)) {
        return Err(Error::arg(
            op,
            "block_rows, block_cols",
            "be (1, 128), (128, 1) or (128, 128)",
            format!("({br}, {bc})"),
        ));
    }
    check::non_empty(op, arg, t, 2)?;
    let n = t.dim();
    check::divisible(op, arg, t, n - 2, br as usize, "block_rows")?;
    check::divisible(op, arg, t, n - 1, bc as usize, "block_cols")?;
    let sizes = t.sizes();
    let (rows, cols) = (sizes[n - 2], sizes[n - 1]);
    let batch: i64 = sizes[..n - 2].iter().product();
    let mut scale_shape = sizes.to_vec();
    scale_shape[n - 2] /= br;
    scale_shape[n - 1] /= bc;
    Ok(Geometry {
        batch: batch as usize,
        rows: rows as usize,
        cols: cols as usize,
        br: br as usize,
        bc: bc as usize,
        scale_shape,
    })
}

struct Quantize {
    x: Tensor,
    dtype: DType,
    device: Device,
    g: Geometry,
    pow2: bool,
    scales: ScaleLayout,
}

impl Quantize {
    fn new(op: Op, backend: Backend, x: Tensor, (br, bc): (i64, i64), pow2: bool) -> Result<Quantize> {
        let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
        let device = check::same_device(op, backend, &[("x", &x)])?;
        let g = geometry(op, "x", &x, br, bc)?;
        Ok(Quantize { x, dtype, device, g, pow2, scales: ScaleLayout::RowMajor })
    }
}

/// A validated `fp8_block_quantize_rowcol` call: x is (m, k), both multiples of 128.
struct QuantizeRowCol {
    x: Tensor,
    dtype: DType,
    device: Device,
    m: i64,
    k: i64,
    pow2: bool,
    scales: ScaleLayout,
}

impl QuantizeRowCol {
    fn new(op: Op, backend: Backend, x: Tensor, pow2: bool) -> Result<QuantizeRowCol> {
        let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
        let device = check::same_device(op, backend, &[("x", &x)])?;
        if x.dim() != 2 {
            return Err(Error::arg(op, "x", "be 2-d (rows, k)", format!("a {}-d tensor", x.dim())));
        }
        check::non_empty(op, "x", &x, 2)?;
        check::divisible(op, "x", &x, 0, BLOCK as usize, "the transposed copy has 1x128 blocks along rows")?;
        check::divisible(op, "x", &x, 1, BLOCK as usize, "the row-wise copy has 1x128 blocks along k")?;
        let (m, k) = (x.sizes()[0], x.sizes()[1]);
        Ok(QuantizeRowCol { x, dtype, device, m, k, pow2, scales: ScaleLayout::RowMajor })
    }

    fn shapes(&self) -> [Vec<i64>; 4] {
        rowcol_shapes(self.m, self.k, self.scales)
    }
}

/// What rowcol of an (m, k) matrix writes: row data (m, k), row scales (m, k/128), transposed col
/// data (k, m), col scales (k, m/128); the scales' storage transposed for `ScaleLayout::MMajor`.
pub(crate) fn rowcol_shapes(m: i64, k: i64, scales: ScaleLayout) -> [Vec<i64>; 4] {
    match scales {
        ScaleLayout::RowMajor => [vec![m, k], vec![m, k / BLOCK], vec![k, m], vec![k, m / BLOCK]],
        ScaleLayout::MMajor => [vec![m, k], vec![k / BLOCK, m], vec![k, m], vec![m / BLOCK, k]],
    }
}

/// A validated `quantize_transposed` call (x as for rowcol).
struct QuantizeTransposed {
    q: QuantizeRowCol,
    out: Transposed,
}

impl QuantizeTransposed {
    /// Data (k, m) and its scales: (k, m/128) for `Cols`, (k/128, m/128) for `TileT`.
    fn shapes(&self) -> [Vec<i64>; 2] {
        let (m, k) = (self.q.m, self.q.k);
        match self.out {
            Transposed::Cols => [vec![k, m], vec![m / BLOCK, k]],
            Transposed::TileT => [vec![k, m], vec![k / BLOCK, m / BLOCK]],
        }
    }
}

struct Dequantize {
    data: Tensor,
    scale_inv: Tensor,
    device: Device,
    g: Geometry,
    out_dtype: DType,
}

impl Dequantize {
    fn new(
        op: Op,
        backend: Backend,
        data: Tensor,
        scale_inv: Tensor,
        (br, bc): (i64, i64),
        out_dtype: Option<DType>,
    ) -> Result<Dequantize> {
        let out_dtype = check::out_dtype(op, out_dtype)?;
        check::dtype_in(op, "data", &data, &[DType::E4M3])?;
        check::dtype_in(op, "scale_inv", &scale_inv, &[DType::F32])?;
        let device = check::same_device(op, backend, &[("data", &data), ("scale_inv", &scale_inv)])?;
        let g = geometry(op, "data", &data, br, bc)?;
        check::shape_eq(op, "scale_inv", &scale_inv, &g.scale_shape)?;
        Ok(Dequantize { data, scale_inv, device, g, out_dtype })
    }
}
