//! Criterion benches, one file per subject (as candle does).

mod lifetime;
mod sched;
mod sim;

criterion::criterion_main!(lifetime::benches, sched::benches, sim::benches);
