//! The validator: checks any schedule (ours or a user's) against its graph. Errors name the
//! node at fault. It decides coverage with its own happens-before bookkeeping ([`Seen`]), not
//! the scheduler's clocks, so a bug in how the scheduler derives its edges cannot hide itself.

use super::{finish, Clocks, Schedule, SyncEdge};
use crate::ep::{Budgets, PerRole, Role};
use crate::error::{Error, Result};
use crate::ir::{Graph, NodeId};

fn bad(m: String) -> Error {
    Error::InvalidInput(m)
}

/// Happens-before as the GPU will see it: for each issued node, how many nodes of each stream
/// are known complete when it starts (stream order, plus the events it waits on).
struct Seen {
    /// Nodes issued so far on each stream.
    issued: PerRole<usize>,
    /// The count each stream has seen of every stream, as of its last issued node.
    stream_view: PerRole<PerRole<usize>>,
    /// Per node: its 1-based index on its own stream, and its view when it started.
    index: Vec<usize>,
    view: Vec<PerRole<usize>>,
}

impl Seen {
    fn new(n: usize) -> Self {
        Seen { issued: Default::default(), stream_view: Default::default(), index: vec![0; n], view: vec![Default::default(); n] }
    }
    /// Issue `c` on `x` after waiting on the events recorded after each of `waits_on`.
    fn issue(&mut self, c: NodeId, x: Role, waits_on: &[NodeId], stream: &[Role]) {
        let mut v = self.stream_view[x];
        for &p in waits_on {
            // The event after p: p itself and everything p had seen.
            let pv = self.view[p.ix()];
            for r in Role::ALL {
                v[r] = v[r].max(pv[r]);
            }
            let ps = stream[p.ix()];
            v[ps] = v[ps].max(self.index[p.ix()]);
        }
        self.issued[x] += 1;
        self.index[c.ix()] = self.issued[x];
        v[x] = self.issued[x];
        self.view[c.ix()] = v;
        self.stream_view[x] = v;
    }
    /// Was `p` complete when `c` started?
    fn covers(&self, c: NodeId, p: NodeId, stream: &[Role]) -> bool {
        self.view[c.ix()][stream[p.ix()]] >= self.index[p.ix()]
    }
}

/// Topological, every cross-stream dependency covered by a wait (directly or through earlier
/// ones), budgets respected, every retire drained after it on the owner's stream.
pub fn validate(g: &Graph, s: &Schedule) -> Result<()> {
    let n = g.len();
    let name = |u: NodeId| g.nodes[u].name.as_str();
    if s.order.len() != n || s.stream.len() != n {
        return Err(bad(format!("schedule has {} nodes, the graph {n}", s.order.len())));
    }
    let mut pos = vec![usize::MAX; n];
    for (i, &u) in s.order.iter().enumerate() {
        let slot = pos.get_mut(u.ix()).ok_or_else(|| bad(format!("schedule names node index {}, not in the graph", u.0)))?;
        if *slot != usize::MAX {
            return Err(bad(format!("node '{}' is issued twice", name(u))));
        }
        *slot = i;
    }
    for (i, nd) in g.nodes.iter().enumerate() {
        if s.stream[i] != Role::of(nd.kind) {
            return Err(bad(format!("node '{}' is on {:?}, its kind needs {:?}", nd.name, s.stream[i], Role::of(nd.kind))));
        }
    }
    // Syncs by consumer, to replay them with vector clocks.
    let mut syncs_of: Vec<Vec<NodeId>> = vec![Vec::new(); n];
    for e in &s.syncs {
        if e.producer.ix() >= n || e.consumer.ix() >= n {
            return Err(bad(format!("sync edge {e:?} names a node not in the graph")));
        }
        if pos[e.producer] >= pos[e.consumer] {
            return Err(bad(format!("sync: '{}' waits on '{}', which is issued later", name(e.consumer), name(e.producer))));
        }
        syncs_of[e.consumer].push(e.producer);
    }
    let mut seen = Seen::new(n);
    let mut in_flight: PerRole<usize> = Default::default();
    for &c in &s.order {
        let x = s.stream[c];
        seen.issue(c, x, &syncs_of[c], &s.stream);
        for &p in &g.preds[c] {
            if pos[p] > pos[c] {
                return Err(bad(format!("'{}' is issued before its predecessor '{}'", name(c), name(p))));
            }
            if !seen.covers(c, p, &s.stream) {
                return Err(bad(format!(
                    "'{}' on {x:?} uses '{}' on {:?} with no wait covering it",
                    name(c),
                    name(p),
                    s.stream[p]
                )));
            }
        }
        let nd = &g.nodes[c];
        if nd.kind.is_launch() {
            let r = Role::of(nd.kind);
            in_flight[r] += 1;
            let budget = s.budgets.of(r);
            if in_flight[r] > budget {
                return Err(bad(format!("'{}' exceeds the {r:?} launch budget of {budget}", nd.name)));
            }
        }
        if let (true, Some(l)) = (nd.kind.is_wait(), nd.partner) {
            in_flight[Role::of(g.nodes[l].kind)] -= 1;
        }
    }
    for r in &s.retires {
        if let Some(d) = r.drain_before {
            if pos[d] <= pos[r.last_consumer] || s.stream[d] != r.owner {
                return Err(bad(format!(
                    "value '{}' drains before '{}', which is not a later node on its owner stream {:?}",
                    g.values[r.value].name,
                    name(d),
                    r.owner
                )));
            }
        }
    }
    Ok(())
}

/// Drains whose owner-stream node is not already ordered after the retire's last consumer:
/// there, the manager's wait adds a dependency (allowed, but ours never does that).
pub fn drains_adding_waits(g: &Graph, s: &Schedule) -> Vec<String> {
    let mut syncs_of: Vec<Vec<NodeId>> = vec![Vec::new(); g.len()];
    for e in &s.syncs {
        syncs_of[e.consumer].push(e.producer);
    }
    let mut clocks = Clocks::new(g.len());
    for &c in &s.order {
        let x: Role = s.stream[c];
        for &p in &syncs_of[c] {
            clocks.join(p, x);
        }
        clocks.step(c, x);
    }
    s.retires
        .iter()
        .filter(|r| {
            r.drain_before.is_some_and(|d| {
                let uncovered = |c: NodeId| {
                    let cs = s.stream[c];
                    cs != r.owner && clocks.at[d][cs] < clocks.seq[c]
                };
                // Every consumer of the value (waits aside) must be covered at the drain.
                g.nodes.iter().enumerate().any(|(i, n)| {
                    !n.kind.is_wait() && n.inputs.contains(&r.value) && uncovered(NodeId::new(i))
                })
            })
        })
        .map(|r| g.values[r.value].name.clone())
        .collect()
}

/// Node names to ids, with the error for a name the graph does not have.
struct Names<'g>(std::collections::HashMap<&'g str, NodeId>);

impl<'g> Names<'g> {
    fn new(g: &'g Graph) -> Self {
        Names(g.node_ids().map(|i| (g.nodes[i].name.as_str(), i)).collect())
    }
    fn id(&self, n: &str) -> Result<NodeId> {
        self.0.get(n).copied().ok_or_else(|| bad(format!("schedule names node '{n}', which is not in the graph")))
    }
    /// Every node exactly once, or an error naming the node.
    fn order(&self, g: &Graph, order: &[String]) -> Result<Vec<NodeId>> {
        let ids = order.iter().map(|n| self.id(n)).collect::<Result<Vec<_>>>()?;
        if ids.len() != g.len() {
            return Err(bad(format!("schedule has {} nodes, the graph {}", ids.len(), g.len())));
        }
        let mut seen = vec![false; g.len()];
        for &u in &ids {
            if std::mem::replace(&mut seen[u.ix()], true) {
                return Err(bad(format!("node '{}' is issued twice", g.nodes[u].name)));
            }
        }
        Ok(ids)
    }
}

/// Validate a schedule given by names: the order, and the record/wait pairs (None: the
/// minimal ones for that order are derived, so only topology and budgets are checked).
pub fn validate_named(g: &Graph, order: &[String], syncs: Option<&[(String, String)]>, budgets: Budgets) -> Result<()> {
    let names = Names::new(g);
    let mut s = finish(g, names.order(g, order)?, budgets);
    if let Some(pairs) = syncs {
        s.syncs = pairs
            .iter()
            .map(|(p, c)| {
                let (p, c) = (names.id(p)?, names.id(c)?);
                Ok(SyncEdge { producer: p, consumer: c, from: s.stream[p], to: s.stream[c] })
            })
            .collect::<Result<Vec<_>>>()?;
    }
    validate(g, &s)
}

/// Node ids of an order given by names: every node exactly once, or an error naming the node.
pub fn order_by_names(g: &Graph, order: &[String]) -> Result<Vec<NodeId>> {
    Names::new(g).order(g, order)
}
