//! Prints the SIMULATED family sweep (issue 8): makespan ms (exposed comm ms) of serial,
//! backward-then-forward, Megatron-style layer pairing and ours, over MoE shapes beyond the
//! symmetric chunk, and ours under rule `search` (cost-guided).
//! `cargo run --release --example sched_family`
use sched_lifetime::scenarios::family;

fn main() {
    println!("SIMULATED. makespan ms (exposed comm ms); bound = max(total compute, total comm); EP budget b.");
    println!(
        "{:<18} {:>5} {:>2} {:>7} {:>14} {:>14} {:>14} {:>14} {:>8} {:>9} {:>14} {:>14} {:>9}",
        "shape", "ratio", "b", "bound", "serial", "B-then-F", "pairing", "ours", "ours/bd", "ours/pair", "classic", "search", "srch/pair"
    );
    let f = |x: (f64, f64)| format!("{:.2} ({:.2})", x.0 / 1e3, x.1 / 1e3);
    for ratio in [0.25, 0.5, 1.0, 2.0] {
        for (name, spec) in family::members(ratio) {
            for budget in [1, 2, 4] {
                let r = family::row(&name, &spec, budget).expect("row");
                let pair = r.pairing.map_or("-".to_string(), f);
                let vs = r.pairing.map_or("-".to_string(), |p| format!("{:.3}", r.ours.0 / p.0));
                let searched = r.ours_search.expect("row() searches");
                let vs_s = r.pairing.map_or("-".to_string(), |p| format!("{:.3}", searched.0 / p.0));
                println!(
                    "{:<18} {:>5.2} {:>2} {:>7.2} {:>14} {:>14} {:>14} {:>14} {:>8.3} {:>9} {:>14} {:>14} {:>9}",
                    name, ratio, budget, r.bound_us / 1e3, f(r.serial), f(r.b_then_f), pair, f(r.ours), r.ours.0 / r.bound_us, vs,
                    f(r.ours_classic), f(searched), vs_s
                );
            }
        }
    }
}
