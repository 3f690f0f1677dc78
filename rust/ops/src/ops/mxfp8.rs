//! `deepwell.mxfp8_quantize` / `mxfp8_dequantize`: CPU kernels (NUMERICS.md "MXFP8").
//! Schemas: torch_ops/deepwell/ops/mxfp8.py.

use deepwell_core::mxfp8::{self, Fp8Elem, ScaleMode, MX_BLOCK};
use deepwell_core::shape::Dims3;

use crate::check;
use crate::dtype::{DType, Device};
use crate::error::Result;
use crate::host::{self, with_floats, with_floats_mut};
use crate::kernel::{boxed_kernel, Kernel};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static QUANTIZE: OpSpec = OpSpec {
    name: "mxfp8_quantize",
    args: &[("x", Kind::Tensor), ("dim", Kind::Int), ("scale_mode", Kind::Str), ("elem", Kind::Str)],
    returns: 2,
};

pub static DEQUANTIZE: OpSpec = OpSpec {
    name: "mxfp8_dequantize",
    args: &[("data", Kind::Tensor), ("scale", Kind::Tensor), ("dim", Kind::Int), ("out_dtype", Kind::OptScalarType)],
    returns: 1,
};

pub fn kernels() -> Vec<Kernel> {
    vec![
        Kernel { spec: &QUANTIZE, dispatch_key: "CPU", boxed: boxed_kernel!(QUANTIZE, quantize_cpu) },
        Kernel { spec: &DEQUANTIZE, dispatch_key: "CPU", boxed: boxed_kernel!(DEQUANTIZE, dequantize_cpu) },
    ]
}

fn elem_dtype(elem: Fp8Elem) -> DType {
    match elem {
        Fp8Elem::E4M3 => DType::E4M3,
        Fp8Elem::E5M2 => DType::E5M2,
    }
}

/// The scale's shape: x's shape with `dim` divided by the block.
fn scale_shape(sizes: &[i64], dim: usize) -> Vec<i64> {
    let mut s = sizes.to_vec();
    s[dim] /= MX_BLOCK as i64;
    s
}

fn quantize_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let x = a.tensor("x")?;
    let dim = a.int("dim")?;
    let mode: ScaleMode = check::parse(op, "scale_mode", &a.str("scale_mode")?, "'rceil', 'floor'")?;
    let elem: Fp8Elem = check::parse(op, "elem", &a.str("elem")?, "'e4m3', 'e5m2'")?;

    let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
    check::on_cpu(op, "x", &x)?;
    check::non_empty(op, "x", &x, 1)?;
    let d = check::dim(op, "dim", dim, x.dim())?;
    check::divisible(op, "x", &x, d, MX_BLOCK, "the MX block size along `dim`")?;

    let dims = Dims3::from_shape(&check::sizes_usize(&x), d);
    let data = Tensor::empty(op, x.sizes(), elem_dtype(elem), Device::Cpu)?;
    let scale = Tensor::empty(op, &scale_shape(x.sizes(), d), DType::E8M0, Device::Cpu)?;
    // SAFETY: x is a validated non-empty CPU float tensor; data/scale are fresh contiguous 1-byte
    // tensors of the sizes mxfp8_quantize writes.
    unsafe {
        let (q, s) = (data.as_mut_slice::<u8>(), scale.as_mut_slice::<u8>());
        with_floats!(host::float_slice(&x, dtype), xs => mxfp8::mxfp8_quantize(xs, dims, mode, elem, q, s));
    }
    Ok(vec![data, scale])
}

fn dequantize_cpu(a: &mut Args) -> Result<Vec<Tensor>> {
    let op = a.op();
    let data = a.tensor("data")?;
    let scale = a.tensor("scale")?;
    let dim = a.int("dim")?;
    let out_dtype = check::out_dtype(op, a.opt_scalar_type("out_dtype")?)?;

    let elem = match check::dtype_in(op, "data", &data, &[DType::E4M3, DType::E5M2])? {
        DType::E5M2 => Fp8Elem::E5M2,
        _ => Fp8Elem::E4M3,
    };
    check::dtype_in(op, "scale", &scale, &[DType::E8M0])?;
    check::on_cpu(op, "data", &data)?;
    check::on_cpu(op, "scale", &scale)?;
    check::non_empty(op, "data", &data, 1)?;
    let d = check::dim(op, "dim", dim, data.dim())?;
    check::divisible(op, "data", &data, d, MX_BLOCK, "the MX block size along `dim`")?;
    check::shape_eq(op, "scale", &scale, &scale_shape(data.sizes(), d))?;

    let dims = Dims3::from_shape(&check::sizes_usize(&data), d);
    let out = Tensor::empty(op, data.sizes(), out_dtype, Device::Cpu)?;
    // SAFETY: validated 1-byte CPU inputs; `out` is fresh and contiguous with data's numel.
    unsafe {
        let (q, s) = (host::row_major::<u8>(&data), host::row_major::<u8>(&scale));
        with_floats_mut!(host::float_slice_mut(&out, out_dtype), o => mxfp8::mxfp8_dequantize(&q, &s, dims, elem, o));
    }
    Ok(vec![out])
}
