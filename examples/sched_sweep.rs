//! Prints the simulated sweep table of the README: exposed comm and makespan of four orders
//! over MoE chunk shapes. `cargo run --release --example sched_sweep`
use sched_lifetime::sched::{moe, Budgets};

fn main() {
    println!("SIMULATED. makespan ms (exposed comm ms); bound = max(total compute, total comm)");
    println!("{:>6} {:>6} {:>8} {:>16} {:>16} {:>16} {:>16} {:>8}", "layers", "ratio", "bound", "serial", "B-then-F", "Megatron", "ours", "ours/bd");
    for layers in [1, 2, 4, 8] {
        for ratio in [0.25, 0.5, 1.0, 1.5, 2.0] {
            let (r, _) = moe::sweep_row(moe::Shape::moe(layers, ratio), Budgets::default()).expect("sweep");
            let f = |x: (f64, f64)| format!("{:.2} ({:.2})", x.0 / 1e3, x.1 / 1e3);
            println!(
                "{:>6} {:>6.2} {:>8.2} {:>16} {:>16} {:>16} {:>16} {:>8.3}",
                layers, ratio, r.bound_us / 1e3, f(r.serial), f(r.b_then_f), f(r.megatron), f(r.ours), r.ours.0 / r.bound_us
            );
        }
    }
}
