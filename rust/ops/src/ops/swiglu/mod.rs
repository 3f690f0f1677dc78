//! `deepwell.swiglu`, `swiglu_backward` and the fused quantizers `fp8_block_swiglu_quantize_rowcol` /
//! `fp8_block_swiglu_backward_quantize_rowcol` (docs/NUMERICS.md "SwiGLU"). The fused ones give
//! exactly `fp8_block_quantize_rowcol` of `swiglu`'s / `swiglu_backward`'s output without writing
//! that output: the MoE experts' activation goes straight into the FP8 operands of the next GEMM
//! (forward) and of the gate_up projection's dgrad and wgrad (backward).
//!
//! Schemas: torch_ops/deepwell/ops/swiglu.py. Checks here, shared by the CPU reference (`cpu.rs`,
//! maths in rust/core/src/swiglu.rs) and CUDA (`cuda.rs`: cuda/swiglu.cuh, cuda/fp8_block_transpose.cuh).
//! Layout: gate_up (rows, 2f), each row's f gate values then its f up values (Hugging Face's fused
//! experts); h and grad (rows, f).

pub(crate) mod cpu;
pub(crate) mod cuda;

use crate::check::{self, Backend};
use crate::dtype::{DType, Device};
use crate::error::{Op, Result};
use crate::kernel::{cpu_and_cuda, Kernel};
use crate::ops::fp8_block::ScaleLayout;
use crate::ops::{run_on, run_one};
use crate::stack::{Args, Kind, OpSpec};
use crate::tensor::Tensor;

pub static SWIGLU: OpSpec = OpSpec { name: "swiglu", args: &[("gate_up", Kind::Tensor)], returns: 1 };

pub static SWIGLU_BACKWARD: OpSpec =
    OpSpec { name: "swiglu_backward", args: &[("gate_up", Kind::Tensor), ("grad", Kind::Tensor)], returns: 1 };

pub static QUANTIZE_ROWCOL: OpSpec = OpSpec {
    name: "fp8_block_swiglu_quantize_rowcol",
    args: &[("gate_up", Kind::Tensor), ("pow2", Kind::Bool)],
    returns: 4,
};

pub static BACKWARD_QUANTIZE_ROWCOL: OpSpec = OpSpec {
    name: "fp8_block_swiglu_backward_quantize_rowcol",
    args: &[("gate_up", Kind::Tensor), ("grad", Kind::Tensor), ("pow2", Kind::Bool)],
    returns: 4,
};

pub fn kernels() -> Vec<Kernel> {
    [
        cpu_and_cuda!(SWIGLU, swiglu_boxed),
        cpu_and_cuda!(SWIGLU_BACKWARD, swiglu_backward_boxed),
        cpu_and_cuda!(QUANTIZE_ROWCOL, quantize_rowcol_boxed),
        cpu_and_cuda!(BACKWARD_QUANTIZE_ROWCOL, backward_quantize_rowcol_boxed),
    ]
    .concat()
}

// ---------------------------------------------------------------------------------------------
// The typed API.

/// h (rows, f) = silu(gate) * up of gate_up (rows, 2f).
pub fn swiglu(op: Op, on: Backend, gate_up: Tensor) -> Result<Tensor> {
    run_one(op, on, Swiglu::new(op, on, gate_up, None, false)?, cpu::swiglu, cuda::swiglu)
}

/// d_gate_up (rows, 2f) = [d gate | d up] of gate_up (rows, 2f) for h's gradient (rows, f).
pub fn swiglu_backward(op: Op, on: Backend, gate_up: Tensor, grad: Tensor) -> Result<Tensor> {
    let s = Swiglu::new(op, on, gate_up, Some(grad), false)?;
    run_one(op, on, s, cpu::swiglu_backward, cuda::swiglu_backward)
}

/// `fp8_block_quantize_rowcol` of `swiglu(gate_up)` (grad None) or of `swiglu_backward(gate_up,
/// grad)`, from one read of the inputs: [row data, row scales, transposed col data, col scales]
/// of the (rows, f) or (rows, 2f) matrix, the scales stored as `scales` says.
pub fn quantize_rowcol(
    op: Op,
    on: Backend,
    gate_up: Tensor,
    grad: Option<Tensor>,
    pow2: bool,
    scales: ScaleLayout,
) -> Result<[Tensor; 4]> {
    let s = Swiglu::new(op, on, gate_up, grad, true)?;
    run_on(op, on, SwigluQuantize { s, pow2, scales }, cpu::quantize_rowcol, cuda::quantize_rowcol)
}

// The dispatcher's entry points.

fn swiglu_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    Ok(vec![swiglu(a.op(), on, a.tensor("gate_up")?)?])
}

fn swiglu_backward_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (gate_up, grad) = (a.tensor("gate_up")?, a.tensor("grad")?);
    Ok(vec![swiglu_backward(a.op(), on, gate_up, grad)?])
}

fn quantize_rowcol_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (gate_up, pow2) = (a.tensor("gate_up")?, a.bool("pow2")?);
    Ok(quantize_rowcol(a.op(), on, gate_up, None, pow2, ScaleLayout::RowMajor)?.into())
}

fn backward_quantize_rowcol_boxed(a: &mut Args, on: Backend) -> Result<Vec<Tensor>> {
    let (gate_up, grad, pow2) = (a.tensor("gate_up")?, a.tensor("grad")?, a.bool("pow2")?);
    Ok(quantize_rowcol(a.op(), on, gate_up, Some(grad), pow2, ScaleLayout::RowMajor)?.into())
}

/// A validated call: gate_up (rows, 2f) and, for the gradients, grad (rows, f) of the same dtype.
struct Swiglu {
    gate_up: Tensor,
    grad: Option<Tensor>,
    dtype: DType,
    device: Device,
    rows: usize,
    f: usize,
}

impl Swiglu {
    /// `blocks`: the fused quantizers' 128 x 128 tiles, which must lie wholly in one half.
    fn new(op: Op, on: Backend, gate_up: Tensor, grad: Option<Tensor>, blocks: bool) -> Result<Swiglu> {
        let dtype = check::dtype_in(op, "gate_up", &gate_up, &check::FLOAT_INPUTS)?;
        check::ndim(op, "gate_up", &gate_up, 2, "(rows, 2 * ffn): gate then up along the last dim")?;
        check::divisible(op, "gate_up", &gate_up, 1, 2, "gate and up halves of equal width")?;
        if blocks {
            check::non_empty(op, "gate_up", &gate_up, 2)?;
            check::divisible(op, "gate_up", &gate_up, 0, 128, "the transposed copy has 1x128 blocks along rows")?;
            check::divisible(op, "gate_up", &gate_up, 1, 256, "gate and up are each whole 128-column blocks")?;
        }
        let (rows, f) = (gate_up.sizes()[0], gate_up.sizes()[1] / 2);
        let mut tensors = vec![("gate_up", &gate_up)];
        if let Some(g) = &grad {
            tensors.push(("grad", g));
            check::dtype_in(op, "grad", g, &[dtype])?;
            check::shape_eq(op, "grad", g, &[rows, f])?;
        }
        let device = check::same_device(op, on, &tensors)?;
        Ok(Swiglu { gate_up, grad, dtype, device, rows: rows as usize, f: f as usize })
    }

    /// The matrix the gradients' and forward's quantizers see: (rows, 2f) or (rows, f).
    fn quantized_cols(&self) -> usize {
        if self.grad.is_some() {
            2 * self.f
        } else {
            self.f
        }
    }
}

/// A validated fused quantization.
struct SwigluQuantize {
    s: Swiglu,
    pow2: bool,
    scales: ScaleLayout,
}
