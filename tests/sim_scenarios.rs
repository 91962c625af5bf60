//! The simulator on named scenarios and bad input. All figures here are simulated.

use sched_lifetime::scenarios;
use sched_lifetime::sim::{self, Mode, Program, Policy, SimOptions};

const GIB: f64 = (1u64 << 30) as f64;

fn run(spec: sim::ProgramSpec, policy: Policy) -> sim::Report {
    sim::simulate(&Program::new(spec).unwrap(), SimOptions::new(policy)).unwrap()
}

#[test]
fn megatron_hero_record_stream_piles_up_scheduled_does_not() {
    let rs = run(scenarios::megatron_hero(16), Policy::RecordStream);
    let sc = run(scenarios::megatron_hero(16), Policy::Scheduled);
    println!(
        "hero: rs pending {:.2} GiB ({} blocks), reserved {:.1} GiB | sched pending {:.2} GiB, parked {:.2} GiB ({} blocks), unusable {:.2} GiB, reserved {:.1} GiB",
        rs.pending_free_peak.bytes as f64 / GIB, rs.pending_free_peak_blocks, rs.reserved_peak.bytes as f64 / GIB,
        sc.pending_free_peak.bytes as f64 / GIB, sc.parked_peak.bytes as f64 / GIB, sc.parked_peak_blocks,
        sc.unusable_peak.bytes as f64 / GIB, sc.reserved_peak.bytes as f64 / GIB
    );
    assert!(rs.hazards.is_empty() && sc.hazards.is_empty());
    assert!(rs.pending_free_peak_blocks >= 4, "record_stream: several big blocks pending at once");
    // Scheduled: nothing pending in the allocator (external inputs aside), and the manager
    // holds at most one dispatch and one grouped-GEMM output at a time.
    assert!(sc.parked_peak_blocks <= 2, "{}", sc.parked_peak_blocks);
    // Cross-stream values wait parked for their owner's drain (none when nothing is parked).
    assert!(sc.parked_peak_blocks >= 1 && sc.parked_peak.bytes > 0, "{}", sc.parked_peak_blocks);
    let reduction = 1.0 - sc.unusable_peak.bytes as f64 / rs.unusable_peak.bytes as f64;
    assert!(reduction >= 0.90, "pending-free peak reduced by {:.1}%", reduction * 100.0);
    assert!(sc.reserved_peak.bytes < rs.reserved_peak.bytes);
    assert!((sc.makespan_us - rs.makespan_us).abs() / rs.makespan_us < 0.05, "same schedule, about the same time");
}

#[test]
fn lagging_pipeline_matches_the_gpu_ab_shape() {
    let rs = run(scenarios::lagging_pipeline(16, 64, 1000.0, 5), Policy::RecordStream);
    let sc = run(scenarios::lagging_pipeline(16, 64, 1000.0, 5), Policy::Scheduled);
    let mib = (1u64 << 20) as f64;
    println!(
        "lagging: reserved rs {:.0} MiB sched {:.0} MiB; pending rs {:.0} MiB",
        rs.reserved_peak.bytes as f64 / mib, sc.reserved_peak.bytes as f64 / mib, rs.pending_free_peak.bytes as f64 / mib
    );
    assert!(sc.reserved_peak.bytes * 3 < rs.reserved_peak.bytes);
    assert_eq!(sc.pending_free_peak.bytes, 0);
}

#[test]
fn no_caching_mode_is_the_liveness_bound_and_never_hazards() {
    let plan = Program::new(scenarios::megatron_hero(4)).unwrap();
    let opts = SimOptions { mode: Mode::NoCaching, ..SimOptions::new(Policy::Scheduled) };
    let nc = sim::simulate(&plan, opts).unwrap();
    let c = sim::simulate(&plan, SimOptions::new(Policy::Scheduled)).unwrap();
    assert!(nc.hazards.is_empty());
    assert!(nc.liveness_lower_bound_bytes <= c.reserved_peak.bytes);
    assert!(c.liveness_lower_bound_bytes > 0);
}

#[test]
fn trace_is_chrome_json_with_kernels_and_counters() {
    let plan = Program::new(scenarios::random_program(7)).unwrap();
    let r = sim::simulate(&plan, SimOptions { trace: true, ..SimOptions::new(Policy::Scheduled) }).unwrap();
    let ev = r.trace.as_ref().unwrap()["traceEvents"].as_array().unwrap().clone();
    assert_eq!(ev.iter().filter(|e| e["ph"] == "X").count(), plan.len());
    assert!(ev.iter().any(|e| e["ph"] == "C"));
    assert!(!r.memory_timeline.is_empty());
}

fn err(json: &str) -> String {
    match Program::from_json(json) {
        Ok(p) => sim::simulate(&p, SimOptions::new(Policy::Scheduled)).unwrap_err().to_string(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_input_is_an_error_naming_the_item() {
    let s = r#""streams": [{"name": "c"}]"#;
    assert!(err(&format!(r#"{{{s}, "nodes": [{{"name": "a", "stream": "x", "us": 1}}]}}"#)).contains("node 'a': unknown stream 'x'"));
    assert!(err(&format!(r#"{{{s}, "nodes": [{{"name": "a", "stream": "c", "us": -1}}]}}"#)).contains("node 'a': duration"));
    assert!(err(&format!(r#"{{{s}, "nodes": [{{"name": "a", "stream": "c", "us": 1, "inputs": ["v"]}}]}}"#))
        .contains("consumes value 'v', which has no producer"));
    assert!(err(&format!(r#"{{{s}, "nodes": [{{"name": "a", "stream": "c", "us": 1, "action": "free"}}]}}"#)).contains("unknown action 'free'"));
    assert!(err(r#"{"streams": [], "nodes": []}"#).contains("no streams"));
    assert!(err("{not json").contains("plan is not valid"));
    assert!(err(&format!(r#"{{{s}, "host_us_per_op": -2, "nodes": []}}"#)).contains("host_us_per_op"));
    // A wait on an event never recorded, at the machine level.
    let cfg = sim::machine::Config { mode: Mode::Caching, host_us_per_op: 1.0, sm_contention: 0.0, timeline: false, log: false, max_queued: 1024 };
    let mut m = sim::Machine::new(cfg, vec![sim::Engine::Compute], 1, |_| 8);
    let e = m.new_event();
    assert!(m.wait(e, 0).unwrap_err().to_string().contains("never recorded"));
    assert!(m.malloc(0, 3).unwrap_err().to_string().contains("unknown stream index 3"));
    assert!(sched_lifetime::scenarios::by_name("nope").is_err());
}

/// A size typed into a scenario name is checked before anything is allocated for it: one past
/// the limit is an input error naming the limit (it used to abort the process on a failed
/// allocation, `chain:100000000000`); the limit itself is accepted where it is cheap to build.
#[test]
fn scenario_sizes_past_the_limit_are_errors_not_aborts() {
    use sched_lifetime::scenarios::{by_name, MAX_CHAIN, MAX_LAYERS};
    for name in ["chain:100000000000".to_string(), format!("chain:{}", MAX_CHAIN + 1), format!("moe_chunk:{}:1.0", MAX_LAYERS + 1)] {
        let e = by_name(&name).unwrap_err();
        assert!(e.is_value_error(), "{name}: {e}");
        assert!(e.to_string().contains("largest supported"), "{name}: {e}");
    }
    assert!(by_name("chain:18446744073709551616").is_err()); // past usize: a parse error
    assert!(by_name("chain:1000").is_ok());
    assert!(by_name("moe_chunk:2:1.0").is_ok());
}

/// Two sources of one phase with a control edge from one to the other (`run_two`'s backward
/// pair: the second microbatch's weight-gradient accumulation after the first's). The edge
/// becomes a token the producer's plan binds; the simulator retires it in that plan, as the
/// executor does, and hands the plan back after the token's last use (it used to retire it in
/// the consumer's plan: rule `search` failed with "bound but never retired").
#[test]
fn control_edges_across_sources_are_retired_in_the_producers_plan() {
    use sched_lifetime::ep::Budgets;
    use sched_lifetime::ir::Graph;
    use sched_lifetime::sched::Rules;

    let g = Graph::from_json(
        r#"{"sources": [{"name": "B", "phase": "B"}, {"name": "B2", "phase": "B"}], "inputs": ["g", "g2"], "nodes": [
            {"name": "B.a", "source": "B", "kind": "compute", "inputs": ["g"], "outputs": ["B.x"], "cost": 50},
            {"name": "B.send", "source": "B", "kind": "comm_launch", "inputs": ["B.x"], "outputs": ["B.y"], "cost": 80},
            {"name": "B.send.wait", "source": "B", "kind": "comm_wait", "launch": "B.send"},
            {"name": "B.dw", "source": "B", "kind": "compute", "wgrad": true, "inputs": ["B.y"], "outputs": ["B.w"], "cost": 40},
            {"name": "B2.a", "source": "B2", "kind": "compute", "inputs": ["g2"], "outputs": ["B2.x"], "cost": 50},
            {"name": "B2.send", "source": "B2", "kind": "comm_launch", "inputs": ["B2.x"], "outputs": ["B2.y"], "cost": 80},
            {"name": "B2.send.wait", "source": "B2", "kind": "comm_wait", "launch": "B2.send"},
            {"name": "B2.dw", "source": "B2", "kind": "compute", "wgrad": true, "inputs": ["B2.y"], "outputs": ["B2.w"], "cost": 40}
        ], "control": [["B.dw", "B2.dw"]]}"#,
    )
    .unwrap();
    let s = sched_lifetime::sched::schedule(&g, Budgets::default()).unwrap();
    for (serial, drains) in [(false, true), (false, false), (true, false)] {
        let rep = sim::simulate_graph(&g, &s.order, serial, drains).unwrap();
        assert!(rep.hazards.is_empty(), "serial {serial} drains {drains}: {:?}", rep.hazards);
    }
    // The dW order holds in the searched schedule too.
    let searched = sim::schedule(&g, Budgets::default(), Rules::parse("search").unwrap()).unwrap();
    let pos = |n: &str| searched.order.iter().position(|&u| g.nodes[u].name == n).unwrap();
    assert!(pos("B.dw") < pos("B2.dw"));
}

/// Lowering with launch waits (rule `search`'s model): an EP launch waits for every compute node
/// issued before it, edges or not (on the GPU the transports allocate the output on the compute
/// stream and make the EP stream wait for it). Filler compute issued ahead of a launch delays the link by its own cost; issued after the
/// launch it runs under the transfer. A page launch is not held (no such wait in the model).
#[test]
fn an_ep_launch_waits_for_the_compute_issued_before_it() {
    use sched_lifetime::ir::{Graph, GraphSpec};
    let graph = |kind: &str, wait: &str| -> Graph {
        let json = format!(
            r#"{{"sources": [{{"name": "F", "phase": "F"}}, {{"name": "B", "phase": "B"}}],
            "nodes": [
              {{"name": "a", "source": "F", "kind": "compute", "outputs": [{{"value": "va", "bytes": 1}}], "cost": 100}},
              {{"name": "L", "source": "F", "kind": "{kind}", "inputs": ["va"], "outputs": [{{"value": "vl", "bytes": 1}}], "cost": 1000}},
              {{"name": "L.wait", "source": "F", "kind": "{wait}", "launch": "L"}},
              {{"name": "c", "source": "F", "kind": "compute", "inputs": ["vl"], "outputs": [{{"value": "vc", "bytes": 1}}], "cost": 100}},
              {{"name": "x", "source": "B", "kind": "compute", "outputs": [{{"value": "vx", "bytes": 1}}], "cost": 500}}
            ]}}"#
        );
        Graph::new(serde_json::from_str::<GraphSpec>(&json).unwrap()).unwrap()
    };
    let span = |g: &Graph, names: &[&str]| {
        let order = sched_lifetime::sched::order_by_names(g, &names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        (sim::makespan_launch_waits(g, &order).unwrap(), sim::makespan(g, &order).unwrap())
    };
    let g = graph("comm_launch", "comm_wait");
    let (before, after) = (span(&g, &["a", "x", "L", "L.wait", "c"]), span(&g, &["a", "L", "x", "L.wait", "c"]));
    // x before L: L starts after a and x (600 us), ends 1600, c 1700. After: L 100-1100, c 1200.
    assert!(before.0 > after.0 + 450.0, "x issued before the launch delays it: {before:?} vs {after:?} us");
    assert!((after.0 - 1200.0).abs() < 20.0, "{after:?}");
    // The edge-only model (`makespan`, `lower`) lets the launch start after a alone.
    assert!((before.1 - after.1).abs() < 20.0, "edge-only model: {before:?} vs {after:?}");
    let p = graph("page_out", "page_wait");
    let (pb, pa) = (span(&p, &["a", "x", "L", "L.wait", "c"]).0, span(&p, &["a", "L", "x", "L.wait", "c"]).0);
    assert!((pb - pa).abs() < 20.0, "a page launch is not held by unrelated compute: {pb} vs {pa}");
}
