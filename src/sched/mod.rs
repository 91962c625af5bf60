//! The scheduler (DESIGN.md §3): multiplexes several annotated graphs (sources) into one issue
//! order so EP communication and paging run under the other graph's compute.
//!
//! Policy, in the order it is applied at each step (deterministic; ties by source priority,
//! then table order; O((N+E) log N)):
//! 1. Noops whose inputs are issued go at once (no kernel).
//! 2. Early launch: a ready comm/page launch issues at once, within its stream's budget
//!    (launches in flight = issued launches whose wait is not yet issued). On the page stream,
//!    a launch from another source than the last one goes first, so F page-outs and B
//!    page-ins interleave.
//! 3. Compute: candidates are nodes whose unissued predecessors are all ready waits. After a
//!    launch from source S, a candidate from another source goes first (yield). Then
//!    launch-enabling compute (ancestors of a launch), then other compute, then weight-gradient
//!    work. A candidate that needs waits gets them issued first (late wait), and the step
//!    restarts, so a launch the waits unblocked goes before it. Before a wait, one ready
//!    weight-gradient node is issued if there is one (wgrad fills the gap a wait would expose;
//!    it never delays a launch, since it enables none).
//! 4. Otherwise the oldest in-flight launch's wait is issued (a budget forces it, or nothing
//!    else is left).
//!
//! Output: the order, each node's stream, the minimal record/wait edges (vector clocks: a wait
//! already implied by an earlier one is dropped), and the lifetime actions: where each
//! cross-stream value retires (its last consumer: so dI's live-ins stay until dW has used
//! them) and before which node its owner drains: the first owner-stream node already ordered
//! after that consumer, so the manager's owner wait adds no dependency (draining at the
//! owner's very next node, as Megatron does, makes it wait for the consumer's comm), or the
//! terminal hand-back.

pub mod moe;
mod validate;

use std::collections::{BTreeSet, VecDeque};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::ir::{Graph, Kind, NodeId, Phase, Stream, ValueId};
use crate::runtime::Action;

pub use validate::{drains_adding_waits, validate};

/// Variables that set the launch budgets.
pub const EP_BUDGET_VAR: &str = "SCHED_LIFETIME_EP_LAUNCH_BUDGET";
/// See [`EP_BUDGET_VAR`].
pub const PAGE_BUDGET_VAR: &str = "SCHED_LIFETIME_PAGE_LAUNCH_BUDGET";
/// Largest accepted budget.
pub const MAX_BUDGET: u32 = 1024;

/// Launches allowed in flight per side stream. The same settings give the same schedule on
/// every rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Budgets {
    pub ep: u32,
    pub page: u32,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets { ep: 2, page: 2 }
    }
}

impl Budgets {
    /// Validated budgets.
    pub fn new(ep: u32, page: u32) -> Result<Budgets> {
        for (var, v) in [(EP_BUDGET_VAR, ep), (PAGE_BUDGET_VAR, page)] {
            if !(1..=MAX_BUDGET).contains(&v) {
                return Err(Error::InvalidInput(format!("{var}={v} is out of range: expected an integer in 1..={MAX_BUDGET}")));
            }
        }
        Ok(Budgets { ep, page })
    }

    /// Parse one setting; `None` or empty gives `default`.
    pub fn parse(var: &str, text: Option<&str>, default: u32) -> Result<u32> {
        let Some(t) = text.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(default);
        };
        match t.parse::<u32>() {
            Ok(v) if (1..=MAX_BUDGET).contains(&v) => Ok(v),
            _ => Err(Error::InvalidInput(format!("{var}='{t}' is not valid: expected an integer in 1..={MAX_BUDGET}"))),
        }
    }

    /// From the explicit settings, else the environment, else the defaults (2 and 2).
    pub fn resolve(ep: Option<&str>, page: Option<&str>) -> Result<Budgets> {
        let env = |v: &str| std::env::var(v).ok();
        let d = Budgets::default();
        let ep_text = ep.map(String::from).or_else(|| env(EP_BUDGET_VAR));
        let page_text = page.map(String::from).or_else(|| env(PAGE_BUDGET_VAR));
        Ok(Budgets {
            ep: Budgets::parse(EP_BUDGET_VAR, ep_text.as_deref(), d.ep)?,
            page: Budgets::parse(PAGE_BUDGET_VAR, page_text.as_deref(), d.page)?,
        })
    }

    fn of(&self, s: Stream) -> usize {
        match s {
            Stream::Ep => self.ep as usize,
            Stream::Page => self.page as usize,
            Stream::Compute => usize::MAX,
        }
    }
}

/// A record/wait pair: `to` waits on the event recorded after `producer` on `from`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SyncEdge {
    pub producer: NodeId,
    pub consumer: NodeId,
    pub from: Stream,
    pub to: Stream,
}

/// Where a cross-stream value retires and its owner drains.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Retire {
    pub value: ValueId,
    /// Stream the value was allocated on (its producer's).
    pub owner: Stream,
    /// The last consumer in issue order, and its stream.
    pub last_consumer: NodeId,
    pub consumer_stream: Stream,
    /// The first owner-stream node ordered after the last consumer (the drain adds no wait
    /// there); None: terminal hand-back.
    pub drain_before: Option<NodeId>,
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
    pub stream: Vec<Stream>,
    /// Minimal cross-stream record/wait edges.
    pub syncs: Vec<SyncEdge>,
    /// Lifetime actions of cross-stream values.
    pub retires: Vec<Retire>,
    pub budgets: Budgets,
}

/// Candidate classes, in preference order.
const ENABLING: usize = 0;
const OTHER: usize = 1;
const WGRAD: usize = 2;

struct State<'g> {
    g: &'g Graph,
    budgets: Budgets,
    /// Unissued predecessors.
    pending: Vec<u32>,
    /// Unissued predecessors that are ready waits.
    soft: Vec<u32>,
    issued: Vec<bool>,
    queued: Vec<bool>,
    pos: Vec<usize>,
    /// Waits before which a wgrad node was already placed.
    filled: Vec<bool>,
    order: Vec<NodeId>,
    class: Vec<u8>,
    prio: Vec<i32>,
    /// Ready launches per side stream: (priority, node).
    launches: [BTreeSet<(i32, NodeId)>; 3],
    /// Compute candidates per source and class: (priority, node).
    compute: Vec<[BTreeSet<(i32, NodeId)>; 3]>,
    noops: BTreeSet<(i32, NodeId)>,
    in_flight: [VecDeque<NodeId>; 3],
    last_page_source: Option<u16>,
    yield_from: Option<u16>,
}

impl<'g> State<'g> {
    fn new(g: &'g Graph, budgets: Budgets) -> Self {
        let n = g.len();
        // Launch-enabling: ancestors of a launch (every launch is pending while its ancestor
        // is ready, so the static answer is the dynamic one).
        let mut enabling = vec![false; n];
        for &u in g.topo.iter().rev() {
            enabling[u as usize] = g.succs[u as usize].iter().any(|&s| g.nodes[s as usize].kind.is_launch() || enabling[s as usize]);
        }
        let class = (0..n)
            .map(|i| {
                let nd = &g.nodes[i];
                if nd.wgrad {
                    WGRAD as u8
                } else if enabling[i] {
                    ENABLING as u8
                } else {
                    OTHER as u8
                }
            })
            .collect();
        let prio = g.nodes.iter().map(|nd| g.sources[nd.source as usize].priority).collect();
        let mut st = State {
            g,
            budgets,
            pending: g.preds.iter().map(|p| p.len() as u32).collect(),
            soft: vec![0; n],
            issued: vec![false; n],
            queued: vec![false; n],
            pos: vec![0; n],
            filled: vec![false; n],
            order: Vec::with_capacity(n),
            class,
            prio,
            launches: Default::default(),
            compute: (0..g.sources.len()).map(|_| Default::default()).collect(),
            noops: BTreeSet::new(),
            in_flight: Default::default(),
            last_page_source: None,
            yield_from: None,
        };
        for i in 0..n as NodeId {
            if st.pending[i as usize] == 0 {
                st.enqueue(i);
            }
        }
        st
    }

    fn key(&self, u: NodeId) -> (i32, NodeId) {
        (self.prio[u as usize], u)
    }

    /// `u` has no unissued predecessor other than ready waits.
    fn enqueue(&mut self, u: NodeId) {
        if self.queued[u as usize] || self.issued[u as usize] {
            return;
        }
        let nd = &self.g.nodes[u as usize];
        let hard_ready = self.pending[u as usize] == 0;
        match nd.kind {
            k if k.is_launch() => {
                // A launch goes only when its wait could follow it at once, so a full budget
                // can always be freed (no wait stuck behind another launch of its stream).
                let wait_free = nd.partner.is_none_or(|w| self.pending[w as usize] <= 1);
                if hard_ready && wait_free {
                    self.queued[u as usize] = true;
                    let k = self.key(u);
                    self.launches[nd.stream().index()].insert(k);
                }
            }
            k if k.is_wait() => {} // waits are issued on demand, never from a queue
            Kind::Noop if hard_ready => {
                self.queued[u as usize] = true;
                let k = self.key(u);
                self.noops.insert(k);
            }
            _ => {
                self.queued[u as usize] = true;
                let (s, c, k) = (nd.source as usize, self.class[u as usize] as usize, self.key(u));
                self.compute[s][c].insert(k);
            }
        }
    }

    fn issue(&mut self, u: NodeId) {
        let ui = u as usize;
        self.issued[ui] = true;
        self.pos[ui] = self.order.len();
        self.order.push(u);
        let nd = &self.g.nodes[ui];
        let kind = nd.kind;
        if kind.is_launch() {
            self.in_flight[nd.stream().index()].push_back(u);
            if nd.stream() == Stream::Page {
                self.last_page_source = Some(nd.source);
            }
            self.yield_from = Some(nd.source);
        }
        if kind.is_wait() {
            if let Some(l) = nd.partner {
                let st = self.g.nodes[l as usize].stream().index();
                self.in_flight[st].retain(|&x| x != l);
            }
        }
        if kind == Kind::Compute {
            self.yield_from = None;
        }
        for &s in &self.g.succs[ui] {
            let si = s as usize;
            self.pending[si] -= 1;
            if kind.is_wait() {
                self.soft[si] -= 1;
            }
            if self.pending[si] == self.soft[si] {
                self.enqueue(s);
            }
            if self.g.nodes[si].kind.is_wait() && self.pending[si] == 1 {
                if let Some(l) = self.g.nodes[si].partner {
                    self.enqueue(l);
                }
            }
            if self.pending[si] == 0 && self.g.nodes[si].kind.is_wait() {
                // A ready wait: its successors may become candidates (it is issued on demand).
                for &t in &self.g.succs[si] {
                    self.soft[t as usize] += 1;
                    if self.pending[t as usize] == self.soft[t as usize] {
                        self.enqueue(t);
                    }
                }
            }
        }
    }

    fn next_launch(&mut self) -> Option<NodeId> {
        for s in [Stream::Ep, Stream::Page] {
            let si = s.index();
            if self.in_flight[si].len() >= self.budgets.of(s) || self.launches[si].is_empty() {
                continue;
            }
            let pick = if s == Stream::Page {
                // Source-aware paging: alternate sources when both have copies ready.
                let last = self.last_page_source;
                self.launches[si].iter().find(|k| Some(self.g.nodes[k.1 as usize].source) != last).or(self.launches[si].first()).copied()
            } else {
                self.launches[si].first().copied()
            };
            if let Some(k) = pick {
                self.launches[si].remove(&k);
                return Some(k.1);
            }
        }
        None
    }

    /// The first weight-gradient candidate that needs no wait (by priority, then order).
    fn ready_wgrad(&self) -> Option<(i32, NodeId)> {
        self.compute
            .iter()
            .flat_map(|c| c[WGRAD].iter().find(|k| self.pending[k.1 as usize] == 0).copied())
            .min()
    }

    fn next_compute(&self) -> Option<(i32, NodeId)> {
        let best_in = |skip: Option<u16>| -> Option<(usize, (i32, NodeId))> {
            let mut best: Option<(usize, (i32, NodeId))> = None;
            for (s, classes) in self.compute.iter().enumerate() {
                if Some(s as u16) == skip {
                    continue;
                }
                for (c, set) in classes.iter().enumerate() {
                    if let Some(&k) = set.first() {
                        if best.is_none_or(|b| (c, k) < b) {
                            best = Some((c, k));
                        }
                        break;
                    }
                }
            }
            best
        };
        let pick = self.yield_from.and_then(|s| best_in(Some(s))).or_else(|| best_in(None));
        pick.map(|(_, k)| k)
    }

    fn run(mut self) -> Result<Vec<NodeId>> {
        let n = self.g.len();
        while self.order.len() < n {
            if let Some(&k) = self.noops.first() {
                self.noops.remove(&k);
                self.issue(k.1);
                continue;
            }
            if let Some(l) = self.next_launch() {
                self.issue(l);
                continue;
            }
            if let Some(k) = self.next_compute() {
                let u = k.1;
                // Late wait: the waits this node needs, just before it; then look again.
                let waits: smallvec::SmallVec<[NodeId; 4]> =
                    self.g.preds[u as usize].iter().copied().filter(|&p| !self.issued[p as usize]).collect();
                // Weight-gradient work fills the gap before a wait: one wgrad node per wait,
                // when one is ready without waits of its own.
                if let Some(&w) = waits.iter().find(|&&w| !self.filled[w as usize]) {
                    self.filled[w as usize] = true;
                    if let Some(f) = self.ready_wgrad() {
                        let nd = &self.g.nodes[f.1 as usize];
                        let s = nd.source as usize;
                        self.compute[s][WGRAD].remove(&f);
                        // Filling a gap does not use up the yield owed to the other source.
                        let owed = self.yield_from;
                        self.issue(f.1);
                        self.yield_from = owed;
                        continue;
                    }
                }
                if waits.is_empty() {
                    let nd = &self.g.nodes[u as usize];
                    let (s, c) = (nd.source as usize, self.class[u as usize] as usize);
                    self.compute[s][c].remove(&k);
                    self.issue(u);
                } else {
                    for w in waits {
                        self.issue(w);
                    }
                }
                continue;
            }
            // Nothing else can go: the wait of the oldest in-flight launch that can be waited.
            let oldest = [Stream::Ep, Stream::Page]
                .iter()
                .flat_map(|s| self.in_flight[s.index()].iter().copied())
                .filter_map(|l| self.g.nodes[l as usize].partner.map(|w| (self.pos[l as usize], w)))
                .filter(|&(_, w)| self.pending[w as usize] == 0)
                .min();
            match oldest {
                Some((_, w)) => self.issue(w),
                None => {
                    let stuck = (0..n).find(|&i| !self.issued[i]).unwrap_or(0);
                    return Err(Error::InvalidInput(format!(
                        "scheduler cannot make progress at node '{}' (a wait whose launch cannot be issued?)",
                        self.g.nodes[stuck].name
                    )));
                }
            }
        }
        Ok(self.order)
    }
}

/// Schedule `g` under `budgets`.
pub fn schedule(g: &Graph, budgets: Budgets) -> Result<Schedule> {
    let _span = tracing::debug_span!("schedule", nodes = g.len()).entered();
    Budgets::new(budgets.ep, budgets.page)?;
    let order = State::new(g, budgets).run()?;
    Ok(finish(g, order, budgets))
}

/// Streams, minimal syncs and lifetime actions for a given order (ours or a baseline's).
pub fn finish(g: &Graph, order: Vec<NodeId>, budgets: Budgets) -> Schedule {
    let n = g.len();
    let stream: Vec<Stream> = g.nodes.iter().map(|nd| nd.stream()).collect();
    let mut pos = vec![0usize; n];
    for (i, &u) in order.iter().enumerate() {
        pos[u as usize] = i;
    }
    let mut clocks = Clocks::new(n);
    let mut syncs = Vec::new();
    // Nodes of each stream in issue order (for the drain search below).
    let mut on_stream: [Vec<NodeId>; 3] = Default::default();
    for &c in &order {
        let x = stream[c as usize];
        for &p in &g.preds[c as usize] {
            if clocks.need(p, x, &stream) {
                clocks.join(p, x);
                syncs.push(SyncEdge { producer: p, consumer: c, from: stream[p as usize], to: x });
            }
        }
        clocks.step(c, x);
        on_stream[x.index()].push(c);
    }
    // Lifetime: values consumed on a stream other than their owner's. Consumers of each value
    // in one flat array (offsets per value), not a Vec each.
    let mut start = vec![0u32; g.values.len() + 1];
    for nd in g.nodes.iter().filter(|nd| !nd.kind.is_wait()) {
        for &v in &nd.inputs {
            start[v as usize + 1] += 1;
        }
    }
    for v in 0..g.values.len() {
        start[v + 1] += start[v];
    }
    let mut fill = start.clone();
    let mut flat = vec![0 as NodeId; start[g.values.len()] as usize];
    for (i, nd) in g.nodes.iter().enumerate().filter(|(_, nd)| !nd.kind.is_wait()) {
        for &v in &nd.inputs {
            flat[fill[v as usize] as usize] = i as NodeId;
            fill[v as usize] += 1;
        }
    }
    let mut retires = Vec::new();
    for v in 0..g.values.len() {
        let cons = &flat[start[v] as usize..start[v + 1] as usize];
        let Some(p) = g.values[v].producer else { continue };
        let owner = stream[p as usize];
        if cons.iter().all(|&c| stream[c as usize] == owner) || cons.is_empty() {
            continue;
        }
        let last = *cons.iter().max_by_key(|&&c| pos[c as usize]).expect("non-empty");
        let cs = stream[last as usize];
        // Drain before the first owner-stream node already ordered after the last consumer
        // (its clock covers it): the manager's wait there adds no dependency. Clocks only grow
        // along a stream, so a binary search finds it. None: the terminal hand-back.
        // Every consumer on another stream must be covered, and the drain comes after the last.
        let list = &on_stream[owner.index()];
        let mut k = list.partition_point(|&u| pos[u as usize] <= pos[last as usize]);
        for &c in cons {
            let c_s = stream[c as usize];
            if c_s != owner {
                let need = clocks.seq[c as usize];
                k = k.max(list.partition_point(|&u| clocks.at[u as usize][c_s.index()] < need));
            }
        }
        let drain_before = list.get(k).copied();
        let phase = g.sources[g.nodes[last as usize].source as usize].phase;
        let action = if phase == Phase::F { Action::EmptyStorage } else { Action::DropReference };
        retires.push(Retire { value: v as ValueId, owner, last_consumer: last, consumer_stream: cs, drain_before, action });
    }
    Schedule { order, stream, syncs, retires, budgets }
}

/// Vector clocks per stream: what each stream has waited for, by position on other streams.
pub(crate) struct Clocks {
    /// Position of each node on its stream (1-based; 0 = none).
    seq: Vec<u64>,
    count: [u64; 3],
    now: [[u64; 3]; 3],
    at: Vec<[u64; 3]>,
}

impl Clocks {
    pub(crate) fn new(n: usize) -> Self {
        Clocks { seq: vec![0; n], count: [0; 3], now: [[0; 3]; 3], at: vec![[0; 3]; n] }
    }
    /// Does stream `x` still need a wait for `p`?
    pub(crate) fn need(&self, p: NodeId, x: Stream, stream: &[Stream]) -> bool {
        let y = stream[p as usize];
        y != x && self.now[x.index()][y.index()] < self.seq[p as usize]
    }
    /// Stream `x` waits on the event recorded after `p`.
    pub(crate) fn join(&mut self, p: NodeId, x: Stream) {
        let pc = self.at[p as usize];
        let xi = x.index();
        for s in 0..3 {
            self.now[xi][s] = self.now[xi][s].max(pc[s]);
        }
    }
    /// `c` runs on `x`.
    pub(crate) fn step(&mut self, c: NodeId, x: Stream) {
        let xi = x.index();
        self.count[xi] += 1;
        self.seq[c as usize] = self.count[xi];
        self.now[xi][xi] = self.count[xi];
        self.at[c as usize] = self.now[xi];
    }
}

/// Per comm/page launch: the compute nodes issued between it and its wait.
#[derive(Clone, Debug, Serialize)]
pub struct Explained {
    pub launch: String,
    pub source: String,
    pub hidden_under: Vec<String>,
}

/// What compute hid each launch.
pub fn explain(g: &Graph, s: &Schedule) -> Vec<Explained> {
    let mut pos = vec![0usize; g.len()];
    for (i, &u) in s.order.iter().enumerate() {
        pos[u as usize] = i;
    }
    let mut out = Vec::new();
    for &u in &s.order {
        let nd = &g.nodes[u as usize];
        if !nd.kind.is_launch() {
            continue;
        }
        let end = nd.partner.map_or(s.order.len(), |w| pos[w as usize]);
        let hidden = s.order[pos[u as usize] + 1..end]
            .iter()
            .filter(|&&c| g.nodes[c as usize].kind == Kind::Compute)
            .map(|&c| g.nodes[c as usize].name.clone())
            .collect();
        out.push(Explained { launch: nd.name.clone(), source: g.sources[nd.source as usize].name.clone(), hidden_under: hidden });
    }
    out
}

/// A schedule with names, as Python sees it.
#[derive(Clone, Debug, Serialize)]
pub struct NamedSchedule {
    pub order: Vec<String>,
    pub streams: Vec<(String, Stream)>,
    pub syncs: Vec<(String, String, Stream, Stream)>,
    pub retires: Vec<NamedRetire>,
    pub budgets: Budgets,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<Vec<Explained>>,
}

/// A retire with names.
#[derive(Clone, Debug, Serialize)]
pub struct NamedRetire {
    pub value: String,
    pub owner: Stream,
    pub last_consumer: String,
    pub consumer_stream: Stream,
    pub drain_before: Option<String>,
    pub action: &'static str,
}

/// Names instead of indices.
pub fn named(g: &Graph, s: &Schedule, explain: Option<Vec<Explained>>) -> NamedSchedule {
    let nm = |u: NodeId| g.nodes[u as usize].name.clone();
    NamedSchedule {
        order: s.order.iter().map(|&u| nm(u)).collect(),
        streams: s.order.iter().map(|&u| (nm(u), s.stream[u as usize])).collect(),
        syncs: s.syncs.iter().map(|e| (nm(e.producer), nm(e.consumer), e.from, e.to)).collect(),
        retires: s
            .retires
            .iter()
            .map(|r| NamedRetire {
                value: g.values[r.value as usize].name.clone(),
                owner: r.owner,
                last_consumer: nm(r.last_consumer),
                consumer_stream: r.consumer_stream,
                drain_before: r.drain_before.map(nm),
                action: r.action.name(),
            })
            .collect(),
        budgets: s.budgets,
        explain,
    }
}

/// Validate a schedule given by names: the order, and the record/wait pairs (None: the
/// minimal ones for that order are derived, so only topology and budgets are checked).
pub fn validate_named(g: &Graph, order: &[String], syncs: Option<&[(String, String)]>, budgets: Budgets) -> Result<()> {
    let ix: std::collections::HashMap<&str, NodeId> =
        g.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i as NodeId)).collect();
    let id = |n: &str| ix.get(n).copied().ok_or_else(|| Error::InvalidInput(format!("schedule names node '{n}', which is not in the graph")));
    let ids = order.iter().map(|n| id(n)).collect::<Result<Vec<_>>>()?;
    if ids.len() != g.len() {
        return Err(Error::InvalidInput(format!("schedule has {} nodes, the graph {}", ids.len(), g.len())));
    }
    let mut seen = vec![false; g.len()];
    for &u in &ids {
        if std::mem::replace(&mut seen[u as usize], true) {
            return Err(Error::InvalidInput(format!("node '{}' is issued twice", g.nodes[u as usize].name)));
        }
    }
    let mut s = finish(g, ids, budgets);
    if let Some(pairs) = syncs {
        s.syncs = pairs
            .iter()
            .map(|(p, c)| {
                let (p, c) = (id(p)?, id(c)?);
                Ok(SyncEdge { producer: p, consumer: c, from: s.stream[p as usize], to: s.stream[c as usize] })
            })
            .collect::<Result<Vec<_>>>()?;
    }
    validate(g, &s)
}
