//! SIMULATED (issue 8): our orders against the exhaustive optimum on small random two-source
//! graphs (a forward and a backward chain of compute nodes and comm launch/wait pairs, dW side
//! nodes, comm/compute 0.25-2, at most 14 nodes), EP budgets 1 and 2; "any chains" allows a
//! transfer to feed the next transfer directly, "MoE-like" puts compute between transfers.
//! "ours" is the default, timing-free policy; "search" is rule `search` (the same graph's node
//! costs, the simulator as cost model: the policy's rule variants and local moves, the shortest
//! kept; `sim::schedule`).
//! `cargo run --release --example sched_optimum [SEEDS] [any|moe]`
use sched_lifetime::ep::Budgets;
use sched_lifetime::scenarios::optimum;
use sched_lifetime::sched::Rules;

#[derive(Default)]
struct Tally {
    n: usize,
    w1: usize,
    w5: usize,
    sum: f64,
    worst: (u64, f64),
}

impl Tally {
    fn add(&mut self, seed: u64, r: f64) {
        self.n += 1;
        self.sum += r;
        self.w1 += usize::from(r <= 1.01);
        self.w5 += usize::from(r <= 1.05);
        if r > self.worst.1 {
            self.worst = (seed, r);
        }
    }
    fn cells(&self) -> String {
        let pct = |k: usize| 100.0 * k as f64 / self.n as f64;
        format!("{:.1}% | {:.1}% | {:.4} | seed {}: {:.4}", pct(self.w1), pct(self.w5), self.sum / self.n as f64, self.worst.0, self.worst.1)
    }
}

fn main() {
    let seeds: u64 = std::env::args().nth(1).map_or(1000, |s| s.parse().expect("SEEDS is a number"));
    let search = Rules::parse("search").expect("rule");
    println!("SIMULATED. ours and search vs the exhaustive optimum (every valid order simulated), {seeds} seeds, graphs of <= 14 nodes.");
    println!("| graphs | EP budget | seeds searched | ours: within 1% | within 5% | mean ours/optimum | worst | search: within 1% | within 5% | mean | worst |");
    println!("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|");
    let only = std::env::args().nth(2); // "any" or "moe": one family
    for (family, moe) in [("any chains", false), ("MoE-like", true)] {
        if only.as_deref().is_some_and(|o| o != if moe { "moe" } else { "any" }) {
            continue;
        }
        for ep in [1u32, 2] {
            let budgets = Budgets::new(ep, 2).expect("budgets");
            let (mut ours, mut searched) = (Tally::default(), Tally::default());
            for seed in 0..seeds {
                let spec = if moe { optimum::small_random_moe(seed, 14) } else { optimum::small_random(seed, 14) };
                let s = optimum::ours_makespan(&spec, budgets, search).expect("search");
                let Some((o, best, _)) = optimum::compare_on(spec, budgets, 2_000_000).expect("compare") else { continue };
                ours.add(seed, o / best);
                searched.add(seed, s / best);
            }
            println!("| {family} | {ep} | {} | {} | {} |", ours.n, ours.cells(), searched.cells());
        }
    }
}
