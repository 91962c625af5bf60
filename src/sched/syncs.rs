//! Streams, minimal record/wait edges and lifetime drain points for any issue order (ours or a
//! baseline's). Vector clocks per stream: a wait already implied by an earlier one is dropped.

use super::{Retire, Schedule, SyncEdge};
use crate::ep::{Budgets, PerRole, Role};
use crate::ir::{Alloc, Graph, NodeId, Phase, ValueId};
use crate::runtime::Action;
use smallvec::SmallVec;

/// Streams, minimal syncs and lifetime actions for a given order.
pub fn finish(g: &Graph, order: Vec<NodeId>, budgets: Budgets) -> Schedule {
    let n = g.len();
    let stream: Vec<Role> = g.nodes.iter().map(|nd| Role::of(nd.kind)).collect();
    let mut pos = vec![0usize; n];
    for (i, &u) in order.iter().enumerate() {
        pos[u] = i;
    }
    let mut clocks = Clocks::new(n);
    let mut syncs = Vec::new();
    // Nodes of each stream in issue order (for the drain search below).
    let mut on_stream: PerRole<Vec<NodeId>> = Default::default();
    for &c in &order {
        let x = stream[c];
        // Uncovered predecessors: per other stream only the latest matters (it covers the
        // earlier ones there); then drop a candidate another candidate's clock already covers,
        // so no edge is implied by the others (minimal, whatever the predecessor order).
        let mut latest: PerRole<Option<NodeId>> = Default::default();
        for &p in &g.preds[c] {
            if clocks.need(p, x, &stream) {
                let y = stream[p];
                if latest[y].is_none_or(|q| clocks.seq[q] < clocks.seq[p]) {
                    latest[y] = Some(p);
                }
            }
        }
        let cands: SmallVec<[NodeId; 2]> = Role::ALL.iter().filter_map(|&r| latest[r]).collect();
        for &p in &cands {
            let y = stream[p];
            let implied = cands.iter().any(|&q| q != p && clocks.at[q][y] >= clocks.seq[p]);
            if !implied {
                clocks.join(p, x);
                syncs.push(SyncEdge { producer: p, consumer: c, from: y, to: x });
            }
        }
        clocks.step(c, x);
        on_stream[x].push(c);
    }
    // Lifetime: values consumed on a stream other than their owner's. Consumers of each value
    // in one flat array (offsets per value), not a Vec each.
    let mut start = vec![0u32; g.values.len() + 1];
    for nd in g.nodes.iter().filter(|nd| !nd.kind.is_wait()) {
        for &v in &nd.inputs {
            start[v.ix() + 1] += 1;
        }
    }
    for v in 0..g.values.len() {
        start[v + 1] += start[v];
    }
    let mut fill = start.clone();
    let mut flat = vec![NodeId(0); start[g.values.len()] as usize];
    for (i, nd) in g.nodes.iter().enumerate().filter(|(_, nd)| !nd.kind.is_wait()) {
        for &v in &nd.inputs {
            flat[fill[v.ix()] as usize] = NodeId::new(i);
            fill[v.ix()] += 1;
        }
    }
    let mut retires = Vec::new();
    for v in 0..g.values.len() {
        let cons = &flat[start[v] as usize..start[v + 1] as usize];
        let Some(p) = g.values[v].producer else { continue };
        // A launch output allocated on its consumer's stream is owned there (the wait's).
        let owner = match (g.values[v].alloc, g.nodes[p].partner) {
            (Alloc::Consumer, Some(w)) => stream[w],
            _ => stream[p],
        };
        if cons.iter().all(|&c| stream[c] == owner) || cons.is_empty() {
            continue;
        }
        let last = *cons.iter().max_by_key(|&&c| pos[c.ix()]).expect("non-empty");
        // The plan event goes on the last cross-stream consumer's stream (the last consumer's
        // own, unless that one runs on the owner's stream: retiring there would release at once
        // while the other stream's use may still run). Recorded after the last use is issued,
        // the event covers that use, and the drain below waits on it. (With uses on two other
        // streams the event covers the later one; the drain point's clock covers both.)
        let other = cons.iter().filter(|&&c| stream[c] != owner).max_by_key(|&&c| pos[c.ix()]).expect("a cross-stream use");
        let cs = stream[*other];
        // Drain before the first owner-stream node already ordered after the last consumer
        // (its clock covers it): the manager's wait there adds no dependency. Clocks only grow
        // along a stream, so a binary search finds it. None: the terminal hand-back.
        // Every consumer on another stream must be covered, and the drain comes after the last.
        let list = &on_stream[owner];
        let mut k = list.partition_point(|&u| pos[u.ix()] <= pos[last.ix()]);
        for &c in cons {
            let c_s = stream[c];
            if c_s != owner {
                let need = clocks.seq[c];
                k = k.max(list.partition_point(|&u| clocks.at[u][c_s] < need));
            }
        }
        let drain_before = list.get(k).copied();
        let phase = g.source_of(last).phase;
        let action = if phase == Phase::F { Action::EmptyStorage } else { Action::DropReference };
        retires.push(Retire { value: ValueId::new(v), owner, last_consumer: last, consumer_stream: cs, drain_before, action });
    }
    Schedule { order, stream, syncs, retires, budgets }
}

/// Vector clocks per stream: what each stream has waited for, by position on other streams.
pub(crate) struct Clocks {
    /// Position of each node on its stream (1-based; 0 = none).
    pub(crate) seq: Vec<u64>,
    count: PerRole<u64>,
    now: PerRole<PerRole<u64>>,
    /// Each node's stream clock right after it.
    pub(crate) at: Vec<PerRole<u64>>,
}

impl Clocks {
    pub(crate) fn new(n: usize) -> Self {
        Clocks { seq: vec![0; n], count: Default::default(), now: Default::default(), at: vec![Default::default(); n] }
    }
    /// Does stream `x` still need a wait for `p`?
    pub(crate) fn need(&self, p: NodeId, x: Role, stream: &[Role]) -> bool {
        let y = stream[p.ix()];
        y != x && self.now[x][y] < self.seq[p]
    }
    /// Stream `x` waits on the event recorded after `p`.
    pub(crate) fn join(&mut self, p: NodeId, x: Role) {
        let pc = self.at[p];
        for r in Role::ALL {
            self.now[x][r] = self.now[x][r].max(pc[r]);
        }
    }
    /// `c` runs on `x`.
    pub(crate) fn step(&mut self, c: NodeId, x: Role) {
        self.count[x] += 1;
        self.seq[c] = self.count[x];
        self.now[x][x] = self.count[x];
        self.at[c] = self.now[x];
    }
}
