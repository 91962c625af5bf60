//! The simulator (DESIGN.md §5): a deterministic model of FIFO streams, events and the CUDA
//! caching allocator, with a race checker, that runs the real lifetime manager through the
//! same [`crate::Runtime`] trait torch and cudarc implement. It predicts what a plan does to
//! the allocator's high-water mark under `record_stream` or scheduled release, and proves the
//! protocol free of reuse hazards on many random plans. Its figures are simulated, never
//! measured.
//!
//! Layers: `alloc` (the allocator model), `machine` (host, streams, engines, events, checker),
//! `plan` (the user-facing plan format, validation, lowering under a policy, reports).

pub mod alloc;
pub mod machine;
pub mod plan;
pub mod scenarios;

pub use alloc::Mode;
pub use machine::{Engine, Hazard};
pub use machine::{Log, Machine};
pub use plan::{run, simulate, NamedHazard, Plan, PlanSpec, Policy, Report, SimOptions, SimRuntime};
