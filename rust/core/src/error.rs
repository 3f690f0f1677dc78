//! The crate's one error enum (docs/DESIGN.md "Conventions"): structured variants, a `Result` alias.
//!
//! The numeric kernels themselves do not return errors: slice lengths and shapes are
//! preconditions that the FFI layer validates first, checked here with `assert!` (a panic is
//! caught at the FFI boundary). Errors are for values parsed from user input, such as mode names.

use thiserror::Error;

/// Everything deepwell-core can report as a recoverable error.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CoreError {
    /// A mode or format name that is not one of the accepted spellings.
    #[error("unknown {what} {got:?}; expected one of: {choices}")]
    UnknownMode {
        /// What was being parsed, e.g. "MXFP8 scale mode".
        what: &'static str,
        /// The string that was given.
        got: String,
        /// The accepted spellings, e.g. "rceil, floor".
        choices: &'static str,
    },
}

/// `Result` with [`CoreError`].
pub type Result<T> = std::result::Result<T, CoreError>;
