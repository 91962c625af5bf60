//! The issue-order policy, applied at each step in this order (deterministic; ties by source
//! priority, then table order; O((N+E) log N); no timing):
//! 1. Noops whose inputs are issued go at once (no kernel).
//! 2. Early launch: a ready comm/page launch issues at once, within its stream's budget
//!    (launches in flight = issued launches whose wait is not yet issued). On the page stream,
//!    a launch from another source than the last one goes first, so F page-outs and B
//!    page-ins interleave.
//! 3. Compute: candidates are nodes whose unissued predecessors are all ready waits. After a
//!    launch from source S, a candidate from another source goes first (yield). Then
//!    launch-enabling compute (ancestors of a launch), then other compute, then weight-gradient
//!    work. Within a class, a candidate that needs no wait goes before one that does
//!    (`ready_first`, default; off under the `classic` rules). A candidate that needs waits gets them issued first (late wait), and the step
//!    restarts, so a launch the waits unblocked goes before it. Before a wait, one ready
//!    weight-gradient node is issued if there is one (wgrad fills the gap a wait would expose;
//!    it never delays a launch, since it enables none).
//! 4. Otherwise the oldest in-flight launch's wait is issued (a budget forces it, or nothing
//!    else is left).
//!
//! Opt-in `launch_first` (a pass over that order): each EP launch, in order, moves up to just
//! after the last of its predecessors and the previous EP launch; where the budget is full
//! there, the waits that free it (of the launches `budget` back and older) move up with it,
//! right before it. Everything else keeps its place. Without it a launch can sit behind compute
//! it does not need (a weight-gradient filler before the budget's late wait), and on the GPU it
//! then waits for that compute too: a transport allocates its output on the compute stream and
//! makes the EP stream wait for everything the compute stream was given so far (`wait_stream`;
//! the simulator models it: `sim::lower_launch_waits`). A trade: the link is kept busy, and the
//! compute stream waits for the previous transfer sooner.

use std::collections::{BTreeSet, VecDeque};

use crate::ep::{Budgets, PerRole, Role};
use crate::error::{Error, Result};
use crate::ir::{Graph, Kind, NodeId, SourceId};

/// Candidate classes, in preference order.
const ENABLING: usize = 0;
const OTHER: usize = 1;
const WGRAD: usize = 2;

/// A queue key: (source priority, cost rank (0 unless a cost rule is on), node).
type Key = (i32, i64, NodeId);

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
    /// Cost rank per node (lower goes first within a class; 0 without cost rules).
    rank: Vec<i64>,
    /// Ready launches per side stream.
    launches: PerRole<BTreeSet<Key>>,
    /// Compute candidates per source and class.
    compute: Vec<[BTreeSet<Key>; 3]>,
    noops: BTreeSet<Key>,
    in_flight: PerRole<VecDeque<NodeId>>,
    last_page_source: Option<SourceId>,
    yield_from: Option<SourceId>,
    /// Opt-in rule: within a class, compute needing no wait before compute needing one.
    ready_first: bool,
}

/// The issue order of `g` under `budgets` (and opt-in `rules`).
pub(super) fn order(g: &Graph, budgets: Budgets, rules: super::Rules) -> Result<Vec<NodeId>> {
    let mut st = State::new(g, budgets, rules);
    st.ready_first = rules.ready_first;
    let order = st.run()?;
    Ok(if rules.launch_first { launch_first(g, order, budgets) } else { order })
}

/// Cost ranks (us, rounded; lower first) under the opt-in cost rules: `soonest_launch` ranks
/// launch-enabling compute by the compute time from it to the launch it enables (the nearest),
/// `critical_path` ranks everything else by its bottom level (longest path to the end, comm
/// included), longest first.
fn cost_ranks(g: &Graph, enabling: &[bool], rules: super::Rules) -> Vec<i64> {
    let n = g.len();
    if !rules.soonest_launch && !rules.critical_path {
        return vec![0; n];
    }
    let cost = |u: NodeId| if g.nodes[u].kind.is_wait() || g.nodes[u].kind == Kind::Noop { 0.0 } else { g.nodes[u].cost };
    let mut to_launch = vec![f64::INFINITY; n];
    let mut blevel = vec![0.0f64; n];
    for &u in g.topo.iter().rev() {
        blevel[u.ix()] = cost(u) + g.succs[u].iter().map(|&s| blevel[s.ix()]).fold(0.0, f64::max);
        if g.nodes[u].kind.is_launch() {
            to_launch[u.ix()] = 0.0;
        } else if enabling[u.ix()] {
            to_launch[u.ix()] = cost(u) + g.succs[u].iter().map(|&s| to_launch[s.ix()]).fold(f64::INFINITY, f64::min);
        }
    }
    (0..n)
        .map(|i| {
            if rules.soonest_launch && enabling[i] && g.nodes[NodeId::new(i)].kind == Kind::Compute {
                to_launch[i].round() as i64
            } else if rules.critical_path {
                -(blevel[i].round() as i64)
            } else {
                0
            }
        })
        .collect()
}

impl<'g> State<'g> {
    fn new(g: &'g Graph, budgets: Budgets, rules: super::Rules) -> Self {
        let n = g.len();
        // Launch-enabling: ancestors of a launch (every launch is pending while its ancestor
        // is ready, so the static answer is the dynamic one).
        let mut enabling = vec![false; n];
        for &u in g.topo.iter().rev() {
            enabling[u.ix()] = g.succs[u].iter().any(|&s| g.nodes[s].kind.is_launch() || enabling[s.ix()]);
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
        // Ties between sources of equal priority: table order, or (`reverse_sources`) the
        // later source first.
        let prio = g
            .nodes
            .iter()
            .map(|nd| g.sources[nd.source].priority * 1024 - if rules.reverse_sources { nd.source.ix() as i32 } else { 0 })
            .collect();
        let rank = cost_ranks(g, &enabling, rules);
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
            rank,
            launches: Default::default(),
            compute: (0..g.sources.len()).map(|_| Default::default()).collect(),
            noops: BTreeSet::new(),
            in_flight: Default::default(),
            last_page_source: None,
            yield_from: None,
            ready_first: false,
        };
        for i in g.node_ids() {
            if st.pending[i] == 0 {
                st.enqueue(i);
            }
        }
        st
    }

    fn key(&self, u: NodeId) -> Key {
        (self.prio[u], self.rank[u.ix()], u)
    }

    /// `u` has no unissued predecessor other than ready waits.
    fn enqueue(&mut self, u: NodeId) {
        if self.queued[u] || self.issued[u] {
            return;
        }
        let nd = &self.g.nodes[u];
        let hard_ready = self.pending[u] == 0;
        match nd.kind {
            k if k.is_launch() => {
                // A launch goes only when its wait could follow it at once, so a full budget
                // can always be freed (no wait stuck behind another launch of its stream).
                let wait_free = nd.partner.is_none_or(|w| self.pending[w] <= 1);
                if hard_ready && wait_free {
                    self.queued[u] = true;
                    let k = self.key(u);
                    self.launches[Role::of(nd.kind)].insert(k);
                }
            }
            k if k.is_wait() => {} // waits are issued on demand, never from a queue
            Kind::Noop if hard_ready => {
                self.queued[u] = true;
                let k = self.key(u);
                self.noops.insert(k);
            }
            _ => {
                self.queued[u] = true;
                let (s, c, k) = (nd.source, self.class[u] as usize, self.key(u));
                self.compute[s][c].insert(k);
            }
        }
    }

    fn issue(&mut self, u: NodeId) {
        self.issued[u] = true;
        self.pos[u] = self.order.len();
        self.order.push(u);
        let nd = &self.g.nodes[u];
        let kind = nd.kind;
        if kind.is_launch() {
            let role = Role::of(kind);
            self.in_flight[role].push_back(u);
            if role == Role::Page {
                self.last_page_source = Some(nd.source);
            }
            self.yield_from = Some(nd.source);
        }
        if kind.is_wait() {
            if let Some(l) = nd.partner {
                let role = Role::of(self.g.nodes[l].kind);
                self.in_flight[role].retain(|&x| x != l);
            }
        }
        if kind == Kind::Compute {
            self.yield_from = None;
        }
        for &s in &self.g.succs[u] {
            self.pending[s] -= 1;
            if kind.is_wait() {
                self.soft[s] -= 1;
            }
            if self.pending[s] == self.soft[s] {
                self.enqueue(s);
            }
            if self.g.nodes[s].kind.is_wait() && self.pending[s] == 1 {
                if let Some(l) = self.g.nodes[s].partner {
                    self.enqueue(l);
                }
            }
            if self.pending[s] == 0 && self.g.nodes[s].kind.is_wait() {
                // A ready wait: its successors may become candidates (it is issued on demand).
                for &t in &self.g.succs[s] {
                    self.soft[t] += 1;
                    if self.pending[t] == self.soft[t] {
                        self.enqueue(t);
                    }
                }
            }
        }
    }

    fn next_launch(&mut self) -> Option<NodeId> {
        for r in Role::SIDE {
            if self.in_flight[r].len() >= self.budgets.of(r) || self.launches[r].is_empty() {
                continue;
            }
            let pick = if r == Role::Page {
                // Source-aware paging: alternate sources when both have copies ready.
                let last = self.last_page_source;
                self.launches[r].iter().find(|k| Some(self.g.nodes[k.2].source) != last).or(self.launches[r].first()).copied()
            } else {
                self.launches[r].first().copied()
            };
            if let Some(k) = pick {
                self.launches[r].remove(&k);
                return Some(k.2);
            }
        }
        None
    }

    /// The first weight-gradient candidate that needs no wait (by priority, then order).
    fn ready_wgrad(&self) -> Option<Key> {
        self.compute.iter().flat_map(|c| c[WGRAD].iter().find(|k| self.pending[k.2] == 0).copied()).min()
    }

    fn next_compute(&self) -> Option<Key> {
        // `ready_first` (default; off under `classic`): within a class, a candidate that needs no wait goes before one
        // that would stall the compute stream on a transfer.
        let best_in = |skip: Option<SourceId>| -> Option<(usize, bool, Key)> {
            let mut best: Option<(usize, bool, Key)> = None;
            for (s, classes) in self.compute.iter().enumerate() {
                if Some(SourceId::new(s)) == skip {
                    continue;
                }
                for (c, set) in classes.iter().enumerate() {
                    let ready = if self.ready_first { set.iter().find(|k| self.pending[k.2] == 0).map(|&k| (c, false, k)) } else { None };
                    if let Some(cand) = ready.or_else(|| set.first().map(|&k| (c, self.ready_first, k))) {
                        if best.is_none_or(|b| cand < b) {
                            best = Some(cand);
                        }
                        break;
                    }
                }
            }
            best
        };
        let pick = self.yield_from.and_then(|s| best_in(Some(s))).or_else(|| best_in(None));
        pick.map(|(_, _, k)| k)
    }

    fn run(mut self) -> Result<Vec<NodeId>> {
        let n = self.g.len();
        while self.order.len() < n {
            if let Some(&k) = self.noops.first() {
                self.noops.remove(&k);
                self.issue(k.2);
                continue;
            }
            if let Some(l) = self.next_launch() {
                self.issue(l);
                continue;
            }
            if let Some(k) = self.next_compute() {
                let u = k.2;
                // Late wait: the waits this node needs, just before it; then look again.
                let waits: smallvec::SmallVec<[NodeId; 4]> =
                    self.g.preds[u].iter().copied().filter(|&p| !self.issued[p]).collect();
                // Weight-gradient work fills the gap before a wait: one wgrad node per wait,
                // when one is ready without waits of its own.
                if let Some(&w) = waits.iter().find(|&&w| !self.filled[w]) {
                    self.filled[w] = true;
                    if let Some(f) = self.ready_wgrad() {
                        let s = self.g.nodes[f.2].source;
                        self.compute[s][WGRAD].remove(&f);
                        // Filling a gap does not use up the yield owed to the other source.
                        let owed = self.yield_from;
                        self.issue(f.2);
                        self.yield_from = owed;
                        continue;
                    }
                }
                if waits.is_empty() {
                    let (s, c) = (self.g.nodes[u].source, self.class[u] as usize);
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
            let oldest = Role::SIDE
                .iter()
                .flat_map(|&r| self.in_flight[r].iter().copied())
                .filter_map(|l| self.g.nodes[l].partner.map(|w| (self.pos[l], w)))
                .filter(|&(_, w)| self.pending[w] == 0)
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

/// Rule `launch_first` (module docs): `order` again, with each EP launch placed as soon as its
/// predecessors and the previous EP launch are placed, the waits its budget needs (those of the
/// launches `budget` back and older) right before it when what they wait for is placed too (else
/// it waits for that). One pass, O(N + E): keeps every edge and budget of `order`.
fn launch_first(g: &Graph, order: Vec<NodeId>, budgets: Budgets) -> Vec<NodeId> {
    let budget = budgets.of(Role::Ep);
    let launches: Vec<NodeId> = order.iter().copied().filter(|&u| g.nodes[u].kind == Kind::CommLaunch).collect();
    let mut at = vec![0usize; g.len()];
    for (i, &u) in order.iter().enumerate() {
        at[u.ix()] = i;
    }
    let mut pending: Vec<usize> = g.preds.iter().map(|p| p.len()).collect();
    let mut placed = vec![false; g.len()];
    let mut out = Vec::with_capacity(order.len());
    let place = |u: NodeId, out: &mut Vec<NodeId>, placed: &mut [bool], pending: &mut [usize]| {
        placed[u.ix()] = true;
        out.push(u);
        for &s in &g.succs[u] {
            pending[s.ix()] -= 1;
        }
    };
    let (mut next, mut first_unwaited) = (0usize, 0usize);
    for &u in &order {
        if placed[u.ix()] {
            continue;
        }
        place(u, &mut out, &mut placed, &mut pending);
        // The next EP launches in turn, each as soon as it can go.
        while let Some(&l) = launches.get(next) {
            if placed[l.ix()] {
                next += 1;
                continue;
            }
            if pending[l.ix()] > 0 {
                break; // (the previous launch is placed: `next` moved past it)
            }
            while first_unwaited < launches.len() && g.nodes[launches[first_unwaited]].partner.is_none_or(|w| placed[w.ix()]) {
                first_unwaited += 1;
            }
            let mut waits: Vec<NodeId> = match next.checked_sub(budget) {
                Some(last) if first_unwaited <= last => launches[first_unwaited..=last]
                    .iter()
                    .filter_map(|&x| g.nodes[x].partner)
                    .filter(|w| !placed[w.ix()])
                    .collect(),
                _ => Vec::new(),
            };
            if waits.iter().any(|w| pending[w.ix()] > 0) {
                break;
            }
            waits.sort_by_key(|w| at[w.ix()]);
            for w in waits {
                place(w, &mut out, &mut placed, &mut pending);
            }
            place(l, &mut out, &mut placed, &mut pending);
            next += 1;
        }
    }
    out
}
