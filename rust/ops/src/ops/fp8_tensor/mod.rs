//! `deepwell.fp8_tensor_quantize`, `fp8_tensor_quantize_rowcol` and `fp8_tensor_dequantize`
//! (docs/NUMERICS.md "FP8 tensor"). Schemas: torch_ops/deepwell/ops/fp8_tensor.py. Checks here,
//! shared by the CPU reference (`cpu.rs`, maths in rust/core/src/fp8_tensor.rs) and CUDA
//! (`cuda.rs`, cuda/fp8_tensor.cuh).
//!
//! One fp32 power-of-two scale for the whole tensor, from its amax; E4M3 or E5M2 codes. The
//! scale comes back as a 0-d tensor (what `_scaled_mm`'s tensor-wise scales are) and never
//! reaches the host: the CUDA amax feeds the cast on the device.

pub(crate) mod cpu;
pub(crate) mod cuda;

use deepwell_core::{fp8_tensor, Fp8Elem};

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Error, Op, Result};
use crate::host::{self, with_floats};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::{run_on, run_one};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static QUANTIZE: OpSpec =
    OpSpec { name: "fp8_tensor_quantize", args: &[("x", Kind::Tensor), ("elem", Kind::Str)], returns: 2 };

pub static QUANTIZE_ROWCOL: OpSpec = OpSpec {
    name: "fp8_tensor_quantize_rowcol",
    args: &[("x", Kind::Tensor), ("elem", Kind::Str), ("amax", Kind::OptTensor), ("copies", Kind::Str)],
    returns: 3,
};

pub static DEQUANTIZE: OpSpec = OpSpec {
    name: "fp8_tensor_dequantize",
    args: &[("data", Kind::Tensor), ("scale_inv", Kind::Tensor), ("out_dtype", Kind::OptScalarType)],
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

// ---------------------------------------------------------------------------------------------
// The typed API: validates, then runs on `on` (the CPU reference or the CUDA kernels).

/// `fp8_tensor_quantize`: x's codes in its own layout and the 0-d fp32 `scale_inv`. `amax`: as
/// for [`quantize_rowcol`].
pub fn quantize(op: Op, on: Backend, x: Tensor, elem: Fp8Elem, amax: Option<Tensor>) -> Result<[Tensor; 2]> {
    let q = Quantize::new(op, on, x, elem, amax)?;
    run_on(op, on, q, cpu::quantize, cuda::quantize)
}

pub use super::Copies;

/// x (m, k) quantized once: [row codes (m, k), the codes transposed (k, m), scale_inv (0-d)], a
/// copy that `copies` leaves out an empty tensor. `Copies::Rows` is `quantize(x)`: x's own layout
/// is the row copy, so no transposing kernel runs.
/// `amax`: x's max |x| computed beforehand (a 0-d fp32 tensor on x's device; see [`Quantize`]),
/// or None to reduce it here.
pub fn quantize_rowcol(
    op: Op,
    on: Backend,
    x: Tensor,
    elem: Fp8Elem,
    copies: Copies,
    amax: Option<Tensor>,
) -> Result<[Tensor; 3]> {
    let _time = crate::host_time::span("fp8_tensor rowcol quantization");
    let q = Quantize::new(op, on, x, elem, amax)?;
    if q.x.dim() != 2 {
        return Err(Error::arg(op, "x", "be 2-d (rows, k)", format!("a {}-d tensor", q.x.dim())));
    }
    if copies == Copies::Rows {
        let (device, elem) = (q.device, q.elem);
        let [rows, scale] = run_on(op, on, q, cpu::quantize, cuda::quantize)?;
        return Ok([rows, Tensor::empty(op, &[0], DType::of_fp8(elem), device)?, scale]);
    }
    run_on(op, on, RowCol { q, copies }, cpu::quantize_rowcol, cuda::quantize_rowcol)
}

/// `fp8_tensor_dequantize`: decode(data) * scale_inv in `out_dtype` (bf16 when None).
pub fn dequantize(op: Op, on: Backend, data: Tensor, scale_inv: Tensor, out_dtype: Option<DType>) -> Result<Tensor> {
    let q = Dequantize::new(op, on, data, scale_inv, out_dtype)?;
    run_one(op, on, q, cpu::dequantize, cuda::dequantize)
}

// The dispatcher's entry points: the schema's arguments, then the typed call.

fn elem_arg(a: &mut Args) -> Result<Fp8Elem> {
    check::parse(a.op(), "elem", &a.str("elem")?, "'e4m3', 'e5m2'")
}

fn quantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, elem) = (a.tensor("x")?, elem_arg(a)?);
    Ok(quantize(a.op(), on, x, elem, None)?.into())
}

fn quantize_rowcol_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (x, elem, amax, copies) = (a.tensor("x")?, elem_arg(a)?, a.opt_tensor("amax")?, super::copies_arg(a)?);
    Ok(quantize_rowcol(a.op(), on, x, elem, copies, amax)?.into())
}

fn dequantize_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (data, scale_inv, out_dtype) = (a.tensor("data")?, a.tensor("scale_inv")?, a.opt_scalar_type("out_dtype")?);
    Ok(vec![dequantize(a.op(), on, data, scale_inv, out_dtype)?])
}

/// A validated quantize call: a non-empty float tensor, and where its producer computed it, its
/// amax: a 0-d fp32 tensor on x's device holding NaN-propagating max |x| (what
/// `torch.linalg.vector_norm(x, inf, dtype=torch.float32)` gives). On CUDA it is trusted, not
/// checked against x (that would be the pass it saves); on the CPU [`check_amax`] checks it. The
/// codes are `quantize(x)`'s exactly when it is x's amax (tests/ops/test_fp8_tensor.py proves torch's
/// reductions give it, NaN and Inf included).
struct Quantize {
    x: Tensor,
    dtype: DType,
    device: Device,
    elem: Fp8Elem,
    amax: Option<Tensor>,
}

impl Quantize {
    fn new(op: Op, backend: Backend, x: Tensor, elem: Fp8Elem, amax: Option<Tensor>) -> Result<Quantize> {
        let dtype = check::dtype_in(op, "x", &x, &check::FLOAT_INPUTS)?;
        let device = check::same_device(op, backend, &[("x", &x)])?;
        check::non_empty(op, "x", &x, 1)?;
        if let Some(a) = &amax {
            check_amax(op, "amax", a, backend, ("x", &x), elem)?;
        }
        Ok(Quantize { x, dtype, device, elem, amax })
    }

    /// (rows, cols) of a 2-d x.
    fn matrix(&self) -> (i64, i64) {
        (self.x.sizes()[0], self.x.sizes()[1])
    }
}

/// An amax argument: a 0-d fp32 tensor on the device of the tensor it is the amax of (shared by
/// the fp8_tensor ops' `amax`, `grad_amax`, `weight_amax` and `x_amax`), `elem` the format `of` is
/// quantized to with it. On CPU tensors its value is checked as well ([`check_amax_value`]); on
/// CUDA it is trusted: checking it is the pass over `of` it saves, and raising would be a host sync.
pub(crate) fn check_amax(
    op: Op,
    arg: &'static str,
    amax: &Tensor,
    backend: Backend,
    of: (&'static str, &Tensor),
    elem: Fp8Elem,
) -> Result<()> {
    check::dtype_in(op, arg, amax, &[DType::F32])?;
    check::same_device(op, backend, &[of, (arg, amax)])?;
    check::shape_eq(op, arg, amax, &[])?;
    if backend == Backend::Cpu {
        check_amax_value(op, arg, amax, of, elem)?;
    }
    Ok(())
}

/// A given amax must quantize `of` exactly as its own amax does (docs/NUMERICS.md "FP8 tensor":
/// the codes depend on the amax only through the power-of-two scale): the scale it gives in `elem`
/// is that of `of`'s NaN-propagating max |x|, it is NaN exactly when `of` holds a NaN, and it is
/// not negative. Equality up to the scale, not bit equality: a compiler's fused reduction (the
/// backend's amax is one) may see values before their rounding to `of`'s dtype, which changes the
/// amax in its last bits but not the codes. Costs one pass over `of`, on the CPU only.
fn check_amax_value(
    op: Op,
    arg: &'static str,
    amax: &Tensor,
    (name, t): (&'static str, &Tensor),
    elem: Fp8Elem,
) -> Result<()> {
    if t.numel() == 0 {
        return Ok(());
    }
    let dtype = check::dtype_in(op, name, t, &check::FLOAT_INPUTS)?;
    // SAFETY: `amax` is a 0-d fp32 CPU tensor and `t` a non-empty float CPU tensor (checked).
    let (given, own) = unsafe {
        let given = host::row_major::<f32>(op, amax)?[0];
        (given, with_floats!(host::float_slice(op, t, dtype)?, xs => fp8_tensor::fp8_tensor_amax(xs)))
    };
    let same_scale = fp8_tensor::fp8_tensor_scale(given, elem) == fp8_tensor::fp8_tensor_scale(own, elem);
    if given.is_nan() != own.is_nan() || given < 0.0 || !same_scale {
        let want =
            format!("be the amax of '{name}' (NaN-propagating max |{name}| = {own}, or a value giving its scale)");
        return Err(Error::arg(op, arg, want, given));
    }
    Ok(())
}

/// A validated rowcol call writing `Copies::Both` or `Copies::Cols` (`quantize_rowcol` runs
/// `Copies::Rows` as `quantize`).
struct RowCol {
    q: Quantize,
    copies: Copies,
}

struct Dequantize {
    data: Tensor,
    scale_inv: Tensor,
    device: Device,
    elem: Fp8Elem,
    out_dtype: DType,
}

impl Dequantize {
    fn new(op: Op, backend: Backend, data: Tensor, scale_inv: Tensor, out_dtype: Option<DType>) -> Result<Dequantize> {
        let out_dtype = check::out_dtype(op, out_dtype)?;
        let elem = match check::dtype_in(op, "data", &data, &[DType::E4M3, DType::E5M2])? {
            DType::E5M2 => Fp8Elem::E5M2,
            _ => Fp8Elem::E4M3,
        };
        check::dtype_in(op, "scale_inv", &scale_inv, &[DType::F32])?;
        let device = check::same_device(op, backend, &[("data", &data), ("scale_inv", &scale_inv)])?;
        check::non_empty(op, "data", &data, 1)?;
        if scale_inv.numel() != 1 {
            return Err(Error::arg(
                op,
                "scale_inv",
                "hold one value (the tensor's scale)",
                format!("shape {}", check::shape_str(scale_inv.sizes())),
            ));
        }
        Ok(Dequantize { data, scale_inv, device, elem, out_dtype })
    }
}
