//! Memory-aware ordering: the liveness peak of an issue order, and the guard that keeps the
//! scheduler's order from raising it over the graph's own (table) order (the compile backend's
//! `memory_slack`: AOTAutograd's order is the table order there).
//!
//! Liveness as the simulator's lower bound counts it (`sim::Machine::liveness_lower_bound`:
//! a value is live from its first use's start to its last use's end), with every node one step
//! long: a value is live from its producer's step through its last reader's step. Graph inputs
//! are not counted (they are live whatever the order); a graph output ([`Graph::outputs`]) lives
//! to the end; a noop's outputs are views of its first input, so their readers keep that
//! storage live (the storage is counted once, with its producer's bytes).
//!
//! The guard: where the graph has nothing to overlap (no launch, no wait: no communication and
//! no paging copy to hide) reordering buys nothing, and the table order is kept; otherwise the
//! scheduled order is kept unless its peak is more than `slack` over the table order's. Then
//! the table's own compute order with every launch issued as early and every wait as late as
//! the budgets allow ([`early_launches_in_table_order`]: overlap at about the table's memory) is
//! taken if its peak is within the slack, else the table order itself (a valid one: topological
//! and within the launch budgets); the check says which and why.

use std::collections::VecDeque;

use serde::Serialize;

use super::search::feasible;
use crate::ep::{Budgets, PerRole, Role};
use crate::ir::{Graph, Kind, NodeId, ValueId};

/// What the memory guard found and chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryCheck {
    /// The liveness peak of the order returned, bytes.
    pub peak_bytes: u64,
    /// The liveness peak of the table order, bytes.
    pub baseline_peak_bytes: u64,
    /// The scheduled order's peak, bytes.
    pub scheduled_peak_bytes: u64,
    /// The slack allowed over the table order (a fraction: 0.02 is 2%).
    pub slack: f64,
    /// True when the table order was kept instead of the scheduled one.
    pub kept_table_order: bool,
    /// Why, in one line.
    pub why: String,
}

/// The liveness peak (bytes) of `order`, a permutation of `g`'s nodes (see the module docs).
pub fn peak(g: &Graph, order: &[NodeId]) -> u64 {
    let n = order.len();
    if n == 0 {
        return 0;
    }
    let mut pos = vec![0usize; g.len()];
    for (i, &u) in order.iter().enumerate() {
        pos[u.ix()] = i;
    }
    // The storage each value is a view of (noops are views of their first input).
    let mut root: Vec<ValueId> = (0..g.values.len()).map(ValueId::new).collect();
    for &u in &g.topo {
        let nd = &g.nodes[u];
        if let (Kind::Noop, Some(&first)) = (nd.kind, nd.inputs.first()) {
            for &o in &nd.outputs {
                root[o.ix()] = root[first.ix()];
            }
        }
    }
    let mut end: Vec<Option<usize>> = vec![None; g.values.len()];
    let extend = |v: ValueId, at: usize, end: &mut Vec<Option<usize>>| {
        let r = root[v.ix()].ix();
        end[r] = Some(end[r].map_or(at, |e| e.max(at)));
    };
    for &u in order {
        for &v in &g.nodes[u].inputs {
            extend(v, pos[u.ix()], &mut end);
        }
    }
    for &v in &g.outputs {
        extend(v, n - 1, &mut end);
    }
    let mut diff = vec![0i128; n + 1];
    for (i, v) in g.values.iter().enumerate() {
        let Some(p) = v.producer else { continue };
        if root[i].ix() != i || v.bytes == 0 {
            continue; // a view: counted with its storage
        }
        let start = pos[p.ix()];
        let last = end[i].unwrap_or(start).max(start);
        diff[start] += i128::from(v.bytes);
        diff[last + 1] -= i128::from(v.bytes);
    }
    let (mut cur, mut best) = (0i128, 0i128);
    for d in &diff[..n] {
        cur += d;
        best = best.max(cur);
    }
    best as u64
}

/// The table's compute order (a topological order of `g`), with each launch issued as soon as
/// its inputs are ready and its stream has room in its budget (at its own table position at the
/// latest, where the oldest transfer in flight on that stream is waited for if it must), and
/// each wait just before the first node that needs it (or where its stream's budget needs it,
/// or at the end). Compute keeps the table's order, so memory stays about the table's.
pub fn early_launches_in_table_order(g: &Graph, budgets: Budgets) -> Vec<NodeId> {
    struct Walk<'a> {
        g: &'a Graph,
        budgets: Budgets,
        done: Vec<bool>,
        out: Vec<NodeId>,
        flight: PerRole<VecDeque<NodeId>>,
    }
    impl Walk<'_> {
        /// Issue `u` after whatever it needs (its predecessors; for a launch, room in its budget).
        fn ensure(&mut self, u: NodeId) {
            if self.done[u.ix()] {
                return;
            }
            let g = self.g;
            for &p in &g.preds[u] {
                self.ensure(p);
            }
            let kind = g.nodes[u].kind;
            if kind.is_launch() {
                let r = Role::of(kind);
                while self.flight[r].len() >= self.budgets.of(r) {
                    let Some(&oldest) = self.flight[r].front() else { break };
                    match g.nodes[oldest].partner {
                        Some(w) => self.ensure(w),
                        None => break, // validated graphs pair every launch
                    }
                }
                self.flight[r].push_back(u);
            } else if kind.is_wait() {
                if let Some(l) = g.nodes[u].partner {
                    let r = Role::of(g.nodes[l].kind);
                    self.flight[r].retain(|&x| x != l);
                }
            }
            self.done[u.ix()] = true;
            self.out.push(u);
        }
    }
    let launches: Vec<NodeId> = g.node_ids().filter(|&u| g.nodes[u].kind.is_launch()).collect();
    let mut w = Walk { g, budgets, done: vec![false; g.len()], out: Vec::with_capacity(g.len()), flight: PerRole::default() };
    // Launch early: every launch whose inputs are ready, while its stream has room.
    let launch_ready = |w: &mut Walk| {
        for &l in &launches {
            let r = Role::of(g.nodes[l].kind);
            if !w.done[l.ix()] && w.flight[r].len() < budgets.of(r) && g.preds[l].iter().all(|p| w.done[p.ix()]) {
                w.ensure(l);
            }
        }
    };
    launch_ready(&mut w);
    for u in g.node_ids() {
        if g.nodes[u].kind.is_wait() {
            continue; // issued when something needs it
        }
        w.ensure(u);
        launch_ready(&mut w);
    }
    for u in g.node_ids() {
        w.ensure(u);
    }
    w.out
}

/// `order` (the scheduler's), or an order nearer the table's where memory asks for it (see the
/// module docs), with what was found. `slack` >= 0.
pub fn guard(g: &Graph, order: Vec<NodeId>, budgets: Budgets, slack: f64) -> (Vec<NodeId>, MemoryCheck) {
    let table: Vec<NodeId> = g.node_ids().collect();
    let table_ok = feasible(g, &table, budgets);
    let (base, sched) = (peak(g, &table), peak(g, &order));
    let mut check = MemoryCheck {
        peak_bytes: sched, baseline_peak_bytes: base, scheduled_peak_bytes: sched, slack, kept_table_order: false, why: String::new(),
    };
    let overlap = g.nodes.iter().any(|nd| nd.kind.is_launch() || nd.kind.is_wait());
    let limit = base as f64 * (1.0 + slack);
    if !overlap && table_ok {
        check.kept_table_order = true;
        check.peak_bytes = base;
        check.why = "nothing to overlap (no communication, no paging copy): the graph's own order".into();
        return (table, check);
    }
    if sched as f64 <= limit {
        check.why = format!("scheduled order kept: peak {sched} bytes, within {:.1}% of the graph's own order's {base}", slack * 100.0);
        return (order, check);
    }
    // The table's compute order with launches early: within the budgets by construction, so
    // tried also where the table order itself breaks them (a traced step that launches its
    // collectives back to back: torchtitan's).
    let early = early_launches_in_table_order(g, budgets);
    let early_peak = peak(g, &early);
    if !table_ok && !(early_peak as f64 <= limit && feasible(g, &early, budgets)) {
        check.why = format!(
            "scheduled order kept although its peak {sched} bytes is over the graph's own order's {base} by more than {:.1}%: the graph's own order breaks the launch budgets, and with its launches early it peaks at {early_peak}",
            slack * 100.0
        );
        return (order, check);
    }
    if early_peak as f64 <= limit && feasible(g, &early, budgets) {
        check.peak_bytes = early_peak;
        check.why = format!(
            "the graph's own compute order with launches early and waits late (peak {early_peak} bytes): the scheduled order's peak {sched} is over the graph's own order's {base} by more than {:.1}% (memory_slack)",
            slack * 100.0
        );
        return (early, check);
    }
    check.kept_table_order = true;
    check.peak_bytes = base;
    check.why = format!(
        "the graph's own order kept: the scheduled order's peak {sched} bytes is over its {base} by more than {:.1}% (memory_slack)",
        slack * 100.0
    );
    (table, check)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::GraphSpec;

    fn graph(json: &str) -> Graph {
        Graph::new(serde_json::from_str::<GraphSpec>(json).unwrap()).unwrap()
    }

    fn ids(g: &Graph, names: &[&str]) -> Vec<NodeId> {
        names.iter().map(|n| g.node_ids().find(|&u| g.nodes[u].name == *n).unwrap()).collect()
    }

    // Two independent chains a -> a2 and b -> b2, each making a 100-byte value read once.
    const CHAINS: &str = r#"{"sources": [{"name": "f", "phase": "F"}], "inputs": ["x"], "outputs": ["a2", "b2"],
        "nodes": [
          {"name": "a", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "a", "bytes": 100}]},
          {"name": "a2", "source": "f", "kind": "compute", "inputs": ["a"], "outputs": [{"value": "a2", "bytes": 1}]},
          {"name": "b", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "b", "bytes": 100}]},
          {"name": "b2", "source": "f", "kind": "compute", "inputs": ["b"], "outputs": [{"value": "b2", "bytes": 1}]}
        ]}"#;

    #[test]
    fn peak_counts_a_value_from_its_producer_to_its_last_reader_and_outputs_to_the_end() {
        let g = graph(CHAINS);
        assert_eq!(peak(&g, &ids(&g, &["a", "a2", "b", "b2"])), 102); // a freed at a2; a2 lives on
        assert_eq!(peak(&g, &ids(&g, &["a", "b", "a2", "b2"])), 201);
        // Without the outputs list, a2 and b2 die where they are made.
        let g2 = graph(&CHAINS.replace(r#""outputs": ["a2", "b2"],"#, ""));
        assert_eq!(peak(&g2, &ids(&g2, &["a", "a2", "b", "b2"])), 101);
    }

    #[test]
    fn a_view_keeps_its_storage_live() {
        let g = graph(
            r#"{"sources": [{"name": "f", "phase": "F"}], "inputs": ["x"],
            "nodes": [
              {"name": "a", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "a", "bytes": 100}]},
              {"name": "v", "source": "f", "kind": "noop", "inputs": ["a"], "outputs": ["v"]},
              {"name": "c", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "c", "bytes": 50}]},
              {"name": "d", "source": "f", "kind": "compute", "inputs": ["v", "c"], "outputs": [{"value": "d", "bytes": 1}]}
            ]}"#,
        );
        // a is read only by the view, but the view is read by d: a lives through d.
        assert_eq!(peak(&g, &ids(&g, &["a", "v", "c", "d"])), 151);
    }

    #[test]
    fn guard_keeps_the_table_order_where_there_is_nothing_to_overlap() {
        let g = graph(CHAINS);
        let worse = ids(&g, &["a", "b", "a2", "b2"]);
        let (order, check) = guard(&g, worse, Budgets::default(), 0.02);
        assert_eq!(order, g.node_ids().collect::<Vec<_>>());
        assert!(check.kept_table_order && check.why.contains("nothing to overlap"), "{check:?}");
        assert_eq!((check.peak_bytes, check.scheduled_peak_bytes), (102, 201));
    }

    fn with_comm() -> Graph {
        // a transfer of t, and two independent 100-byte chains: the table order runs them one
        // after the other, an order that starts both first doubles the peak.
        graph(
            r#"{"sources": [{"name": "f", "phase": "F"}], "inputs": ["x"], "outputs": ["r", "a2", "b2"],
            "nodes": [
              {"name": "l", "source": "f", "kind": "comm_launch", "inputs": ["x"], "outputs": [{"value": "r", "bytes": 10, "alloc": "consumer"}]},
              {"name": "w", "source": "f", "kind": "comm_wait", "launch": "l"},
              {"name": "a", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "a", "bytes": 100}]},
              {"name": "a2", "source": "f", "kind": "compute", "inputs": ["a"], "outputs": [{"value": "a2", "bytes": 1}]},
              {"name": "b", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "b", "bytes": 100}]},
              {"name": "b2", "source": "f", "kind": "compute", "inputs": ["b"], "outputs": [{"value": "b2", "bytes": 1}]}
            ]}"#,
        )
    }

    #[test]
    fn early_launches_keep_the_compute_order_and_wait_late() {
        let g = with_comm();
        // The table waits at once; the launch goes first (no inputs to wait for) and its wait,
        // needed by nothing, last.
        assert_eq!(early_launches_in_table_order(&g, Budgets::default()), ids(&g, &["l", "a", "a2", "b", "b2", "w"]));
        // Two launches on one stream with budget 1: the second waits for the first's wait.
        let two = graph(
            r#"{"sources": [{"name": "f", "phase": "F"}], "inputs": ["x"],
            "nodes": [
              {"name": "c", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "c", "bytes": 4}]},
              {"name": "l1", "source": "f", "kind": "comm_launch", "inputs": ["x"], "outputs": [{"value": "r1", "bytes": 1, "alloc": "consumer"}]},
              {"name": "w1", "source": "f", "kind": "comm_wait", "launch": "l1"},
              {"name": "l2", "source": "f", "kind": "comm_launch", "inputs": ["c"], "outputs": [{"value": "r2", "bytes": 1, "alloc": "consumer"}]},
              {"name": "w2", "source": "f", "kind": "comm_wait", "launch": "l2"},
              {"name": "d", "source": "f", "kind": "compute", "inputs": ["r1", "r2"], "outputs": [{"value": "d", "bytes": 4}]}
            ]}"#,
        );
        let order = early_launches_in_table_order(&two, Budgets::default());
        assert_eq!(order, ids(&two, &["l1", "c", "w1", "l2", "w2", "d"]));
        assert!(feasible(&two, &order, Budgets::default()));
    }

    #[test]
    fn early_launches_is_a_valid_order_on_random_graphs() {
        for seed in 0..300 {
            let g = Graph::new(crate::scenarios::optimum::small_random_moe(seed, 24)).unwrap();
            for b in [1, 2] {
                let budgets = Budgets { ep: b, page: b };
                let o = early_launches_in_table_order(&g, budgets);
                let mut seen = vec![false; g.len()];
                o.iter().for_each(|u| seen[u.ix()] = true);
                assert!(o.len() == g.len() && seen.iter().all(|&x| x), "seed {seed}: not a permutation");
                assert!(feasible(&g, &o, budgets), "seed {seed}, budget {b}: {o:?}");
            }
        }
    }

    #[test]
    fn guard_takes_the_early_launch_order_where_the_table_order_breaks_the_budget() {
        // Two launches back to back in the table (budget 1: the table order is not valid), and a
        // scheduled order that keeps both 100-byte values live at once.
        let g = graph(
            r#"{"sources": [{"name": "f", "phase": "F"}], "inputs": ["x"], "outputs": ["a2", "b2"],
            "nodes": [
              {"name": "l1", "source": "f", "kind": "comm_launch", "inputs": ["x"], "outputs": [{"value": "r1", "bytes": 1, "alloc": "consumer"}]},
              {"name": "l2", "source": "f", "kind": "comm_launch", "inputs": ["x"], "outputs": [{"value": "r2", "bytes": 1, "alloc": "consumer"}]},
              {"name": "w1", "source": "f", "kind": "comm_wait", "launch": "l1"},
              {"name": "w2", "source": "f", "kind": "comm_wait", "launch": "l2"},
              {"name": "a", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "a", "bytes": 100}]},
              {"name": "a2", "source": "f", "kind": "compute", "inputs": ["a"], "outputs": [{"value": "a2", "bytes": 1}]},
              {"name": "b", "source": "f", "kind": "compute", "inputs": ["x"], "outputs": [{"value": "b", "bytes": 100}]},
              {"name": "b2", "source": "f", "kind": "compute", "inputs": ["b"], "outputs": [{"value": "b2", "bytes": 1}]}
            ]}"#,
        );
        let budgets = Budgets { ep: 1, page: 1 };
        let table: Vec<NodeId> = g.node_ids().collect();
        assert!(!feasible(&g, &table, budgets));
        let worse = ids(&g, &["l1", "a", "b", "a2", "b2", "w1", "l2", "w2"]);
        assert!(feasible(&g, &worse, budgets));
        let (order, check) = guard(&g, worse.clone(), budgets, 0.02);
        assert_eq!(order, early_launches_in_table_order(&g, budgets));
        assert!(feasible(&g, &order, budgets) && check.peak_bytes < check.scheduled_peak_bytes, "{check:?}");
        assert!(check.why.starts_with("the graph's own compute order with launches early"), "{}", check.why);
    }

    #[test]
    fn guard_refuses_an_order_over_the_slack_and_keeps_one_within_it() {
        let g = with_comm();
        let worse = ids(&g, &["l", "a", "b", "a2", "b2", "w"]);
        let (order, check) = guard(&g, worse.clone(), Budgets::default(), 0.02);
        // Over the slack: the table's compute order with the launch early and the wait late.
        assert_eq!(order, ids(&g, &["l", "a", "a2", "b", "b2", "w"]));
        assert!(!check.kept_table_order && check.why.contains("launches early and waits late"), "{check:?}");
        assert_eq!((check.baseline_peak_bytes, check.scheduled_peak_bytes, check.peak_bytes), (112, 211, 112));
        // Asked for (a slack of 100%), the scheduled order stays.
        let (order, check) = guard(&g, worse.clone(), Budgets::default(), 1.0);
        assert_eq!(order, worse);
        assert!(!check.kept_table_order, "{check:?}");
        // An order with overlap and the same peak stays at 2%.
        let same = ids(&g, &["l", "a", "a2", "b", "b2", "w"]);
        assert_eq!(guard(&g, same.clone(), Budgets::default(), 0.02).0, same);
    }
}
