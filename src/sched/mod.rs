//! The scheduler (DESIGN.md §3): multiplexes several annotated graphs (sources) into one issue
//! order so EP communication and paging run under the other graph's compute.
//!
//! Files: `policy` (the greedy issue order), `memory` (an order's liveness peak, and the guard
//! that keeps an order from raising it over the graph's own), `syncs` (streams, minimal record/wait edges and
//! lifetime drain points for any order), `validate` (an independent check of any schedule),
//! `explain` (names for Python and what each launch ran under). `sched` sees only the graph
//! ([`crate::ir`]) and the stream roles and budgets ([`crate::ep`]); lowering a schedule into
//! the simulator lives in `sim::lower`, generated graphs and baseline orders in `scenarios`.
//!
//! Output: the order, each node's stream, the minimal record/wait edges, and the lifetime
//! actions: where each cross-stream value retires (its last consumer: so dI's live-ins stay
//! until dW has used them) and before which node its owner drains: the first owner-stream node
//! already ordered after that consumer, so the manager's owner wait adds no dependency
//! (draining at the owner's very next node, as Megatron does, makes it wait for the consumer's
//! comm), or the terminal hand-back.

mod explain;
pub mod memory;
mod policy;
mod search;
mod syncs;
mod validate;

use serde::Serialize;

use crate::ep::{Budgets, Role};
use crate::error::Result;
use crate::ir::{Graph, NodeId, ValueId};
use crate::runtime::Action;

pub use explain::{explain, named, Explained, NamedRetire, NamedSchedule};
pub use syncs::finish;
pub(crate) use syncs::Clocks;
pub use validate::{drains_adding_waits, order_by_names, validate, validate_named};

/// A record/wait pair: `to` waits on the event recorded after `producer` on `from`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SyncEdge {
    /// The node after which the event is recorded.
    pub producer: NodeId,
    /// The node before which the wait is enqueued.
    pub consumer: NodeId,
    /// The producer's stream.
    pub from: Role,
    /// The consumer's stream.
    pub to: Role,
}

/// Where a cross-stream value retires and its owner drains.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Retire {
    /// The value.
    pub value: ValueId,
    /// Stream the value was allocated on (its producer's).
    pub owner: Role,
    /// The last consumer in issue order.
    pub last_consumer: NodeId,
    /// The stream the plan event is recorded on: the last consumer's, or, when the last use is
    /// on the owner's own stream, the last cross-stream consumer's (a retire on the owner's
    /// stream would release at once, before that other use is known to be done).
    pub consumer_stream: Role,
    /// The first owner-stream node ordered after the last consumer (the drain adds no wait
    /// there); None: terminal hand-back.
    pub drain_before: Option<NodeId>,
    /// What the release does.
    #[serde(serialize_with = "action_name")]
    pub action: Action,
}

fn action_name<S: serde::Serializer>(a: &Action, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(a.name())
}

/// The scheduler's output.
#[derive(Clone, Debug, Serialize)]
pub struct Schedule {
    /// Issue order.
    pub order: Vec<NodeId>,
    /// Stream of each node (by node id).
    pub stream: Vec<Role>,
    /// Minimal cross-stream record/wait edges.
    pub syncs: Vec<SyncEdge>,
    /// Lifetime actions of cross-stream values.
    pub retires: Vec<Retire>,
    /// The budgets the order respects.
    pub budgets: Budgets,
}

/// Policy rules that can be switched (a rule becomes default only after an A/B on the GPU;
/// `ready_first` did: 2 x H200 main job, 1.314x vs 1.247x over sequential, README).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rules {
    /// Within a candidate class, compute that needs no wait goes before compute that would
    /// stall the compute stream on a transfer (wait late, taken one step further). Default on;
    /// `classic` turns it off (the policy before it, kept for A/Bs).
    pub ready_first: bool,
    /// Cost rule (opt-in; uses the graph's node costs): launch-enabling compute closest (in
    /// compute time) to its launch goes first.
    pub soonest_launch: bool,
    /// Cost rule (opt-in): within a class, the node with the longest remaining path goes first.
    pub critical_path: bool,
    /// Between sources of equal priority, the later source's nodes first (table order
    /// otherwise).
    pub reverse_sources: bool,
    /// Cost-guided search among orders (needs a cost model: `sim::schedule`; plain
    /// `schedule_with` refuses it).
    pub search: bool,
    /// Opt-in: each EP launch moved up to just after its predecessors and the previous EP
    /// launch, with the wait that frees a full budget moved up before it (a pass over the
    /// policy's order). On the GPU a launch also waits for every compute kernel issued before
    /// it (the transport allocates its output on the compute stream: `wait_stream`), so compute
    /// issued ahead of a launch it does not need delays the link; see `policy`.
    pub launch_first: bool,
}

impl Default for Rules {
    fn default() -> Rules {
        Rules { ready_first: true, soonest_launch: false, critical_path: false, reverse_sources: false, search: false, launch_first: false }
    }
}

impl Rules {
    /// The rule names `parse` accepts.
    pub const NAMES: &'static [&'static str] =
        &["ready_first", "classic", "soonest_launch", "critical_path", "reverse_sources", "search", "launch_first"];

    /// The policy before `ready_first` became default.
    pub const CLASSIC: Rules =
        Rules { ready_first: false, soonest_launch: false, critical_path: false, reverse_sources: false, search: false, launch_first: false };

    /// Comma-separated rule names ("" = the default rules).
    pub fn parse(text: &str) -> Result<Rules> {
        let mut r = Rules::default();
        for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "ready_first" => r.ready_first = true,
                "classic" => r.ready_first = false,
                "soonest_launch" => r.soonest_launch = true,
                "critical_path" => r.critical_path = true,
                "reverse_sources" => r.reverse_sources = true,
                "search" => r.search = true,
                "launch_first" => r.launch_first = true,
                other => {
                    return Err(crate::error::Error::InvalidInput(format!(
                        "unknown scheduler rule '{other}'; known rules: {}",
                        Self::NAMES.join(", ")
                    )))
                }
            }
        }
        Ok(r)
    }
}

/// Schedule `g` under `budgets` with the default policy.
pub fn schedule(g: &Graph, budgets: Budgets) -> Result<Schedule> {
    schedule_with(g, budgets, Rules::default())
}

/// Schedule `g` under `budgets` with opt-in `rules`.
pub fn schedule_with(g: &Graph, budgets: Budgets, rules: Rules) -> Result<Schedule> {
    let _span = tracing::debug_span!("schedule", nodes = g.len()).entered();
    Budgets::new(budgets.ep, budgets.page)?;
    if rules.search {
        return Err(crate::error::Error::InvalidInput(
            "scheduler rule 'search' needs a cost model (sim::schedule, or the schedule op)".into(),
        ));
    }
    let order = policy::order(g, budgets, rules)?;
    Ok(finish(g, order, budgets))
}

/// Schedule `g` under `budgets` with rule `search` on: the order among the policy's variants
/// and their local moves that `cost` (a makespan model of an order) rates shortest, at most
/// `max_evals` calls of it (module `search`).
pub fn schedule_searched(
    g: &Graph, budgets: Budgets, rules: Rules, max_evals: usize, cost: &dyn Fn(&[NodeId]) -> Result<f64>,
) -> Result<Schedule> {
    Budgets::new(budgets.ep, budgets.page)?;
    let order = search::order(g, budgets, rules, max_evals, cost)?;
    debug_assert!(search::feasible(g, &order, budgets));
    Ok(finish(g, order, budgets))
}
