//! `deepwell.fp8_block_quantize` / `fp8_block_dequantize`: CPU kernels (NUMERICS.md "FP8 block").
//! Schemas: torch_ops/deepwell/ops/fp8_block.py.
//!
//! Block shapes: 1x128 (activations and gradients along K), 128x1 (the same along M, for wgrad) and
//! 128x128 (weights). The tensor is viewed as (batch, rows, cols) with rows/cols its last two dims.

use deepwell_core::fp8_block;

use crate::check;
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::host::{self, with_floats, with_floats_mut};
use crate::kernel::{boxed_kernel, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static QUANTIZE: OpSpec = OpSpec {
    name: "fp8_block_quantize",
    args: &[("x", Kind::Tensor), ("block_rows", Kind::Int), ("block_cols", Kind::Int), ("pow2", Kind::Bool)],
    returns: 2,
};

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
    vec![
        Kernel { spec: &QUANTIZE, dispatch_key: "CPU", boxed: boxed_kernel!(QUANTIZE, quantize_cpu) },
        Kernel { spec: &DEQUANTIZE, dispatch_key: "CPU", boxed: boxed_kernel!(DEQUANTIZE, dequantize_cpu) },
    ]
}

/// The supported block shapes (DeepSeek-V3 / Transformer Engine Float8BlockScaling).
const BLOCKS: [(i64, i64); 3] = [(1, 128), (128, 1), (128, 128)];

/// Validates the block shape and that the tensor's last two dims are multiples of it; returns
/// (batch, rows, cols, block_rows, block_cols) and the scale's shape.
fn geometry(op: Op, arg: &'static str, t: &Tensor, br: i64, bc: i64) -> Result<([usize; 5], Vec<i64>)> {
    if !BLOCKS.contains(&(br, bc)) {
        return Err(Error::arg(op, "block_rows, block_cols", "be (1, 128), (128, 1) or (128, 128)", format!("({br}, {bc})")));
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
    Ok(([batch as usize, rows as usize, cols as usize, br as usize, bc as usize], scale_shape))
}

fn quantize_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let x = a.tensor("x")?;
    let (br, bc) = (a.int("block_rows")?, a.int("block_cols")?);
    let pow2 = a.bool("pow2")?;

    let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
    check::on_cpu(op, "x", &x)?;
    let ([batch, rows, cols, br, bc], scale_shape) = geometry(op, "x", &x, br, bc)?;

    let data = Tensor::empty(op, x.sizes(), DType::E4M3, Device::Cpu)?;
    let scale_inv = Tensor::empty(op, &scale_shape, DType::F32, Device::Cpu)?;
    // SAFETY: validated non-empty CPU float input; outputs fresh, contiguous, of the written sizes.
    unsafe {
        let (q, s) = (data.as_mut_slice::<u8>(), scale_inv.as_mut_slice::<f32>());
        with_floats!(host::float_slice(&x, dtype), xs => fp8_block::fp8_block_quantize(xs, batch, rows, cols, br, bc, pow2, q, s));
    }
    Ok(vec![data, scale_inv])
}

fn dequantize_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let data = a.tensor("data")?;
    let scale_inv = a.tensor("scale_inv")?;
    let (br, bc) = (a.int("block_rows")?, a.int("block_cols")?);
    let out_dtype = check::out_dtype(op, a.opt_scalar_type("out_dtype")?)?;

    check::dtype_in(op, "data", &data, &[DType::E4M3])?;
    check::dtype_in(op, "scale_inv", &scale_inv, &[DType::F32])?;
    check::on_cpu(op, "data", &data)?;
    check::on_cpu(op, "scale_inv", &scale_inv)?;
    let ([batch, rows, cols, br, bc], scale_shape) = geometry(op, "data", &data, br, bc)?;
    check::shape_eq(op, "scale_inv", &scale_inv, &scale_shape)?;

    let out = Tensor::empty(op, data.sizes(), out_dtype, Device::Cpu)?;
    // SAFETY: validated CPU inputs; `out` fresh and contiguous with data's numel.
    unsafe {
        let (q, s) = (host::row_major::<u8>(&data), host::row_major::<f32>(&scale_inv));
        with_floats_mut!(host::float_slice_mut(&out, out_dtype), o => fp8_block::fp8_block_dequantize(&q, &s, batch, rows, cols, br, bc, o));
    }
    Ok(vec![out])
}
