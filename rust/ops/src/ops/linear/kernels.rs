//! The quantizer kernels the linear layers use, called directly (not through the dispatcher) on the
//! tensor's device: the same code as `torch.ops.deepwell.*_quantize`, errors under the linear op's
//! name. Arguments follow the quantizers' schemas (torch_ops/deepwell/ops/*.py).

use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::kernel::Body;
use crate::ops::{fp8_block, mxfp8, nvfp4, swizzle};
use crate::stack::Args;
use crate::tensor::Tensor;

/// Runs the CPU or the CUDA body of a quantizer op, as `device` says; its N outputs.
fn run<const N: usize>(device: Device, cpu: Body, cuda: Body, mut args: Args) -> Result<[Tensor; N]> {
    let op = args.op();
    let outputs = match device {
        Device::Cpu => cpu(&mut args)?,
        Device::Cuda(_) => cuda(&mut args)?,
        other => return Err(Error::Unsupported { op, what: format!("no kernels for {other}") }),
    };
    let got = outputs.len();
    outputs.try_into().map_err(|_| Error::Internal { op, msg: format!("a quantizer returned {got} tensors, not {N}") })
}

/// MXFP8 along `dim` (rceil scales, E4M3): (data, scale).
pub fn mxfp8_quantize(op: Op, x: Tensor, dim: i64) -> Result<(Tensor, Tensor)> {
    let device = x.device();
    let args = Args::internal(op)
        .with_tensor("x", x)
        .with_int("dim", dim)
        .with_str("scale_mode", "rceil")
        .with_str("elem", "e4m3");
    let [a, b] = run(device, mxfp8::cpu::quantize, mxfp8::cuda::quantize, args)?;
    Ok((a, b))
}

/// MXFP8 of x (m, k) along k and along m in one pass: [row data, row scale, col data (m, k),
/// col scale (m/32, k)].
pub fn mxfp8_quantize_rowcol(op: Op, x: Tensor) -> Result<[Tensor; 4]> {
    let device = x.device();
    let args = Args::internal(op)
        .with_tensor("x", x)
        .with_str("scale_mode", "rceil")
        .with_str("elem", "e4m3")
        .with_bool("col_transposed", false)
        .with_bool("swizzle", false);
    run(device, mxfp8::cpu::quantize_rowcol, mxfp8::cuda::quantize_rowcol, args)
}

pub fn mxfp8_dequantize(op: Op, data: Tensor, scale: Tensor, dim: i64, out: DType) -> Result<Tensor> {
    let device = data.device();
    let args = Args::internal(op)
        .with_tensor("data", data)
        .with_tensor("scale", scale)
        .with_int("dim", dim)
        .with_opt_scalar_type("out_dtype", Some(out.code()));
    let [out] = run(device, mxfp8::cpu::dequantize, mxfp8::cuda::dequantize, args)?;
    Ok(out)
}

/// FP8 with fp32 power-of-two block scales: (data, scale_inv).
pub fn fp8_block_quantize(op: Op, x: Tensor, block: (i64, i64)) -> Result<(Tensor, Tensor)> {
    let device = x.device();
    let args = Args::internal(op)
        .with_tensor("x", x)
        .with_int("block_rows", block.0)
        .with_int("block_cols", block.1)
        .with_bool("pow2", true);
    let [a, b] = run(device, fp8_block::cpu::quantize, fp8_block::cuda::quantize, args)?;
    Ok((a, b))
}

/// x (m, k) in 1x128 blocks along k and, transposed, along m: [data (m, k), scale (m, k/128),
/// data (k, m), scale (k, m/128)].
pub fn fp8_block_quantize_rowcol(op: Op, x: Tensor) -> Result<[Tensor; 4]> {
    let device = x.device();
    let args = Args::internal(op).with_tensor("x", x).with_bool("pow2", true);
    run(device, fp8_block::cpu::quantize_rowcol, fp8_block::cuda::quantize_rowcol, args)
}

pub fn fp8_block_dequantize(op: Op, data: Tensor, scale: Tensor, block: (i64, i64), out: DType) -> Result<Tensor> {
    let device = data.device();
    let args = Args::internal(op)
        .with_tensor("data", data)
        .with_tensor("scale_inv", scale)
        .with_int("block_rows", block.0)
        .with_int("block_cols", block.1)
        .with_opt_scalar_type("out_dtype", Some(out.code()));
    let [out] = run(device, fp8_block::cpu::dequantize, fp8_block::cuda::dequantize, args)?;
    Ok(out)
}

/// NVFP4 options of one operand (docs/NUMERICS.md "NVFP4").
#[derive(Clone, Copy, Debug, Default)]
pub struct Nvfp4Options {
    /// 16x16 blocks (weights) instead of 1x16.
    pub block_2d: bool,
    /// Stochastic rounding with this seed (gradients); round-to-nearest when None.
    pub seed: Option<u64>,
    /// The 16x16 random Hadamard transform along K (the wgrad operands).
    pub hadamard: bool,
}

/// NVFP4 along the last dim, global amax reduced on the device: (data, scale, global S_dec).
pub fn nvfp4_quantize(op: Op, x: Tensor, o: Nvfp4Options) -> Result<[Tensor; 3]> {
    let device = x.device();
    let args = Args::internal(op)
        .with_tensor("x", x)
        .with_opt_tensor("global_amax", None)
        .with_bool("block_2d", o.block_2d)
        .with_bool("stochastic", o.seed.is_some())
        .with_int("seed", o.seed.unwrap_or(0) as i64)
        .with_bool("hadamard", o.hadamard);
    run(device, nvfp4::cpu::quantize, nvfp4::cuda::quantize, args)
}

pub fn nvfp4_dequantize(op: Op, data: Tensor, scale: Tensor, global: Tensor, out: DType) -> Result<Tensor> {
    let device = data.device();
    let args = Args::internal(op)
        .with_tensor("data", data)
        .with_tensor("scale", scale)
        .with_tensor("global_scale", global)
        .with_opt_scalar_type("out_dtype", Some(out.code()));
    let [out] = run(device, nvfp4::cpu::dequantize, nvfp4::cuda::dequantize, args)?;
    Ok(out)
}

/// Blackwell's 128x4 tiled layout of a 2-D scale tensor (1-D result).
pub fn swizzle_scales(op: Op, scale: Tensor) -> Result<Tensor> {
    let device = scale.device();
    let args = Args::internal(op).with_tensor("scale", scale);
    let [out] = run(device, swizzle::cpu::swizzle, swizzle::cuda::swizzle, args)?;
    Ok(out)
}

/// Inverse of `swizzle_scales`: the (rows, cols) scales back from the 1-D tiled layout.
pub fn unswizzle_scales(op: Op, swizzled: Tensor, rows: i64, cols: i64) -> Result<Tensor> {
    let device = swizzled.device();
    let args = Args::internal(op).with_tensor("swizzled", swizzled).with_int("rows", rows).with_int("cols", cols);
    let [out] = run(device, swizzle::cpu::unswizzle, swizzle::cuda::unswizzle, args)?;
    Ok(out)
}
