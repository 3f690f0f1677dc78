//! Errors of the CUDA runtime. Every driver call carries the call's name; compile errors carry the
//! kernel and NVRTC's log; cache errors name the directory.

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("CUDA driver call {call} failed: {msg}")]
    Driver { call: &'static str, msg: String },

    #[error("NVRTC could not compile {kernel} for {arch}:\n{log}")]
    Compile { kernel: String, arch: String, log: String },

    #[error("NVRTC: {0}")]
    Nvrtc(String),

    #[error("JIT cache at {dir}: {msg}")]
    Cache { dir: String, msg: String },

    #[error("{0}")]
    Unsupported(String),
}

pub type Result<T> = std::result::Result<T, GpuError>;

/// Attaches the call name to a cudarc driver error.
pub(crate) fn driver<T>(call: &'static str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| GpuError::Driver { call, msg: e.to_string() })
}
