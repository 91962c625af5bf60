//! Prints the simulated sweep table of the README: exposed comm and makespan of four orders
//! over MoE chunk shapes. `cargo run --release --example sched_sweep`
use sched_lifetime::ep::Budgets;
use sched_lifetime::scenarios::{moe, sweep};

fn main() {
    println!("SIMULATED. makespan ms (exposed comm ms); bound = max(total compute, total comm).");
    println!("Lifetime manager on; drains where the schedule puts them, or (last two columns) at the owner's next node as Megatron does.");
    println!(
        "{:>6} {:>6} {:>8} {:>14} {:>14} {:>14} {:>14} {:>8} {:>15} {:>15}",
        "layers", "ratio", "bound", "serial", "B-then-F", "Megatron", "ours", "ours/bd", "Megatron/next", "ours/next"
    );
    let mut rows = Vec::new();
    for layers in [1, 2, 4, 8] {
        for ratio in [0.25, 0.5, 1.0, 1.5, 2.0] {
            let (r, _) = sweep::sweep_row(moe::Shape::moe(layers, ratio), Budgets::default()).expect("sweep");
            let f = |x: (f64, f64)| format!("{:.2} ({:.2})", x.0 / 1e3, x.1 / 1e3);
            println!(
                "{:>6} {:>6.2} {:>8.2} {:>14} {:>14} {:>14} {:>14} {:>8.3} {:>15} {:>15}",
                layers,
                ratio,
                r.bound_us / 1e3,
                f(r.serial),
                f(r.b_then_f),
                f(r.megatron),
                f(r.ours),
                r.ours.0 / r.bound_us,
                f(r.megatron_next_node),
                f(r.ours_next_node)
            );
            rows.push((layers, ratio, r.ours_reserved));
        }
    }
    println!("\nours, max reserved MiB (schedule drains / next-node drains):");
    for (l, r, (a, b)) in rows {
        print!("{l}x{r}: {}/{}  ", a >> 20, b >> 20);
    }
    println!();
}
