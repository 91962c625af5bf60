//! SIMULATED: does a second EP launch in flight help? Our order scheduled with EP budget 1,
//! run where budget 2 is allowed (a budget-1 order is a valid budget-2 order), against our
//! budget-2 order and the exhaustive budget-2 optimum on small random graphs, and against our
//! budget-2 order on the family. `cargo run --release --example sched_budget [SEEDS]`
use sched_lifetime::ep::Budgets;
use sched_lifetime::scenarios::{family, optimum};
use sched_lifetime::sched::Rules;

fn main() {
    let seeds: u64 = std::env::args().nth(1).map_or(200, |s| s.parse().expect("SEEDS is a number"));
    let (b1, b2) = (Budgets::new(1, 2).expect("budgets"), Budgets::new(2, 2).expect("budgets"));
    println!("SIMULATED. Small random graphs (<= 14 nodes), {seeds} seeds; optimum = exhaustive search at EP budget 2.");
    println!("| graphs | seeds searched | budget-2 order within 5% | budget-1 order within 5% | mean budget-2/optimum | mean budget-1/optimum | budget 1 better | budget 1 worse |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, moe) in [("any chains", false), ("MoE-like", true)] {
        let (mut n, mut w2, mut w1, mut s2, mut s1, mut better, mut worse) = (0usize, 0usize, 0usize, 0.0, 0.0, 0usize, 0usize);
        for seed in 0..seeds {
            let spec = if moe { optimum::small_random_moe(seed, 14) } else { optimum::small_random(seed, 14) };
            let one = optimum::ours_makespan(&spec, b1, Rules::default()).expect("budget 1");
            let Some((two, best, _)) = optimum::compare_on(spec, b2, 2_000_000).expect("compare") else { continue };
            n += 1;
            w2 += usize::from(two <= best * 1.05);
            w1 += usize::from(one <= best * 1.05);
            s2 += two / best;
            s1 += one / best;
            better += usize::from(one < two - 1e-6);
            worse += usize::from(one > two + 1e-6);
        }
        let pct = |k: usize| 100.0 * k as f64 / n.max(1) as f64;
        println!(
            "| {name} | {n} | {:.1}% | {:.1}% | {:.4} | {:.4} | {better} | {worse} |",
            pct(w2), pct(w1), s2 / n as f64, s1 / n as f64
        );
    }
    let (mut t1, mut t2, mut better, mut worse, mut points) = (0.0, 0.0, 0, 0, 0);
    let (mut paired, mut behind1, mut behind2, mut worst1, mut worst2) = (0, 0, 0, 0.0f64, 0.0f64);
    for ratio in [0.25, 0.5, 1.0, 2.0] {
        for (name, spec) in family::members(ratio) {
            let g = family::build(&spec);
            let one = optimum::ours_makespan(&g, b1, Rules::default()).expect("budget 1");
            let two = optimum::ours_makespan(&g, b2, Rules::default()).expect("budget 2");
            t1 += one;
            t2 += two;
            points += 1;
            better += usize::from(one < two - 1e-6);
            worse += usize::from(one > two + 1e-6);
            // Against the layer pairing at budget 2 (the stronger of its two rule sets).
            if let Some((pair, _)) = family::row(&name, &spec, 2).expect("row").pairing {
                paired += 1;
                behind1 += usize::from(one > pair * 1.01);
                behind2 += usize::from(two > pair * 1.01);
                worst1 = worst1.max(one / pair);
                worst2 = worst2.max(two / pair);
            }
        }
    }
    println!("family ({points} points, ratios 0.25-2): total makespan budget 2 {:.2} ms, budget 1 {:.2} ms; budget 1 better on {better}, worse on {worse}", t2 / 1e3, t1 / 1e3);
    println!(
        "against the budget-2 layer pairing ({paired} points): more than 1% behind: budget-2 order {behind2} (worst {worst2:.4}), budget-1 order {behind1} (worst {worst1:.4})"
    );
}
