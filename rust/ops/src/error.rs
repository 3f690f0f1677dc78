//! The one error type of the shared library. Every message names the op and, for bad arguments,
//! the argument, what was expected and what was given; `kernel.rs` raises it as a RuntimeError.

use std::fmt;

/// The `deepwell.<op>` prefix every user-facing message starts with.
#[derive(Clone, Copy, Debug)]
pub struct Op(pub &'static str);

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "deepwell.{}", self.0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad argument: `deepwell.mxfp8_quantize: argument 'x' must have dtype ..., got torch.int32`.
    #[error("{op}: argument '{arg}' must {expected}, got {got}")]
    Arg { op: Op, arg: &'static str, expected: String, got: String },

    /// Two arguments that do not agree with each other.
    #[error("{op}: {msg}")]
    Mismatch { op: Op, msg: String },

    /// A libtorch shim call failed (libtorch printed its reason to stderr before 2.13).
    #[error("{op}: libtorch call {call} failed (see the 'Exception in aoti_torch' message above)")]
    Torch { op: Op, call: &'static str },

    /// torch's allocator (or the host's, for a reference kernel's buffer) refused an allocation.
    #[error("{op}: could not allocate {what} ({bytes} bytes): out of memory")]
    Alloc { op: Op, what: String, bytes: u128 },

    /// The op has no kernel for this device in this build.
    #[error("{op}: {what}")]
    Unsupported { op: Op, what: String },

    /// The CUDA runtime failed (driver, NVRTC, JIT cache).
    #[error("{op}: {source}")]
    Gpu { op: Op, source: deepwell_gpu::GpuError },

    /// A Rust panic caught at the FFI boundary: a bug in deepwell, reported instead of aborting.
    #[error("{op}: internal error (a panic; please report): {msg}")]
    Panic { op: Op, msg: String },

    /// A state deepwell's own invariants exclude (a bug, not bad input), found without panicking.
    #[error("{op}: internal error (please report): {msg}")]
    Internal { op: Op, msg: String },

    /// Loading or registering the library.
    #[error("deepwell: {0}")]
    Load(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn arg(op: Op, arg: &'static str, expected: impl Into<String>, got: impl fmt::Display) -> Error {
        Error::Arg { op, arg, expected: expected.into(), got: got.to_string() }
    }
}
