//! Property tests over 10,000 seeded random plans (2-4 microbatches, 2-3 streams, random lags).
//! The race checker is compared against a brute-force oracle over the machine's full
//! allocation/use log, so "caught in every seed that can expose it" is checked, not assumed.

use std::collections::BTreeSet;

use sched_lifetime::scenarios;
use sched_lifetime::sim::{self, Machine, Program, Policy, SimOptions};

const SEEDS: u64 = 10_000;

/// Every (old value, new value) pair where a block was reused by `new` while a use of `old`
/// had not completed: O(n^2) over the log, no pruning, no incremental state.
fn oracle(m: &Machine) -> BTreeSet<(u32, u32)> {
    let log = &m.log;
    let mut out = BTreeSet::new();
    for &(a, a_addr, a_size, _, a_free) in &log.allocs {
        if a_free == u64::MAX {
            continue;
        }
        let a_end = log.uses.iter().filter(|u| u.0 == a).map(|u| u.4).fold(f64::MIN, f64::max);
        for &(b, b_addr, b_size, b_alloc, _) in &log.allocs {
            let overlap = a_addr < b_addr + b_size && b_addr < a_addr + a_size;
            if b == a || !overlap || b_alloc < a_free {
                continue;
            }
            if log.uses.iter().any(|u| u.0 == b && u.3 < a_end) {
                out.insert((a, b));
            }
        }
    }
    out
}

fn run(seed: u64, policy: Policy) -> (sim::Report, Machine) {
    let plan = Program::new(scenarios::random_program(seed)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    sim::run(&plan, SimOptions { log: true, ..SimOptions::new(policy) }).unwrap_or_else(|e| panic!("seed {seed} {policy:?}: {e}"))
}

fn checker(m: &Machine) -> BTreeSet<(u32, u32)> {
    m.hazards.iter().map(|h| (h.old_value, h.new_value)).collect()
}

#[test]
fn scheduled_never_hazards_record_stream_never_hazards_and_pends_more() {
    let mut unusable_ge = 0;
    for seed in 0..SEEDS {
        let (sc, msc) = run(seed, Policy::Scheduled);
        let (rs, mrs) = run(seed, Policy::RecordStream);
        assert!(sc.hazards.is_empty(), "seed {seed}: scheduled hazard {:?}", sc.hazards[0]);
        assert!(oracle(&msc).is_empty(), "seed {seed}: oracle finds a scheduled hazard");
        assert!(rs.hazards.is_empty(), "seed {seed}: record_stream hazard {:?}", rs.hazards[0]);
        assert!(oracle(&mrs).is_empty(), "seed {seed}: oracle finds a record_stream hazard");
        assert!(
            rs.pending_free_peak.bytes >= sc.pending_free_peak.bytes,
            "seed {seed}: record_stream pending-free peak {} < scheduled {}",
            rs.pending_free_peak.bytes,
            sc.pending_free_peak.bytes
        );
        unusable_ge += (rs.unusable_peak.bytes >= sc.unusable_peak.bytes) as u32;
    }
    println!("record_stream pending >= scheduled pending+parked in {unusable_ge}/{SEEDS} seeds");
}

#[test]
fn broken_rule1_is_caught_in_every_seed_that_can_expose_it() {
    let mut exposed = 0;
    for seed in 0..SEEDS {
        let (_, m) = run(seed, Policy::BrokenRule1);
        let want = oracle(&m);
        let got = checker(&m);
        assert_eq!(got, want, "seed {seed}: checker and oracle disagree");
        exposed += !want.is_empty() as u32;
    }
    println!("rule 1 broken: {exposed}/{SEEDS} seeds expose a hazard, all caught");
    assert!(exposed as u64 > SEEDS / 10, "too few exposing seeds ({exposed}): the generator lost its lags");
}

#[test]
fn simulation_is_deterministic() {
    for seed in [1, 99, 4242] {
        let a = serde_json::to_string(&run(seed, Policy::Scheduled).0).unwrap();
        let b = serde_json::to_string(&run(seed, Policy::Scheduled).0).unwrap();
        assert_eq!(a, b);
    }
}

fn run_wide(seed: u64, policy: Policy) -> (sim::Report, Machine) {
    let plan = Program::new(scenarios::random_program_wide(seed)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    sim::run(&plan, SimOptions { log: true, ..SimOptions::new(policy) }).unwrap_or_else(|e| panic!("seed {seed} {policy:?}: {e}"))
}

#[test]
fn wide_programs_explicit_drains_external_inputs_side_readers_never_hazard() {
    const WIDE: u64 = 3_000;
    let (mut exposed, mut fallbacks, mut sides) = (0, 0, 0);
    for seed in 0..WIDE {
        for policy in [Policy::Scheduled, Policy::RecordStream] {
            let (r, m) = run_wide(seed, policy);
            assert!(r.hazards.is_empty(), "seed {seed} {policy:?}: hazard {:?}", r.hazards[0]);
            assert!(oracle(&m).is_empty(), "seed {seed} {policy:?}: oracle finds a hazard");
            if policy == Policy::Scheduled {
                fallbacks += (r.fallback_record_stream > 0) as u32;
            }
        }
        let (_, m) = run_wide(seed, Policy::BrokenRule1);
        let want = oracle(&m);
        assert_eq!(checker(&m), want, "seed {seed}: checker and oracle disagree");
        exposed += !want.is_empty() as u32;
        sides += scenarios::random_program_wide(seed).nodes.iter().any(|n| n.name.contains(".side")) as u32;
    }
    println!("wide: rule 1 broken exposes {exposed}/{WIDE}; fallbacks in {fallbacks}; side readers in {sides}");
    assert!(exposed as u64 > WIDE / 10 && fallbacks as u64 > WIDE / 2 && sides as u64 > WIDE / 2, "generator lost its coverage");
}
