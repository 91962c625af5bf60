//! Seeded fuzzing, bounded in time (CI runs it): mutated graph tables and simulator programs
//! through the decoders, the scheduler, the validator, the lowering and the simulator. No
//! input may panic; every graph the decoder accepts must get a schedule the validator accepts
//! (or a clear error), and its lowered program must simulate without a hazard. The corpus
//! (`tests/fuzz_corpus/*.json`) holds seeds; generated scenarios are added to it at run time.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use sched_lifetime::ep::Budgets;
use sched_lifetime::ir::Graph;
use sched_lifetime::scenarios::{self, moe, Rng};
use sched_lifetime::sched;
use sched_lifetime::sim::{self, Policy, Program, SimOptions};
use serde_json::Value;

const BUDGET: Duration = Duration::from_secs(4);

fn corpus(prefix: &str) -> Vec<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz_corpus");
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// One structural mutation of a JSON value.
fn mutate_value(v: &mut Value, r: &mut Rng) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = &keys[r.below(keys.len() as u64) as usize];
            match r.below(4) {
                0 => {
                    m.remove(k);
                }
                1 => {
                    m.insert(k.clone(), [Value::Null, Value::from(-1), Value::from(u64::MAX), Value::from("x"), Value::from(1e308)][r.below(5) as usize].clone());
                }
                _ => mutate_value(m.get_mut(k).expect("key"), r),
            }
        }
        Value::Array(a) if !a.is_empty() => {
            let i = r.below(a.len() as u64) as usize;
            match r.below(4) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let dup = a[i].clone();
                    a.push(dup);
                }
                2 => {
                    let j = r.below(a.len() as u64) as usize;
                    a.swap(i, j)
                }
                _ => mutate_value(&mut a[i], r),
            }
        }
        Value::String(s) => {
            *s = match r.below(3) {
                0 => String::new(),
                1 => format!("{s}{}", r.below(3)),
                _ => "F.L0.attn".into(),
            }
        }
        Value::Number(_) => *v = [Value::from(0), Value::from(-3), Value::from(f64::MAX), Value::from(7)][r.below(4) as usize].clone(),
        _ => {}
    }
}

/// A byte-level mutation of the text (flips, cuts, inserts).
fn mutate_text(t: &str, r: &mut Rng) -> String {
    let mut b = t.as_bytes().to_vec();
    if b.is_empty() {
        return "{".into();
    }
    let i = r.below(b.len() as u64) as usize;
    match r.below(3) {
        0 => {
            let set = b"{}[],:\"0a-";
            b[i] = set[r.below(set.len() as u64) as usize]
        }
        1 => b.truncate(i),
        _ => {
            let set = b"{}[],:\"0";
            b.insert(i, set[r.below(set.len() as u64) as usize])
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

fn check_graph_text(text: &str, r: &mut Rng) {
    let Ok(g) = Graph::from_json(text) else { return };
    let budgets = Budgets::new(1 + r.below(4) as u32, 1 + r.below(4) as u32).expect("valid budgets");
    let Ok(s) = sched::schedule(&g, budgets) else { return };
    if let Err(e) = sched::validate(&g, &s) {
        panic!("accepted graph, schedule rejected by the validator: {e}\n{text}");
    }
    if let Ok(p) = Program::new(sim::lower(&g, &s.order, false)) {
        if let Ok(rep) = sim::simulate(&p, SimOptions::new(Policy::Scheduled)) {
            assert!(rep.hazards.is_empty(), "lowered schedule hazard {:?}\n{text}", rep.hazards[0]);
        }
    }
}

fn check_program_text(text: &str) {
    if let Ok(p) = Program::from_json(text) {
        for policy in [Policy::Scheduled, Policy::RecordStream] {
            if let Ok(rep) = sim::simulate(&p, SimOptions::new(policy)) {
                assert!(rep.hazards.is_empty(), "{policy:?} hazard {:?}\n{text}", rep.hazards[0]);
            }
        }
    }
}

fn fuzz(seeds: Vec<String>, check: impl Fn(&str, &mut Rng)) -> u64 {
    let start = Instant::now();
    let mut r = Rng::new(0x5eed);
    let mut n = 0u64;
    while start.elapsed() < BUDGET {
        let base = &seeds[r.below(seeds.len() as u64) as usize];
        let text = if r.below(2) == 0 {
            mutate_text(base, &mut r)
        } else {
            let mut v: Value = serde_json::from_str(base).expect("seed is JSON");
            for _ in 0..1 + r.below(3) {
                mutate_value(&mut v, &mut r);
            }
            v.to_string()
        };
        let out = catch_unwind(AssertUnwindSafe(|| check(&text, &mut r)));
        if let Err(p) = out {
            let msg = p.downcast_ref::<String>().cloned().or(p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            panic!("input {n} panicked: {msg}\ninput: {text}");
        }
        n += 1;
    }
    n
}

#[test]
fn graphs_never_panic_and_accepted_ones_schedule_validly() {
    let mut seeds = corpus("graph");
    for (l, ratio) in [(1, 1.0), (2, 0.5)] {
        seeds.push(serde_json::to_string(&moe::chunk(moe::Shape::moe(l, ratio))).expect("json"));
    }
    seeds.push(serde_json::to_string(&moe::chunk(moe::Shape { dense: 1, mtp: true, ..moe::Shape::moe(2, 1.0) })).expect("json"));
    let n = fuzz(seeds, check_graph_text);
    println!("graph fuzz: {n} inputs");
    assert!(n > 100);
}

#[test]
fn programs_never_panic_or_hazard() {
    let mut seeds = corpus("program");
    for seed in [3, 11, 29] {
        seeds.push(serde_json::to_string(&scenarios::random_program(seed)).expect("json"));
        seeds.push(serde_json::to_string(&scenarios::random_program_wide(seed)).expect("json"));
    }
    let n = fuzz(seeds, |t, _| check_program_text(t));
    println!("program fuzz: {n} inputs");
    assert!(n > 100);
}
