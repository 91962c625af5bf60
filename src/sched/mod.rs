//! The scheduler (DESIGN.md §3): multiplexes several annotated graphs (sources) into one issue
//! order so EP communication and paging run under the other graph's compute.
//!
//! Files: `policy` (the greedy issue order), `syncs` (streams, minimal record/wait edges and
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
mod policy;
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
    /// The last consumer's stream.
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

/// Schedule `g` under `budgets`.
pub fn schedule(g: &Graph, budgets: Budgets) -> Result<Schedule> {
    let _span = tracing::debug_span!("schedule", nodes = g.len()).entered();
    Budgets::new(budgets.ep, budgets.page)?;
    let order = policy::order(g, budgets)?;
    Ok(finish(g, order, budgets))
}
