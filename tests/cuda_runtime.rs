//! The lifetime manager over raw CUDA streams through cudarc (feature `cuda`), on a GPU.
//! The tests are `#[ignore]`d, so a run without a GPU reports them as ignored, never as passed;
//! on a GPU run the binary with `--ignored` (or `--include-ignored`): there a missing driver
//! is a failure. CPU CI does not build this file.
//!
//! Poison test without torch: the consumer on stream B is delayed by a 4 GiB device copy, then
//! reads `buf`; the owner A then overwrites `buf` (what a reuse would do). With the manager's
//! acquire, A waits on the plan event first and the read is intact; the control, without the
//! wait, is overwritten.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};
use sched_lifetime::cuda::{CudaRuntime, Release};
use sched_lifetime::{Action, Device, Manager, StreamId, TensorKey};

struct Gpu {
    rt: CudaRuntime,
    a: sys::CUstream,
    b: sys::CUstream,
}

/// The GPU, or a panic saying why not (these tests only run when asked for with --ignored).
fn gpu() -> Gpu {
    let rt = CudaRuntime::new().unwrap_or_else(|e| panic!("asked to run a GPU test, but: {e}"));
    let dev = result::device::get(0).expect("CUDA device 0");
    // SAFETY: the primary context of device 0, made current for this thread.
    unsafe {
        let ctx = result::primary_ctx::retain(dev).expect("primary context");
        result::ctx::set_current(ctx).expect("set context");
    }
    let a = result::stream::create(result::stream::StreamKind::NonBlocking).expect("stream a");
    let b = result::stream::create(result::stream::StreamKind::NonBlocking).expect("stream b");
    Gpu { rt, a, b }
}

fn sid(s: sys::CUstream) -> StreamId {
    StreamId::cuda(0, s as usize as i64)
}

const N: usize = 16 << 20;
const BIG: usize = 4 << 30;

/// One iteration; returns whether the consumer's copy was overwritten, and the release log.
fn iteration(g: &mut Gpu, bufs: (u64, u64, u64, u64), protect: bool) -> (bool, Vec<Action>) {
    let (buf, out, big_src, big_dst) = bufs;
    let log: Arc<Mutex<Vec<Action>>> = Arc::default();
    let mut m: Manager<Release, sched_lifetime::cuda::CudaEvent> = Manager::new("cuda poison");
    let key = TensorKey { tensor: buf, storage: buf, nbytes: N as u64, covers_storage: true, device: Device { device_type: 1, index: 0 } };
    // SAFETY: all pointers are live allocations of at least the sizes used; streams are ours.
    unsafe {
        result::memset_d8_async(buf, 1, N, g.a).unwrap();
        m.bind(&[key], sid(g.a), |_| {
            let log = log.clone();
            Box::new(move |a| log.lock().unwrap().push(a)) as Release
        })
        .unwrap();
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
        result::event::record(ev, g.a).unwrap();
        result::stream::wait_event(g.b, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap();
        // The lagging consumer.
        result::memcpy_dtod_async(big_dst, big_src, BIG, g.b).unwrap();
        result::memcpy_dtod_async(out, buf, N, g.b).unwrap();
        m.retire(&mut g.rt, &[key], sid(g.b), Action::EmptyStorage, |_| unreachable!("bound")).unwrap();
        if protect {
            assert_eq!(m.acquire(&mut g.rt, sid(g.a)).unwrap(), 1);
        }
        // The owner reuses the block at once.
        result::memset_d8_async(buf, 0xEE, N, g.a).unwrap();
        result::ctx::synchronize().unwrap();
        let mut host = vec![0u8; N];
        result::memcpy_dtoh_sync(&mut host, out).unwrap();
        if !protect {
            m.abandon(&mut g.rt).unwrap();
        } else {
            m.finalize(&mut g.rt).unwrap();
        }
        result::event::destroy(ev).unwrap();
        let corrupt = host.iter().any(|&x| x != 1);
        let released = log.lock().unwrap().clone();
        (corrupt, released)
    }
}

fn alloc(g: &Gpu) -> (u64, u64, u64, u64) {
    let _ = g;
    // SAFETY: plain device allocations, freed by the process exit.
    unsafe {
        (
            result::malloc_sync(N).unwrap(),
            result::malloc_sync(N).unwrap(),
            result::malloc_sync(BIG).unwrap(),
            result::malloc_sync(BIG).unwrap(),
        )
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored there"]
fn owner_waits_for_the_lagging_consumer_before_reuse() {
    let mut g = gpu();
    let bufs = alloc(&g);
    let mut corrupt = 0;
    for _ in 0..50 {
        let (c, released) = iteration(&mut g, bufs, true);
        corrupt += c as u32;
        assert_eq!(released, vec![Action::EmptyStorage], "released once, at the acquire");
    }
    println!("cudarc poison, protected: {corrupt}/50 corrupt");
    assert_eq!(corrupt, 0);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored there"]
fn control_without_the_owner_wait_is_overwritten() {
    let mut g = gpu();
    let bufs = alloc(&g);
    let mut corrupt = 0;
    for _ in 0..20 {
        corrupt += iteration(&mut g, bufs, false).0 as u32;
    }
    println!("cudarc poison, control: {corrupt}/20 corrupt");
    assert!(corrupt > 0, "the harness cannot see a missing wait");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored there"]
fn record_stream_fallback_defers_release_until_the_consumer_is_done() {
    let mut g = gpu();
    let (buf, out, big_src, big_dst) = alloc(&g);
    let log: Arc<Mutex<Vec<Action>>> = Arc::default();
    let mut m: Manager<Release, sched_lifetime::cuda::CudaEvent> = Manager::new("fallback");
    let key = TensorKey { tensor: buf, storage: buf, nbytes: N as u64, covers_storage: true, device: Device { device_type: 1, index: 0 } };
    // SAFETY: as above.
    unsafe {
        result::memcpy_dtod_async(big_dst, big_src, BIG, g.b).unwrap();
        result::memcpy_dtod_async(out, buf, N, g.b).unwrap();
        let l = log.clone();
        m.retire(&mut g.rt, &[key], sid(g.b), Action::EmptyStorage, |_| {
            let l = l.clone();
            Box::new(move |a| l.lock().unwrap().push(a)) as Release
        })
        .unwrap();
        assert_eq!(g.rt.deferred(), 1, "unbound: kept until B passes the event");
        result::ctx::synchronize().unwrap();
        assert_eq!(g.rt.poll().unwrap(), 1);
    }
    assert_eq!(log.lock().unwrap().len(), 1);
    assert_eq!(m.stats().fallback_record_stream, 1);
}
