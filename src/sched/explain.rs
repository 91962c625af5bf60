//! What Python sees of a schedule: node names instead of ids, and, per launch, the compute
//! issued between it and its wait (what it ran under).

use serde::Serialize;

use super::Schedule;
use crate::ep::{Budgets, Role};
use crate::ir::{Graph, Kind, NodeId};

/// Per comm/page launch: the compute nodes issued between it and its wait.
#[derive(Clone, Debug, Serialize)]
pub struct Explained {
    /// The launch.
    pub launch: String,
    /// Its source.
    pub source: String,
    /// Compute issued between the launch and its wait, in order.
    pub hidden_under: Vec<String>,
}

/// What compute hid each launch.
pub fn explain(g: &Graph, s: &Schedule) -> Vec<Explained> {
    let mut pos = vec![0usize; g.len()];
    for (i, &u) in s.order.iter().enumerate() {
        pos[u.ix()] = i;
    }
    let mut out = Vec::new();
    for &u in &s.order {
        let nd = &g.nodes[u];
        if !nd.kind.is_launch() {
            continue;
        }
        let end = nd.partner.map_or(s.order.len(), |w| pos[w.ix()]);
        let hidden = s.order[pos[u.ix()] + 1..end]
            .iter()
            .filter(|&&c| g.nodes[c].kind == Kind::Compute)
            .map(|&c| g.nodes[c].name.clone())
            .collect();
        out.push(Explained { launch: nd.name.clone(), source: g.sources[nd.source].name.clone(), hidden_under: hidden });
    }
    out
}

/// A schedule with names, as Python sees it.
#[derive(Clone, Debug, Serialize)]
pub struct NamedSchedule {
    /// Issue order.
    pub order: Vec<String>,
    /// (node, stream) in issue order.
    pub streams: Vec<(String, Role)>,
    /// (producer, consumer, producer stream, consumer stream) record/wait pairs.
    pub syncs: Vec<(String, String, Role, Role)>,
    /// Lifetime actions.
    pub retires: Vec<NamedRetire>,
    /// The budgets the order respects.
    pub budgets: Budgets,
    /// What each launch ran under, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<Vec<Explained>>,
    /// The memory guard's finding, when asked for (`memory::guard`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<super::memory::MemoryCheck>,
}

/// A retire with names.
#[derive(Clone, Debug, Serialize)]
pub struct NamedRetire {
    /// The value.
    pub value: String,
    /// Its owner stream.
    pub owner: Role,
    /// The last consumer.
    pub last_consumer: String,
    /// The last consumer's stream.
    pub consumer_stream: Role,
    /// The owner-stream node before which the owner drains (None: terminal hand-back).
    pub drain_before: Option<String>,
    /// The action's name.
    pub action: &'static str,
}

/// Names instead of indices.
pub fn named(g: &Graph, s: &Schedule, explain: Option<Vec<Explained>>) -> NamedSchedule {
    let nm = |u: NodeId| g.nodes[u].name.clone();
    NamedSchedule {
        order: s.order.iter().map(|&u| nm(u)).collect(),
        streams: s.order.iter().map(|&u| (nm(u), s.stream[u.ix()])).collect(),
        syncs: s.syncs.iter().map(|e| (nm(e.producer), nm(e.consumer), e.from, e.to)).collect(),
        retires: s
            .retires
            .iter()
            .map(|r| NamedRetire {
                value: g.values[r.value].name.clone(),
                owner: r.owner,
                last_consumer: nm(r.last_consumer),
                consumer_stream: r.consumer_stream,
                drain_before: r.drain_before.map(nm),
                action: r.action.name(),
            })
            .collect(),
        budgets: s.budgets,
        explain,
        memory: None,
    }
}
