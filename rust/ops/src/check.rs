//! Argument validation shared by the ops. Each check returns an `Error::Arg` that names the op, the
//! argument, what was expected and what was given (docs/DESIGN.md "Conventions"). The fake kernels in
//! `torch_ops/deepwell/ops/*.py` mirror these checks so meta tensors fail the same way.

use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

pub fn shape_str(sizes: &[i64]) -> String {
    let parts: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// Non-empty and at least `min_dim`-dimensional (0-d tensors have no dim to block along).
pub fn non_empty(op: Op, arg: &'static str, t: &Tensor, min_dim: usize) -> Result<()> {
    if t.dim() < min_dim {
        return Err(Error::arg(
            op,
            arg,
            format!("have at least {min_dim} dimension(s)"),
            format!("a {}-d tensor", t.dim()),
        ));
    }
    if t.numel() == 0 {
        return Err(Error::arg(op, arg, "be non-empty", format!("shape {}", shape_str(t.sizes()))));
    }
    Ok(())
}

pub fn dtype_in(op: Op, arg: &'static str, t: &Tensor, allowed: &[DType]) -> Result<DType> {
    let d = t.dtype();
    if allowed.contains(&d) {
        return Ok(d);
    }
    let names: Vec<String> = allowed.iter().map(|d| d.to_string()).collect();
    Err(Error::arg(op, arg, format!("have dtype {}", names.join(" or ")), d))
}

/// The floating dtypes the quantizers read (widened exactly to fp32).
pub const FLOAT_INPUTS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The dtypes dequantizers may write.
pub fn out_dtype(op: Op, dtype: Option<DType>) -> Result<DType> {
    let d = dtype.unwrap_or(DType::BF16);
    if FLOAT_INPUTS.contains(&d) {
        Ok(d)
    } else {
        Err(Error::arg(op, "out_dtype", "be torch.float32, torch.bfloat16 or torch.float16", d))
    }
}

/// Which kernel is running: the CPU reference or the CUDA one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    /// The backend of tensors on `device` (what an op called from Rust runs on).
    pub fn of(op: Op, device: Device) -> Result<Backend> {
        match device {
            Device::Cpu => Ok(Backend::Cpu),
            Device::Cuda(_) => Ok(Backend::Cuda),
            other => Err(Error::Unsupported { op, what: format!("no kernels for {other}") }),
        }
    }
}

/// Every tensor argument must be on the kernel's backend and on one device; returns that device.
pub fn same_device(op: Op, backend: Backend, tensors: &[(&'static str, &Tensor)]) -> Result<Device> {
    let mut first: Option<(&'static str, Device)> = None;
    for &(arg, t) in tensors {
        let d = t.device();
        let ok = matches!((backend, d), (Backend::Cpu, Device::Cpu) | (Backend::Cuda, Device::Cuda(_)));
        if !ok {
            let want = if backend == Backend::Cpu { "be on the CPU" } else { "be on a CUDA device" };
            return Err(Error::arg(op, arg, format!("{want} like the other arguments"), d));
        }
        match first {
            None => first = Some((arg, d)),
            Some((a0, d0)) if d0 != d => {
                return Err(Error::arg(op, arg, format!("be on {d0} like '{a0}'"), d));
            }
            _ => {}
        }
    }
    Ok(first.map_or(Device::Cpu, |(_, d)| d))
}

/// `arg` must have `ndim` dims (`layout` names them, e.g. "(out_features, in_features)").
pub fn ndim(op: Op, arg: &'static str, t: &Tensor, ndim: usize, layout: &str) -> Result<()> {
    if t.dim() == ndim {
        return Ok(());
    }
    Err(Error::arg(op, arg, format!("be {ndim}-d {layout}"), format!("a {}-d tensor", t.dim())))
}

/// Python-style dim (negative counts from the end) -> index.
pub fn dim(op: Op, arg: &'static str, dim: i64, ndim: usize) -> Result<usize> {
    let n = ndim as i64;
    let d = if dim < 0 { dim + n } else { dim };
    if (0..n).contains(&d) {
        Ok(d as usize)
    } else {
        Err(Error::arg(op, arg, format!("be in [{}, {}] for a {ndim}-d tensor", -n, n - 1), dim))
    }
}

/// `size(dim)` of `arg` must be a multiple of `block`.
pub fn divisible(op: Op, arg: &'static str, t: &Tensor, dim: usize, block: usize, why: &str) -> Result<()> {
    let size = t.sizes()[dim];
    if size as usize % block == 0 {
        return Ok(());
    }
    Err(Error::arg(
        op,
        arg,
        format!("have size(dim={dim}) divisible by {block} ({why})"),
        format!("shape {}", shape_str(t.sizes())),
    ))
}

pub fn shape_eq(op: Op, arg: &'static str, t: &Tensor, expected: &[i64]) -> Result<()> {
    if t.sizes() == expected {
        return Ok(());
    }
    Err(Error::arg(op, arg, format!("have shape {}", shape_str(expected)), shape_str(t.sizes())))
}

/// Parses a string option with the core crate's `FromStr`, naming the argument on failure.
pub fn parse<T: std::str::FromStr>(op: Op, arg: &'static str, s: &str, choices: &str) -> Result<T> {
    s.parse().map_err(|_| Error::arg(op, arg, format!("be one of {choices}"), quoted(s)))
}

/// Characters of a bad string argument shown in an error message.
const QUOTED_MAX: usize = 64;

/// A user's string for an error message: in double quotes, `"` and `\` escaped, control
/// characters as `\u{..}`, cut after 64 characters (a hostile caller's megabyte string must not
/// become a megabyte message). `_checks.quoted` in Python writes exactly the same.
pub fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars().take(QUOTED_MAX) {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    let n = s.chars().count();
    if n > QUOTED_MAX {
        out.push_str(&format!("... ({n} characters)"));
    }
    out
}

pub fn sizes_usize(t: &Tensor) -> Vec<usize> {
    t.sizes().iter().map(|&s| s as usize).collect()
}
