//! Criterion benches, one file per subject (as candle does).

mod lifetime;

criterion::criterion_main!(lifetime::benches);
