//! MoE chunk graphs for tests, benchmarks and the comparison with Megatron-LM's hand-written
//! combined-1F1B order, and the baseline orders (Megatron's, backward-then-forward).
//!
//! A chunk pairs the forward of one microbatch (source `F1`) with the backward of another
//! (`B0`), each `layers` deep. MoE layer: attn -> dispatch (a2a) -> mlp (experts) -> combine
//! (a2a); its backward: combine -> mlp dI (+ dW) -> dispatch -> attn dI (+ dW). Dense layers
//! have noop dispatch/combine; an MTP tail adds a dense layer after the last forward layer
//! (and before the first backward one).

use std::collections::HashMap;

use super::Rng;
use crate::ir::{Graph, GraphSpec, Kind, NodeId, NodeSpec, OutputSpec, Phase, Source};

/// Shape of a chunk; durations in microseconds (only the simulator reads them).
#[derive(Copy, Clone, Debug)]
pub struct Shape {
    /// Layers per source.
    pub layers: usize,
    /// The first `dense` layers are dense (noop dispatch/combine).
    pub dense: usize,
    /// An MTP tail (a dense layer after the last forward layer).
    pub mtp: bool,
    /// Attention time.
    pub attn_us: f64,
    /// Expert (MLP) time.
    pub mlp_us: f64,
    /// Time of each all-to-all.
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

/// Builds graph tables for the generated shapes (here and in `family`): every value 64 MiB,
/// costs as given or, with a seeded `rng`, each times U(0.5, 1.5) (one draw per node but noops,
/// which cost 0; waits are given 0).
pub(super) struct Builder {
    pub(super) nodes: Vec<NodeSpec>,
    rng: Option<Rng>,
}

impl Builder {
    pub(super) fn new(rng: Option<Rng>) -> Self {
        Builder { nodes: Vec::new(), rng }
    }
    fn cost(&mut self, kind: Kind, base: f64) -> f64 {
        match &mut self.rng {
            _ if kind == Kind::Noop => 0.0,
            Some(r) => base * (0.5 + r.below(1001) as f64 / 1000.0),
            None => base,
        }
    }
    pub(super) fn add(&mut self, name: &str, source: &str, kind: Kind, ins: &[&str], outs: &[&str], cost: f64) {
        let cost = self.cost(kind, cost);
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
    pub(super) fn wgrad(&mut self, name: &str, source: &str, ins: &[&str], cost: f64) {
        self.add(name, source, Kind::Compute, ins, &[&format!("{name}.grad")], cost);
        self.nodes.last_mut().expect("just added").wgrad = true;
    }
    /// A comm launch + wait pair, or a noop for dense layers.
    pub(super) fn comm(&mut self, name: &str, source: &str, ins: &[&str], output: &str, cost: f64, dense: bool) {
        if dense {
            self.add(name, source, Kind::Noop, ins, &[output], 0.0);
        } else {
            self.add(name, source, Kind::CommLaunch, ins, &[output], cost);
            self.add(&format!("{name}.wait"), source, Kind::CommWait, &[], &[], 0.0);
            self.nodes.last_mut().expect("just added").launch = Some(name.to_string());
        }
    }
}

/// The chunk's graph table.
pub fn chunk(shape: Shape) -> GraphSpec {
    let mut b = Builder::new(None);
    let (f, bw) = ("F1", "B0");
    let l_n = shape.layers;
    // Forward.
    for l in 0..l_n {
        let dense = l < shape.dense;
        let p = format!("F.L{l}");
        b.add(&format!("{p}.attn"), f, Kind::Compute, &[&format!("F.x{l}")], &[&format!("F.a{l}")], shape.attn_us);
        b.comm(&format!("{p}.dispatch"), f, &[&format!("F.a{l}")], &format!("F.d{l}"), shape.comm_us, dense);
        b.add(&format!("{p}.mlp"), f, Kind::Compute, &[&format!("F.d{l}")], &[&format!("F.m{l}")], shape.mlp_us);
        b.comm(&format!("{p}.combine"), f, &[&format!("F.m{l}")], &format!("F.x{}", l + 1), shape.comm_us, dense);
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
        b.comm(&format!("{p}.combine"), bw, &[&g_in], &gc, shape.comm_us, dense);
        b.add(&format!("{p}.mlp"), bw, Kind::Compute, &[&gc], &[&gm], shape.mlp_us);
        b.wgrad(&format!("{p}.mlp.dw"), bw, &[&gc], shape.mlp_us * shape.dw_fraction);
        b.comm(&format!("{p}.dispatch"), bw, &[&gm], &gd, shape.comm_us, dense);
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
        outputs: vec![],
    }
}

/// Megatron-LM's fixed per-layer order for F layer i paired with B layer L-1-i:
/// B.combine, F.attn, B.mlp, F.dispatch, B.mlp.dW, B.dispatch, F.mlp, F.combine, B.attn,
/// B.attn.dW (waits right before their first consumer; MTP backward first, forward last).
pub fn megatron_order(g: &Graph, shape: Shape) -> Vec<NodeId> {
    let ix: HashMap<&str, NodeId> = g.node_ids().map(|i| (g.nodes[i].name.as_str(), i)).collect();
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
pub fn backward_then_forward(g: &Graph) -> Vec<NodeId> {
    let (mut b, mut f): (Vec<NodeId>, Vec<NodeId>) = g.node_ids().partition(|&u| g.source_of(u).phase != Phase::F);
    b.append(&mut f);
    b
}

