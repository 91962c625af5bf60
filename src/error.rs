//! One error type for the crate, grouped by category. Every message names the manager,
//! tensor, stream or setting at fault; nothing here panics.

/// Errors raised by the core, the runtimes and the FFI boundary.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// Bad input from the caller: wrong device, duplicate tensor, bad action code, bad setting.
    #[error("{0}")]
    InvalidInput(String),
    /// A lifetime-protocol violation: retire twice, aliasing, leftover bindings, use after finalize.
    #[error("{0}")]
    Protocol(String),
    /// A runtime (torch shim, cudarc, simulator) failed to carry out an action.
    #[error("runtime error: {0}")]
    Runtime(String),
    /// A handle that names no live manager.
    #[error("unknown lifetime manager handle {0:#x} (destroyed, or never created)")]
    UnknownManager(u64),
    /// The crate was built without the `cuda` feature, or no CUDA driver could be loaded.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
}

impl Error {
    /// True for errors that Python should see as `ValueError` (bad input), false for
    /// `RuntimeError` (protocol or runtime failures).
    pub fn is_value_error(&self) -> bool {
        matches!(self, Error::InvalidInput(_))
    }
}

/// Crate-wide result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
