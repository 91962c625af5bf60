//! Lowering a graph and an issue order (ours or a baseline's) into a simulator [`ProgramSpec`]:
//! the derived form the simulator runs. Waits are implied by data (the simulator waits at the
//! consumer); other edges become zero-byte tokens (with [`lower_launch_waits`], so does an EP
//! launch's wait for the compute issued before it, as on the GPU). Lifetime drains go where the
//! schedule puts them ([`crate::sched::finish`]), with each plan's hand-back last.

use super::program::{InputSpec, NodeSpec, OutputSpec, ProgramSpec, StreamSpec};
use super::Engine;
use crate::ep::{Budgets, PerRole, Role};
use crate::ir::{Graph, NodeId};
use crate::sched::finish;

/// The program that issues `order`; `serial` puts everything on one stream (and drains at
/// every node, as there is nothing to schedule).
pub fn lower(g: &Graph, order: &[NodeId], serial: bool) -> ProgramSpec {
    lower_drained(g, order, serial, !serial)
}

/// As [`lower`]; `scheduled_drains: false` drains at every node of a plan on its stream, as
/// Megatron-LM's manager does.
pub fn lower_drained(g: &Graph, order: &[NodeId], serial: bool, scheduled_drains: bool) -> ProgramSpec {
    build(g, order, serial, scheduled_drains, false)
}

/// As [`lower`] (not serial, drains where the schedule puts them), and each EP launch also waits
/// for every compute node issued before it, edges or not: what the transports do on the GPU.
/// They allocate the output on the compute stream and make the EP stream wait for it
/// (`ep_link.consumer_output`'s `wait_stream`, as torch's process groups do for NCCL), so
/// compute issued ahead of a launch delays the link by its own cost. Rule `search` rates
/// orders with it ([`super::makespan_launch_waits`]); the other figures keep the edge-only
/// model (`lower`).
pub fn lower_launch_waits(g: &Graph, order: &[NodeId]) -> ProgramSpec {
    build(g, order, false, true, true)
}

fn build(g: &Graph, order: &[NodeId], serial: bool, scheduled_drains: bool, launch_waits: bool) -> ProgramSpec {
    let drains = finish(g, order.to_vec(), Budgets::default()).retires;
    let n = g.len();
    let mut extra_in: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut extra_out: Vec<Vec<String>> = vec![Vec::new(); n];
    let data_producer = |u: NodeId| -> NodeId {
        let nd = &g.nodes[u];
        if nd.kind.is_wait() {
            nd.partner.unwrap_or(u)
        } else {
            u
        }
    };
    for c in g.node_ids() {
        if g.nodes[c].kind.is_wait() {
            continue;
        }
        for &p in &g.preds[c] {
            let p = data_producer(p);
            let feeds = g.nodes[c].inputs.iter().any(|&v| g.values[v].producer == Some(p));
            if !feeds && p != c {
                let t = format!("tok:{}->{}", p.0, c.0);
                extra_out[p].push(t.clone());
                extra_in[c].push(t);
            }
        }
    }
    // `launch_waits`: an EP launch's stream waits for the last compute node in issue order.
    if launch_waits && !serial {
        let mut last_compute: Option<NodeId> = None;
        for &u in order {
            let nd = &g.nodes[u];
            if nd.kind.is_wait() {
                continue;
            }
            if Role::of(nd.kind) == Role::Compute {
                last_compute = Some(u);
            } else if nd.kind.is_launch() && Role::of(nd.kind) == Role::Ep {
                if let Some(p) = last_compute.filter(|&p| !g.preds[u].contains(&p)) {
                    let t = format!("tok:issued:{}->{}", p.0, u.0);
                    extra_out[p].push(t.clone());
                    extra_in[u].push(t);
                }
            }
        }
    }
    // Waits are not simulator nodes: a drain placed before one moves to the next node of
    // that stream (the wait itself is implied at the consumer).
    let mut next_real = vec![None; n];
    let mut pending_waits: PerRole<Vec<NodeId>> = Default::default();
    for &u in order {
        let nd = &g.nodes[u];
        let r = Role::of(nd.kind);
        if nd.kind.is_wait() {
            pending_waits[r].push(u);
        } else {
            for w in pending_waits[r].drain(..) {
                next_real[w.ix()] = Some(u);
            }
            next_real[u.ix()] = Some(u);
        }
    }
    let mut acquire: Vec<Vec<String>> = vec![Vec::new(); n];
    for r in &drains {
        let d = r.drain_before.and_then(|d| next_real[d.ix()]);
        if let (Some(d), Some(p)) = (d, g.values[r.value].producer) {
            let plan = g.source_of(p).name.clone();
            if !acquire[d].contains(&plan) {
                acquire[d].push(plan);
            }
        }
    }
    let mut nodes = Vec::new();
    for &u in order {
        let nd = &g.nodes[u];
        if nd.kind.is_wait() {
            continue;
        }
        let stream = if serial { Role::Compute } else { Role::of(nd.kind) };
        let mut inputs: Vec<String> = nd.inputs.iter().map(|&v| g.values[v].name.clone()).collect();
        inputs.extend(extra_in[u].iter().cloned());
        let mut outputs: Vec<OutputSpec> =
            nd.outputs.iter().map(|&v| OutputSpec { value: g.values[v].name.clone(), bytes: g.values[v].bytes }).collect();
        outputs.extend(extra_out[u].iter().map(|t| OutputSpec { value: t.clone(), bytes: 0 }));
        nodes.push(NodeSpec {
            name: nd.name.clone(),
            plan: Some(g.sources[nd.source].name.clone()),
            stream: stream.name().into(),
            us: nd.cost,
            inputs,
            outputs,
            action: None,
            host_sync: false,
            acquire: std::mem::take(&mut acquire[u]),
        });
    }
    let inputs = g
        .values
        .iter()
        .filter(|v| v.producer.is_none())
        .map(|v| InputSpec { value: v.name.clone(), bytes: v.bytes, stream: Role::Compute.name().into() })
        .collect();
    let engine = |r: Role| if r == Role::Compute { Engine::Compute } else { Engine::Comm };
    ProgramSpec {
        streams: Role::ALL.iter().map(|&r| StreamSpec { name: r.name().into(), engine: engine(r) }).collect(),
        inputs,
        nodes,
        host_us_per_op: Some(1.0),
        sm_contention: Some(0.0),
        max_queued: None,
        explicit_acquire: scheduled_drains,
    }
}

/// Cost of a node with no cost in the graph and none given, by kind (us): compute and
/// launches 100, noops and waits 0 (waits are not simulator nodes).
pub const DEFAULT_COST_US: f64 = 100.0;

/// [`lower`] with each node's duration from `costs` (by name), else its graph cost when
/// positive, else [`DEFAULT_COST_US`] for compute and launches. A cost naming no node, or a
/// negative / non-finite cost, is an error.
pub fn costed(g: &Graph, order: &[NodeId], costs: &std::collections::HashMap<String, f64>) -> crate::Result<ProgramSpec> {
    let names: std::collections::HashSet<&str> = g.nodes.iter().map(|n| n.name.as_str()).collect();
    let mut unknown: Vec<&String> = costs.keys().filter(|k| !names.contains(k.as_str())).collect();
    unknown.sort();
    if let Some(k) = unknown.first() {
        return Err(crate::Error::InvalidInput(format!("costs name node '{k}', which is not in the graph")));
    }
    if let Some((k, v)) = costs.iter().find(|(_, v)| !v.is_finite() || **v < 0.0) {
        return Err(crate::Error::InvalidInput(format!("cost of '{k}' must be a finite number >= 0, got {v}")));
    }
    let mut p = lower(g, order, false);
    let by_name: std::collections::HashMap<&str, &crate::ir::Node> = g.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    for n in &mut p.nodes {
        let nd = by_name[n.name.as_str()];
        n.us = match costs.get(&n.name) {
            Some(&us) => us,
            None if nd.cost > 0.0 => nd.cost,
            None if nd.kind == crate::ir::Kind::Noop => 0.0,
            None => DEFAULT_COST_US,
        };
    }
    Ok(p)
}
