//! Rust core cost of the lifetime protocol per tensor: bind + retire (cross-stream, parked) +
//! acquire (wait + release), against the counting runtime (no torch, no CUDA). Target < 200 ns.

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use sched_lifetime::{Action, Device, Manager, RecordingRuntime, StreamId, TensorKey};

const A: StreamId = StreamId::cuda(0, 1);
const B: StreamId = StreamId::cuda(0, 2);

fn keys(n: usize) -> Vec<TensorKey> {
    (0..n as u64)
        .map(|i| TensorKey {
            tensor: 0x7f00_0000_0000 + i * 0x1a0,
            storage: 0x7e00_0000_0000 + i * 0x90,
            nbytes: 1 << 20,
            covers_storage: true,
            device: Device { device_type: 1, index: 0 },
        })
        .collect()
}

fn per_tensor(c: &mut Criterion) {
    let mut g = c.benchmark_group("lifetime/bind_retire_acquire");
    for batch in [1usize, 8, 64] {
        let ts = keys(batch);
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_with_input(BenchmarkId::new("cross_stream", batch), &ts, |bench, ts| {
            let mut rt = RecordingRuntime::counting();
            let mut m = Manager::<u64, u32>::new("bench");
            bench.iter(|| {
                m.bind(ts, A, |i| ts[i].tensor).unwrap();
                m.retire(&mut rt, ts, B, Action::EmptyStorage, |i| ts[i].tensor).unwrap();
                m.acquire(&mut rt, A).unwrap()
            });
        });
        g.bench_with_input(BenchmarkId::new("same_stream", batch), &ts, |bench, ts| {
            let mut rt = RecordingRuntime::counting();
            let mut m = Manager::<u64, u32>::new("bench");
            bench.iter(|| {
                m.bind(ts, A, |i| ts[i].tensor).unwrap();
                m.retire(&mut rt, ts, A, Action::EmptyStorage, |i| ts[i].tensor).unwrap();
            });
        });
    }
    g.finish();
}

criterion_group!(benches, per_tensor);
