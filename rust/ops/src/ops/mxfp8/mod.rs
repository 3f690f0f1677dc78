//! `deepwell.mxfp8_quantize`, `mxfp8_quantize_rowcol` and `mxfp8_dequantize` (docs/NUMERICS.md "MXFP8").
//! Schemas: torch_ops/deepwell/ops/mxfp8.py. Argument checks live here, shared by the CPU
//! reference (`cpu.rs`, maths in rust/core/src/mxfp8.rs) and the CUDA kernels (`cuda.rs`,
//! cuda/mxfp8.cuh), so both backends accept and reject exactly the same inputs.

pub(crate) mod cpu;
pub(crate) mod cuda;

use deepwell_core::mxfp8::{Fp8Elem, ScaleMode, MX_BLOCK};
use deepwell_core::shape::Dims3;

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::{run_on, run_one};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static QUANTIZE: OpSpec = OpSpec {
    name: "mxfp8_quantize",
    args: &[("x", Kind::Tensor), ("dim", Kind::Int), ("scale_mode", Kind::Str), ("elem", Kind::Str)],
    returns: 2,
};

pub static QUANTIZE_ROWCOL: OpSpec = OpSpec {
    name: "mxfp8_quantize_rowcol",
    args: &[
        ("x", Kind::Tensor),
        ("scale_mode", Kind::Str),
        ("elem", Kind::Str),
        ("col_transposed", Kind::Bool),
        ("swizzle", Kind::Bool),
    ],
    returns: 4,
};

pub static DEQUANTIZE: OpSpec = OpSpec {
    name: "mxfp8_dequantize",
    args: &[("data", Kind::Tensor), ("scale", Kind::Tensor), ("dim", Kind::Int), ("out_dtype", Kind::OptScalarType)],
    returns: 1,
};

pub fn kernels() -> Vec<Kernel> {
    [
        cpu_and_cuda!(QUANTIZE, quantize_boxed),
        cpu_and_cuda!(QUANTIZE_ROWCOL, quantize_rowcol_boxed),
        cpu_and_cuda!(DEQUANTIZE, dequantize_boxed),
    ]
    .concat()
}

/// The scale rounding and element format of an MXFP8 quantization (docs/NUMERICS.md "MXFP8").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MxOptions {
    pub mode: ScaleMode,
    pub elem: Fp8Elem,
}

impl MxOptions {
    /// What training uses: rceil scales, E4M3 elements (the OCP MX recipe).
    pub const TRAINING: MxOptions = MxOptions { mode: ScaleMode::Rceil, elem: Fp8Elem::E4M3 };
}

// ---------------------------------------------------------------------------------------------
// The typed API: validates, then runs on `on` (the CPU reference or the CUDA kernels).

/// `mxfp8_quantize`: x quantized in blocks of 32 along `dim`; (data, scale).
pub fn quantize(op: Op, on: Backend, x: Tensor, dim: i64, o: MxOptions) -> Result<[Tensor; 2]> {
    let q = Quantize::new(op, on, x, dim, o)?;
    run_on(op, on, q, cpu::quantize, cuda::quantize)
}

/// `mxfp8_quantize_rowcol`: x (m, k) along k and along m from one read; [row data, row scale,
/// col data, col scale] (col transposed to (k, m) when asked; scales swizzled when asked).
pub fn quantize_rowcol(
    op: Op,
    on: Backend,
    x: Tensor,
    o: MxOptions,
    col_transposed: bool,
    swizzle: bool,
) -> Result<[Tensor; 4]> {
    let q = QuantizeRowCol::new(op, on, x, o, col_transposed, swizzle)?;
    run_on(op, on, q, cpu::quantize_rowcol, cuda::quantize_rowcol)
}

/// `mxfp8_dequantize`: data * scale along `dim`, in `out_dtype` (bf16 when None).
pub fn dequantize(
    op: Op,
    on: Backend,
    data: Tensor,
    scale: Tensor,
    dim: i64,
    out_dtype: Option<DType>,
) -> Result<Tensor> {
    let q = Dequantize::new(op, on, data, scale, dim, out_dtype)?;
    run_one(op, on, q, cpu::dequantize, cuda::dequantize)
}

// The dispatcher's entry points: the schema's arguments, then the typed call.

fn quantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, dim, o) = (a.tensor("x")?, a.int("dim")?, parse_options(a)?);
    Ok(quantize(a.op(), on, x, dim, o)?.into())
}

fn quantize_rowcol_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, o) = (a.tensor("x")?, parse_options(a)?);
    let (col_transposed, swizzle) = (a.bool("col_transposed")?, a.bool("swizzle")?);
    Ok(quantize_rowcol(a.op(), on, x, o, col_transposed, swizzle)?.into())
}

fn dequantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (data, scale, dim) = (a.tensor("data")?, a.tensor("scale")?, a.int("dim")?);
    let out_dtype = a.opt_scalar_type("out_dtype")?;
    Ok(vec![dequantize(a.op(), on, data, scale, dim, out_dtype)?])
}

/// x's shape with `dim` divided by the block.
fn scale_shape(sizes: &[i64], dim: usize) -> Vec<i64> {
    let mut s = sizes.to_vec();
    s[dim] /= MX_BLOCK as i64;
    s
}

fn parse_options(a: &mut Args) -> Result<MxOptions> {
    let op = a.op();
    let mode = check::parse(op, "scale_mode", &a.str("scale_mode")?, "'rceil', 'floor'")?;
    let elem = check::parse(op, "elem", &a.str("elem")?, "'e4m3', 'e5m2'")?;
    Ok(MxOptions { mode, elem })
}

/// A validated `mxfp8_quantize` call.
struct Quantize {
    x: Tensor,
    dtype: DType,
    device: Device,
    dims: Dims3,
    mode: ScaleMode,
    elem: Fp8Elem,
    data_shape: Vec<i64>,
    scale_shape: Vec<i64>,
}

impl Quantize {
    fn new(op: Op, backend: Backend, x: Tensor, dim: i64, o: MxOptions) -> Result<Quantize> {
        let MxOptions { mode, elem } = o;
        let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
        let device = check::same_device(op, backend, &[("x", &x)])?;
        check::non_empty(op, "x", &x, 1)?;
        let d = check::dim(op, "dim", dim, x.dim())?;
        check::divisible(op, "x", &x, d, MX_BLOCK, "the MX block size along `dim`")?;
        let dims = Dims3::from_shape(&check::sizes_usize(&x), d);
        let (data_shape, scale_shape) = (x.sizes().to_vec(), scale_shape(x.sizes(), d));
        Ok(Quantize { x, dtype, device, dims, mode, elem, data_shape, scale_shape })
    }
}

/// A validated `mxfp8_quantize_rowcol` call: x is (m, k), both multiples of 32.
struct QuantizeRowCol {
    x: Tensor,
    dtype: DType,
    device: Device,
    m: usize,
    k: usize,
    mode: ScaleMode,
    elem: Fp8Elem,
    col_transposed: bool,
    swizzle: bool,
}

impl QuantizeRowCol {
    fn new(op: Op, backend: Backend, x: Tensor, o: MxOptions, col_transposed: bool, swizzle: bool) -> Result<Self> {
        let MxOptions { mode, elem } = o;
        let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
        let device = check::same_device(op, backend, &[("x", &x)])?;
        if x.dim() != 2 {
            return Err(Error::arg(op, "x", "be 2-d (rows, k)", format!("a {}-d tensor", x.dim())));
        }
        check::non_empty(op, "x", &x, 2)?;
        check::divisible(op, "x", &x, 0, MX_BLOCK, "column-wise blocks run along rows")?;
        check::divisible(op, "x", &x, 1, MX_BLOCK, "row-wise blocks run along k")?;
        let (m, k) = (x.sizes()[0] as usize, x.sizes()[1] as usize);
        Ok(QuantizeRowCol { x, dtype, device, m, k, mode, elem, col_transposed, swizzle })
    }

    /// (row data, row scale, col data, col scale) shapes, scales before any swizzle.
    fn shapes(&self) -> [Vec<i64>; 4] {
        let (m, k, b) = (self.m as i64, self.k as i64, MX_BLOCK as i64);
        if self.col_transposed {
            [vec![m, k], vec![m, k / b], vec![k, m], vec![k, m / b]]
        } else {
            [vec![m, k], vec![m, k / b], vec![m, k], vec![m / b, k]]
        }
    }
}

/// A validated `mxfp8_dequantize` call.
struct Dequantize {
    data: Tensor,
    scale: Tensor,
    device: Device,
    dims: Dims3,
    elem: Fp8Elem,
    out_dtype: DType,
}

impl Dequantize {
    fn new(op: Op, backend: Backend, data: Tensor, scale: Tensor, dim: i64, out_dtype: Option<DType>) -> Result<Self> {
        let out_dtype = check::out_dtype(op, out_dtype)?;
        let elem = match check::dtype_in(op, "data", &data, &[DType::E4M3, DType::E5M2])? {
            DType::E5M2 => Fp8Elem::E5M2,
            _ => Fp8Elem::E4M3,
        };
        check::dtype_in(op, "scale", &scale, &[DType::E8M0])?;
        let device = check::same_device(op, backend, &[("data", &data), ("scale", &scale)])?;
        check::non_empty(op, "data", &data, 1)?;
        let d = check::dim(op, "dim", dim, data.dim())?;
        check::divisible(op, "data", &data, d, MX_BLOCK, "the MX block size along `dim`")?;
        check::shape_eq(op, "scale", &scale, &scale_shape(data.sizes(), d))?;
        let dims = Dims3::from_shape(&check::sizes_usize(&data), d);
        Ok(Dequantize { data, scale, device, dims, elem, out_dtype })
    }
}
