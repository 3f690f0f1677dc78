//! `deepwell.nvfp4_quantize` / `nvfp4_dequantize`: CPU kernels (NUMERICS.md "NVFP4").
//! Schemas: torch_ops/deepwell/ops/nvfp4.py.

use deepwell_core::nvfp4::{self, Nvfp4Options, NVFP4_BLOCK};

use crate::check;
use crate::dtype::{DType, Device};
use crate::error::{Error, Result};
use crate::host::{self, with_floats, with_floats_mut};
use crate::kernel::{boxed_kernel, Kernel};
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
    vec![
        Kernel { spec: &QUANTIZE, dispatch_key: "CPU", boxed: boxed_kernel!(QUANTIZE, quantize_cpu) },
        Kernel { spec: &DEQUANTIZE, dispatch_key: "CPU", boxed: boxed_kernel!(DEQUANTIZE, dequantize_cpu) },
    ]
}

/// Reads a one-element float32 CPU tensor (the per-tensor amax or scale).
fn scalar_f32(op: crate::error::Op, arg: &'static str, t: &Tensor) -> Result<f32> {
    check::dtype_in(op, arg, t, &[DType::F32])?;
    check::on_cpu(op, arg, t)?;
    if t.numel() != 1 {
        return Err(Error::arg(op, arg, "have exactly one element", format!("shape {}", check::shape_str(t.sizes()))));
    }
    // SAFETY: a one-element float32 CPU tensor; data_ptr addresses that element.
    Ok(unsafe { *(t.data_ptr() as *const f32) })
}

/// (rows, k): the tensor flattened to 2-D along its last dim.
fn rows_k(sizes: &[i64]) -> (usize, usize) {
    let k = *sizes.last().unwrap_or(&1) as usize;
    let numel: i64 = sizes.iter().product();
    (numel as usize / k.max(1), k)
}

fn quantize_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let x = a.tensor("x")?;
    let global_amax = a.opt_tensor("global_amax")?;
    let block_2d = a.bool("block_2d")?;
    let stochastic = a.bool("stochastic")?;
    let seed = a.int("seed")?;
    let hadamard = a.bool("hadamard")?;

    let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
    check::on_cpu(op, "x", &x)?;
    check::non_empty(op, "x", &x, 1)?;
    let last = x.dim() - 1;
    check::divisible(op, "x", &x, last, NVFP4_BLOCK, "the NVFP4 block size along the last dim")?;
    if block_2d {
        if x.dim() < 2 {
            return Err(Error::arg(op, "x", "be at least 2-d when block_2d=True", format!("a {}-d tensor", x.dim())));
        }
        check::divisible(op, "x", &x, last - 1, NVFP4_BLOCK, "16x16 blocks need rows in multiples of 16")?;
    }
    let amax = global_amax.as_ref().map(|t| scalar_f32(op, "global_amax", t)).transpose()?;

    let opts = Nvfp4Options { block_2d, stochastic_seed: stochastic.then_some(seed as u64), hadamard };
    let (rows, k) = rows_k(x.sizes());
    let mut data_shape = x.sizes().to_vec();
    let mut scale_shape = x.sizes().to_vec();
    data_shape[last] /= 2;
    scale_shape[last] /= NVFP4_BLOCK as i64;
    let data = Tensor::empty(op, &data_shape, DType::U8, Device::Cpu)?;
    let scale = Tensor::empty(op, &scale_shape, DType::E4M3, Device::Cpu)?;
    let global_scale = Tensor::empty(op, &[], DType::F32, Device::Cpu)?;
    // SAFETY: x is a validated non-empty CPU float tensor; the outputs are fresh contiguous tensors
    // of the sizes nvfp4_quantize writes.
    unsafe {
        let (q, s) = (data.as_mut_slice::<u8>(), scale.as_mut_slice::<u8>());
        let s_dec = with_floats!(host::float_slice(&x, dtype), xs => {
            let g = amax.unwrap_or_else(|| nvfp4::nvfp4_global_amax(xs, k, hadamard));
            nvfp4::nvfp4_quantize(xs, rows, k, g, &opts, q, s)
        });
        global_scale.as_mut_slice::<f32>()[0] = s_dec;
    }
    Ok(vec![data, scale, global_scale])
}

fn dequantize_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let data = a.tensor("data")?;
    let scale = a.tensor("scale")?;
    let global_scale = a.tensor("global_scale")?;
    let out_dtype = check::out_dtype(op, a.opt_scalar_type("out_dtype")?)?;

    check::dtype_in(op, "data", &data, &[DType::U8])?;
    check::dtype_in(op, "scale", &scale, &[DType::E4M3])?;
    check::on_cpu(op, "data", &data)?;
    check::on_cpu(op, "scale", &scale)?;
    check::non_empty(op, "data", &data, 1)?;
    let s_dec = scalar_f32(op, "global_scale", &global_scale)?;
    let last = data.dim() - 1;
    check::divisible(op, "data", &data, last, NVFP4_BLOCK / 2, "8 packed bytes per 16-element block")?;
    let mut out_shape = data.sizes().to_vec();
    out_shape[last] *= 2;
    let mut scale_shape = out_shape.clone();
    scale_shape[last] /= NVFP4_BLOCK as i64;
    check::shape_eq(op, "scale", &scale, &scale_shape)?;

    let (rows, k) = rows_k(&out_shape);
    let out = Tensor::empty(op, &out_shape, out_dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU inputs; `out` is fresh and contiguous with rows*k elements.
    unsafe {
        let (q, s) = (host::row_major::<u8>(&data), host::row_major::<u8>(&scale));
        with_floats_mut!(host::float_slice_mut(&out, out_dtype), o => nvfp4::nvfp4_dequantize(&q, &s, s_dec, rows, k, o));
    }
    Ok(vec![out])
}
