//! The simulator (DESIGN.md §5): a deterministic model of FIFO streams, events and the CUDA
//! caching allocator, with a race checker, that runs the real lifetime manager through the
//! same [`crate::Runtime`] trait torch and cudarc implement. It predicts what a program does
//! to the allocator's high-water mark under `record_stream` or scheduled release, and proves
//! the protocol free of reuse hazards on many random programs. Its figures are simulated,
//! never measured.
//!
//! Layers: `alloc` (the allocator model), `machine` (host, streams, engines, events, checker),
//! `program` (the simulator's input format, validation, execution under a policy, reports),
//! `lower` (graph + issue order -> program: the derived form of a schedule).

pub mod alloc;
pub mod lower;
pub mod machine;
pub mod program;

pub use alloc::Mode;
pub use lower::{costed, lower, lower_drained};
pub use machine::{Engine, Hazard};
pub use machine::{Log, Machine};
pub use program::{run, simulate, NamedHazard, Policy, Program, ProgramSpec, Report, SimOptions, SimRuntime};
