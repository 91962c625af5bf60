//! One test per rule of DESIGN.md §2, against the recording runtime, which logs every call in
//! order. Each test names the rule it holds and fails when the rule is broken.

use sched_lifetime::{Action, Device, Manager, Op, RecordingRuntime, StreamId, TensorKey};

const A: StreamId = StreamId::cuda(0, 1); // owner (compute)
const B: StreamId = StreamId::cuda(0, 2); // consumer (comm)
const C: StreamId = StreamId::cuda(0, 3);

fn t(id: u64) -> TensorKey {
    TensorKey { tensor: id, storage: 1000 + id, nbytes: 64 * id, covers_storage: true, device: Device { device_type: 1, index: 0 } }
}

fn mgr() -> (Manager<u64, u32>, RecordingRuntime) {
    (Manager::new("plan0"), RecordingRuntime::new())
}

fn bind(m: &mut Manager<u64, u32>, ts: &[TensorKey], owner: StreamId) {
    m.bind(ts, owner, |i| ts[i].tensor).unwrap();
}

fn retire(
    m: &mut Manager<u64, u32>,
    rt: &mut RecordingRuntime,
    ts: &[TensorKey],
    consumer: StreamId,
    action: Action,
) -> sched_lifetime::Result<()> {
    m.retire(rt, ts, consumer, action, |i| ts[i].tensor)
}

fn pos(ops: &[Op], op: &Op) -> usize {
    ops.iter().position(|o| o == op).unwrap_or_else(|| panic!("{op:?} not in {ops:?}"))
}

/// Checks the whole log: every release of a cross-stream entry comes after a wait, on its
/// owner stream, on the event recorded on its consumer after the consume. `retired_at` is the
/// log length when the tensor was retired: a record before it is stale (it does not cover
/// this consume), so it does not count.
fn assert_waits_before_releases(ops: &[Op], tensor: u64, owner: StreamId, consumer: StreamId, retired_at: usize) {
    let rel = ops.iter().position(|o| matches!(o, Op::Release(p, _) if *p == tensor)).expect("released");
    let rec = ops[..rel]
        .iter()
        .rposition(|o| matches!(o, Op::Record(_, s) if *s == consumer))
        .expect("plan event recorded on the consumer before release");
    assert!(rec >= retired_at, "rule 1 broken: the last plan event on {consumer} before tensor {tensor}'s release was recorded before its retire: {ops:?}");
    let Op::Record(ev, _) = ops[rec] else { unreachable!() };
    assert!(
        ops[rec..rel].contains(&Op::Wait(ev, owner)),
        "rule 1 broken: tensor {tensor} released before {owner} waited on event {ev}: {ops:?}"
    );
}

#[test]
fn rule1_wait_before_free() {
    let (mut m, mut rt) = mgr();
    let x = t(1);
    bind(&mut m, &[x], A);
    retire(&mut m, &mut rt, &[x], B, Action::EmptyStorage).unwrap();
    assert!(!rt.ops.iter().any(|o| matches!(o, Op::Release(..))), "released before the owner's acquire");
    assert_eq!(m.acquire(&mut rt, A).unwrap(), 1);
    assert_waits_before_releases(&rt.ops, 1, A, B, 0);
    // The wait is the last thing before the release.
    let w = pos(&rt.ops, &Op::Wait(1, A));
    assert_eq!(w + 1, pos(&rt.ops, &Op::Release(1, Action::EmptyStorage)));
}

#[test]
fn rule1_failed_wait_releases_nothing() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1), t(2)], A);
    retire(&mut m, &mut rt, &[t(1), t(2)], B, Action::EmptyStorage).unwrap();
    rt.fail_next_wait = true;
    assert!(m.acquire(&mut rt, A).is_err());
    assert!(!rt.ops.iter().any(|o| matches!(o, Op::Release(..))), "released after a failed wait: {:?}", rt.ops);
    assert_eq!(m.parked_on(A), 2);
    assert_eq!(m.acquire(&mut rt, A).unwrap(), 2);
}

#[test]
fn rule1_consumer_on_two_streams_owner_waits_on_both() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1), t(2)], A);
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    let at2 = rt.ops.len();
    retire(&mut m, &mut rt, &[t(2)], C, Action::EmptyStorage).unwrap();
    m.acquire(&mut rt, A).unwrap();
    assert_waits_before_releases(&rt.ops, 1, A, B, 0);
    assert_waits_before_releases(&rt.ops, 2, A, C, at2);
}

#[test]
fn rule2_same_stream_retires_immediately() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1)], A);
    retire(&mut m, &mut rt, &[t(1)], A, Action::EmptyStorage).unwrap();
    assert_eq!(rt.ops, vec![Op::Release(1, Action::EmptyStorage)], "no event, no wait, released at once");
    assert_eq!(m.stats().immediate, 1);
    assert_eq!(m.acquire(&mut rt, A).unwrap(), 0);
    assert_eq!(rt.ops.len(), 1, "nothing left to drain");
}

#[test]
fn rule3_actions_reach_the_runtime_unchanged() {
    let (mut m, mut rt) = mgr();
    let ts = [t(1), t(2), t(3)];
    bind(&mut m, &ts, A);
    for (x, a) in ts.iter().zip(Action::ALL) {
        retire(&mut m, &mut rt, &[*x], B, a).unwrap();
    }
    m.acquire(&mut rt, A).unwrap();
    let released: Vec<_> = rt.ops.iter().filter_map(|o| if let Op::Release(p, a) = o { Some((*p, *a)) } else { None }).collect();
    assert_eq!(released, vec![(1, Action::EmptyStorage), (2, Action::DropReference), (3, Action::Preserve)]);
    let s = m.stats();
    assert_eq!((s.retired_empty_storage, s.retired_drop_reference, s.retired_preserve), (1, 1, 1));
}

/// Rule 3's `EmptyStorage` is for a tensor that spans its storage: on a view of part of one it
/// would empty its base's bytes too. Refused in every retire entry before any change, naming
/// the fix; `DropReference` and `Preserve` of the same view, and `EmptyStorage` of the whole
/// tensor, are accepted.
#[test]
fn rule3_empty_storage_of_a_partial_view_is_refused_before_any_change() {
    let (mut m, mut rt) = mgr();
    let part = TensorKey { covers_storage: false, ..t(1) };
    bind(&mut m, &[part], A);
    let before = m.stats();
    let e = retire(&mut m, &mut rt, &[part], B, Action::EmptyStorage).unwrap_err();
    assert!(e.is_value_error() && e.to_string().contains("view of part of its storage") && e.to_string().contains("drop_reference"), "{e}");
    let e = m.retire_owned(&mut rt, &[t(2), part], A, B, Action::EmptyStorage, |i| [2, 1][i]).unwrap_err();
    assert!(e.to_string().contains("tensor 1 is a view"), "{e}");
    let e = m.release_after(&mut rt, &[part], A, A, Action::EmptyStorage, |_| 1).unwrap_err();
    assert!(e.to_string().contains("view of part"), "{e}");
    assert_eq!(m.stats(), before);
    assert!(rt.ops.is_empty(), "{:?}", rt.ops);
    // A storage already emptied (another plan retired the tensor) is said to be so, not a view.
    {
        let (mut m2, mut rt2) = mgr();
        let emptied = TensorKey { covers_storage: false, nbytes: 0, ..t(4) };
        bind(&mut m2, &[emptied], A);
        let before2 = m2.stats();
        let e = retire(&mut m2, &mut rt2, &[emptied], B, Action::EmptyStorage).unwrap_err();
        assert!(e.is_value_error() && e.to_string().contains("storage is already empty") && !e.to_string().contains("view"), "{e}");
        assert_eq!(m2.stats(), before2);
        retire(&mut m2, &mut rt2, &[emptied], B, Action::DropReference).unwrap();
    }
    retire(&mut m, &mut rt, &[part], B, Action::DropReference).unwrap();
    m.retire_owned(&mut rt, &[t(3)], A, B, Action::EmptyStorage, |_| 3).unwrap();
    m.acquire(&mut rt, A).unwrap();
    let released: Vec<_> = rt.ops.iter().filter_map(|o| if let Op::Release(p, a) = o { Some((*p, *a)) } else { None }).collect();
    assert_eq!(released, vec![(1, Action::DropReference), (3, Action::EmptyStorage)]);
}

#[test]
fn rule4_unknown_owner_takes_record_stream_fallback() {
    let (mut m, mut rt) = mgr();
    retire(&mut m, &mut rt, &[t(9)], B, Action::EmptyStorage).unwrap();
    assert_eq!(rt.ops, vec![Op::RecordStream(9, B)]);
    assert_eq!(m.stats().fallback_record_stream, 1);
    assert_eq!(m.stats().pending_count, 0);
}

#[test]
fn rule4_fallback_on_host_stream_records_nothing() {
    let mut m = Manager::<u64, u32>::new("cpu");
    let mut rt = RecordingRuntime::new();
    let x = TensorKey { device: StreamId::cpu().device, ..t(1) };
    m.retire(&mut rt, &[x], StreamId::cpu(), Action::DropReference, |_| 1).unwrap();
    assert!(rt.ops.is_empty());
    assert_eq!(m.stats().fallback_record_stream, 1);
}

#[test]
fn rule5_one_manager_never_drains_another_plans_queue() {
    let mut rt = RecordingRuntime::new();
    let mut f = Manager::<u64, u32>::new("F mb1");
    let mut b = Manager::<u64, u32>::new("B mb0");
    bind(&mut f, &[t(1)], A);
    bind(&mut b, &[t(2)], A);
    retire(&mut f, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    retire(&mut b, &mut rt, &[t(2)], B, Action::DropReference).unwrap();
    let b_event = match rt.ops.iter().filter(|o| matches!(o, Op::Record(..))).nth(1) {
        Some(Op::Record(e, _)) => *e,
        _ => panic!("two records expected"),
    };
    let before = rt.ops.len();
    assert_eq!(f.acquire(&mut rt, A).unwrap(), 1);
    let new = &rt.ops[before..];
    assert!(!new.contains(&Op::Wait(b_event, A)), "F waited on B's plan event (adds a B->F dependency): {new:?}");
    assert!(!new.iter().any(|o| matches!(o, Op::Release(2, _))), "F drained B's tensor");
    assert_eq!(b.parked_on(A), 1);
    assert_eq!(b.acquire(&mut rt, A).unwrap(), 1);
}

#[test]
fn rule6_noop_passes_binding_to_next_real_consumer() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1)], A);
    // A noop node on C hands the same object on; it does not retire it.
    m.passthrough(&[t(1)]).unwrap();
    assert!(rt.ops.is_empty());
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    assert_eq!(m.parked_on(A), 1, "binding kept its owner A through the noop");
    assert_eq!(m.parked_on(C), 0);
    m.acquire(&mut rt, A).unwrap();
    assert_waits_before_releases(&rt.ops, 1, A, B, 0);
    // A noop after the last consumer is a use after retire.
    let (mut m2, mut rt2) = mgr();
    bind(&mut m2, &[t(1)], A);
    retire(&mut m2, &mut rt2, &[t(1)], B, Action::EmptyStorage).unwrap();
    assert!(m2.passthrough(&[t(1)]).is_err());
}

#[test]
fn rule7_terminal_handback_drains_every_owner() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1)], A);
    bind(&mut m, &[t(2)], C);
    retire(&mut m, &mut rt, &[t(1), t(2)], B, Action::EmptyStorage).unwrap();
    let s = m.finalize(&mut rt).unwrap();
    assert_waits_before_releases(&rt.ops, 1, A, B, 0);
    assert_waits_before_releases(&rt.ops, 2, C, B, 0);
    assert_eq!((s.handbacks, s.drained, s.pending_count), (2, 2, 0));
    assert!(m.acquire(&mut rt, A).is_err(), "use after finalize is an error");
}

#[test]
fn rule7_leftover_bindings_are_an_error_and_change_nothing() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1), t(2)], A);
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    let n = rt.ops.len();
    let err = m.finalize(&mut rt).unwrap_err().to_string();
    assert!(err.contains("1 tensor(s)") && err.contains("never retired"), "{err}");
    assert_eq!(rt.ops.len(), n, "a failed finalize issued work");
    assert_eq!(m.parked_on(A), 1);
    retire(&mut m, &mut rt, &[t(2)], B, Action::EmptyStorage).unwrap();
    m.finalize(&mut rt).unwrap();
}

#[test]
fn rule8_aliases_rejected_before_any_state_change() {
    let (mut m, mut rt) = mgr();
    let x = t(1);
    let view = TensorKey { tensor: 77, ..x }; // another tensor over the same storage
    bind(&mut m, &[x, view], A);
    let before = m.stats();
    let err = retire(&mut m, &mut rt, &[x, view], B, Action::EmptyStorage).unwrap_err().to_string();
    assert!(err.contains("alias"), "{err}");
    assert!(rt.ops.is_empty());
    assert_eq!(m.stats(), before);
    // The same tensor twice in one call is also refused.
    assert!(retire(&mut m, &mut rt, &[x, x], B, Action::EmptyStorage).unwrap_err().to_string().contains("same tensor"));
    assert!(rt.ops.is_empty());
}

#[test]
fn rule8_retire_twice_across_calls_is_rejected() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1)], A);
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    let n = rt.ops.len();
    assert!(retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).is_err());
    assert_eq!(rt.ops.len(), n);
}

#[test]
fn rule9_protocol_is_host_side_only_so_capture_records_it() {
    // Under capture the manager's calls are recorded into the graph; replay runs none of them.
    // What makes that valid: the whole protocol is record/wait/release with no host query.
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1), t(2)], A);
    retire(&mut m, &mut rt, &[t(1), t(2)], B, Action::EmptyStorage).unwrap();
    m.finalize(&mut rt).unwrap();
    assert!(rt.ops.iter().all(|o| matches!(o, Op::NewEvent(..) | Op::Record(..) | Op::Wait(..) | Op::Release(..))));
}

#[test]
fn device_mismatch_is_input_error() {
    let (mut m, mut rt) = mgr();
    let other = StreamId::cuda(1, 5);
    let e = m.bind(&[t(1)], other, |_| 1).unwrap_err();
    assert!(e.is_value_error() && e.to_string().contains("cuda:1"), "{e}");
    bind(&mut m, &[t(1)], A);
    let e = retire(&mut m, &mut rt, &[t(1)], other, Action::EmptyStorage).unwrap_err();
    assert!(e.is_value_error(), "{e}");
}

#[test]
fn stats_track_pending_peaks() {
    let (mut m, mut rt) = mgr();
    let ts = [t(1), t(2), t(3)];
    bind(&mut m, &ts, A);
    retire(&mut m, &mut rt, &ts, B, Action::EmptyStorage).unwrap();
    let s = m.stats();
    assert_eq!((s.pending_count, s.pending_bytes), (3, 64 * 6));
    m.acquire(&mut rt, A).unwrap();
    let s = m.stats();
    assert_eq!((s.pending_count, s.pending_peak_count, s.pending_peak_bytes), (0, 3, 384));
    assert_eq!(s.waits, 1, "one wait covers all three (one consumer)");
}

#[test]
fn abandon_falls_back_to_record_stream_for_parked() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1), t(2)], A);
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    m.abandon(&mut rt).unwrap();
    assert!(rt.ops.contains(&Op::RecordStream(1, B)));
    assert!(!rt.ops.iter().any(|o| matches!(o, Op::Release(..))));
    let s = m.stats();
    assert_eq!((s.abandoned, s.pending_count, s.pending_bytes, s.bound_now), (1, 0, 0, 0));
    assert!(m.is_finalized());
}

#[test]
fn duplicates_found_even_when_not_adjacent() {
    let (mut m, _) = mgr();
    let x = t(1);
    let view = TensorKey { tensor: 77, ..x };
    let e = m.bind(&[x, view, x], A, |i| i as u64).unwrap_err();
    assert!(e.to_string().contains("same tensor"), "{e}");
    assert_eq!(m.stats().bound, 0);
}

#[test]
fn rebind_same_owner_is_idempotent_other_owner_is_error() {
    let (mut m, _) = mgr();
    bind(&mut m, &[t(1)], A);
    bind(&mut m, &[t(1)], A);
    assert_eq!(m.stats().bound, 1);
    assert!(m.bind(&[t(1)], B, |_| 1).unwrap_err().to_string().contains("already bound"));
}

#[test]
fn rule2_host_streams_are_one_queue() {
    let mut m = Manager::<u64, u32>::new("cpu");
    let mut rt = RecordingRuntime::new();
    let other_cpu = StreamId { id: 7, ..StreamId::cpu() };
    let x = TensorKey { device: StreamId::cpu().device, ..t(1) };
    m.bind(&[x], StreamId::cpu(), |_| 1).unwrap();
    m.retire(&mut rt, &[x], other_cpu, Action::EmptyStorage, |_| 1).unwrap();
    assert_eq!(rt.ops, vec![Op::Release(1, Action::EmptyStorage)]);
}

#[test]
fn rule8_retire_twice_after_an_immediate_release_is_rejected() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1)], A);
    retire(&mut m, &mut rt, &[t(1)], A, Action::EmptyStorage).unwrap(); // same stream: released at once
    let (n, before) = (rt.ops.len(), m.stats());
    let err = retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap_err().to_string();
    assert!(err.contains("already retired"), "{err}");
    assert_eq!((rt.ops.len(), m.stats()), (n, before), "no fallback, nothing changed");
    assert!(m.bind(&[t(1)], A, |_| 1).is_err(), "binding a retired tensor again is a use after retire");
    m.finalize(&mut rt).unwrap();
}

#[test]
fn rule8_alias_across_calls_is_rejected() {
    let (mut m, mut rt) = mgr();
    let x = t(1);
    let view = TensorKey { tensor: 77, ..x }; // another tensor over x's storage
    bind(&mut m, &[x, view], A);
    retire(&mut m, &mut rt, &[x], B, Action::EmptyStorage).unwrap();
    let (n, before) = (rt.ops.len(), m.stats());
    let err = retire(&mut m, &mut rt, &[view], B, Action::EmptyStorage).unwrap_err().to_string();
    assert!(err.contains("aliases the storage") && err.contains("rule 8"), "{err}");
    assert_eq!((rt.ops.len(), m.stats()), (n, before));
    // Once x's storage is released (drained), the view no longer aliases anything parked.
    m.acquire(&mut rt, A).unwrap();
    retire(&mut m, &mut rt, &[view], B, Action::EmptyStorage).unwrap();
    m.finalize(&mut rt).unwrap();
}

#[test]
fn rule1_helper_rejects_a_stale_plan_event() {
    // A log where the consumer's event was recorded for an earlier tensor and the retire of
    // tensor 2 recorded nothing: the owner's wait covers the old consume, not this one.
    let ops = vec![Op::Record(1, B), Op::Wait(1, A), Op::Release(1, Action::EmptyStorage), Op::Wait(1, A), Op::Release(2, Action::EmptyStorage)];
    assert_waits_before_releases(&ops, 1, A, B, 0);
    let stale = std::panic::catch_unwind(|| assert_waits_before_releases(&ops, 2, A, B, 3));
    assert!(stale.is_err(), "a record before the retire was accepted as covering it");
}

#[test]
fn rule1_each_retire_records_a_fresh_plan_event() {
    // Two consumes on one consumer stream, retired in two calls: the owner must wait on the
    // event recorded at the second retire, not on the one recorded at the first.
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1), t(2)], A);
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    let at2 = rt.ops.len();
    retire(&mut m, &mut rt, &[t(2)], B, Action::EmptyStorage).unwrap();
    m.acquire(&mut rt, A).unwrap();
    assert_waits_before_releases(&rt.ops, 1, A, B, 0);
    assert_waits_before_releases(&rt.ops, 2, A, B, at2);
}

#[test]
fn rule8_preserved_views_of_one_storage_may_be_retired_in_two_calls() {
    // Preserve releases nothing of the storage (EP library buffers, symmetric memory): two
    // slices of one buffer retired separately are fine.
    let (mut m, mut rt) = mgr();
    let a = t(1);
    let b = TensorKey { tensor: 78, ..a };
    bind(&mut m, &[a, b], A);
    retire(&mut m, &mut rt, &[a], B, Action::Preserve).unwrap();
    retire(&mut m, &mut rt, &[b], B, Action::Preserve).unwrap();
    assert_eq!(m.parked_on(A), 2);
    m.finalize(&mut rt).unwrap();
}

#[test]
fn counters_and_accessors_report_what_happened() {
    let (mut m, mut rt) = mgr();
    assert_eq!(m.name(), "plan0");
    assert!(!m.is_finalized());
    bind(&mut m, &[t(1), t(2), t(3)], A);
    m.passthrough(&[t(1), t(2)]).unwrap();
    m.passthrough(&[t(3)]).unwrap();
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    retire(&mut m, &mut rt, &[t(2)], B, Action::EmptyStorage).unwrap();
    retire(&mut m, &mut rt, &[t(3)], C, Action::DropReference).unwrap();
    let s = m.stats();
    assert_eq!((s.passthrough, s.events_recorded, s.bound, s.pending_count, s.pending_bytes), (3, 3, 3, 3, 64 * 6));
    assert_eq!((s.pending_peak_count, s.pending_peak_bytes), (3, 64 * 6));
    let s = m.finalize(&mut rt).unwrap();
    assert!(m.is_finalized());
    assert_eq!((s.drained, s.waits, s.handbacks, s.pending_count, s.pending_bytes), (3, 2, 1, 0, 0));
}

#[test]
fn rule1_acquire_drains_only_the_acquiring_owners_queue() {
    // The queue of another owner stream (made first) must not be drained by A's acquire: its
    // tensors would be released after A's wait, with C never having waited.
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(2)], C);
    retire(&mut m, &mut rt, &[t(2)], B, Action::EmptyStorage).unwrap();
    assert_eq!(m.acquire(&mut rt, A).unwrap(), 0, "A has nothing parked");
    bind(&mut m, &[t(1)], A);
    retire(&mut m, &mut rt, &[t(1)], B, Action::EmptyStorage).unwrap();
    assert_eq!(m.acquire(&mut rt, A).unwrap(), 1);
    assert!(!rt.ops.iter().any(|o| matches!(o, Op::Release(2, _))), "C's tensor released on A's acquire");
    assert_eq!((m.parked_on(C), m.stats().pending_count, m.stats().pending_bytes), (1, 1, t(2).nbytes));
    assert_eq!(m.acquire(&mut rt, C).unwrap(), 1);
    assert_eq!(m.stats().pending_bytes, 0);
}

/// `retire_owned` (bind + retire in one call, the eager hot path) keeps rules 1 and 2 exactly
/// as bind-then-retire does, and every check of both runs before any change.
#[test]
fn retire_owned_is_bind_then_retire_and_checks_first() {
    // Cross-stream: parked until the owner's acquire, wait before release (rule 1).
    let (mut m, mut rt) = mgr();
    let x = t(1);
    m.retire_owned(&mut rt, &[x], A, B, Action::EmptyStorage, |i| [x][i].tensor).unwrap();
    assert!(!rt.ops.iter().any(|o| matches!(o, Op::Release(..))), "released before the owner's acquire");
    assert_eq!(m.acquire(&mut rt, A).unwrap(), 1);
    assert_waits_before_releases(&rt.ops, 1, A, B, 0);
    let s = m.stats();
    assert_eq!((s.bound, s.fallback_record_stream), (1, 0));
    // Same stream: released at once (rule 2), no event.
    let (mut m, mut rt) = mgr();
    m.retire_owned(&mut rt, &[t(2)], A, A, Action::DropReference, |_| 2).unwrap();
    assert_eq!(rt.ops, vec![Op::Release(2, Action::DropReference)]);
    // Checks first: an alias in the call, or a binding to another owner, changes nothing.
    let (mut m, mut rt) = mgr();
    let mut v = t(4);
    v.storage = t(3).storage;
    let e = m.retire_owned(&mut rt, &[t(3), v], A, B, Action::EmptyStorage, |i| 3 + i as u64).unwrap_err();
    assert!(e.to_string().contains("alias one storage"), "{e}");
    bind(&mut m, &[t(5)], C);
    let e = m.retire_owned(&mut rt, &[t(6), t(5)], A, B, Action::EmptyStorage, |i| 6 - i as u64).unwrap_err();
    assert!(e.to_string().contains("already bound to"), "{e}");
    assert_eq!(m.stats().bound, 1, "a failed retire_owned bound nothing");
    assert!(rt.ops.is_empty());
}

/// `retire_owned` is the hot path's own code (one lookup per tensor), not bind-then-retire: on
/// random call sequences (tensors bound before or not, to this owner or another, retired
/// twice, views of one storage, both actions that matter, cross-stream or not, acquires in
/// between) it leaves the same log and counters as `bind` followed by `retire` on a second
/// manager, and a call it rejects changes nothing.
#[test]
fn retire_owned_equals_bind_then_retire_on_random_sequences() {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let streams = [A, B, C];
    let actions = [Action::EmptyStorage, Action::DropReference, Action::Preserve];
    let (mut rejected, mut crossed) = (0, 0);
    for _ in 0..200 {
        let (mut fused, mut rt_f) = mgr();
        let (mut split, mut rt_s) = mgr();
        let mut fresh = 1u64;
        for _ in 0..30 {
            // Tensors: mostly fresh, sometimes an earlier one again or a view of one.
            let n = 1 + next(3) as usize;
            let ts: Vec<TensorKey> = (0..n)
                .map(|_| match next(6) {
                    0 if fresh > 1 => t(1 + next(fresh - 1)),
                    1 if fresh > 1 => {
                        let mut v = t(fresh + 1000);
                        v.storage = t(1 + next(fresh - 1)).storage;
                        fresh += 1;
                        v
                    }
                    _ => {
                        fresh += 1;
                        t(fresh)
                    }
                })
                .collect();
            let owner = streams[next(3) as usize];
            match next(4) {
                0 => {
                    // A bind as Megatron's pattern does it, on both managers alike.
                    let a = fused.bind(&ts, owner, |i| ts[i].tensor).map_err(|e| e.to_string());
                    let b = split.bind(&ts, owner, |i| ts[i].tensor).map_err(|e| e.to_string());
                    assert_eq!(a, b);
                }
                1 => {
                    assert_eq!(fused.acquire(&mut rt_f, owner).unwrap(), split.acquire(&mut rt_s, owner).unwrap());
                }
                _ => {
                    let consumer = streams[next(3) as usize];
                    let action = actions[next(3) as usize];
                    let (before_ops, before) = (rt_f.ops.len(), fused.stats());
                    match fused.retire_owned(&mut rt_f, &ts, owner, consumer, action, |i| ts[i].tensor) {
                        Ok(()) => {
                            crossed += usize::from(owner != consumer);
                            split.bind(&ts, owner, |i| ts[i].tensor).unwrap();
                            retire(&mut split, &mut rt_s, &ts, consumer, action).unwrap();
                        }
                        Err(_) => {
                            rejected += 1;
                            assert_eq!((rt_f.ops.len(), fused.stats()), (before_ops, before), "a rejected call changed something");
                        }
                    }
                }
            }
            assert_eq!(rt_f.ops, rt_s.ops);
            assert_eq!(fused.stats(), split.stats());
        }
        fused.abandon(&mut rt_f).unwrap();
        split.abandon(&mut rt_s).unwrap();
    }
    assert!(rejected > 100 && crossed > 100, "the sequences hit both paths: {rejected} rejected, {crossed} crossed");
}

/// `release_after` (record_stream's one-call replacement): the owner waits on the consumer's
/// event recorded at this retire, then releases these tensors and the plan's others parked for
/// the owner; same stream, released at once with no event. Returns what the acquire released.
#[test]
fn release_after_waits_then_releases_with_the_owners_other_parked() {
    let (mut m, mut rt) = mgr();
    bind(&mut m, &[t(1)], A);
    retire(&mut m, &mut rt, &[t(1)], C, Action::EmptyStorage).unwrap();
    let at = rt.ops.len();
    let got = m.release_after(&mut rt, &[t(2), t(3)], A, B, Action::EmptyStorage, |i| 2 + i as u64).unwrap();
    assert_eq!(got, 3, "t(2), t(3) and the parked t(1)");
    assert_waits_before_releases(&rt.ops, 2, A, B, at);
    assert_waits_before_releases(&rt.ops, 3, A, B, at);
    assert_waits_before_releases(&rt.ops, 1, A, C, 0);
    assert_eq!((m.parked_on(A), m.stats().pending_count, m.stats().bound), (0, 0, 3));
    // Same stream: nothing parked, nothing recorded; the count is the acquire's (none parked).
    let (mut m, mut rt) = mgr();
    assert_eq!(m.release_after(&mut rt, &[t(4)], A, A, Action::EmptyStorage, |_| 4).unwrap(), 0);
    assert_eq!(rt.ops, vec![Op::Release(4, Action::EmptyStorage)]);
    // A rejected retire releases nothing and waits on nothing.
    let e = m.release_after(&mut rt, &[t(4)], A, B, Action::EmptyStorage, |_| 4).unwrap_err();
    assert!(e.to_string().contains("already retired"), "{e}");
    assert_eq!(rt.ops.len(), 1);
}
