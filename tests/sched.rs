//! The scheduler: Megatron's overlap pairs derived with no layer-specific code, dense layers,
//! an MTP tail, the dI/dW live-in rule, the validator, errors, and properties on random graphs.

use sched_lifetime::ir::{Graph, GraphSpec, Kind, NodeSpec, OutputSpec, Phase, Source};
use sched_lifetime::ep::Budgets;
use sched_lifetime::scenarios::{moe, sweep, Rng};
use sched_lifetime::sched::{self, validate, Schedule};

fn pos(g: &Graph, s: &Schedule, name: &str) -> usize {
    let id = g.nodes.iter().position(|n| n.name == name).unwrap_or_else(|| panic!("no node {name}"));
    s.order.iter().position(|&u| u.ix() == id).expect("scheduled")
}

/// `comm` runs under `compute`: launched before it, waited after it.
fn hidden(g: &Graph, s: &Schedule, comm: &str, compute: &str) -> bool {
    let (l, c, w) = (pos(g, s, comm), pos(g, s, compute), pos(g, s, &format!("{comm}.wait")));
    l < c && c < w
}

fn names(g: &Graph, s: &Schedule) -> String {
    s.order.iter().map(|&u| g.nodes[u.ix()].name.as_str()).collect::<Vec<_>>().join(", ")
}

fn megatron_pairs_hold(shape: moe::Shape, budgets: Budgets) {
    let g = Graph::new(moe::chunk(shape)).unwrap();
    let s = sched::schedule(&g, budgets).unwrap();
    validate(&g, &s).unwrap();
    let l_n = shape.layers;
    for i in shape.dense..l_n {
        // F layer i runs against B layer L-1-i, as in combined 1F1B.
        let (f, b) = (format!("F.L{i}"), format!("B.L{}", l_n - 1 - i));
        if l_n - 1 - i < shape.dense {
            continue;
        }
        let order = names(&g, &s);
        assert!(hidden(&g, &s, &format!("{b}.combine"), &format!("{f}.attn")), "B.combine | F.attn: {order}");
        assert!(hidden(&g, &s, &format!("{f}.dispatch"), &format!("{b}.mlp")), "F.dispatch | B.mlp: {order}");
        assert!(hidden(&g, &s, &format!("{b}.dispatch"), &format!("{f}.mlp")), "B.dispatch | F.mlp: {order}");
        assert!(hidden(&g, &s, &format!("{f}.combine"), &format!("{b}.attn")), "F.combine | B.attn: {order}");
    }
}

#[test]
fn moe_layer_overlaps_the_four_megatron_pairs() {
    for budgets in [Budgets::new(1, 1).unwrap(), Budgets::default(), Budgets::new(4, 4).unwrap()] {
        megatron_pairs_hold(moe::Shape::moe(1, 1.0), budgets);
    }
}

#[test]
fn every_layer_of_a_deep_chunk_overlaps_the_four_pairs() {
    for layers in [2, 4, 8] {
        megatron_pairs_hold(moe::Shape::moe(layers, 0.5), Budgets::new(1, 1).unwrap());
        megatron_pairs_hold(moe::Shape::moe(layers, 0.5), Budgets::default());
        let g = Graph::new(moe::chunk(moe::Shape::moe(layers, 0.5))).unwrap();
        every_launch_hidden_by_the_other_source(&g, &sched::schedule(&g, Budgets::default()).unwrap());
    }
}

/// Every launch runs under compute of the other source, unless that source had no compute
/// left when it was launched.
fn every_launch_hidden_by_the_other_source(g: &Graph, s: &Schedule) {
    let ex = sched::explain(g, s);
    for e in &ex {
        let launch_pos = pos(g, s, &e.launch);
        let other_left = s.order[launch_pos..].iter().any(|&u| {
            let nd = &g.nodes[u.ix()];
            nd.kind == Kind::Compute && g.sources[nd.source.ix()].name != e.source
        });
        let by_other = e.hidden_under.iter().any(|c| !c.starts_with(&e.source[..1]));
        assert!(by_other || !other_left, "{} is not hidden by the other source: {}", e.launch, names(g, s));
    }
}

#[test]
fn dense_layers_and_mtp_tail() {
    let shape = moe::Shape { dense: 1, mtp: true, ..moe::Shape::moe(3, 1.0) };
    let g = Graph::new(moe::chunk(shape)).unwrap();
    let s = sched::schedule(&g, Budgets::default()).unwrap();
    validate(&g, &s).unwrap();
    every_launch_hidden_by_the_other_source(&g, &s);
    // All-dense chunk: no launch at all, a valid interleaving of the two sources.
    let dense = moe::Shape { dense: 2, ..moe::Shape::moe(2, 1.0) };
    let gd = Graph::new(moe::chunk(dense)).unwrap();
    let sd = sched::schedule(&gd, Budgets::default()).unwrap();
    validate(&gd, &sd).unwrap();
    assert!(sd.syncs.is_empty() && sd.retires.is_empty());
    // Dense dispatch/combine are noops: no launch, no sync edge through them.
    for n in ["F.L0.dispatch", "F.L0.combine", "B.L0.dispatch", "B.L0.combine"] {
        let id = g.nodes.iter().position(|x| x.name == n).unwrap();
        assert_eq!(g.nodes[id].kind, Kind::Noop);
        assert!(!s.syncs.iter().any(|e| e.producer.ix() == id || e.consumer.ix() == id), "{n} has a sync");
    }
    // The MTP tail runs last in F and first in B, and overlaps the other source's comm.
    assert!(pos(&g, &s, "F.mtp.mlp") > pos(&g, &s, "F.L2.mlp"));
    assert!(pos(&g, &s, "B.mtp.attn") < pos(&g, &s, "B.L2.mlp"));
}

#[test]
fn ours_matches_or_beats_megatron_and_nears_the_bound_in_the_simulator() {
    // The default EP budget (1) and budget 2. Our drains (placed where they add no wait) hold
    // memory a little longer than Megatron's next-node drains on the same order: one 64 MiB
    // block at budget 2; at budget 1 the next-node drains gain one more block, ours stay put.
    for (ep, extra_blocks) in [(1, 2), (2, 1)] {
        for layers in [1, 2, 4, 8] {
            for ratio in [0.25, 0.5, 1.0, 1.5, 2.0] {
                let (r, _) = sweep::sweep_row(moe::Shape::moe(layers, ratio), Budgets::new(ep, 2).unwrap()).unwrap();
                assert!(r.ours.0 <= r.megatron.0 * 1.001, "{layers} layers, ratio {ratio}: ours {:?} megatron {:?}", r.ours, r.megatron);
                assert!(r.ours.0 <= r.bound_us * 1.05, "{layers} layers, ratio {ratio}: ours {} bound {}", r.ours.0, r.bound_us);
                assert!(r.ours.0 < r.b_then_f.0 && r.ours.0 < r.serial.0);
                // The whole system (our order, our drain points) against Megatron as shipped
                // (its order, drains at the owner's next node), at `extra_blocks` more memory at most.
                assert!(r.ours.0 <= r.megatron_next_node.0 * 1.001);
                assert!(r.ours_reserved.0 <= r.ours_reserved.1 + extra_blocks * (64 << 20), "ep {ep}: {:?}", r.ours_reserved);
                assert_eq!(r.hazards, 0, "{layers} layers, ratio {ratio}: the race checker found hazards");
            }
        }
    }
}

#[test]
fn drains_add_no_wait() {
    for layers in [1, 4] {
        let g = Graph::new(moe::chunk(moe::Shape::moe(layers, 1.0))).unwrap();
        let s = sched::schedule(&g, Budgets::default()).unwrap();
        assert!(s.retires.iter().filter(|r| r.drain_before.is_some()).count() > 4 * layers);
        assert_eq!(sched::drains_adding_waits(&g, &s), Vec::<String>::new());
        // Megatron's rule (the owner's next node) on the same order does add waits.
        let mut next = s.clone();
        for r in next.retires.iter_mut() {
            let p = s.order.iter().position(|&u| u == r.last_consumer).unwrap();
            r.drain_before = s.order[p + 1..].iter().copied().find(|&u| s.stream[u.ix()] == r.owner);
        }
        assert!(!sched::drains_adding_waits(&g, &next).is_empty());
    }
}

#[test]
fn dw_keeps_di_live_ins_until_it_has_run() {
    let g = Graph::new(moe::chunk(moe::Shape::moe(2, 1.0))).unwrap();
    let s = sched::schedule(&g, Budgets::default()).unwrap();
    // B.gc{l} is read by B.L{l}.mlp (dI) and B.L{l}.mlp.dw: it retires at whichever runs last.
    for l in 0..2 {
        let v = g.values.iter().position(|v| v.name == format!("B.gc{l}")).unwrap();
        let r = s.retires.iter().find(|r| r.value.ix() == v).expect("B.gc is cross-stream (owner ep)");
        let last = &g.nodes[r.last_consumer.ix()].name;
        let (di, dw) = (pos(&g, &s, &format!("B.L{l}.mlp")), pos(&g, &s, &format!("B.L{l}.mlp.dw")));
        assert_eq!(*last, if dw > di { format!("B.L{l}.mlp.dw") } else { format!("B.L{l}.mlp") });
        assert_eq!(r.action.name(), "drop_reference");
    }
    // Forward values retire with empty_storage.
    assert!(s.retires.iter().any(|r| g.values[r.value.ix()].name == "F.a0" && r.action.name() == "empty_storage"));
}

#[test]
fn syncs_are_minimal_and_validator_rejects_broken_schedules() {
    let g = Graph::new(moe::chunk(moe::Shape::moe(2, 1.0))).unwrap();
    let s = sched::schedule(&g, Budgets::new(1, 1).unwrap()).unwrap();
    validate(&g, &s).unwrap();
    // Dropping any sync edge leaves a cross-stream use uncovered: none is redundant.
    for i in 0..s.syncs.len() {
        let mut t = s.clone();
        t.syncs.remove(i);
        assert!(validate(&g, &t).unwrap_err().to_string().contains("no wait covering it"), "sync {i} was redundant");
    }
    // Swapping a wait before its launch breaks topology.
    let mut t = s.clone();
    let (l, w) = (pos(&g, &s, "F.L0.dispatch"), pos(&g, &s, "F.L0.dispatch.wait"));
    t.order.swap(l, w);
    assert!(validate(&g, &t).is_err());
    // A compute node before its same-stream predecessor (no sync edge involved).
    let mut t = s.clone();
    let (w, m) = (pos(&g, &s, "F.L0.dispatch.wait"), pos(&g, &s, "F.L0.mlp"));
    t.order.swap(w, m);
    let e = validate(&g, &t).unwrap_err().to_string();
    assert!(e.contains("'F.L0.mlp' is issued before its predecessor 'F.L0.dispatch.wait'"), "{e}");
    // The same order under a smaller budget than it uses.
    let wide = sched::schedule(&g, Budgets::new(4, 4).unwrap()).unwrap();
    let mut t = wide.clone();
    t.budgets = Budgets::new(1, 1).unwrap();
    let max_in_flight = {
        let mut cur = 0i32;
        let mut m = 0;
        for &u in &wide.order {
            let k = g.nodes[u.ix()].kind;
            cur += k.is_launch() as i32 - (k == Kind::CommWait) as i32;
            m = m.max(cur);
        }
        m
    };
    if max_in_flight > 1 {
        assert!(validate(&g, &t).unwrap_err().to_string().contains("launch budget"));
    }
    // A drain placed before the retire.
    let mut t = s.clone();
    let r = t.retires.iter_mut().find(|r| r.drain_before.is_some()).unwrap();
    r.drain_before = Some(r.last_consumer);
    assert!(validate(&g, &t).unwrap_err().to_string().contains("drains before"));
    // A drain after the last consumer but on another stream than the owner's.
    let mut t = s.clone();
    let i = t.retires.iter().position(|r| r.drain_before.is_some()).unwrap();
    let (owner, last) = (t.retires[i].owner, t.retires[i].last_consumer);
    let p_last = t.order.iter().position(|&u| u == last).unwrap();
    let other = *t.order[p_last + 1..].iter().find(|&&u| t.stream[u.ix()] != owner).expect("a later node on another stream");
    t.retires[i].drain_before = Some(other);
    assert!(validate(&g, &t).unwrap_err().to_string().contains("drains before"));
}

fn spec_err(f: impl FnOnce(&mut GraphSpec)) -> String {
    let mut spec = moe::chunk(moe::Shape::moe(1, 1.0));
    f(&mut spec);
    Graph::new(spec).map(|_| ()).unwrap_err().to_string()
}

#[test]
fn errors_name_the_node_or_setting() {
    assert!(spec_err(|s| s.control.push(("F.L0.mlp".into(), "F.L0.attn".into()))).contains("cycle through node"));
    // A cycle of one node: a control edge to itself, or a node reading its own output.
    assert!(spec_err(|s| s.control.push(("F.L0.attn".into(), "F.L0.attn".into()))).contains("cycle through node 'F.L0.attn': a control edge"));
    assert!(spec_err(|s| {
        let own = match &s.nodes[0].outputs[0] {
            OutputSpec::Name(n) => n.clone(),
            OutputSpec::Placed { value, .. } | OutputSpec::Sized { value, .. } => value.clone(),
        };
        s.nodes[0].inputs.push(own);
    })
    .contains("reads its own output"));
    assert!(spec_err(|s| s.nodes[0].inputs.push("ghost".into())).contains("uses value 'ghost', which no node produces"));
    assert!(spec_err(|s| s.nodes[0].source = "Z9".into()).contains("names source 'Z9', which is not declared"));
    assert!(spec_err(|s| {
        let w = s.nodes.iter_mut().find(|n| n.kind == Kind::CommWait).unwrap();
        w.launch = None;
    })
    .contains("is a wait without a launch"));
    assert!(spec_err(|s| {
        let w = s.nodes.iter_mut().find(|n| n.kind == Kind::CommWait).unwrap();
        w.launch = Some("F.L0.attn".into());
    })
    .contains("not a matching launch"));
    assert!(spec_err(|s| s.nodes.retain(|n| n.kind != Kind::CommWait)).contains("has no wait"));
    // A value's bytes are capped (the fuzzer found u64::MAX overflowing the simulator's rounding).
    let huge = |bytes: u64| move |s: &mut GraphSpec| s.inputs.push(OutputSpec::Sized { value: "huge".into(), bytes });
    let e = spec_err(huge(u64::MAX));
    assert!(e.contains("value 'huge' has 18446744073709551615 bytes, over the 1125899906842624 (1 PiB)"), "{e}");
    assert!(Graph::new({
        let mut spec = moe::chunk(moe::Shape::moe(1, 1.0));
        huge(sched_lifetime::ir::MAX_VALUE_BYTES)(&mut spec);
        spec
    })
    .is_ok());
    assert!(Graph::from_json("{").unwrap_err().to_string().contains("graph is not valid"));
    assert!(Budgets::new(0, 1).unwrap_err().to_string().contains("SCHED_LIFETIME_EP_LAUNCH_BUDGET=0 is out of range"));
    let e = Budgets::resolve(None, Some("lots")).unwrap_err().to_string();
    assert!(e.contains("SCHED_LIFETIME_PAGE_LAUNCH_BUDGET='lots' is not valid: expected an integer in 1..=1024"), "{e}");
    assert_eq!(Budgets::resolve(Some("3"), Some("")).unwrap(), Budgets { ep: 3, page: 2 });
}

/// A random annotated graph: 2-3 sources, chains of compute / comm pairs / page pairs / noops
/// / wgrad side nodes, extra data edges to earlier values of the same source, and control
/// edges across sources. Every edge goes forward in table order, so the graph is acyclic.
fn random_graph(seed: u64) -> GraphSpec {
    let mut r = Rng::new(seed);
    let phases = [Phase::F, Phase::B, Phase::DW];
    let n_src = 2 + r.below(2) as usize;
    let sources: Vec<Source> = (0..n_src)
        .map(|i| Source { name: format!("S{i}"), microbatch: i as u32, phase: phases[i], priority: r.below(3) as i32 })
        .collect();
    let mut nodes: Vec<NodeSpec> = Vec::new();
    let mut last: Vec<Option<String>> = vec![None; n_src];
    let mut made: Vec<Vec<String>> = vec![Vec::new(); n_src];
    let mut control = Vec::new();
    let len = 10 + r.below(40) as usize;
    for k in 0..len {
        let s = r.below(n_src as u64) as usize;
        let src = format!("S{s}");
        let mut ins: Vec<String> = last[s].iter().cloned().collect();
        if made[s].len() > 2 && r.below(4) == 0 {
            let v = made[s][r.below(made[s].len() as u64) as usize].clone();
            if !ins.contains(&v) {
                ins.push(v);
            }
        }
        let out = format!("v{k}");
        let base = NodeSpec {
            name: format!("n{k}"),
            source: src.clone(),
            kind: Kind::Compute,
            wgrad: false,
            inputs: ins,
            outputs: vec![OutputSpec::Sized { value: out.clone(), bytes: 1 << 20 }],
            mutates: vec![],
            launch: None,
            cost: 1.0 + r.below(10) as f64,
        };
        match r.below(6) {
            0 | 1 => {
                let kind = [Kind::CommLaunch, Kind::PageOut, Kind::PageIn][r.below(3) as usize];
                nodes.push(NodeSpec { kind, ..base });
                nodes.push(NodeSpec {
                    name: format!("n{k}.wait"),
                    source: src.clone(),
                    kind: if kind == Kind::CommLaunch { Kind::CommWait } else { Kind::PageWait },
                    wgrad: false,
                    inputs: vec![],
                    outputs: vec![],
                    mutates: vec![],
                    launch: Some(format!("n{k}")),
                    cost: 0.0,
                });
            }
            2 => nodes.push(NodeSpec { kind: Kind::Noop, ..base }),
            3 if last[s].is_some() => {
                // A wgrad side node off the chain: the chain continues from the previous value.
                nodes.push(NodeSpec { wgrad: true, ..base });
                made[s].push(out);
                continue;
            }
            _ => nodes.push(base),
        }
        if k > 3 && r.below(8) == 0 {
            let from = nodes[r.below(nodes.len() as u64 - 1) as usize].name.clone();
            let to = nodes.last().unwrap().name.clone();
            if from != to && !from.ends_with(".wait") {
                control.push((from, to));
            }
        }
        made[s].push(out.clone());
        last[s] = Some(out);
    }
    GraphSpec { sources, nodes, control, reuse: vec![], inputs: vec![], outputs: vec![] }
}

#[test]
fn random_graphs_give_valid_deterministic_schedules_within_budget() {
    for seed in 0..2000u64 {
        let g = Graph::new(random_graph(seed)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let budgets = Budgets::new(1 + (seed % 3) as u32, 1 + (seed % 2) as u32).unwrap();
        let s = sched::schedule(&g, budgets).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        validate(&g, &s).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", names(&g, &s)));
        // Checked here as well, independently of the validator.
        let mut seen = vec![false; g.len()];
        let mut in_flight = [0u32; 3];
        for &u in &s.order {
            assert!(!std::mem::replace(&mut seen[u.ix()], true), "seed {seed}: node issued twice");
            let nd = &g.nodes[u.ix()];
            if nd.kind.is_launch() {
                let st = if nd.kind == Kind::CommLaunch { 1 } else { 2 };
                in_flight[st] += 1;
                assert!(in_flight[st] <= if st == 1 { budgets.ep } else { budgets.page }, "seed {seed}: budget");
            }
            if nd.kind.is_wait() {
                let l = nd.partner.unwrap();
                assert!(seen[l.ix()], "seed {seed}: wait before its launch");
                in_flight[if g.nodes[l.ix()].kind == Kind::CommLaunch { 1 } else { 2 }] -= 1;
            }
        }
        assert!(seen.iter().all(|&x| x));
        assert_eq!(sched::drains_adding_waits(&g, &s), Vec::<String>::new(), "seed {seed}");
        // Minimal on every random graph too: dropping any one sync leaves a use uncovered.
        for i in 0..s.syncs.len() {
            let mut t = s.clone();
            t.syncs.remove(i);
            let e = validate(&g, &t).expect_err(&format!("seed {seed}: sync {i} of {} was redundant", s.syncs.len()));
            assert!(e.to_string().contains("no wait covering it"), "seed {seed}: {e}");
        }
        let again = sched::schedule(&g, budgets).unwrap();
        assert_eq!(serde_json::to_string(&s).unwrap(), serde_json::to_string(&again).unwrap(), "seed {seed}: not deterministic");
    }
}


#[test]
fn page_outs_and_page_ins_of_two_sources_interleave() {
    // F pages out four saved activations, B pages four back in; all ready at once.
    let mut nodes = Vec::new();
    let page = |name: &str, src: &str, kind: Kind, input: &str| {
        vec![
            NodeSpec {
                name: name.into(),
                source: src.into(),
                kind,
                wgrad: false,
                inputs: vec![input.into()],
                outputs: vec![OutputSpec::Name(format!("{name}.out"))],
                mutates: vec![],
                launch: None,
                cost: 1.0,
            },
            NodeSpec {
                name: format!("{name}.wait"),
                source: src.into(),
                kind: Kind::PageWait,
                wgrad: false,
                inputs: vec![],
                outputs: vec![],
                mutates: vec![],
                launch: Some(name.into()),
                cost: 0.0,
            },
        ]
    };
    for i in 0..4 {
        nodes.extend(page(&format!("F.out{i}"), "F1", Kind::PageOut, &format!("act{i}")));
    }
    for i in 0..4 {
        nodes.extend(page(&format!("B.in{i}"), "B0", Kind::PageIn, &format!("host{i}")));
    }
    let inputs = (0..4).flat_map(|i| [OutputSpec::Name(format!("act{i}")), OutputSpec::Name(format!("host{i}"))]).collect();
    let spec = GraphSpec {
        sources: vec![
            Source { name: "F1".into(), microbatch: 1, phase: Phase::F, priority: 0 },
            Source { name: "B0".into(), microbatch: 0, phase: Phase::B, priority: 0 },
        ],
        nodes,
        control: vec![],
        reuse: vec![],
        inputs,
        outputs: vec![],
    };
    let g = Graph::new(spec).unwrap();
    for budget in [1, 2] {
        let s = sched::schedule(&g, Budgets::new(2, budget).unwrap()).unwrap();
        validate(&g, &s).unwrap();
        let launches: Vec<&str> =
            s.order.iter().map(|&u| &g.nodes[u.ix()]).filter(|n| n.kind.is_launch()).map(|n| &n.name[..1]).collect();
        assert_eq!(launches.join(""), "FBFBFBFB", "page budget {budget}: {}", names(&g, &s));
    }
}

#[test]
fn launch_output_allocated_on_the_consumer_stream_needs_no_retire() {
    let text = |alloc: &str| {
        format!(
            r#"{{"sources": [{{"name": "F0", "phase": "F"}}], "inputs": ["x"], "nodes": [
            {{"name": "a", "source": "F0", "kind": "compute", "inputs": ["x"], "outputs": ["s"]}},
            {{"name": "d", "source": "F0", "kind": "comm_launch", "inputs": ["s"], "outputs": [{{"value": "r", "bytes": 8, "alloc": "{alloc}"}}]}},
            {{"name": "d.wait", "source": "F0", "kind": "comm_wait", "launch": "d"}},
            {{"name": "e", "source": "F0", "kind": "compute", "inputs": ["r"], "outputs": ["y"]}}]}}"#
        )
    };
    let retired = |alloc: &str| {
        let g = Graph::from_json(&text(alloc)).unwrap();
        let s = sched::schedule(&g, Budgets::default()).unwrap();
        validate(&g, &s).unwrap();
        s.retires.iter().map(|r| g.values[r.value.ix()].name.clone()).collect::<Vec<_>>()
    };
    // `s` crosses compute -> ep either way; `r` only when the ep stream owns it.
    assert_eq!(retired("producer"), ["s", "r"]);
    assert_eq!(retired("consumer"), ["s"]);
    let bad = text("consumer").replace(r#""outputs": ["s"]"#, r#""outputs": [{"value": "s", "alloc": "consumer"}]"#);
    let e = Graph::from_json(&bad).unwrap_err().to_string();
    assert!(e.contains("node 'a': only launch outputs"), "{e}");
}

#[test]
fn launch_enabling_compute_goes_before_unrelated_compute() {
    // One source: `other` (unrelated, first in the table) and `pre` (feeds a dispatch) are both
    // ready. The policy runs `pre` first so the dispatch launches early and runs under `other`;
    // without the preference, table order would run `other` first and leave it exposed.
    let text = r#"{"sources": [{"name": "F0", "phase": "F"}], "inputs": ["x", "y"], "nodes": [
        {"name": "other", "source": "F0", "kind": "compute", "inputs": ["y"], "outputs": ["o"]},
        {"name": "pre", "source": "F0", "kind": "compute", "inputs": ["x"], "outputs": ["p"]},
        {"name": "d", "source": "F0", "kind": "comm_launch", "inputs": ["p"], "outputs": ["q"]},
        {"name": "d.wait", "source": "F0", "kind": "comm_wait", "launch": "d"},
        {"name": "post", "source": "F0", "kind": "compute", "inputs": ["q", "o"], "outputs": ["z"]}]}"#;
    let g = Graph::from_json(text).unwrap();
    let s = sched::schedule(&g, Budgets::default()).unwrap();
    assert_eq!(names(&g, &s), "pre, d, other, d.wait, post");
    let ex = sched::explain(&g, &s);
    assert_eq!(ex[0].hidden_under, vec!["other".to_string()]);
}

/// Brute force: is every predecessor reachable from its consumer's start through stream order
/// and the given sync edges? (DFS per pair; no clocks.)
fn oracle_all_covered(g: &Graph, s: &Schedule) -> bool {
    let n = g.len();
    let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut last_on: std::collections::HashMap<String, usize> = Default::default();
    for &u in &s.order {
        let key = format!("{:?}", s.stream[u.ix()]);
        if let Some(&prev) = last_on.get(&key) {
            succ[prev].push(u.ix());
        }
        last_on.insert(key, u.ix());
    }
    for e in &s.syncs {
        succ[e.producer.ix()].push(e.consumer.ix());
    }
    let reaches = |from: usize, to: usize| {
        let mut stack = vec![from];
        let mut seen = vec![false; n];
        while let Some(v) = stack.pop() {
            if v == to {
                return true;
            }
            if !std::mem::replace(&mut seen[v], true) {
                stack.extend(succ[v].iter().copied());
            }
        }
        false
    };
    (0..n).all(|c| g.preds[c].iter().all(|&p| reaches(p.ix(), c)))
}

#[test]
fn validator_coverage_agrees_with_brute_force_reachability() {
    let (mut rejected, mut accepted) = (0, 0);
    for seed in 0..400u64 {
        let g = Graph::new(random_graph(seed)).unwrap();
        let s = sched::schedule(&g, Budgets::new(2, 2).unwrap()).unwrap();
        let mut r = Rng::new(seed ^ 77);
        let mut t = s.clone();
        t.syncs.retain(|_| r.below(3) != 0);
        let ours = validate(&g, &t).is_ok();
        assert_eq!(ours, oracle_all_covered(&g, &t), "seed {seed}: validator and brute force disagree");
        if ours { accepted += 1 } else { rejected += 1 }
    }
    assert!(rejected > 50 && accepted > 10, "{rejected} rejected, {accepted} accepted");
}

#[test]
fn family_ours_never_worse_than_backward_then_forward_or_serial() {
    use sched_lifetime::scenarios::family;
    for ratio in [0.25, 0.5, 1.0, 2.0] {
        for (name, spec) in family::members(ratio) {
            for budget in [1, 2, 4] {
                let r = family::row_with(&name, &spec, budget, false).unwrap(); // (search is not checked here)
                assert!(r.ours.0 <= r.b_then_f.0 && r.ours.0 <= r.serial.0, "{name} ratio {ratio} budget {budget}: {r:?}");
                assert_eq!(r.hazards, 0, "{name} ratio {ratio} budget {budget}: the race checker found hazards");
                // The balance issue's bar: within 1% of the Megatron-style layer pairing (at
                // its strongest: the shorter of both rule sets within a pair) where it exists.
                if let Some(p) = r.pairing {
                    assert!(r.ours.0 <= p.0 * 1.01, "{name} ratio {ratio} budget {budget}: ours {:?} pairing {p:?}", r.ours);
                }
            }
        }
    }
}

#[test]
fn validator_rejects_malformed_schedules_naming_what_is_wrong() {
    let g = Graph::new(moe::chunk(moe::Shape::moe(1, 1.0))).unwrap();
    let s = sched::schedule(&g, Budgets::default()).unwrap();
    let mut t = s.clone();
    t.order.pop();
    assert!(validate(&g, &t).unwrap_err().to_string().contains("schedule has"));
    let mut t = s.clone();
    t.stream.pop();
    assert!(validate(&g, &t).unwrap_err().to_string().contains("schedule has"));
    let mut t = s.clone();
    t.syncs[0].producer = sched_lifetime::ir::NodeId(9999);
    assert!(validate(&g, &t).unwrap_err().to_string().contains("not in the graph"));
    let mut t = s.clone();
    t.syncs[0].consumer = sched_lifetime::ir::NodeId(9999);
    assert!(validate(&g, &t).unwrap_err().to_string().contains("not in the graph"));
    // By names, as Python calls it.
    let names: Vec<String> = s.order.iter().map(|&u| g.nodes[u.ix()].name.clone()).collect();
    sched::validate_named(&g, &names, None, Budgets::default()).unwrap();
    let e = |o: &[String]| sched::validate_named(&g, o, None, Budgets::default()).unwrap_err().to_string();
    assert!(e(&names[1..]).contains("schedule has"));
    let mut dup = names.clone();
    dup[1] = dup[0].clone();
    assert!(e(&dup).contains("is issued twice"));
    let mut unknown = names.clone();
    unknown[0] = "F.nope".into();
    assert!(e(&unknown).contains("'F.nope', which is not in the graph"));
    let mut swapped = names.clone();
    swapped.reverse();
    assert!(e(&swapped).contains("before its predecessor"));
    assert_eq!(sched::order_by_names(&g, &names).unwrap(), s.order);
}

#[test]
fn across_sources_launch_enabling_compute_beats_weight_gradient_work() {
    // At the start nothing was launched (no yield owed): F's launch-enabling compute and B's
    // wgrad node are both ready; the enabling one goes first whatever the table order.
    let text = r#"{"sources": [{"name": "B0", "phase": "B"}, {"name": "F1", "phase": "F"}], "inputs": ["g", "x"], "nodes": [
        {"name": "B.dw", "source": "B0", "kind": "compute", "wgrad": true, "inputs": ["g"], "outputs": ["w"]},
        {"name": "F.pre", "source": "F1", "kind": "compute", "inputs": ["x"], "outputs": ["p"]},
        {"name": "F.d", "source": "F1", "kind": "comm_launch", "inputs": ["p"], "outputs": ["q"]},
        {"name": "F.d.wait", "source": "F1", "kind": "comm_wait", "launch": "F.d"},
        {"name": "F.post", "source": "F1", "kind": "compute", "inputs": ["q"], "outputs": ["z"]}]}"#;
    let g = Graph::from_json(text).unwrap();
    let s = sched::schedule(&g, Budgets::default()).unwrap();
    assert_eq!(names(&g, &s), "F.pre, F.d, B.dw, F.d.wait, F.post");
}

#[test]
fn noops_issue_as_soon_as_their_inputs_are_issued() {
    // Dense layers: the noop dispatch/combine follow their producer at once.
    let shape = moe::Shape { dense: 2, ..moe::Shape::moe(2, 1.0) };
    let g = Graph::new(moe::chunk(shape)).unwrap();
    let s = sched::schedule(&g, Budgets::default()).unwrap();
    for (i, &u) in s.order.iter().enumerate() {
        if g.nodes[u.ix()].kind != Kind::Noop {
            continue;
        }
        let last_pred = g.preds[u.ix()].iter().map(|&p| s.order.iter().position(|&x| x == p).unwrap()).max();
        // Right after its last predecessor (or the noops before it), or first of all.
        let ok = match last_pred {
            Some(p) => s.order[p + 1..i].iter().all(|&x| g.nodes[x.ix()].kind == Kind::Noop),
            None => s.order[..i].iter().all(|&x| g.nodes[x.ix()].kind == Kind::Noop),
        };
        assert!(ok, "noop '{}' waited: {}", g.nodes[u.ix()].name, names(&g, &s));
    }
}

/// The exhaustive search (issue 8's optimum) never loses to our order (it must find ours or
/// better: the same edges and budget rule), and finds strictly better orders on some seeds
/// (the greedy is not optimal; the gap is reported by `examples/sched_optimum`).
#[test]
fn exhaustive_optimum_is_never_worse_than_ours() {
    use sched_lifetime::scenarios::optimum;
    let mut better = 0;
    for seed in 0..12u64 {
        for ep in [1u32, 2] {
            let b = Budgets::new(ep, 2).unwrap();
            let (ours, best, orders) = optimum::compare(seed, 10, b, 200_000).unwrap().expect("small enough to search");
            assert!(orders > 0);
            assert!(best <= ours + 1e-6, "seed {seed} ep {ep}: optimum {best} > ours {ours}");
            better += usize::from(best < ours * 0.999);
        }
    }
    assert!(better > 0, "the search never beat the greedy: it would prove nothing");
}

/// Rule `ready_first` (default since its GPU A/B; `classic` turns it off): within a class,
/// compute that needs no wait goes before compute that would stall on a transfer. Both rule
/// sets keep every order valid and within budget, and the rule does what it says on a graph
/// where the two compete (the forward's next compute needs its transfer, the backward's needs
/// nothing).
#[test]
fn ready_first_rule_is_default_valid_and_prefers_compute_that_needs_no_wait() {
    use sched_lifetime::scenarios::optimum;
    use sched_lifetime::sched::Rules;
    assert_eq!(Rules::parse("").unwrap(), Rules::default());
    assert!(Rules::default().ready_first && Rules::parse("ready_first").unwrap().ready_first);
    assert_eq!(Rules::parse("classic").unwrap(), Rules::CLASSIC);
    assert!(Rules::parse("fastest").unwrap_err().to_string().contains("known rules: ready_first, classic"));
    for seed in 0..500u64 {
        let g = Graph::new(random_graph(seed)).unwrap();
        let budgets = Budgets::new(1 + (seed % 3) as u32, 1 + (seed % 2) as u32).unwrap();
        for rules in [Rules::default(), Rules::CLASSIC] {
            let s = sched::schedule_with(&g, budgets, rules).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            validate(&g, &s).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
        assert_eq!(sched::schedule_with(&g, budgets, Rules::default()).unwrap().order, sched::schedule(&g, budgets).unwrap().order);
    }
    // MoE-like seed 5: F1.n2 needs F1.n1's transfer; B0.n6 needs nothing.
    let g = Graph::new(optimum::small_random_moe(5, 14)).unwrap();
    let b = Budgets::new(1, 2).unwrap();
    let pos = |s: &Schedule, n: &str| s.order.iter().position(|&u| g.nodes[u.ix()].name == n).unwrap();
    let classic = sched::schedule_with(&g, b, Rules::CLASSIC).unwrap();
    let ready = sched::schedule(&g, b).unwrap();
    assert!(pos(&classic, "F1.n1.wait") < pos(&classic, "B0.n6"), "classic: the stalling candidate went first");
    assert!(pos(&ready, "B0.n6") < pos(&ready, "F1.n1.wait"), "ready_first: the ready candidate goes first");
}

#[test]
fn a_value_last_used_on_its_owner_after_a_cross_stream_use_retires_on_that_stream() {
    // router+shared: F.L0.a feeds the router, the dispatch (EP stream) and the shared expert
    // (compute, issued after the dispatch). Retiring on compute would release at once while the
    // dispatch may still read it; the plan event goes on the EP stream, drained where compute
    // has already waited on the dispatch.
    use sched_lifetime::ep::Role;
    use sched_lifetime::scenarios::family;
    let (_, spec) = family::members(0.25).into_iter().find(|(n, _)| n == "router+shared 2").unwrap();
    let g = Graph::new(family::build(&spec)).unwrap();
    let s = sched::schedule(&g, Budgets::default()).unwrap();
    let r = s.retires.iter().find(|r| g.values[r.value.ix()].name == "F.L0.a").expect("F.L0.a is retired");
    assert_eq!(g.nodes[r.last_consumer.ix()].name, "F.L0.shared");
    assert_eq!((r.owner, r.consumer_stream), (Role::Compute, Role::Ep));
    let drain = r.drain_before.expect("drained in the plan");
    assert!(pos(&g, &s, &g.nodes[drain.ix()].name) >= pos(&g, &s, "F.L0.dispatch.wait"));
    // Every retire whose last use is on the owner's stream names another stream.
    for r in &s.retires {
        assert_ne!(r.consumer_stream, r.owner, "{}", g.values[r.value.ix()].name);
    }
}

/// Rule `search` (cost-guided, issue 8): under its model (the simulator with EP launches waiting
/// for the compute issued before them) it is never worse than the default order (its first
/// candidate), strictly better on some seeds and within 5% of the exhaustive optimum (same
/// model) on most; every order valid and within budget; the same order twice;
/// without node costs the default order itself; plain `schedule_with` refuses it (no cost
/// model).
#[test]
fn search_rule_is_valid_deterministic_and_never_worse_than_the_default() {
    use sched_lifetime::scenarios::optimum;
    use sched_lifetime::sched::Rules;
    use sched_lifetime::sim;
    let search = Rules::parse("search").unwrap();
    let (mut better, mut near, mut total) = (0, 0, 0);
    for seed in 0..16u64 {
        for ep in [1u32, 2] {
            let b = Budgets::new(ep, 2).unwrap();
            let spec = if seed % 2 == 0 { optimum::small_random_moe(seed, 10) } else { optimum::small_random(seed, 10) };
            let g = Graph::new(spec.clone()).unwrap();
            let s = sim::schedule(&g, b, search).unwrap();
            validate(&g, &s).unwrap_or_else(|e| panic!("seed {seed} ep {ep}: {e}"));
            assert_eq!(sim::schedule(&g, b, search).unwrap().order, s.order, "seed {seed}: not deterministic");
            let d = sched::schedule(&g, b).unwrap();
            // Rated by search's own model (EP launches wait for the compute issued before them).
            let (ms, md) = (sim::makespan_launch_waits(&g, &s.order).unwrap(), sim::makespan_launch_waits(&g, &d.order).unwrap());
            assert!(ms <= md, "seed {seed} ep {ep}: search {ms} > default {md}");
            better += usize::from(ms < md * 0.999);
            let best = optimum::exhaustive_launch_waits(&g, b, 200_000).unwrap().expect("small").makespan_us;
            total += 1;
            near += usize::from(ms <= best * 1.05);
            let mut zero = spec;
            for n in &mut zero.nodes {
                n.cost = 0.0;
            }
            let gz = Graph::new(zero).unwrap();
            assert_eq!(sim::schedule(&gz, b, search).unwrap().order, sched::schedule(&gz, b).unwrap().order, "seed {seed}: no costs");
        }
    }
    assert!(better > 0, "search never beat the default: it would prove nothing");
    assert!(near * 10 >= total * 9, "search within 5% of the optimum on {near} of {total} seeds");
    let g = Graph::new(optimum::small_random_moe(0, 10)).unwrap();
    let e = sched::schedule_with(&g, Budgets::new(1, 2).unwrap(), search).unwrap_err().to_string();
    assert!(e.contains("needs a cost model"), "{e}");
}

/// The search's local moves with an injected cost model: rating an order by how late one
/// node comes, the search moves that node as early as the edges and budgets allow (right
/// after its predecessor's chain), and never past a budget.
#[test]
fn search_moves_nodes_where_the_cost_model_wants_them_within_edges_and_budgets() {
    use sched_lifetime::scenarios::optimum;
    use sched_lifetime::sched::Rules;
    let g = Graph::new(optimum::small_random_moe(3, 14)).unwrap();
    let b = Budgets::new(1, 2).unwrap();
    let target = g.node_ids().rev().find(|&u| g.nodes[u].kind == Kind::Compute && g.nodes[u].source.ix() == 1).unwrap();
    let pos = |o: &[sched_lifetime::ir::NodeId]| o.iter().position(|&u| u == target).unwrap();
    let cost = |o: &[sched_lifetime::ir::NodeId]| Ok(pos(o) as f64);
    let s = sched::schedule_searched(&g, b, Rules::default(), 2000, &cost).unwrap();
    validate(&g, &s).unwrap();
    // Its earliest possible place: after all its ancestors.
    let mut anc = std::collections::HashSet::new();
    let mut stack = vec![target];
    while let Some(u) = stack.pop() {
        for &p in &g.preds[u] {
            if anc.insert(p) {
                stack.push(p);
            }
        }
    }
    assert_eq!(pos(&s.order), anc.len(), "{:?}", s.order.iter().map(|&u| g.nodes[u].name.clone()).collect::<Vec<_>>());
    let d = sched::schedule(&g, b).unwrap();
    assert!(pos(&d.order) > anc.len(), "the default already placed it first: the test would prove nothing");
}

/// The opt-in cost rules the search starts from do what they say: `soonest_launch` issues
/// first the launch-enabling compute closest (in compute time) to its launch, `reverse_sources`
/// lets the later source go first between sources of equal priority, `critical_path` puts the
/// longest remaining path first; every variant valid.
#[test]
fn cost_rules_order_by_distance_to_launch_source_and_critical_path() {
    use sched_lifetime::scenarios::optimum;
    use sched_lifetime::sched::Rules;
    // Random seed 1: B0.n6 (149 us) enables B0.n7's launch; F1.n0 + F1.n1 (812 + 777 us)
    // enable F1.n2's.
    let g = Graph::new(optimum::small_random(1, 14)).unwrap();
    let b = Budgets::new(2, 2).unwrap();
    let first = |rules: &str| {
        let s = sched::schedule_with(&g, b, Rules::parse(rules).unwrap()).unwrap();
        validate(&g, &s).unwrap();
        g.nodes[s.order[0].ix()].name.clone()
    };
    assert_eq!(first(""), "F1.n0");
    assert_eq!(first("soonest_launch"), "B0.n6");
    assert_eq!(first("reverse_sources"), "B0.n6");
    assert_eq!(first("soonest_launch,reverse_sources"), "B0.n6");
    // Longest path first: seed 25's backward chain is the longer one, so its head goes first
    // (the default, timing-free, starts with the forward's by table order).
    let g25 = Graph::new(optimum::small_random(25, 14)).unwrap();
    let first25 = |rules: &str| g25.nodes[sched::schedule_with(&g25, b, Rules::parse(rules).unwrap()).unwrap().order[0].ix()].name.clone();
    assert_eq!((first25(""), first25("critical_path"), first25("soonest_launch")), ("F1.n0".into(), "B0.n5".into(), "F1.n0".into()));
    for seed in 0..200u64 {
        let g = Graph::new(random_graph(seed)).unwrap();
        let budgets = Budgets::new(1 + (seed % 3) as u32, 1 + (seed % 2) as u32).unwrap();
        for rules in ["soonest_launch", "critical_path", "reverse_sources", "classic,soonest_launch,critical_path,reverse_sources"] {
            let s = sched::schedule_with(&g, budgets, Rules::parse(rules).unwrap()).unwrap_or_else(|e| panic!("seed {seed} {rules}: {e}"));
            validate(&g, &s).unwrap_or_else(|e| panic!("seed {seed} {rules}: {e}"));
        }
    }
}

/// Issue 31: once no move within the window helps, the search tries the same moves anywhere in
/// the order. On a graph longer than four windows (the family's F4_with_B2 at comm/compute 1.0,
/// 42 nodes) a source's tail must move past more than a window of the other's nodes: the
/// windowed moves alone stopped at 8703 us (SIMULATED), the whole-order pass reaches 8403 (a
/// lower bound is 8000: the critical path).
#[test]
fn search_moves_past_the_window_on_graphs_longer_than_four_windows() {
    use sched_lifetime::scenarios::family;
    use sched_lifetime::sched::Rules;
    use sched_lifetime::sim;
    let g = Graph::new(family::build(&family::member("F4_with_B2", 1.0).unwrap())).unwrap();
    assert!(g.len() > 32, "{} nodes: the whole order is the window, the test would prove nothing", g.len());
    let b = Budgets::new(1, 2).unwrap();
    let s = sim::schedule(&g, b, Rules::parse("search").unwrap()).unwrap();
    validate(&g, &s).unwrap();
    let ms = sim::makespan(&g, &s.order).unwrap();
    assert!(ms < 8500.0, "search {ms} us: the windowed moves alone give 8703");
}

/// Compute nodes issued between the point an EP launch could go (its inputs and the previous EP
/// launch issued) and the launch itself, over every EP launch of the order.
fn compute_before_ready_launches(g: &Graph, s: &Schedule) -> usize {
    let at: Vec<usize> = {
        let mut at = vec![0; g.len()];
        for (i, &u) in s.order.iter().enumerate() {
            at[u.ix()] = i;
        }
        at
    };
    let mut prev: Option<usize> = None;
    let mut gap = 0;
    for (i, &u) in s.order.iter().enumerate() {
        if g.nodes[u.ix()].kind != Kind::CommLaunch {
            continue;
        }
        let from = g.preds[u].iter().map(|p| at[p.ix()]).chain(prev).max().map_or(0, |r| r + 1);
        gap += s.order[from..i].iter().filter(|v| g.nodes[v.ix()].kind == Kind::Compute).count();
        prev = Some(i);
    }
    gap
}

/// Rule `launch_first` (opt-in, issue 28): a ready EP launch that only its stream's budget holds
/// back gets the budget's wait at once and goes next, before more compute (on the GPU a launch
/// waits for every compute kernel issued before it). Valid and within budget on random graphs;
/// on MoE chunks with EP budget 1 no compute is issued between the point an EP launch could go
/// and the launch, where the default order issues weight-gradient filler there. It is a
/// trade (the compute stream waits for the previous transfer sooner), so it is opt-in and a seed
/// of rule `search`, whose model has that wait: searched orders are never worse than it there.
#[test]
fn launch_first_rule_issues_budget_blocked_launches_before_more_compute() {
    use sched_lifetime::sched::Rules;
    use sched_lifetime::sim;
    let lf = Rules::parse("launch_first").unwrap();
    assert!(lf.launch_first && lf.ready_first && !Rules::default().launch_first);
    for seed in 0..500u64 {
        let g = Graph::new(random_graph(seed)).unwrap();
        let budgets = Budgets::new(1 + (seed % 3) as u32, 1 + (seed % 2) as u32).unwrap();
        let s = sched::schedule_with(&g, budgets, lf).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        validate(&g, &s).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    let b = Budgets::new(1, 2).unwrap();
    for layers in [1, 2, 4] {
        let g = Graph::new(moe::chunk(moe::Shape::moe(layers, 1.0))).unwrap();
        let ours = sched::schedule(&g, b).unwrap();
        let first = sched::schedule_with(&g, b, lf).unwrap();
        validate(&g, &first).unwrap();
        assert_eq!(compute_before_ready_launches(&g, &first), 0, "{layers} layers: {}", names(&g, &first));
        assert!(compute_before_ready_launches(&g, &ours) > 0, "{layers} layers: the default issues no filler there: the test proves nothing");
        let searched = sim::schedule(&g, b, Rules::parse("search").unwrap()).unwrap();
        let t = |s: &Schedule| sim::makespan_launch_waits(&g, &s.order).unwrap();
        eprintln!("{layers} layers (SIMULATED, launch waits): ours {} launch_first {} search {}", t(&ours), t(&first), t(&searched));
        assert!(t(&searched) <= t(&first).min(t(&ours)) + 1e-6, "{layers} layers: search is seeded with both");
    }
}

/// Rule `launch_first` never moves a wait above what it waits for: on random graphs whose waits
/// also wait (control edges) for compute of another source, every order stays valid (a wait the
/// budget needs moves up with a launch only once its own predecessors are placed).
#[test]
fn launch_first_keeps_a_budget_wait_behind_its_own_predecessors() {
    use sched_lifetime::sched::Rules;
    let lf = Rules::parse("launch_first").unwrap();
    let mut moved = 0;
    for seed in 0..500u64 {
        let mut spec = random_graph(seed);
        let mut r = Rng::new(seed ^ 0x5eed);
        for i in 0..spec.nodes.len() {
            let nd = &spec.nodes[i];
            if nd.kind != Kind::CommWait {
                continue;
            }
            let others: Vec<String> =
                spec.nodes[..i].iter().filter(|n| n.kind == Kind::Compute && n.source != nd.source).map(|n| n.name.clone()).collect();
            if !others.is_empty() && r.below(2) == 0 {
                let x = others[r.below(others.len() as u64) as usize].clone();
                spec.control.push((x, nd.name.clone()));
            }
        }
        let g = Graph::new(spec).unwrap();
        let budgets = Budgets::new(1 + (seed % 3) as u32, 1 + (seed % 2) as u32).unwrap();
        let s = sched::schedule_with(&g, budgets, lf).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        validate(&g, &s).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", names(&g, &s)));
        moved += usize::from(s.order != sched::schedule(&g, budgets).unwrap().order);
    }
    assert!(moved > 0, "launch_first moved nothing on these graphs: the test would prove nothing");
}
