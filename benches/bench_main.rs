//! Criterion benches, one file per subject (as candle does).

mod lifetime;
mod sim;

criterion::criterion_main!(lifetime::benches, sim::benches);
