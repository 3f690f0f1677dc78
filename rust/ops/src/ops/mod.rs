//! The op catalogue: every kernel this library registers, one module per op family (the same stems
//! as `cuda/*.cuh`, `torch_ops/deepwell/ops/*.py`, `tests/ops/test_*.py` and `rust/core/src/*.rs`).
//!
//! Each family has `mod.rs`, `cpu.rs` (the reference) and `cuda.rs` (the kernels). `mod.rs` holds:
//! - the schemas' argument specs (`OpSpec`, checked against the Python schemas by a test);
//! - the typed API: one function per op (`mxfp8::quantize(op, on, x, dim, MxOptions)`, ...) that
//!   validates into a typed call struct and runs the CPU or CUDA body through `run_on`. Rust code
//!   (the linear layers, later MoE) calls these; nothing re-parses strings;
//! - the dispatcher's entry points (`*_boxed`): read the schema's arguments, call the typed API.

pub mod fp8_block;
pub mod fp8_gemm;
pub mod fp8_tensor;
pub mod linear;
pub mod moe;
pub mod mxfp8;
pub mod nvfp4;
pub mod swiglu;
pub mod swizzle;

use crate::check::Backend;
use crate::error::{Error, Op, Result};
use crate::kernel::Kernel;
use crate::tensor::Tensor;

/// Which copies of x (m, k) a transposing quantizer (`fp8_block_quantize_rowcol`,
/// `fp8_tensor_quantize_rowcol`) writes; the torch ops' `copies` argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copies {
    /// The row codes (m, k) and the transposed codes (k, m), from one read.
    Both,
    /// The row codes alone (an fprop operand whose wgrad copy is made later, from x again).
    Rows,
    /// The transposed codes (k, m) alone (a wgrad operand: x or dy along the tokens).
    Cols,
}

impl std::str::FromStr for Copies {
    type Err = ();

    fn from_str(s: &str) -> std::result::Result<Copies, ()> {
        match s {
            "both" => Ok(Copies::Both),
            "rows" => Ok(Copies::Rows),
            "cols" => Ok(Copies::Cols),
            _ => Err(()),
        }
    }
}

/// The `copies` argument of the rowcol ops.
pub(crate) fn copies_arg(a: &mut crate::stack::Args) -> Result<Copies> {
    crate::check::parse(a.op(), "copies", &a.str("copies")?, "'both', 'rows', 'cols'")
}

/// A kernel body: the CPU reference (`cpu.rs`) or the CUDA kernels (`cuda.rs`) of a validated call.
pub(crate) type Body<Q> = fn(Op, Q) -> Result<Vec<Tensor>>;

/// Runs the validated call `q` with the body of backend `on`; its N outputs (the family's typed
/// functions return them as arrays).
pub(crate) fn run_on<Q, const N: usize>(op: Op, on: Backend, q: Q, cpu: Body<Q>, cuda: Body<Q>) -> Result<[Tensor; N]> {
    let v = match on {
        Backend::Cpu => cpu(op, q)?,
        Backend::Cuda => cuda(op, q)?,
    };
    let got = v.len();
    v.try_into().map_err(|_| Error::Internal { op, msg: format!("a kernel returned {got} tensors, not {N}") })
}

/// `run_on` for a kernel with one output.
pub(crate) fn run_one<Q>(op: Op, on: Backend, q: Q, cpu: Body<Q>, cuda: Body<Q>) -> Result<Tensor> {
    let [out] = run_on(op, on, q, cpu, cuda)?;
    Ok(out)
}

pub fn all_kernels() -> Vec<Kernel> {
    let mut k = Vec::new();
    k.extend(mxfp8::kernels());
    k.extend(nvfp4::kernels());
    k.extend(fp8_block::kernels());
    k.extend(fp8_gemm::kernels());
    k.extend(fp8_tensor::kernels());
    k.extend(swizzle::kernels());
    k.extend(linear::kernels());
    k.extend(moe::kernels());
    k.extend(swiglu::kernels());
    k
}
