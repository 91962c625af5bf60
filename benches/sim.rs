//! Simulator throughput: machine operations per second on a 100k-node, two-source plan
//! (target: at least 5 M/s), for both policies. Program parsing/validation is outside the loop.

use criterion::{criterion_group, Criterion, Throughput};
use sched_lifetime::scenarios;
use sched_lifetime::sim::{self, Program, Policy, SimOptions};

fn events_per_second(c: &mut Criterion) {
    let plan = Program::new(scenarios::chain(100_000)).expect("valid plan");
    let mut g = c.benchmark_group("sim/chain_100k");
    g.sample_size(10);
    for policy in [Policy::RecordStream, Policy::Scheduled] {
        let events = sim::simulate(&plan, SimOptions::new(policy)).expect("runs").events;
        g.throughput(Throughput::Elements(events));
        g.bench_function(format!("{policy:?}"), |b| b.iter(|| sim::simulate(&plan, SimOptions::new(policy)).expect("runs")));
    }
    g.finish();
}

criterion_group!(benches, events_per_second);
