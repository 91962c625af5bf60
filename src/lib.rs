//! `sched_lifetime`: schedule-aware cross-stream tensor lifetime for PyTorch MoE training.
//!
//! The core is plain Rust with no torch or CUDA linkage; feature `torch` adds the cxx shim
//! (`ffi`) that registers `torch.ops.sched_lifetime.*`, feature `cuda` adds a cudarc runtime.
//! See DESIGN.md for the protocol and its rules.
//!
//! Layers, each importing only those below it: `ir` (the one graph format) -> `ep` (stream
//! roles, launch budgets) -> `sched` (the scheduler); `runtime` (the `Runtime` trait) ->
//! `lifetime` (the manager); `sim` (allocator and stream model, programs lowered from graphs)
//! above both; `scenarios` (generated graphs, programs, baseline orders, sweeps) on top;
//! `cuda` and `ffi` are backends of `runtime`.

#![warn(missing_docs)]

pub mod cuda;
pub mod ep;
pub mod error;
pub mod ir;
pub mod lifetime;
pub mod paging;
pub mod runtime;
pub mod scenarios;
pub mod sched;
pub mod sim;

#[cfg(feature = "torch")]
mod ffi;

pub use error::{Error, Result};
pub use lifetime::{Manager, Stats};
pub use runtime::{Action, Device, Op, RecordingRuntime, Runtime, StreamId, TensorKey};

/// Turn on `tracing` output (plan / drain / schedule spans) to stderr when the environment
/// variable `SCHED_LIFETIME_LOG` holds a filter (e.g. `debug`, `sched_lifetime=trace`).
/// Off otherwise; calling it again does nothing.
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("SCHED_LIFETIME_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
                .try_init();
        }
    });
}
