//! MoE chunk graphs for tests, benchmarks and the comparison with Megatron-LM's hand-written
//! combined-1F1B order, plus the bridge from a schedule to a simulator plan.
//!
//! A chunk pairs the forward of one microbatch (source `F1`) with the backward of another
//! (`B0`), each `layers` deep. MoE layer: attn -> dispatch (a2a) -> mlp (experts) -> combine
//! (a2a); its backward: combine -> mlp dI (+ dW) -> dispatch -> attn dI (+ dW). Dense layers
//! have noop dispatch/combine; an MTP tail adds a dense layer after the last forward layer
//! (and before the first backward one).

use std::collections::HashMap;

use super::{finish, schedule, Budgets, Schedule};
use crate::error::Result;
use crate::ir::{Graph, GraphSpec, Kind, NodeSpec, OutputSpec, Phase, Source};
use crate::sim::{self, Engine, Plan, PlanSpec, Policy, SimOptions};

/// Shape of a chunk; durations in microseconds (only the simulator reads them).
#[derive(Copy, Clone, Debug)]
pub struct Shape {
    pub layers: usize,
    /// The first `dense` layers are dense (noop dispatch/combine).
    pub dense: usize,
    pub mtp: bool,
    pub attn_us: f64,
    pub mlp_us: f64,
    pub comm_us: f64,
    /// dW time as a fraction of the matching dI.
    pub dw_fraction: f64,
}

impl Shape {
    /// An all-MoE chunk with comm/compute ratio `ratio` (comm per a2a vs. attn + mlp).
    pub fn moe(layers: usize, ratio: f64) -> Self {
        Shape { layers, dense: 0, mtp: false, attn_us: 400.0, mlp_us: 600.0, comm_us: ratio * 500.0, dw_fraction: 0.5 }
    }
}

struct Builder {
    nodes: Vec<NodeSpec>,
}

impl Builder {
    fn add(&mut self, name: &str, source: &str, kind: Kind, ins: &[&str], outs: &[&str], cost: f64) {
        self.nodes.push(NodeSpec {
            name: name.to_string(),
            source: source.to_string(),
            kind,
            wgrad: false,
            inputs: ins.iter().map(|s| s.to_string()).collect(),
            outputs: outs.iter().map(|o| OutputSpec::Sized { value: o.to_string(), bytes: 64 << 20 }).collect(),
            mutates: Vec::new(),
            launch: None,
            cost,
        });
    }
    fn wgrad(&mut self, name: &str, source: &str, ins: &[&str], cost: f64) {
        self.add(name, source, Kind::Compute, ins, &[&format!("{name}.grad")], cost);
        self.nodes.last_mut().expect("just added").wgrad = true;
    }
    /// A comm launch + wait pair, or a noop for dense layers.
    fn comm(&mut self, name: &str, source: &str, input: &str, output: &str, cost: f64, dense: bool) {
        if dense {
            self.add(name, source, Kind::Noop, &[input], &[output], 0.0);
        } else {
            self.add(name, source, Kind::CommLaunch, &[input], &[output], cost);
            self.add(&format!("{name}.wait"), source, Kind::CommWait, &[], &[], 0.0);
            self.nodes.last_mut().expect("just added").launch = Some(name.to_string());
        }
    }
}

/// The chunk's graph table.
pub fn chunk(shape: Shape) -> GraphSpec {
    let mut b = Builder { nodes: Vec::new() };
    let (f, bw) = ("F1", "B0");
    let l_n = shape.layers;
    // Forward.
    for l in 0..l_n {
        let dense = l < shape.dense;
        let p = format!("F.L{l}");
        b.add(&format!("{p}.attn"), f, Kind::Compute, &[&format!("F.x{l}")], &[&format!("F.a{l}")], shape.attn_us);
        b.comm(&format!("{p}.dispatch"), f, &format!("F.a{l}"), &format!("F.d{l}"), shape.comm_us, dense);
        b.add(&format!("{p}.mlp"), f, Kind::Compute, &[&format!("F.d{l}")], &[&format!("F.m{l}")], shape.mlp_us);
        b.comm(&format!("{p}.combine"), f, &format!("F.m{l}"), &format!("F.x{}", l + 1), shape.comm_us, dense);
    }
    if shape.mtp {
        b.add("F.mtp.attn", f, Kind::Compute, &[&format!("F.x{l_n}")], &["F.mtp.a"], shape.attn_us);
        b.add("F.mtp.mlp", f, Kind::Compute, &["F.mtp.a"], &["F.mtp.out"], shape.mlp_us);
    }
    // Backward, last layer first.
    let mut g_in = format!("B.g{l_n}");
    if shape.mtp {
        b.add("B.mtp.mlp", bw, Kind::Compute, &["B.mtp.g"], &["B.mtp.gm"], shape.mlp_us);
        b.add("B.mtp.attn", bw, Kind::Compute, &["B.mtp.gm"], &[&g_in], shape.attn_us);
    }
    for l in (0..l_n).rev() {
        let dense = l < shape.dense;
        let p = format!("B.L{l}");
        let (gc, gm, gd, g_out) = (format!("B.gc{l}"), format!("B.gm{l}"), format!("B.gd{l}"), format!("B.g{l}"));
        b.comm(&format!("{p}.combine"), bw, &g_in, &gc, shape.comm_us, dense);
        b.add(&format!("{p}.mlp"), bw, Kind::Compute, &[&gc], &[&gm], shape.mlp_us);
        b.wgrad(&format!("{p}.mlp.dw"), bw, &[&gc], shape.mlp_us * shape.dw_fraction);
        b.comm(&format!("{p}.dispatch"), bw, &gm, &gd, shape.comm_us, dense);
        b.add(&format!("{p}.attn"), bw, Kind::Compute, &[&gd], &[&g_out], shape.attn_us);
        b.wgrad(&format!("{p}.attn.dw"), bw, &[&gd], shape.attn_us * shape.dw_fraction);
        g_in = g_out;
    }
    let mut inputs = vec![OutputSpec::Sized { value: "F.x0".into(), bytes: 64 << 20 }];
    inputs.push(OutputSpec::Sized {
        value: if shape.mtp { "B.mtp.g".into() } else { format!("B.g{l_n}") },
        bytes: 64 << 20,
    });
    GraphSpec {
        sources: vec![
            Source { name: f.into(), microbatch: 1, phase: Phase::F, priority: 0 },
            Source { name: bw.into(), microbatch: 0, phase: Phase::B, priority: 0 },
        ],
        nodes: b.nodes,
        control: vec![],
        reuse: vec![],
        inputs,
    }
}

/// Megatron-LM's fixed per-layer order for F layer i paired with B layer L-1-i:
/// B.combine, F.attn, B.mlp, F.dispatch, B.mlp.dW, B.dispatch, F.mlp, F.combine, B.attn,
/// B.attn.dW (waits right before their first consumer; MTP backward first, forward last).
pub fn megatron_order(g: &Graph, shape: Shape) -> Vec<u32> {
    let ix: HashMap<&str, u32> = g.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i as u32)).collect();
    let mut names: Vec<String> = Vec::new();
    if shape.mtp {
        names.extend(["B.mtp.mlp", "B.mtp.attn"].map(String::from));
    }
    let l_n = shape.layers;
    for i in 0..l_n {
        let (fl, bl) = (format!("F.L{i}"), format!("B.L{}", l_n - 1 - i));
        for n in [
            format!("{bl}.combine"),
            format!("{fl}.attn"),
            format!("{bl}.combine.wait"),
            format!("{bl}.mlp"),
            format!("{fl}.dispatch"),
            format!("{bl}.mlp.dw"),
            format!("{bl}.dispatch"),
            format!("{fl}.dispatch.wait"),
            format!("{fl}.mlp"),
            format!("{fl}.combine"),
            format!("{bl}.dispatch.wait"),
            format!("{bl}.attn"),
            format!("{bl}.attn.dw"),
            format!("{fl}.combine.wait"),
        ] {
            names.push(n);
        }
    }
    if shape.mtp {
        names.extend(["F.mtp.attn", "F.mtp.mlp"].map(String::from));
    }
    names.iter().filter_map(|n| ix.get(n.as_str()).copied()).collect()
}

/// torchtitan's multiplexed graph today: every backward node, then every forward node.
pub fn backward_then_forward(g: &Graph) -> Vec<u32> {
    let (mut b, mut f): (Vec<u32>, Vec<u32>) = (0..g.len() as u32).partition(|&u| g.sources[g.nodes[u as usize].source as usize].phase != Phase::F);
    b.append(&mut f);
    b
}

/// A simulator plan that issues `order`; waits are implied by data (the simulator waits at
/// the consumer), other edges become zero-byte tokens. `serial` puts everything on one stream.
/// Lifetime drains go where the schedule puts them (`finish`), with the plan's hand-back last.
pub fn to_plan(g: &Graph, order: &[u32], serial: bool) -> PlanSpec {
    to_plan_drained(g, order, serial, !serial)
}

/// As [`to_plan`]; `scheduled_drains: false` drains at every node of a plan on its stream, as
/// Megatron-LM's manager does.
pub fn to_plan_drained(g: &Graph, order: &[u32], serial: bool, scheduled_drains: bool) -> PlanSpec {
    let drains = finish(g, order.to_vec(), Budgets::default()).retires;
    use crate::sim::plan::{InputSpec, NodeSpec as SimNode, OutputSpec as SimOut, StreamSpec};
    let n = g.len();
    let mut extra_in: Vec<Vec<String>> = vec![Vec::new(); n];
    let mut extra_out: Vec<Vec<String>> = vec![Vec::new(); n];
    let data_producer = |u: u32| -> u32 {
        let nd = &g.nodes[u as usize];
        if nd.kind.is_wait() {
            nd.partner.unwrap_or(u)
        } else {
            u
        }
    };
    for c in 0..n {
        if g.nodes[c].kind.is_wait() {
            continue;
        }
        for &p in &g.preds[c] {
            let p = data_producer(p);
            let feeds = g.nodes[c].inputs.iter().any(|&v| g.values[v as usize].producer == Some(p));
            if !feeds && p as usize != c {
                let t = format!("tok:{p}->{c}");
                extra_out[p as usize].push(t.clone());
                extra_in[c].push(t);
            }
        }
    }
    // Waits are not simulator nodes: a drain placed before one moves to the next node of
    // that stream (the wait itself is implied at the consumer).
    let mut next_real = vec![None; n];
    let mut pending_waits: [Vec<u32>; 3] = Default::default();
    for &u in order {
        let nd = &g.nodes[u as usize];
        let si = nd.stream().index();
        if nd.kind.is_wait() {
            pending_waits[si].push(u);
        } else {
            for w in pending_waits[si].drain(..) {
                next_real[w as usize] = Some(u);
            }
            next_real[u as usize] = Some(u);
        }
    }
    let mut acquire: Vec<Vec<String>> = vec![Vec::new(); n];
    for r in &drains {
        let d = r.drain_before.and_then(|d| next_real[d as usize]);
        if let (Some(d), Some(p)) = (d, g.values[r.value as usize].producer) {
            let plan = g.sources[g.nodes[p as usize].source as usize].name.clone();
            if !acquire[d as usize].contains(&plan) {
                acquire[d as usize].push(plan);
            }
        }
    }
    let mut nodes = Vec::new();
    for &u in order {
        let nd = &g.nodes[u as usize];
        if nd.kind.is_wait() {
            continue;
        }
        let stream = match (serial, nd.stream()) {
            (true, _) | (false, crate::ir::Stream::Compute) => "compute",
            (false, crate::ir::Stream::Ep) => "ep",
            (false, crate::ir::Stream::Page) => "page",
        };
        let mut inputs: Vec<String> = nd.inputs.iter().map(|&v| g.values[v as usize].name.clone()).collect();
        inputs.extend(extra_in[u as usize].iter().cloned());
        let mut outputs: Vec<SimOut> =
            nd.outputs.iter().map(|&v| SimOut { value: g.values[v as usize].name.clone(), bytes: g.values[v as usize].bytes }).collect();
        outputs.extend(extra_out[u as usize].iter().map(|t| SimOut { value: t.clone(), bytes: 0 }));
        nodes.push(SimNode {
            name: nd.name.clone(),
            plan: Some(g.sources[nd.source as usize].name.clone()),
            stream: stream.into(),
            us: nd.cost,
            inputs,
            outputs,
            action: None,
            host_sync: false,
            acquire: std::mem::take(&mut acquire[u as usize]),
        });
    }
    let inputs = g
        .values
        .iter()
        .filter(|v| v.producer.is_none())
        .map(|v| InputSpec { value: v.name.clone(), bytes: v.bytes, stream: "compute".into() })
        .collect();
    PlanSpec {
        streams: vec![
            StreamSpec { name: "compute".into(), engine: Engine::Compute },
            StreamSpec { name: "ep".into(), engine: Engine::Comm },
            StreamSpec { name: "page".into(), engine: Engine::Comm },
        ],
        inputs,
        nodes,
        host_us_per_op: Some(1.0),
        sm_contention: Some(0.0),
        max_queued: None,
        explicit_acquire: scheduled_drains,
    }
}

/// One row of the sweep (all figures simulated).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepRow {
    pub layers: usize,
    pub ratio: f64,
    pub bound_us: f64,
    /// (makespan, exposed comm) for serial, B-then-F, Megatron's order, ours, all with the
    /// schedule's drain points.
    pub serial: (f64, f64),
    pub b_then_f: (f64, f64),
    pub megatron: (f64, f64),
    pub ours: (f64, f64),
    /// Megatron's order and ours with drains at the owner's next node of the plan.
    pub megatron_next_node: (f64, f64),
    pub ours_next_node: (f64, f64),
    /// Max reserved bytes of ours: schedule drains, next-node drains.
    pub ours_reserved: (u64, u64),
}

/// Simulated with the real lifetime manager: (makespan, exposed comm, max reserved).
fn simulate_order(g: &Graph, order: &[u32], serial: bool, scheduled_drains: bool) -> Result<(f64, f64, u64)> {
    let plan = Plan::new(to_plan_drained(g, order, serial, scheduled_drains))?;
    let r = sim::simulate(&plan, SimOptions::new(Policy::Scheduled))?;
    Ok((r.makespan_us, r.exposed_comm_us, r.reserved_peak.bytes))
}

/// Simulate the four orders for one shape.
pub fn sweep_row(shape: Shape, budgets: Budgets) -> Result<(SweepRow, Schedule)> {
    let g = Graph::new(chunk(shape))?;
    let ours = schedule(&g, budgets)?;
    let meg = megatron_order(&g, shape);
    let compute: f64 = g.nodes.iter().filter(|n| n.kind == Kind::Compute).map(|n| n.cost).sum();
    let comm: f64 = g.nodes.iter().filter(|n| n.kind.is_launch()).map(|n| n.cost).sum();
    let two = |x: (f64, f64, u64)| (x.0, x.1);
    let ours_s = simulate_order(&g, &ours.order, false, true)?;
    let ours_n = simulate_order(&g, &ours.order, false, false)?;
    let row = SweepRow {
        layers: shape.layers,
        ratio: shape.comm_us / (shape.attn_us + shape.mlp_us) * 2.0,
        bound_us: compute.max(comm),
        serial: two(simulate_order(&g, &finish(&g, (0..g.len() as u32).collect(), budgets).order, true, false)?),
        b_then_f: two(simulate_order(&g, &backward_then_forward(&g), false, true)?),
        megatron: two(simulate_order(&g, &meg, false, true)?),
        ours: two(ours_s),
        megatron_next_node: two(simulate_order(&g, &meg, false, false)?),
        ours_next_node: two(ours_n),
        ours_reserved: (ours_s.2, ours_n.2),
    };
    Ok((row, ours))
}

/// `moe_chunk:LAYERS:RATIO` for Python: the graph table, and for the baselines (Megatron's
/// order, B-then-F) their orders with the minimal record/wait edges, by name, so a GPU script
/// can run each order on real streams next to ours.
pub fn chunk_scenario(name: &str) -> Result<serde_json::Value> {
    let bad = || crate::Error::InvalidInput(format!("'{name}': expected moe_chunk:LAYERS:RATIO, e.g. moe_chunk:4:1.0"));
    let mut parts = name.split(':').skip(1);
    let layers: usize = parts.next().and_then(|x| x.parse().ok()).filter(|&l| l > 0).ok_or_else(bad)?;
    let ratio: f64 = parts.next().and_then(|x| x.parse().ok()).filter(|r: &f64| r.is_finite() && *r > 0.0).ok_or_else(bad)?;
    let shape = Shape::moe(layers, ratio);
    let spec = chunk(shape);
    let g = Graph::new(spec.clone())?;
    let named = |order: Vec<u32>| super::named(&g, &finish(&g, order, Budgets::default()), None);
    Ok(serde_json::json!({
        "graph": spec,
        "orders": {
            "megatron": named(megatron_order(&g, shape)),
            "b_then_f": named(backward_then_forward(&g)),
        },
    }))
}
