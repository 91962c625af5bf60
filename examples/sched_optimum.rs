//! SIMULATED (issue 8): our order against the exhaustive optimum on small random two-source
//! graphs (a forward and a backward chain of compute nodes and comm launch/wait pairs, dW side
//! nodes, comm/compute 0.25-2, at most 14 nodes), EP budgets 1 and 2; "any chains" allows a
//! transfer to feed the next transfer directly, "MoE-like" puts compute between transfers.
//! "ours" is the default policy (with `ready_first`); the last columns are the `classic` rules
//! (the default before `ready_first`).
//! `cargo run --release --example sched_optimum [SEEDS]`
use sched_lifetime::ep::Budgets;
use sched_lifetime::scenarios::optimum;
use sched_lifetime::sched::Rules;

fn main() {
    let seeds: u64 = std::env::args().nth(1).map_or(1000, |s| s.parse().expect("SEEDS is a number"));
    println!("SIMULATED. ours vs the exhaustive optimum (every valid order simulated), {seeds} seeds, graphs of <= 14 nodes.");
    println!("| graphs | EP budget | seeds searched | within 1% | within 5% | mean ours/optimum | worst (seed: ours/optimum) | classic: within 5% | classic: mean | classic: worst |");
    println!("|---|---:|---:|---:|---:|---:|---|---:|---:|---|");
    for (family, moe) in [("any chains", false), ("MoE-like", true)] {
    for ep in [1u32, 2] {
        let budgets = Budgets::new(ep, 2).expect("budgets");
        let (mut n, mut w1, mut w5, mut sum) = (0usize, 0usize, 0usize, 0.0f64);
        let mut worst = (0u64, 0.0f64);
        let (mut r5, mut rsum, mut rworst) = (0usize, 0.0f64, (0u64, 0.0f64));
        for seed in 0..seeds {
            let spec = if moe { optimum::small_random_moe(seed, 14) } else { optimum::small_random(seed, 14) };
            let ready = optimum::ours_makespan(&spec, budgets, Rules::CLASSIC).expect("classic");
            let Some((ours, best, _)) = optimum::compare_on(spec, budgets, 2_000_000).expect("compare") else { continue };
            let rr = ready / best;
            r5 += usize::from(rr <= 1.05);
            rsum += rr;
            if rr > rworst.1 {
                rworst = (seed, rr);
            }
            let r = ours / best;
            n += 1;
            sum += r;
            w1 += usize::from(r <= 1.01);
            w5 += usize::from(r <= 1.05);
            if r > worst.1 {
                worst = (seed, r);
            }
        }
        println!(
            "| {family} | {ep} | {n} | {:.1}% | {:.1}% | {:.4} | seed {}: {:.4} | {:.1}% | {:.4} | seed {}: {:.4} |",
            100.0 * w1 as f64 / n as f64, 100.0 * w5 as f64 / n as f64, sum / n as f64, worst.0, worst.1,
            100.0 * r5 as f64 / n as f64, rsum / n as f64, rworst.0, rworst.1
        );
    }
    }
}
