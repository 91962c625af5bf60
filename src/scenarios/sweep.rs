//! The simulated sweep of the README: four orders (serial, backward-then-forward, Megatron's,
//! ours) over MoE chunk shapes, through the simulator with the real lifetime manager.

use super::moe::{backward_then_forward, chunk, megatron_order, Shape};
use crate::ep::Budgets;
use crate::error::Result;
use crate::ir::{Graph, Kind, NodeId};
use crate::sched::{finish, schedule, Schedule};
use crate::sim;

/// One row of the sweep (all figures simulated).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SweepRow {
    /// Layers per source.
    pub layers: usize,
    /// Comm/compute ratio.
    pub ratio: f64,
    /// max(total compute, total comm).
    pub bound_us: f64,
    /// (makespan, exposed comm) for serial, B-then-F, Megatron's order, ours, all with the
    /// schedule's drain points: one stream.
    pub serial: (f64, f64),
    /// Every backward node, then every forward node.
    pub b_then_f: (f64, f64),
    /// Megatron-LM's fixed per-layer order.
    pub megatron: (f64, f64),
    /// Our schedule.
    pub ours: (f64, f64),
    /// Megatron's order with drains at the owner's next node of the plan.
    pub megatron_next_node: (f64, f64),
    /// Ours with drains at the owner's next node of the plan.
    pub ours_next_node: (f64, f64),
    /// Max reserved bytes of ours: schedule drains, next-node drains.
    pub ours_reserved: (u64, u64),
    /// Reuse hazards the race checker found over every simulated order (must be 0).
    pub hazards: usize,
}

/// Simulated with the real lifetime manager: (makespan, exposed comm, max reserved, hazards).
pub(super) fn simulate_order(g: &Graph, order: &[NodeId], serial: bool, scheduled_drains: bool) -> Result<(f64, f64, u64, usize)> {
    let r = sim::simulate_graph(g, order, serial, scheduled_drains)?;
    Ok((r.makespan_us, r.exposed_comm_us, r.reserved_peak.bytes, r.hazards.len()))
}

/// Simulate the four orders for one shape.
pub fn sweep_row(shape: Shape, budgets: Budgets) -> Result<(SweepRow, Schedule)> {
    let g = Graph::new(chunk(shape))?;
    let ours = schedule(&g, budgets)?;
    let meg = megatron_order(&g, shape);
    let compute: f64 = g.nodes.iter().filter(|n| n.kind == Kind::Compute).map(|n| n.cost).sum();
    let comm: f64 = g.nodes.iter().filter(|n| n.kind.is_launch()).map(|n| n.cost).sum();
    let mut hazards = 0;
    let mut two = |x: (f64, f64, u64, usize)| {
        hazards += x.3;
        (x.0, x.1)
    };
    let ours_s = simulate_order(&g, &ours.order, false, true)?;
    let ours_n = simulate_order(&g, &ours.order, false, false)?;
    let serial = two(simulate_order(&g, &finish(&g, g.node_ids().collect(), budgets).order, true, false)?);
    let b_then_f = two(simulate_order(&g, &backward_then_forward(&g), false, true)?);
    let megatron = two(simulate_order(&g, &meg, false, true)?);
    let megatron_next_node = two(simulate_order(&g, &meg, false, false)?);
    let (ours_t, ours_next_t) = (two(ours_s), two(ours_n));
    let row = SweepRow {
        layers: shape.layers,
        ratio: shape.comm_us / (shape.attn_us + shape.mlp_us) * 2.0,
        bound_us: compute.max(comm),
        serial,
        b_then_f,
        megatron,
        ours: ours_t,
        megatron_next_node,
        ours_next_node: ours_next_t,
        ours_reserved: (ours_s.2, ours_n.2),
        hazards,
    };
    Ok((row, ours))
}

