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
pub use lower::{costed, lower, lower_drained, lower_launch_waits};
pub use machine::{Engine, Hazard};
pub use machine::{Log, Machine};
pub use program::{run, simulate, NamedHazard, Policy, Program, ProgramSpec, Report, SimOptions, SimRuntime};

use crate::ep::Budgets;
use crate::ir::{Graph, NodeId};
use crate::sched::{Rules, Schedule};

/// `order` on `g` through the simulator with the graph's node costs and scheduled release
/// (`serial`: all on one stream; `scheduled_drains`: drains where the schedule puts them, else
/// at the owner's next node).
pub fn simulate_graph(g: &Graph, order: &[NodeId], serial: bool, scheduled_drains: bool) -> crate::Result<Report> {
    simulate(&Program::new(lower_drained(g, order, serial, scheduled_drains))?, SimOptions::new(Policy::Scheduled))
}

/// The simulated makespan (us) of `order` on `g` with the graph's node costs, drains where the
/// schedule puts them, scheduled release.
pub fn makespan(g: &Graph, order: &[NodeId]) -> crate::Result<f64> {
    Ok(simulate_graph(g, order, false, true)?.makespan_us)
}

/// As [`makespan`], with each EP launch also waiting for the compute issued before it
/// ([`lower_launch_waits`]: what the transports do on the GPU): the cost model of rule `search`.
/// On the main job's pair with the H200's measured costs (emulated EP link, 2026-12-02) a model
/// with this wait reproduced the measured step within 1.5%; without it, search picked orders that
/// issue filler compute ahead of launches (`calibrated` measured slower than `ours`).
pub fn makespan_launch_waits(g: &Graph, order: &[NodeId]) -> crate::Result<f64> {
    Ok(simulate(&Program::new(lower_launch_waits(g, order))?, SimOptions::new(Policy::Scheduled))?.makespan_us)
}

/// Schedule `g` under `rules`: the policy's order, or with rule `search` (and node costs) the
/// order the simulator rates shortest ([`makespan_launch_waits`]) among the policy's variants
/// (`launch_first` on and off) and their local moves (`sched::schedule_searched`), with a
/// model-call budget that shrinks with the graph (2000 calls up to 100 nodes, 100 from 2000
/// nodes). Without costs `search` changes nothing.
pub fn schedule(g: &Graph, budgets: Budgets, rules: Rules) -> crate::Result<Schedule> {
    if !rules.search || g.nodes.iter().all(|n| n.cost == 0.0) {
        return crate::sched::schedule_with(g, budgets, Rules { search: false, ..rules });
    }
    let evals = (200_000 / g.len().max(1)).clamp(100, 2000);
    crate::sched::schedule_searched(g, budgets, rules, evals, &|o| makespan_launch_waits(g, o))
}
