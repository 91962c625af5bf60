//! A family of MoE chunk shapes beyond the symmetric one (issue 8): a router node, a shared
//! expert beside the routed experts (joined by a post node), dense first layers, an MTP tail,
//! forward and backward chunks of unequal length, a third source (deferred dW of another
//! microbatch), per-node costs varied by up to 50%. With reference orders: serial,
//! backward-then-forward, and Megatron-style layer pairing (F layer i with B layer L-1-i, each
//! pair finished before the next starts) where the layers pair. All figures are SIMULATED.

use std::collections::HashMap;

use super::moe::Builder;
use super::Rng;
use crate::ep::Budgets;
use crate::error::Result;
use crate::ir::{Graph, GraphSpec, Kind, NodeId, OutputSpec, Phase, Source};
use crate::sched::{finish, schedule};
use super::sweep::simulate_order;

/// One member of the family.
#[derive(Clone, Debug)]
pub struct FamilySpec {
    /// Layers of the forward source.
    pub f_layers: usize,
    /// Layers of the backward source.
    pub b_layers: usize,
    /// The first `dense` layers (of each source) have no dispatch/combine.
    pub dense: usize,
    /// A separate router node before each dispatch.
    pub router: bool,
    /// A shared expert beside the routed experts, joined with the combine in a post node.
    pub shared: bool,
    /// An MTP tail (a dense layer after the last forward layer, before the first backward one).
    pub mtp: bool,
    /// A third source: deferred weight-gradient work of another microbatch.
    pub third: bool,
    /// Comm time per all-to-all over (attn + mlp) / 2.
    pub ratio: f64,
    /// Seed of the cost jitter (each cost times U(0.5, 1.5)); None: exact costs.
    pub jitter: Option<u64>,
}

impl FamilySpec {
    /// A symmetric all-MoE member.
    pub fn new(layers: usize, ratio: f64) -> Self {
        FamilySpec { f_layers: layers, b_layers: layers, dense: 0, router: false, shared: false, mtp: false, third: false, ratio, jitter: None }
    }
}

const ATTN: f64 = 400.0;
const MLP: f64 = 600.0;
const ROUTER: f64 = 50.0;
const SHARED: f64 = 300.0;
const POST: f64 = 50.0;
const MIB64: u64 = 64 << 20;

fn s(x: impl Into<String>) -> String {
    x.into()
}

/// The member's graph table: sources F1 (forward), B0 (backward) and, with `third`, W2.
pub fn build(f: &FamilySpec) -> GraphSpec {
    let comm = f.ratio * (ATTN + MLP) / 2.0;
    let mut b = Builder::new(f.jitter.map(Rng::new));
    // Forward.
    let mut x = s("F.x0");
    for l in 0..f.f_layers {
        let p = format!("F.L{l}");
        let a = format!("{p}.a");
        b.add(&format!("{p}.attn"), "F1", Kind::Compute, &[&x], &[&a], ATTN);
        if l < f.dense {
            let out = format!("{p}.out");
            b.add(&format!("{p}.mlp"), "F1", Kind::Compute, &[&a], &[&out], MLP);
            x = out;
            continue;
        }
        let r = format!("{p}.r");
        let mut dins = vec![a.as_str()];
        if f.router {
            b.add(&format!("{p}.router"), "F1", Kind::Compute, &[&a], &[&r], ROUTER);
            dins.push(&r);
        }
        let (d, m, c) = (format!("{p}.d"), format!("{p}.m"), format!("{p}.c"));
        b.comm(&format!("{p}.dispatch"), "F1", &dins, &d, comm, false);
        b.add(&format!("{p}.mlp"), "F1", Kind::Compute, &[&d], &[&m], MLP);
        b.comm(&format!("{p}.combine"), "F1", &[&m], &c, comm, false);
        if f.shared {
            let (sh, out) = (format!("{p}.s"), format!("{p}.out"));
            b.add(&format!("{p}.shared"), "F1", Kind::Compute, &[&a], &[&sh], SHARED);
            b.add(&format!("{p}.post"), "F1", Kind::Compute, &[&c, &sh], &[&out], POST);
            x = out;
        } else {
            x = c;
        }
    }
    if f.mtp {
        b.add("F.mtp.attn", "F1", Kind::Compute, &[&x], &["F.mtp.a"], ATTN);
        b.add("F.mtp.mlp", "F1", Kind::Compute, &["F.mtp.a"], &["F.mtp.out"], MLP);
    }
    // Backward, last layer first.
    let mut g = s("B.g.top");
    if f.mtp {
        b.add("B.mtp.mlp", "B0", Kind::Compute, &[&g], &["B.mtp.gm"], MLP);
        b.add("B.mtp.attn", "B0", Kind::Compute, &["B.mtp.gm"], &["B.mtp.g"], ATTN);
        g = s("B.mtp.g");
    }
    for l in (0..f.b_layers).rev() {
        let p = format!("B.L{l}");
        let ga = format!("{p}.ga");
        if l < f.dense {
            b.add(&format!("{p}.mlp"), "B0", Kind::Compute, &[&g], &[&ga], MLP);
            b.wgrad(&format!("{p}.mlp.dw"), "B0", &[&g], MLP / 2.0);
        } else {
            let (gc, gs) = (format!("{p}.gc"), format!("{p}.gs"));
            let into_combine = if f.shared {
                b.add(&format!("{p}.post"), "B0", Kind::Compute, &[&g], &[&gc, &gs], POST);
                &gc
            } else {
                &g
            };
            let (gm, gd, gx) = (format!("{p}.gm"), format!("{p}.gd"), format!("{p}.gx"));
            b.comm(&format!("{p}.combine"), "B0", &[into_combine], &gm, comm, false);
            b.add(&format!("{p}.mlp"), "B0", Kind::Compute, &[&gm], &[&gd], MLP);
            b.wgrad(&format!("{p}.mlp.dw"), "B0", &[&gm], MLP / 2.0);
            b.comm(&format!("{p}.dispatch"), "B0", &[&gd], &gx, comm, false);
            let (gr, gsh) = (format!("{p}.gr"), format!("{p}.gsh"));
            let mut ains = vec![gx.as_str()];
            if f.router {
                b.add(&format!("{p}.router"), "B0", Kind::Compute, &[&gx], &[&gr], ROUTER);
                ains.push(&gr);
            }
            if f.shared {
                b.add(&format!("{p}.shared"), "B0", Kind::Compute, &[&gs], &[&gsh], SHARED);
                b.wgrad(&format!("{p}.shared.dw"), "B0", &[&gs], SHARED / 2.0);
                ains.push(&gsh);
            }
            b.add(&format!("{p}.mlp.x"), "B0", Kind::Noop, &ains, &[&ga], 0.0);
        }
        let out = format!("{p}.g");
        b.add(&format!("{p}.attn"), "B0", Kind::Compute, &[&ga], &[&out], ATTN);
        b.wgrad(&format!("{p}.attn.dw"), "B0", &[&ga], ATTN / 2.0);
        g = out;
    }
    let mut sources = vec![Source { name: s("F1"), microbatch: 1, phase: Phase::F, priority: 0 }, Source { name: s("B0"), microbatch: 0, phase: Phase::B, priority: 0 }];
    let mut inputs = vec![OutputSpec::Sized { value: s("F.x0"), bytes: MIB64 }, OutputSpec::Sized { value: s("B.g.top"), bytes: MIB64 }];
    if f.third {
        sources.push(Source { name: s("W2"), microbatch: 2, phase: Phase::DW, priority: 0 });
        for l in 0..f.b_layers.max(1) {
            let gin = format!("W.L{l}.g");
            inputs.push(OutputSpec::Sized { value: gin.clone(), bytes: MIB64 });
            b.wgrad(&format!("W.L{l}.attn.dw"), "W2", &[&gin], ATTN / 2.0);
            b.wgrad(&format!("W.L{l}.mlp.dw"), "W2", &[&gin], MLP / 2.0);
        }
    }
    GraphSpec { sources, nodes: b.nodes, control: vec![], reuse: vec![], inputs, outputs: vec![] }
}

fn layer_of(name: &str) -> Option<(char, usize)> {
    let side = name.chars().next()?;
    let rest = name.get(2..)?;
    if let Some(num) = rest.strip_prefix('L') {
        let n: usize = num.split('.').next()?.parse().ok()?;
        return Some((side, n));
    }
    None
}

/// Megatron-style pairing: F layer i with B layer L-1-i, each pair (and the MTP nodes around
/// them) finished before the next starts; within a pair our policy under `rules` orders the
/// nodes. None when the layers do not pair (unequal lengths, a third source).
pub fn pairing_order(spec: &FamilySpec, budgets: Budgets, rules: crate::sched::Rules) -> Result<Option<Vec<NodeId>>> {
    if spec.f_layers != spec.b_layers || spec.third {
        return Ok(None);
    }
    let l_n = spec.f_layers;
    let mut gs = build(spec);
    let pair_of = |name: &str| -> usize {
        match layer_of(name) {
            Some(('F', i)) => i + 1,
            Some(('B', i)) => l_n - i,
            _ if name.starts_with("B.mtp") => 0,
            _ => l_n + 1, // F.mtp
        }
    };
    let mut by_pair: HashMap<usize, Vec<String>> = HashMap::new();
    for n in &gs.nodes {
        by_pair.entry(pair_of(&n.name)).or_default().push(n.name.clone());
    }
    for k in 0..=l_n {
        let (Some(a), Some(b)) = (by_pair.get(&k), by_pair.get(&(k + 1))) else { continue };
        for x in a {
            for y in b {
                gs.control.push((x.clone(), y.clone()));
            }
        }
    }
    let barred = Graph::new(gs)?;
    Ok(Some(crate::sched::schedule_with(&barred, budgets, rules)?.order))
}

/// The pairing baseline at its strongest, finished (syncs and drains) under `budgets`: within a
/// pair, the shorter (SIMULATED) of our default and `classic` orders. None where the layers do
/// not pair.
pub fn best_pairing(spec: &FamilySpec, g: &Graph, budgets: Budgets) -> Result<Option<Vec<NodeId>>> {
    let mut best: Option<(f64, Vec<NodeId>)> = None;
    for rules in [crate::sched::Rules::default(), crate::sched::Rules::CLASSIC] {
        if let Some(o) = pairing_order(spec, budgets, rules)? {
            let o = finish(g, o, budgets).order;
            let (makespan, ..) = simulate_order(g, &o, false, true)?;
            if best.as_ref().is_none_or(|b| makespan < b.0) {
                best = Some((makespan, o));
            }
        }
    }
    Ok(best.map(|b| b.1))
}

/// A member by its name with spaces as underscores (`router+shared_4`), at `ratio`.
pub fn member(slug: &str, ratio: f64) -> Option<FamilySpec> {
    members(ratio).into_iter().find(|(n, _)| n.replace(' ', "_") == slug).map(|m| m.1)
}

/// The members' names as `member` takes them.
pub fn slugs() -> Vec<String> {
    members(1.0).into_iter().map(|(n, _)| n.replace(' ', "_")).collect()
}

/// One row of the family sweep (SIMULATED).
#[derive(Clone, Debug, serde::Serialize)]
pub struct FamilyRow {
    /// The member's name.
    pub shape: String,
    /// Comm/compute ratio.
    pub ratio: f64,
    /// EP budget.
    pub budget: u32,
    /// max(total compute, total comm).
    pub bound_us: f64,
    /// (makespan, exposed comm) of each order.
    pub serial: (f64, f64),
    /// Every B (and W) node, then every F node.
    pub b_then_f: (f64, f64),
    /// Megatron-style layer pairing, where the layers pair (within a pair, the shorter of our
    /// default and `classic` orders).
    pub pairing: Option<(f64, f64)>,
    /// Our schedule.
    pub ours: (f64, f64),
    /// Our schedule under the `classic` rules (before `ready_first` became default).
    pub ours_classic: (f64, f64),
    /// Our schedule under rule `search` (cost-guided: the graph's costs, the simulator).
    pub ours_search: Option<(f64, f64)>,
    /// Reuse hazards the race checker found over every simulated order (must be 0).
    pub hazards: usize,
}

/// The named members: the symmetric chunk, router + shared expert, dense first, MTP, unequal
/// lengths both ways, three sources, jittered costs.
pub fn members(ratio: f64) -> Vec<(String, FamilySpec)> {
    let base = FamilySpec::new(4, ratio);
    vec![
        (s("symmetric 4"), base.clone()),
        (s("router+shared 2"), FamilySpec { router: true, shared: true, ..FamilySpec::new(2, ratio) }),
        (s("router+shared 4"), FamilySpec { router: true, shared: true, ..base.clone() }),
        (s("dense1+moe 4"), FamilySpec { dense: 1, ..base.clone() }),
        (s("mtp 3"), FamilySpec { mtp: true, ..FamilySpec::new(3, ratio) }),
        (s("F2 with B4"), FamilySpec { f_layers: 2, b_layers: 4, ..base.clone() }),
        (s("F4 with B2"), FamilySpec { f_layers: 4, b_layers: 2, ..base.clone() }),
        (s("three sources 3"), FamilySpec { third: true, ..FamilySpec::new(3, ratio) }),
        (s("jittered shared 4"), FamilySpec { shared: true, router: true, jitter: Some(7), ..base }),
    ]
}

/// Simulate every order for one member.
pub fn row(name: &str, spec: &FamilySpec, budget: u32) -> Result<FamilyRow> {
    row_with(name, spec, budget, true)
}

/// As [`row`]; `search: false` leaves rule `search` out (`ours_search` None): it is the slow
/// part (thousands of simulations per member).
pub fn row_with(name: &str, spec: &FamilySpec, budget: u32, search: bool) -> Result<FamilyRow> {
    let budgets = Budgets::new(budget, 2)?;
    let g = Graph::new(build(spec))?;
    let compute: f64 = g.nodes.iter().filter(|n| n.kind == Kind::Compute).map(|n| n.cost).sum();
    let comm: f64 = g.nodes.iter().filter(|n| n.kind.is_launch()).map(|n| n.cost).sum();
    let ours = schedule(&g, budgets)?.order;
    let classic = crate::sched::schedule_with(&g, budgets, crate::sched::Rules::CLASSIC)?.order;
    let searched =
        if search { Some(crate::sim::schedule(&g, budgets, crate::sched::Rules { search: true, ..Default::default() })?.order) } else { None };
    let table: Vec<NodeId> = g.node_ids().collect();
    let mut hazards = 0;
    // Our drain points for every order; the serial one drains at every node, as in the sweep.
    let mut sim = |order: &[NodeId], serial: bool| -> Result<(f64, f64)> {
        let (makespan, exposed, _, h) = simulate_order(&g, order, serial, !serial)?;
        hazards += h;
        Ok((makespan, exposed))
    };
    let pairing = match best_pairing(spec, &g, budgets)? {
        Some(o) => Some(sim(&o, false)?),
        None => None,
    };
    Ok(FamilyRow {
        shape: name.into(),
        ratio: spec.ratio,
        budget,
        bound_us: compute.max(comm),
        serial: sim(&finish(&g, table, budgets).order, true)?,
        b_then_f: sim(&super::moe::backward_then_forward(&g), false)?,
        pairing,
        ours: sim(&ours, false)?,
        ours_classic: sim(&classic, false)?,
        ours_search: match searched {
            Some(o) => Some(sim(&o, false)?),
            None => None,
        },
        hazards,
    })
}
