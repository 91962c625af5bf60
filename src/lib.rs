//! `sched_lifetime`: schedule-aware cross-stream tensor lifetime for PyTorch MoE training.
//!
//! The core (`lifetime`, `runtime`) is plain Rust with no torch or CUDA linkage; feature
//! `torch` adds the cxx shim (`ffi`) that registers `torch.ops.sched_lifetime.*`, feature
//! `cuda` adds a cudarc runtime. See DESIGN.md for the protocol and its rules.

pub mod cuda;
pub mod error;
pub mod ir;
pub mod lifetime;
pub mod runtime;
pub mod sched;
pub mod sim;

#[cfg(feature = "torch")]
mod ffi;

pub use error::{Error, Result};
pub use lifetime::{Manager, Stats};
pub use runtime::{Action, Device, Op, RecordingRuntime, Runtime, StreamId, TensorKey};
