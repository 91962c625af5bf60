//! Generated inputs: scheduler graphs (MoE chunks) with their baseline orders, simulator
//! programs (the Megatron hero case, the lagging pipeline, random programs, chains), the
//! seeded generator, and the simulated sweep. What tests, benches, the CLI and Python's
//! `sl.scenario_graph` / `sl.scenario_program` use. Sits above `sched` and `sim`.

pub mod family;
pub mod moe;
pub mod optimum;
pub mod programs;
mod rng;
pub mod sweep;

pub use programs::{chain, lagging_pipeline, megatron_hero, random_program, random_program_wide};
pub use rng::Rng;

use serde::Serialize;

use crate::ep::Budgets;
use crate::error::{Error, Result};
use crate::ir::{Graph, GraphSpec, NodeId};
use crate::sched::{finish, named, NamedSchedule};
use crate::sim::ProgramSpec;

/// A scheduler graph with the baseline orders it is compared against.
#[derive(Clone, Debug, Serialize)]
pub struct GraphScenario {
    /// The graph table (what Python builds and `sl.schedule` takes).
    pub graph: GraphSpec,
    /// Baseline orders by name, each with its minimal record/wait edges and drains.
    pub orders: std::collections::BTreeMap<String, NamedSchedule>,
}

/// What a scenario name gives: a graph for the scheduler, or a program for the simulator.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Scenario {
    /// `moe_chunk:LAYERS:RATIO`, `family:MEMBER:RATIO`.
    Graph(GraphScenario),
    /// `megatron_hero`, `lagging_pipeline`, `random:SEED`, `chain:N`.
    Program {
        /// The simulator program.
        program: ProgramSpec,
    },
}

const NAMES: &str = "moe_chunk:LAYERS:RATIO or family:MEMBER:RATIO (graphs), megatron_hero, lagging_pipeline, random:SEED or chain:N (programs)";

/// A scenario by name.
pub fn by_name(name: &str) -> Result<Scenario> {
    let bad = || Error::InvalidInput(format!("unknown scenario '{name}': expected {NAMES}"));
    let program = |p: ProgramSpec| Ok(Scenario::Program { program: p });
    match name.split_once(':') {
        None if name == "megatron_hero" => program(megatron_hero(16)),
        None if name == "lagging_pipeline" => program(lagging_pipeline(16, 64, 1000.0, 5)),
        Some(("random", s)) => s.parse().map(random_program).map_err(|_| bad()).and_then(program),
        Some(("chain", n)) => {
            let n: usize = n.parse().map_err(|_| bad())?;
            program(chain(within(name, "chain length", n, MAX_CHAIN)?))
        }
        Some(("moe_chunk", _)) => moe_chunk(name).map(Scenario::Graph),
        Some(("family", _)) => family_member(name).map(Scenario::Graph),
        _ => Err(bad()),
    }
}

/// The largest sizes a scenario name may ask for: a size the user types is checked before
/// anything is allocated for it, so a typo is an error and never an aborted process (a failed
/// allocation aborts in Rust).
pub const MAX_CHAIN: usize = 1_000_000;
/// See [`MAX_CHAIN`]: layers of a generated MoE chunk.
pub const MAX_LAYERS: usize = 4096;

fn within(name: &str, what: &str, n: usize, max: usize) -> Result<usize> {
    if n > max {
        return Err(Error::InvalidInput(format!("scenario '{name}': {what} {n} is above the largest supported, {max}")));
    }
    Ok(n)
}

/// `moe_chunk:LAYERS:RATIO`: the graph table and, for the baselines (Megatron's order,
/// B-then-F), their orders with the minimal record/wait edges, by name, so a GPU script can
/// run each order on real streams next to ours.
fn moe_chunk(name: &str) -> Result<GraphScenario> {
    let bad = || Error::InvalidInput(format!("'{name}': expected moe_chunk:LAYERS:RATIO, e.g. moe_chunk:4:1.0"));
    let mut parts = name.split(':').skip(1);
    let layers: usize = parts.next().and_then(|x| x.parse().ok()).filter(|&l| l > 0).ok_or_else(bad)?;
    let layers = within(name, "layer count", layers, MAX_LAYERS)?;
    let ratio: f64 = parts.next().and_then(|x| x.parse().ok()).filter(|r: &f64| r.is_finite() && *r > 0.0).ok_or_else(bad)?;
    let shape = moe::Shape::moe(layers, ratio);
    let spec = moe::chunk(shape);
    let g = Graph::new(spec.clone())?;
    let named_order = |order: Vec<NodeId>| named(&g, &finish(&g, order, Budgets::default()), None);
    let orders = [
        ("megatron".to_string(), named_order(moe::megatron_order(&g, shape))),
        ("b_then_f".to_string(), named_order(moe::backward_then_forward(&g))),
    ];
    Ok(GraphScenario { graph: spec, orders: orders.into_iter().collect() })
}

/// `family:MEMBER:RATIO` (MEMBER as `family::slugs` names it, e.g. `router+shared_4`): the
/// member's graph table and its baselines with their record/wait edges (`b_then_f`, and
/// `pairing` where the layers pair), so a GPU script can run each order next to ours.
fn family_member(name: &str) -> Result<GraphScenario> {
    let bad = || {
        let slugs = family::slugs().join(", ");
        Error::InvalidInput(format!("'{name}': expected family:MEMBER:RATIO, MEMBER one of {slugs}; RATIO > 0"))
    };
    let mut parts = name.split(':').skip(1);
    let slug = parts.next().ok_or_else(bad)?;
    let ratio: f64 = parts.next().and_then(|x| x.parse().ok()).filter(|r: &f64| r.is_finite() && *r > 0.0).ok_or_else(bad)?;
    if parts.next().is_some() {
        return Err(bad());
    }
    let spec = family::member(slug, ratio).ok_or_else(bad)?;
    let gs = family::build(&spec);
    let g = Graph::new(gs.clone())?;
    let budgets = Budgets::default();
    let named_order = |order: Vec<NodeId>| named(&g, &finish(&g, order, budgets), None);
    let mut orders = std::collections::BTreeMap::new();
    orders.insert("b_then_f".to_string(), named_order(moe::backward_then_forward(&g)));
    if let Some(o) = family::best_pairing(&spec, &g, budgets)? {
        orders.insert("pairing".to_string(), named_order(o));
    }
    Ok(GraphScenario { graph: gs, orders })
}
