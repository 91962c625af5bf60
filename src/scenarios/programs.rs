//! Simulator programs built in Rust: the Megatron hero case, the lagging pipeline of the GPU
//! A/B, seeded random programs for property tests, and large chains for benchmarks.

use super::Rng;
use crate::sim::program::{InputSpec, NodeSpec, OutputSpec, ProgramSpec, StreamSpec};
use crate::sim::Engine;

const MIB: u64 = 1 << 20;

fn streams(names: &[(&str, Engine)]) -> Vec<StreamSpec> {
    names.iter().map(|(n, e)| StreamSpec { name: n.to_string(), engine: *e }).collect()
}

fn node(name: String, plan: &str, stream: &str, us: f64, inputs: Vec<String>, outputs: Vec<(String, u64)>) -> NodeSpec {
    NodeSpec {
        name,
        plan: Some(plan.to_string()),
        stream: stream.to_string(),
        us,
        inputs,
        outputs: outputs.into_iter().map(|(value, bytes)| OutputSpec { value, bytes }).collect(),
        action: None,
        host_sync: false,
        acquire: Vec::new(),
    }
}

/// The hero case of Megatron-LM PR "schedule-aware cross-stream tensor lifetime" (seed 000):
/// DeepSeek-V3 width, 14 layers (3 dense + 11 MoE), 16 microbatches per step, dispatch and
/// grouped-GEMM (FC2) outputs of ~1.32 GiB, the comm stream lagging the host by more than a
/// node. Forward chunks only; the host syncs once per microbatch (the loss), so it runs at
/// most one microbatch ahead. Durations are illustrative, not measured.
pub fn megatron_hero(microbatches: usize) -> ProgramSpec {
    let big = 1352 * MIB; // ~1.32 GiB
    let act = 168 * MIB; // hidden 7168 x seq 6144 x mbs 2 x bf16
    let mut nodes = Vec::new();
    let mut inputs = Vec::new();
    for mb in 0..microbatches {
        let p = format!("F{mb}");
        let mut h = format!("{p}.x");
        inputs.push(InputSpec { value: h.clone(), bytes: act, stream: "compute".into() });
        for l in 0..14 {
            let pre = format!("{p}.L{l}");
            let a = format!("{pre}.attn_out");
            nodes.push(node(format!("{pre}.attn"), &p, "compute", 900.0, vec![h.clone()], vec![(a.clone(), act)]));
            let out = format!("{pre}.out");
            if l < 3 {
                nodes.push(node(format!("{pre}.mlp"), &p, "compute", 700.0, vec![a], vec![(out.clone(), act)]));
            } else {
                let d = format!("{pre}.dispatched");
                let f = format!("{pre}.fc2_out");
                nodes.push(node(format!("{pre}.dispatch"), &p, "comm", 1100.0, vec![a], vec![(d.clone(), big)]));
                nodes.push(node(format!("{pre}.experts"), &p, "compute", 1000.0, vec![d], vec![(f.clone(), big)]));
                nodes.push(node(format!("{pre}.combine"), &p, "comm", 1100.0, vec![f], vec![(out.clone(), act)]));
            }
            h = out;
        }
        let mut loss = node(format!("{p}.loss"), &p, "compute", 200.0, vec![h], vec![(format!("{p}.loss"), 4)]);
        loss.host_sync = true;
        nodes.push(loss);
    }
    ProgramSpec {
        streams: streams(&[("compute", Engine::Compute), ("comm", Engine::Comm)]),
        inputs,
        nodes,
        host_us_per_op: Some(5.0),
        sm_contention: Some(0.0),
        max_queued: None,
        explicit_acquire: false,
    }
}

/// The GPU A/B's pipeline (`python -m sched_lifetime ab`): per step, `n` tensors of `mib` MiB
/// made on the compute stream and read by a consumer on a second stream that sleeps `lag_us`.
pub fn lagging_pipeline(n: usize, mib: u64, lag_us: f64, steps: usize) -> ProgramSpec {
    let mut nodes = Vec::new();
    for step in 0..steps {
        let p = format!("step{step}");
        for i in 0..n {
            let x = format!("{p}.x{i}");
            nodes.push(node(format!("{p}.produce{i}"), &p, "A", 30.0, vec![], vec![(x.clone(), mib * MIB)]));
            nodes.push(node(format!("{p}.consume{i}"), &p, "B", lag_us, vec![x], vec![(format!("{p}.sum{i}"), 8)]));
        }
        let mut sync = node(format!("{p}.sync"), &p, "A", 1.0, vec![], vec![]);
        sync.host_sync = true;
        nodes.push(sync);
        let mut sync_b = node(format!("{p}.sync_b"), &p, "B", 1.0, vec![], vec![]);
        sync_b.host_sync = true;
        nodes.push(sync_b);
    }
    ProgramSpec {
        streams: streams(&[("A", Engine::Compute), ("B", Engine::Compute)]),
        inputs: vec![],
        nodes,
        host_us_per_op: Some(5.0),
        sm_contention: None,
        max_queued: None,
        explicit_acquire: false,
    }
}

/// A random program: 2-4 microbatches, 2-3 streams, chains of 3-12 nodes each, some values read
/// twice, durations with random lags, sizes from a small set (so blocks get reused), nodes of
/// different microbatches interleaved at random, a few host syncs.
pub fn random_program(seed: u64) -> ProgramSpec {
    let mut r = Rng::new(seed);
    let n_streams = 2 + r.below(2) as usize;
    let names = ["s0", "s1", "s2"];
    let engines = [Engine::Compute, Engine::Comm, Engine::Compute];
    let mbs = 2 + r.below(3) as usize;
    let mut chains: Vec<Vec<NodeSpec>> = Vec::new();
    for mb in 0..mbs {
        let p = format!("mb{mb}");
        let len = 3 + r.below(10) as usize;
        let mut live: Vec<String> = Vec::new();
        let mut chain = Vec::new();
        for k in 0..len {
            let stream = names[r.below(n_streams as u64) as usize];
            let mut ins = Vec::new();
            if let Some(last) = live.last() {
                ins.push(last.clone());
            }
            if live.len() > 1 && r.below(3) == 0 {
                let other = live[r.below(live.len() as u64 - 1) as usize].clone();
                if !ins.contains(&other) {
                    ins.push(other);
                }
            }
            let us = if r.below(4) == 0 { 200.0 + r.below(2000) as f64 } else { 1.0 + r.below(100) as f64 };
            let bytes = [1, 2, 3, 4, 8][r.below(5) as usize] * MIB + r.below(4) * 512;
            let out = format!("{p}.v{k}");
            let mut n = node(format!("{p}.n{k}"), &p, stream, us, ins, vec![(out.clone(), bytes)]);
            n.host_sync = r.below(20) == 0;
            if r.below(6) == 0 {
                n.action = Some("drop_reference".into());
            }
            chain.push(n);
            live.push(out);
        }
        chains.push(chain);
    }
    // Interleave the chains, keeping each chain's order.
    let mut nodes = Vec::new();
    let mut idx = vec![0usize; mbs];
    loop {
        let open: Vec<usize> = (0..mbs).filter(|&c| idx[c] < chains[c].len()).collect();
        if open.is_empty() {
            break;
        }
        let c = open[r.below(open.len() as u64) as usize];
        nodes.push(chains[c][idx[c]].clone());
        idx[c] += 1;
    }
    ProgramSpec {
        streams: (0..n_streams).map(|i| StreamSpec { name: names[i].into(), engine: engines[i] }).collect(),
        inputs: vec![],
        nodes,
        host_us_per_op: Some([0.5, 2.0, 5.0][r.below(3) as usize]),
        sm_contention: Some(0.0),
        max_queued: Some([4, 1024][r.below(2) as usize]),
        explicit_acquire: false,
    }
}

/// A long two-source plan for benchmarks: `nodes` nodes in chunks alternating two streams,
/// two microbatches interleaved.
pub fn chain(nodes: usize) -> ProgramSpec {
    let mut out = Vec::with_capacity(nodes);
    let mut prev = [String::new(), String::new()];
    for i in 0..nodes {
        let mb = i % 2;
        let p = if mb == 0 { "F" } else { "B" };
        let stream = if (i / 2) % 3 == 1 { "comm" } else { "compute" };
        let v = format!("{p}{i}");
        let ins = if prev[mb].is_empty() { vec![] } else { vec![prev[mb].clone()] };
        out.push(node(format!("n{i}"), p, stream, 10.0 + (i % 7) as f64, ins, vec![(v.clone(), (1 + (i % 4) as u64) * MIB)]));
        prev[mb] = v;
    }
    ProgramSpec {
        streams: streams(&[("compute", Engine::Compute), ("comm", Engine::Comm)]),
        inputs: vec![],
        nodes: out,
        host_us_per_op: Some(1.0),
        sm_contention: Some(0.1),
        max_queued: None,
        explicit_acquire: false,
    }
}


/// A random program that also exercises what [`random_program`] leaves out: explicit drain
/// points (`explicit_acquire`, random nodes draining random plans), external inputs (unbound:
/// the record_stream fallback) read on several streams, and side readers: nodes that read an
/// older value of their plan on a random stream, unordered with the rest of the chain.
pub fn random_program_wide(seed: u64) -> ProgramSpec {
    let mut p = random_program(seed);
    let mut r = Rng::new(seed ^ 0xA5A5_5A5A_0F0F_F0F0);
    let streams: Vec<String> = p.streams.iter().map(|s| s.name.clone()).collect();
    let pick = |r: &mut Rng, v: &[String]| v[r.below(v.len() as u64) as usize].clone();
    let plans: Vec<String> = {
        let mut v: Vec<String> = p.nodes.iter().filter_map(|n| n.plan.clone()).collect();
        v.sort();
        v.dedup();
        v
    };
    let externals: Vec<String> = (0..1 + r.below(3)).map(|k| format!("ext{k}")).collect();
    for (k, e) in externals.iter().enumerate() {
        p.inputs.push(InputSpec { value: e.clone(), bytes: (1 + k as u64) * MIB, stream: streams[0].clone() });
    }
    let mut out: Vec<NodeSpec> = Vec::with_capacity(p.nodes.len() * 2);
    let mut produced: Vec<(String, String)> = Vec::new(); // (plan, value)
    for (i, mut n) in std::mem::take(&mut p.nodes).into_iter().enumerate() {
        if r.below(4) == 0 {
            n.inputs.push(pick(&mut r, &externals));
        }
        if r.below(3) == 0 {
            n.acquire.push(pick(&mut r, &plans));
        }
        let plan = n.plan.clone().unwrap_or_default();
        for o in &n.outputs {
            produced.push((plan.clone(), o.value.clone()));
        }
        out.push(n);
        let own: Vec<&(String, String)> = produced.iter().filter(|(pl, _)| *pl == plan).collect();
        if own.len() > 1 && r.below(3) == 0 {
            let v = own[r.below(own.len() as u64) as usize].1.clone();
            let us = 1.0 + r.below(1500) as f64;
            let side = format!("{plan}.side{i}");
            out.push(node(side.clone(), &plan, &pick(&mut r, &streams), us, vec![v], vec![(format!("{side}.out"), 8)]));
        }
    }
    p.nodes = out;
    p.explicit_acquire = true;
    p
}
