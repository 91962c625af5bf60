//! Planning time of a 100k-node, two-source graph (target: under 50 ms): 12,500 MoE layers
//! per source, 8 nodes each, comm launch/wait pairs and wgrad nodes included.

use criterion::{criterion_group, Criterion};
use sched_lifetime::ir::Graph;
use sched_lifetime::ep::Budgets;
use sched_lifetime::scenarios::moe;
use sched_lifetime::sched::schedule;

fn plan_100k(c: &mut Criterion) {
    // 14 nodes per layer pair (F: attn, 2x launch+wait, mlp; B: 2x launch+wait, mlp, dw, attn, dw).
    let g = Graph::new(moe::chunk(moe::Shape::moe(7_143, 1.0))).expect("valid graph");
    assert!(g.len() >= 100_000, "{} nodes", g.len());
    let mut group = c.benchmark_group("sched");
    group.sample_size(10);
    group.bench_function(format!("plan_{}_nodes", g.len()), |b| b.iter(|| schedule(&g, Budgets::default()).expect("schedules")));
    group.finish();
}

criterion_group!(benches, plan_100k);
