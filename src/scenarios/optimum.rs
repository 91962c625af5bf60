//! The optimum for small graphs (issue 8): every issue order of a graph of up to ~14 nodes
//! that respects its edges and the launch budgets, each simulated (the simulator's model, the
//! real lifetime manager), the shortest kept. The reference our greedy order is measured
//! against on random two-source MoE-like graphs. All figures are SIMULATED.

use super::sweep::simulate_order;
use super::Rng;
use crate::ep::{Budgets, PerRole, Role};
use crate::error::Result;
use crate::ir::{Graph, GraphSpec, Kind, NodeId, NodeSpec, OutputSpec, Phase, Source};
use crate::sched::{schedule, Rules};

/// A small random graph: a forward and a backward source, each a chain of compute nodes and
/// comm launch/wait pairs (with, in the backward, a weight-gradient side node now and then);
/// compute costs 100-1000 us, comm costs 100-1000 us times a comm/compute ratio of 0.25-2;
/// at most `max_nodes` nodes (waits included).
pub fn small_random(seed: u64, max_nodes: usize) -> GraphSpec {
    random_chains(seed, max_nodes, false)
}

/// `small_random` with the MoE constraint that a transfer's result always feeds compute
/// before the next transfer (dispatch -> experts -> combine), never another transfer at once.
pub fn small_random_moe(seed: u64, max_nodes: usize) -> GraphSpec {
    random_chains(seed, max_nodes, true)
}

fn random_chains(seed: u64, max_nodes: usize, compute_between: bool) -> GraphSpec {
    let mut r = Rng::new(seed);
    let ratio = [0.25, 0.5, 1.0, 2.0][r.below(4) as usize];
    let sources = vec![
        Source { name: "F1".into(), microbatch: 1, phase: Phase::F, priority: 0 },
        Source { name: "B0".into(), microbatch: 0, phase: Phase::B, priority: 0 },
    ];
    let mut nodes: Vec<NodeSpec> = Vec::new();
    let mut k = 0usize;
    for src in ["F1", "B0"] {
        let budget = max_nodes / 2;
        let mut used = 0usize;
        let mut last: Option<String> = None;
        let mut last_was_comm = false;
        while used < budget {
            let name = format!("{src}.n{k}");
            let out = format!("{src}.v{k}");
            k += 1;
            let ins: Vec<String> = last.iter().cloned().collect();
            let node = |kind: Kind, cost: f64, wgrad: bool| NodeSpec {
                name: name.clone(),
                source: src.into(),
                kind,
                wgrad,
                inputs: ins.clone(),
                outputs: vec![OutputSpec::Sized { value: out.clone(), bytes: 1 << 20 }],
                mutates: vec![],
                launch: None,
                cost,
            };
            let pick = r.below(5);
            if pick < 2 && used + 2 <= budget && last.is_some() && !(compute_between && last_was_comm) {
                nodes.push(node(Kind::CommLaunch, (100 + r.below(900)) as f64 * ratio, false));
                nodes.push(NodeSpec {
                    name: format!("{name}.wait"),
                    source: src.into(),
                    kind: Kind::CommWait,
                    wgrad: false,
                    inputs: vec![],
                    outputs: vec![],
                    mutates: vec![],
                    launch: Some(name.clone()),
                    cost: 0.0,
                });
                used += 2;
                last_was_comm = true;
            } else if pick == 2 && src == "B0" && last.is_some() {
                // dW off the chain: the chain continues from the previous value.
                nodes.push(node(Kind::Compute, (50 + r.below(450)) as f64, true));
                used += 1;
                continue;
            } else {
                nodes.push(node(Kind::Compute, (100 + r.below(900)) as f64, false));
                used += 1;
                last_was_comm = false;
            }
            last = Some(out);
        }
    }
    GraphSpec { sources, nodes, control: vec![], reuse: vec![], inputs: vec![], outputs: vec![] }
}

/// The result of an exhaustive search.
#[derive(Clone, Debug)]
pub struct Optimum {
    /// The shortest simulated makespan (us) over every valid order.
    pub makespan_us: f64,
    /// One order reaching it.
    pub order: Vec<NodeId>,
    /// How many complete orders were simulated.
    pub orders: usize,
}

/// The best of every issue order of `g` within `budgets` (None when there are more than
/// `cap` orders: too large to search).
pub fn exhaustive(g: &Graph, budgets: Budgets, cap: usize) -> Result<Option<Optimum>> {
    exhaustive_model(g, budgets, cap, false)
}

/// As [`exhaustive`], rated by rule `search`'s model: each EP launch also waits for the compute
/// issued before it ([`crate::sim::makespan_launch_waits`]).
pub fn exhaustive_launch_waits(g: &Graph, budgets: Budgets, cap: usize) -> Result<Option<Optimum>> {
    exhaustive_model(g, budgets, cap, true)
}

fn exhaustive_model(g: &Graph, budgets: Budgets, cap: usize, launch_waits: bool) -> Result<Option<Optimum>> {
    let n = g.len();
    let mut indeg: Vec<usize> = g.preds.iter().map(|p| p.len()).collect();
    let mut succs: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, ps) in g.preds.iter().enumerate() {
        for p in ps {
            succs[p.ix()].push(i);
        }
    }
    let mut search =
        Search { g, budgets, succs, best: None, orders: 0, cap, prefix: Vec::with_capacity(n), in_flight: PerRole::default(), launch_waits };
    if !search.dfs(&mut indeg)? {
        return Ok(None);
    }
    Ok(search.best.map(|(m, o)| Optimum { makespan_us: m, order: o, orders: search.orders }))
}

struct Search<'g> {
    g: &'g Graph,
    budgets: Budgets,
    succs: Vec<Vec<usize>>,
    best: Option<(f64, Vec<NodeId>)>,
    orders: usize,
    cap: usize,
    prefix: Vec<NodeId>,
    in_flight: PerRole<usize>,
    launch_waits: bool,
}

impl Search<'_> {
    /// Extends the prefix every way; false when the cap was hit.
    fn dfs(&mut self, indeg: &mut Vec<usize>) -> Result<bool> {
        let n = self.g.len();
        if self.prefix.len() == n {
            self.orders += 1;
            if self.orders > self.cap {
                return Ok(false);
            }
            let m = if self.launch_waits {
                crate::sim::makespan_launch_waits(self.g, &self.prefix)?
            } else {
                let (m, _, _, hazards) = simulate_order(self.g, &self.prefix, false, true)?;
                debug_assert_eq!(hazards, 0);
                m
            };
            if self.best.as_ref().is_none_or(|(b, _)| m < *b) {
                self.best = Some((m, self.prefix.clone()));
            }
            return Ok(true);
        }
        let placed: Vec<bool> = {
            let mut v = vec![false; n];
            for u in &self.prefix {
                v[u.ix()] = true;
            }
            v
        };
        for i in 0..n {
            if placed[i] || indeg[i] != 0 {
                continue;
            }
            let kind = self.g.nodes[i].kind;
            let role = Role::of(kind);
            if kind.is_launch() && self.in_flight[role] >= self.budgets.of(role) {
                continue;
            }
            if kind.is_launch() {
                self.in_flight[role] += 1;
            } else if kind.is_wait() {
                self.in_flight[Role::of(self.g.nodes[self.g.nodes[i].partner.expect("wait has a launch").ix()].kind)] -= 1;
            }
            for &s in &self.succs[i] {
                indeg[s] -= 1;
            }
            self.prefix.push(NodeId::new(i));
            let ok = self.dfs(indeg)?;
            self.prefix.pop();
            for &s in &self.succs[i] {
                indeg[s] += 1;
            }
            if kind.is_launch() {
                self.in_flight[role] -= 1;
            } else if kind.is_wait() {
                self.in_flight[Role::of(self.g.nodes[self.g.nodes[i].partner.expect("wait has a launch").ix()].kind)] += 1;
            }
            if !ok {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// One seed's comparison: (ours, optimum, orders searched), makespans in us; None when the
/// graph has too many orders to search.
pub fn compare(seed: u64, max_nodes: usize, budgets: Budgets, cap: usize) -> Result<Option<(f64, f64, usize)>> {
    compare_on(small_random(seed, max_nodes), budgets, cap)
}

/// `compare` on a given graph table.
pub fn compare_on(spec: GraphSpec, budgets: Budgets, cap: usize) -> Result<Option<(f64, f64, usize)>> {
    let g = Graph::new(spec)?;
    let ours = schedule(&g, budgets)?;
    let (m, _, _, hazards) = simulate_order(&g, &ours.order, false, true)?;
    debug_assert_eq!(hazards, 0);
    Ok(exhaustive(&g, budgets, cap)?.map(|o| (m, o.makespan_us, o.orders)))
}

/// Our simulated makespan (us) on a graph table under opt-in `rules`.
pub fn ours_makespan(spec: &GraphSpec, budgets: Budgets, rules: Rules) -> Result<f64> {
    let g = Graph::new(spec.clone())?;
    let s = crate::sim::schedule(&g, budgets, rules)?;
    Ok(simulate_order(&g, &s.order, false, true)?.0)
}
