//! `deepwell.nvfp4_quantize` / `nvfp4_dequantize` (docs/NUMERICS.md "NVFP4"). Schemas:
//! torch_ops/deepwell/ops/nvfp4.py. Checks here, shared by the CPU reference (`cpu.rs`, maths in
//! rust/core/src/nvfp4.rs) and CUDA (`cuda.rs`, cuda/nvfp4.cuh).

pub(crate) mod cpu;
pub(crate) mod cuda;

pub use deepwell_core::nvfp4::Nvfp4Options;
use deepwell_core::nvfp4::NVFP4_BLOCK;

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::{run_on, run_one};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static QUANTIZE: OpSpec = OpSpec {
    name: "nvfp4_quantize",
    args: &[
        ("x", Kind::Tensor),
        ("global_amax", Kind::OptTensor),
        ("block_2d", Kind::Bool),
        ("stochastic", Kind::Bool),
        ("seed", Kind::Int),
        ("hadamard", Kind::Bool),
    ],
    returns: 3,
};

pub static DEQUANTIZE: OpSpec = OpSpec {
    name: "nvfp4_dequantize",
    args: &[
        ("data", Kind::Tensor),
        ("scale", Kind::Tensor),
        ("global_scale", Kind::Tensor),
        ("out_dtype", Kind::OptScalarType),
    ],
    returns: 1,
};

pub fn kernels() -> Vec<Kernel> {
    [cpu_and_cuda!(QUANTIZE, quantize_boxed), cpu_and_cuda!(DEQUANTIZE, dequantize_boxed)].concat()
}

// ---------------------------------------------------------------------------------------------
// The typed API: validates, then runs on `on` (the CPU reference or the CUDA kernels).

/// `nvfp4_quantize`: E2M1 along the last dim with E4M3 scales per 16 (16x16 when `o.block_2d`) and
/// the per-tensor decode scale from `global_amax` (reduced on the device when None); (data, scale,
/// S_dec).
pub fn quantize(op: Op, on: Backend, x: Tensor, global_amax: Option<Tensor>, o: Nvfp4Options) -> Result<[Tensor; 3]> {
    let q = Quantize::new(op, on, x, global_amax, o)?;
    run_on(op, on, q, cpu::quantize, cuda::quantize)
}

/// `nvfp4_dequantize`: codes * scale * S_dec, in `out_dtype` (bf16 when None).
pub fn dequantize(
    op: Op,
    on: Backend,
    data: Tensor,
    scale: Tensor,
    global_scale: Tensor,
    out_dtype: Option<DType>,
) -> Result<Tensor> {
    let q = Dequantize::new(op, on, data, scale, global_scale, out_dtype)?;
    run_one(op, on, q, cpu::dequantize, cuda::dequantize)
}

// The dispatcher's entry points: the schema's arguments, then the typed call.

fn quantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, global_amax) = (a.tensor("x")?, a.opt_tensor("global_amax")?);
    let (block_2d, stochastic, seed, hadamard) =
        (a.bool("block_2d")?, a.bool("stochastic")?, a.int("seed")?, a.bool("hadamard")?);
    let o = Nvfp4Options { block_2d, stochastic_seed: stochastic.then_some(seed as u64), hadamard };
    Ok(quantize(a.op(), on, x, global_amax, o)?.into())
}

fn dequantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (data, scale, global_scale) = (a.tensor("data")?, a.tensor("scale")?, a.tensor("global_scale")?);
    let out_dtype = a.opt_scalar_type("out_dtype")?;
    Ok(vec![dequantize(a.op(), on, data, scale, global_scale, out_dtype)?])
}

/// A one-element float32 tensor (the per-tensor amax or decode scale).
fn check_scalar_f32(op: Op, arg: &'static str, t: &Tensor) -> Result<()> {
    check::dtype_in(op, arg, t, &[DType::F32])?;
    if t.numel() != 1 {
        return Err(Error::arg(op, arg, "have exactly one element", format!("shape {}", check::shape_str(t.sizes()))));
    }
    Ok(())
}

/// (rows, k): the tensor flattened to 2-D along its last dim.
fn rows_k(sizes: &[i64]) -> (usize, usize) {
    let k = *sizes.last().unwrap_or(&1) as usize;
    let numel: i64 = sizes.iter().product();
    (numel as usize / k.max(1), k)
}

struct Quantize {
    x: Tensor,
    global_amax: Option<Tensor>,
    dtype: DType,
    device: Device,
    rows: usize,
    k: usize,
    block_2d: bool,
    seed: Option<u64>,
    hadamard: bool,
    data_shape: Vec<i64>,
    scale_shape: Vec<i64>,
}

impl Quantize {
    fn new(op: Op, backend: Backend, x: Tensor, global_amax: Option<Tensor>, o: Nvfp4Options) -> Result<Quantize> {
        let Nvfp4Options { block_2d, stochastic_seed: seed, hadamard } = o;

        let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
        let mut on_device = vec![("x", &x)];
        if let Some(g) = &global_amax {
            on_device.push(("global_amax", g));
        }
        let device = check::same_device(op, backend, &on_device)?;
        check::non_empty(op, "x", &x, 1)?;
        let last = x.dim() - 1;
        check::divisible(op, "x", &x, last, NVFP4_BLOCK, "the NVFP4 block size along the last dim")?;
        if block_2d {
            if x.dim() < 2 {
                return Err(Error::arg(
                    op,
                    "x",
                    "be at least 2-d when block_2d=True",
                    format!("a {}-d tensor", x.dim()),
                ));
            }
            check::divisible(op, "x", &x, last - 1, NVFP4_BLOCK, "16x16 blocks need rows in multiples of 16")?;
        }
        if let Some(g) = &global_amax {
            check_scalar_f32(op, "global_amax", g)?;
        }
        let (rows, k) = rows_k(x.sizes());
        let mut data_shape = x.sizes().to_vec();
        let mut scale_shape = x.sizes().to_vec();
        data_shape[last] /= 2;
        scale_shape[last] /= NVFP4_BLOCK as i64;
        Ok(Quantize { x, global_amax, dtype, device, rows, k, block_2d, seed, hadamard, data_shape, scale_shape })
    }
}

struct Dequantize {
    data: Tensor,
    scale: Tensor,
    global_scale: Tensor,
    device: Device,
    rows: usize,
    k: usize,
    out_shape: Vec<i64>,
    out_dtype: DType,
}

impl Dequantize {
    fn new(
        op: Op,
        backend: Backend,
        data: Tensor,
        scale: Tensor,
        global_scale: Tensor,
        out_dtype: Option<DType>,
    ) -> Result<Dequantize> {
        let out_dtype = check::out_dtype(op, out_dtype)?;
        check::dtype_in(op, "data", &data, &[DType::U8])?;
        check::dtype_in(op, "scale", &scale, &[DType::E4M3])?;
        let device =
            check::same_device(op, backend, &[("data", &data), ("scale", &scale), ("global_scale", &global_scale)])?;
        check::non_empty(op, "data", &data, 1)?;
        check_scalar_f32(op, "global_scale", &global_scale)?;
        let last = data.dim() - 1;
        check::divisible(op, "data", &data, last, NVFP4_BLOCK / 2, "8 packed bytes per 16-element block")?;
        let mut out_shape = data.sizes().to_vec();
        out_shape[last] *= 2;
        let mut scale_shape = out_shape.clone();
        scale_shape[last] /= NVFP4_BLOCK as i64;
        check::shape_eq(op, "scale", &scale, &scale_shape)?;
        let (rows, k) = rows_k(&out_shape);
        Ok(Dequantize { data, scale, global_scale, device, rows, k, out_shape, out_dtype })
    }
}
