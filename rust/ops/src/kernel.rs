//! The boxed-kernel trampoline and the one function that raises into Python.
//!
//! Rules (docs/DESIGN.md "Errors"; Rust RFC 2945):
//! - kernels are `extern "C-unwind"`, so the C++ exception thrown by `aoti_torch_check` may unwind
//!   through them, and `panic = "unwind"` stays on in every profile;
//! - everything that can panic (decoding, the kernel body, dropping the inputs) runs inside
//!   `catch_unwind`, so no Rust panic crosses into libtorch;
//! - `aoti_torch_check` is called only after `catch_unwind` returned and every owned handle was
//!   released (catching a foreign exception in `catch_unwind` aborts the process).

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::abi::{api, BoxedKernel, StableIValue};
use crate::error::{Error, Op, Result};
use crate::stack::{c_message, Args, OpSpec};
use crate::tensor::Tensor;

/// A kernel body: takes its arguments by name and returns its outputs in schema order.
pub type Body = fn(&mut Args) -> Result<Vec<Tensor>>;

/// One registration: the op, the dispatch key ("CPU", "CUDA") and the boxed entry point.
#[derive(Clone, Copy)]
pub struct Kernel {
    pub spec: &'static OpSpec,
    pub dispatch_key: &'static str,
    pub boxed: BoxedKernel,
}

/// Makes the `extern "C-unwind"` entry point for `(spec, body)`.
macro_rules! boxed_kernel {
    ($spec:path, $body:expr) => {{
        unsafe extern "C-unwind" fn trampoline(stack: *mut $crate::abi::StableIValue, nargs: u64, nout: u64) {
            // SAFETY: libtorch calls boxed kernels with a stack of max(nargs, nout) slots holding the
            // schema's arguments; `run` checks the counts against the spec before decoding.
            unsafe { $crate::kernel::run(&$spec, $body, stack, nargs, nout) }
        }
        trampoline as $crate::abi::BoxedKernel
    }};
}
pub(crate) use boxed_kernel;

/// The CPU and the CUDA registration of an op whose dispatcher entry is `$f(args, backend)` (the
/// layout of every op family: `mod.rs` reads the schema's arguments and calls the family's typed
/// function, which validates and runs `cpu.rs` (the reference) or `cuda.rs`).
macro_rules! cpu_and_cuda {
    ($spec:path, $f:ident) => {
        [
            $crate::kernel::Kernel {
                spec: &$spec,
                dispatch_key: "CPU",
                boxed: $crate::kernel::boxed_kernel!($spec, |a: &mut $crate::stack::Args| $f(
                    a,
                    $crate::check::Backend::Cpu
                )),
            },
            $crate::kernel::Kernel {
                spec: &$spec,
                dispatch_key: "CUDA",
                boxed: $crate::kernel::boxed_kernel!($spec, |a: &mut $crate::stack::Args| $f(
                    a,
                    $crate::check::Backend::Cuda
                )),
            },
        ]
    };
}
pub(crate) use cpu_and_cuda;

/// The CPU and the CUDA registration of an op with one body for both devices, `$f(args)` (the linear
/// layers: the device-specific work happens in the quantizers and GEMMs they call).
macro_rules! one_body {
    ($spec:path, $f:ident) => {
        [
            $crate::kernel::Kernel {
                spec: &$spec,
                dispatch_key: "CPU",
                boxed: $crate::kernel::boxed_kernel!($spec, $f),
            },
            $crate::kernel::Kernel {
                spec: &$spec,
                dispatch_key: "CUDA",
                boxed: $crate::kernel::boxed_kernel!($spec, $f),
            },
        ]
    };
}
pub(crate) use one_body;

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic with a non-string payload".to_owned())
}

/// Decodes the stack, runs `body`, and writes its outputs or raises its error.
///
/// # Safety
/// `stack` must point to `max(nargs, nout)` StableIValues laid out as libtorch's boxed-kernel adapter
/// lays them out.
pub unsafe fn run(spec: &'static OpSpec, body: Body, stack: *mut StableIValue, nargs: u64, nout: u64) {
    let op = Op(spec.name);
    let _time = crate::host_time::span(spec.name);
    let outcome = if nargs as usize != spec.args.len() || nout as usize != spec.returns {
        // Without a matching spec the arguments cannot be decoded, so they cannot be freed either:
        // leaking them is the safe choice, and the registry test keeps this branch unreachable.
        Err(Error::Mismatch {
            op,
            msg: format!(
                "the schema has {nargs} arguments and {nout} returns but the kernel expects {} and {}",
                spec.args.len(),
                spec.returns
            ),
        })
    } else {
        catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the counts match the spec, and the caller guarantees the layout.
            let decode = crate::host_time::span("decode arguments");
            let mut args = unsafe { Args::decode(op, spec, stack) };
            drop(decode);
            let outputs = body(&mut args)?;
            if outputs.len() != spec.returns {
                return Err(Error::Internal { op, msg: format!("kernel returned {} outputs", outputs.len()) });
            }
            Ok(outputs)
            // `args` drops here: every input handle not moved into an output is released.
        }))
        .unwrap_or_else(|payload| Err(Error::Panic { op, msg: panic_message(payload) }))
    };
    match outcome {
        Ok(outputs) => {
            for (i, t) in outputs.into_iter().enumerate() {
                // SAFETY: i < nout <= stack length; the stack takes ownership of the handle.
                unsafe { *stack.add(i) = t.into_raw() as StableIValue };
            }
        }
        Err(e) => raise(&e),
    }
}

/// Throws `e` as a c10::Error, which Python sees as `RuntimeError(message)`. Never returns.
pub fn raise(e: &Error) -> ! {
    let msg = c_message(&e.to_string());
    // SAFETY: aoti_torch_check(false, ...) throws a C++ exception that unwinds through this
    // `C-unwind` frame (dropping `msg`) into libtorch's dispatcher. No Rust frame between here and
    // libtorch holds a lock or is inside catch_unwind.
    unsafe {
        (api().aoti_torch_check)(
            false,
            c"deepwell".as_ptr(),
            c"rust/ops/src/kernel.rs".as_ptr(),
            line!(),
            msg.as_ptr(),
        );
    }
    // aoti_torch_check(false, ..) always throws; if a future libtorch returned instead, continuing
    // would hand torch an output stack we never filled.
    std::process::abort()
}
