//! The lifetime manager: frees tensors that cross streams as soon as the schedule proves it safe.
//!
//! One [`Manager`] per plan (rule 5). A consumer on stream B *retires* a tensor owned by stream
//! A; the manager records its plan event on B and parks the tensor in `pending[A]`. The next
//! *acquire* of A enqueues `A.wait(event)` and only then releases the parked tensors (rule 1),
//! so the caching allocator can hand the block out again on A with no reuse race and no
//! `record_stream`. The rules of DESIGN.md §2 are enforced here, each where it is named; their
//! tests are in `tests/lifetime_rules.rs`.

mod stats;

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use smallvec::SmallVec;

pub use stats::Stats;

use crate::error::{Error, Result};
use crate::runtime::{Action, Runtime, StreamId, TensorKey};

/// Keys are object addresses: already well spread, so a multiplicative mix is enough.
#[derive(Default)]
pub struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type AddrMap<V> = HashMap<u64, V, BuildHasherDefault<AddrHasher>>;
type AddrSet = HashSet<u64, BuildHasherDefault<AddrHasher>>;

struct Binding<P> {
    owner: StreamId,
    nbytes: u64,
    payload: P,
}

struct Parked<P> {
    tensor: u64,
    storage: u64,
    consumer: StreamId,
    action: Action,
    nbytes: u64,
    payload: P,
}

/// Tensors waiting for their owner stream's next acquire.
struct OwnerQueue<P> {
    owner: StreamId,
    entries: Vec<Parked<P>>,
    /// Consumer streams whose plan-event record covers these entries (the owner waits on each).
    consumers: SmallVec<[StreamId; 2]>,
}

/// Work on one stream, or on host-ordered streams, needs no event between producer and
/// consumer: the consumer's work is queued after (or already done before) the next owner use.
fn same_queue(owner: StreamId, consumer: StreamId) -> bool {
    owner == consumer || (owner.is_host() && consumer.is_host())
}

/// The per-plan lifetime manager. It stores payloads `P` (strong references) and events `E`
/// of the [`Runtime`] that executes its decisions; each call takes that runtime.
pub struct Manager<P, E> {
    name: String,
    bindings: AddrMap<Binding<P>>,
    /// Tensor keys parked in some owner queue (retiring one again is an error).
    parked: AddrSet,
    /// Storages of parked tensors (kept alive by their payloads, so an address names one
    /// storage): retiring another view of one in a later call is an alias (rule 8).
    parked_storages: AddrSet,
    /// Tensors released at once with `EmptyStorage`, held (their storage already empty, so no
    /// device memory) until the plan ends: their addresses stay theirs, and retiring one again
    /// is caught instead of taking the record_stream fallback.
    spent: AddrMap<P>,
    queues: SmallVec<[OwnerQueue<P>; 4]>,
    /// The plan event, one per consumer stream: each record marks that stream's consumes.
    events: SmallVec<[(StreamId, E); 2]>,
    stats: Stats,
    finalized: bool,
}

impl<P, E> Manager<P, E> {
    /// A manager for one plan; `name` appears in every error message.
    pub fn new(name: impl Into<String>) -> Self {
        Manager {
            name: name.into(),
            bindings: AddrMap::default(),
            parked: AddrSet::default(),
            parked_storages: AddrSet::default(),
            spent: AddrMap::default(),
            queues: SmallVec::new(),
            events: SmallVec::new(),
            stats: Stats::default(),
            finalized: false,
        }
    }

    /// The plan's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats;
        s.bound_now = self.bindings.len() as u64;
        s
    }

    /// True once `finalize` succeeded.
    pub fn is_finalized(&self) -> bool {
        self.finalized
    }

    fn check_open(&self) -> Result<()> {
        if self.finalized {
            return Err(Error::Protocol(format!(
                "lifetime manager '{}' was already finalized; create a new manager for the next plan",
                self.name
            )));
        }
        Ok(())
    }

    /// Reject duplicates (and, when retiring, aliases: rule 8) inside one call before any
    /// state changes. Binding two views of one storage is fine; retiring both is not.
    fn check_distinct(&self, verb: &str, tensors: &[TensorKey], reject_alias: bool) -> Result<()> {
        // Sorted by (storage, tensor): copies of one tensor and views of one storage are adjacent.
        let mut by_storage: SmallVec<[(u64, u64, usize); 16]> =
            tensors.iter().enumerate().map(|(i, t)| (t.storage, t.tensor, i)).collect();
        by_storage.sort_unstable();
        for w in by_storage.windows(2) {
            let (a, b) = (w[0].2, w[1].2);
            let same_tensor = w[0].1 == w[1].1;
            let alias = w[0].0 == w[1].0 && w[0].0 != 0;
            if same_tensor || (reject_alias && alias) {
                return Err(if same_tensor {
                    Error::Protocol(format!(
                        "plan '{}': tensors {a} and {b} of one {verb} call are the same tensor; {verb} it once",
                        self.name
                    ))
                } else {
                    Error::Protocol(format!(
                        "plan '{}': tensors {a} and {b} of one {verb} call alias one storage; \
                         retiring both would release it twice (rule 8: aliases are rejected)",
                        self.name
                    ))
                });
            }
        }
        Ok(())
    }

    /// Per-tensor checks of bind and retire: on the stream's device, not already parked.
    fn check_tensor(&self, verb: &str, role: &str, i: usize, t: &TensorKey, stream: StreamId) -> Result<()> {
        self.check_device(verb, role, i, t, stream)?;
        if self.parked.contains(&t.tensor) {
            return Err(Error::Protocol(format!(
                "plan '{}': {verb}: tensor {i} was already retired and waits for its owner's acquire",
                self.name
            )));
        }
        if self.spent.contains_key(&t.tensor) {
            return Err(Error::Protocol(format!(
                "plan '{}': {verb}: tensor {i} was already retired and its storage emptied",
                self.name
            )));
        }
        if verb == "retire" && t.storage != 0 && self.parked_storages.contains(&t.storage) {
            return Err(Error::Protocol(format!(
                "plan '{}': retire: tensor {i} aliases the storage of a tensor already retired in this plan; \
                 retiring both would release it twice (rule 8: aliases are rejected)",
                self.name
            )));
        }
        Ok(())
    }

    /// Rule 3's `EmptyStorage` frees the storage, so it applies only to a tensor that spans its
    /// whole storage: on a view of part of one it would empty the base tensor's bytes as well (a
    /// later read of the base reads freed memory). Such a view is refused, naming the fix.
    fn check_action(&self, verb: &str, i: usize, t: &TensorKey, action: Action) -> Result<()> {
        if action == Action::EmptyStorage && !t.covers_storage && t.nbytes == 0 {
            // Elements but no bytes: the storage was emptied already (another plan's retire).
            return Err(Error::InvalidInput(format!(
                "plan '{}': {verb}: tensor {i}'s storage is already empty (0 bytes; emptied by another plan's \
                 retire?): there is nothing to free; retire each tensor in one plan, or this one with \
                 action='drop_reference'",
                self.name
            )));
        }
        if action == Action::EmptyStorage && !t.covers_storage {
            return Err(Error::InvalidInput(format!(
                "plan '{}': {verb}: tensor {i} is a view of part of its storage ({} bytes); action \
                 'empty_storage' would empty the whole storage, under its base tensor too: retire \
                 the base tensor, or this view with action='drop_reference'",
                self.name, t.nbytes
            )));
        }
        Ok(())
    }

    /// The tensor is on the stream's device.
    fn check_device(&self, verb: &str, role: &str, i: usize, t: &TensorKey, stream: StreamId) -> Result<()> {
        if t.device != stream.device {
            return Err(Error::InvalidInput(format!(
                "plan '{}': {verb}: tensor {i} is on {} but the {role} stream is {stream}",
                self.name, t.device
            )));
        }
        Ok(())
    }

    /// Bind's own check: not bound to another owner.
    fn check_owner(&self, i: usize, t: &TensorKey, owner: StreamId) -> Result<()> {
        match self.bindings.get(&t.tensor) {
            Some(b) if b.owner != owner => Err(Error::Protocol(format!(
                "plan '{}': bind: tensor {i} is already bound to {}, not {owner}",
                self.name, b.owner
            ))),
            _ => Ok(()),
        }
    }

    /// Record that `tensors` are owned by `owner` (the stream their storage was allocated on).
    /// `take(i)` yields the runtime's strong reference to tensor `i`.
    pub fn bind(
        &mut self,
        tensors: &[TensorKey],
        owner: StreamId,
        mut take: impl FnMut(usize) -> P,
    ) -> Result<()> {
        self.check_open()?;
        self.check_distinct("bind", tensors, false)?;
        for (i, t) in tensors.iter().enumerate() {
            self.check_tensor("bind", "owner", i, t, owner)?;
            self.check_owner(i, t, owner)?;
        }
        for (i, t) in tensors.iter().enumerate() {
            // Binding again to the same owner changes nothing (idempotent).
            if let std::collections::hash_map::Entry::Vacant(e) = self.bindings.entry(t.tensor) {
                e.insert(Binding { owner, nbytes: t.nbytes, payload: take(i) });
                self.stats.bound += 1;
            }
        }
        Ok(())
    }

    /// A noop/view node passed these tensors through unchanged (rule 6): the binding stays
    /// with the object and reaches the next real consumer. Errors if one was already retired.
    pub fn passthrough(&mut self, tensors: &[TensorKey]) -> Result<()> {
        self.check_open()?;
        for (i, t) in tensors.iter().enumerate() {
            if self.parked.contains(&t.tensor) {
                return Err(Error::Protocol(format!(
                    "plan '{}': passthrough: tensor {i} was already retired; a noop after the last \
                     consumer would read released storage",
                    self.name
                )));
            }
        }
        self.stats.passthrough += tensors.len() as u64;
        Ok(())
    }

    /// The consumer on `consumer` is done with `tensors` (its work is already queued).
    ///
    /// Bound tensors on their owner stream are released at once (rule 2); bound tensors of
    /// another owner are parked until that owner's acquire (rules 1, 3); unbound tensors take
    /// the `record_stream(consumer)` fallback (rule 4). Validation runs before any change.
    pub fn retire<R: Runtime<Payload = P, Event = E>>(
        &mut self,
        rt: &mut R,
        tensors: &[TensorKey],
        consumer: StreamId,
        action: Action,
        mut take: impl FnMut(usize) -> P,
    ) -> Result<()> {
        self.check_open()?;
        self.check_distinct("retire", tensors, true)?;
        let mut cross = false;
        for (i, t) in tensors.iter().enumerate() {
            self.check_tensor("retire", "consumer", i, t, consumer)?;
            self.check_action("retire", i, t, action)?;
            if let Some(b) = self.bindings.get(&t.tensor) {
                cross |= !same_queue(b.owner, consumer);
            }
        }
        if cross {
            // Mark the consumer's work before anything is parked, so every parked entry is covered.
            self.record_plan_event(rt, consumer)?;
        }
        for (i, t) in tensors.iter().enumerate() {
            match self.bindings.remove(&t.tensor) {
                Some(b) => self.settle(rt, b, t, consumer, action, || take(i))?,
                None => {
                    self.stats.fallback_record_stream += 1;
                    let payload = take(i);
                    if consumer.is_host() {
                        // Host-ordered work is finished when the call returns: nothing to record.
                        drop(payload);
                    } else {
                        rt.record_stream(payload, consumer)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `bind` to `owner`, then `retire` on `consumer`, in one call: the eager hot path, for a
    /// caller that knows the owner stream when it retires (one call instead of a bind per
    /// tensor as it is produced plus a retire). Every check of both runs before any change.
    pub fn retire_owned<R: Runtime<Payload = P, Event = E>>(
        &mut self,
        rt: &mut R,
        tensors: &[TensorKey],
        owner: StreamId,
        consumer: StreamId,
        action: Action,
        mut take: impl FnMut(usize) -> P,
    ) -> Result<()> {
        self.check_open()?;
        self.check_distinct("retire", tensors, true)?;
        // Retire's checks, then bind's (each tensor looked up once more: the hot path does not
        // go through `bind` and `retire`, which would repeat every check and map update).
        for (i, t) in tensors.iter().enumerate() {
            self.check_tensor("retire", "consumer", i, t, consumer)?;
            self.check_action("retire", i, t, action)?;
        }
        for (i, t) in tensors.iter().enumerate() {
            self.check_device("bind", "owner", i, t, owner)?;
            self.check_owner(i, t, owner)?;
        }
        // Every tensor is (or now becomes) bound to `owner`, so the call crosses or it does not.
        if !tensors.is_empty() && !same_queue(owner, consumer) {
            self.record_plan_event(rt, consumer)?;
        }
        for (i, t) in tensors.iter().enumerate() {
            let b = match self.bindings.remove(&t.tensor) {
                Some(b) => b,
                None => {
                    self.stats.bound += 1;
                    Binding { owner, nbytes: t.nbytes, payload: take(i) }
                }
            };
            self.settle(rt, b, t, consumer, action, || take(i))?;
        }
        Ok(())
    }

    /// `retire_owned`, then `acquire(owner)`: the consumer has queued its last use, the owner
    /// waits for it now and the storage goes back to the owner's pool at once (with this plan's
    /// other tensors parked for `owner`). Returns how many tensors the acquire released.
    pub fn release_after<R: Runtime<Payload = P, Event = E>>(
        &mut self,
        rt: &mut R,
        tensors: &[TensorKey],
        owner: StreamId,
        consumer: StreamId,
        action: Action,
        take: impl FnMut(usize) -> P,
    ) -> Result<usize> {
        self.retire_owned(rt, tensors, owner, consumer, action, take)?;
        self.drain(rt, owner)
    }

    /// A bound tensor's retire on `consumer`: released now on its owner's queue (rule 2; an
    /// emptied storage's object is kept until the plan ends), parked for its owner otherwise
    /// (rules 1, 3). `again` yields one more reference to the tensor.
    fn settle<R: Runtime<Payload = P, Event = E>>(
        &mut self,
        rt: &mut R,
        b: Binding<P>,
        t: &TensorKey,
        consumer: StreamId,
        action: Action,
        again: impl FnOnce() -> P,
    ) -> Result<()> {
        self.stats.count_retired(action);
        if same_queue(b.owner, consumer) {
            self.stats.immediate += 1;
            if action == Action::EmptyStorage {
                // Empty the storage now; keep the (now memoryless) object until the plan ends.
                rt.release(again(), action)?;
                self.spent.insert(t.tensor, b.payload);
                return Ok(());
            }
            return rt.release(b.payload, action);
        }
        // Preserve releases nothing of the storage, so its views may be parked twice.
        if t.storage != 0 && action != Action::Preserve {
            self.parked_storages.insert(t.storage);
        }
        self.park(b, t.tensor, t.storage, consumer, action);
        Ok(())
    }

    fn record_plan_event<R: Runtime<Payload = P, Event = E>>(&mut self, rt: &mut R, consumer: StreamId) -> Result<()> {
        let slot = match self.events.iter().position(|(s, _)| *s == consumer) {
            Some(i) => i,
            None => {
                let ev = rt.new_event(consumer)?;
                self.events.push((consumer, ev));
                self.events.len() - 1
            }
        };
        rt.record(&mut self.events[slot].1, consumer)?;
        self.stats.events_recorded += 1;
        Ok(())
    }

    fn park(&mut self, b: Binding<P>, tensor: u64, storage: u64, consumer: StreamId, action: Action) {
        let qi = match self.queues.iter().position(|q| q.owner == b.owner) {
            Some(i) => i,
            None => {
                self.queues.push(OwnerQueue { owner: b.owner, entries: Vec::new(), consumers: SmallVec::new() });
                self.queues.len() - 1
            }
        };
        let q = &mut self.queues[qi];
        if !q.consumers.contains(&consumer) {
            q.consumers.push(consumer);
        }
        q.entries.push(Parked { tensor, storage, consumer, action, nbytes: b.nbytes, payload: b.payload });
        self.parked.insert(tensor);
        self.stats.pending_count += 1;
        self.stats.pending_bytes += b.nbytes;
        self.stats.pending_peak_count = self.stats.pending_peak_count.max(self.stats.pending_count);
        self.stats.pending_peak_bytes = self.stats.pending_peak_bytes.max(self.stats.pending_bytes);
    }

    /// The next node on `stream` is about to run: enqueue `stream.wait(plan event)` for every
    /// consumer that parked tensors owned by `stream`, then release them (rule 1). Only this
    /// plan's queue is drained (rule 5). Returns the number of tensors released.
    pub fn acquire<R: Runtime<Payload = P, Event = E>>(&mut self, rt: &mut R, stream: StreamId) -> Result<usize> {
        self.check_open()?;
        self.drain(rt, stream)
    }

    fn drain<R: Runtime<Payload = P, Event = E>>(&mut self, rt: &mut R, stream: StreamId) -> Result<usize> {
        let Some(qi) = self.queues.iter().position(|q| q.owner == stream && !q.entries.is_empty()) else {
            return Ok(0);
        };
        let _span = tracing::debug_span!("drain", plan = %self.name, stream = %stream).entered();
        // Rule 1: every wait is enqueued before the first release; a failed wait releases nothing.
        for c in self.queues[qi].consumers.iter() {
            let ev = &self.events.iter().find(|(s, _)| s == c).ok_or_else(|| {
                Error::Runtime(format!("plan '{}': no plan event recorded on consumer {c}", self.name))
            })?;
            rt.wait(&ev.1, stream)?;
            self.stats.waits += 1;
        }
        let q = &mut self.queues[qi];
        q.consumers.clear();
        // Taken and put back so the queue keeps its capacity (no allocation per drain).
        let mut entries = std::mem::take(&mut q.entries);
        let n = entries.len();
        let mut first_err = None;
        for e in entries.drain(..) {
            self.parked.remove(&e.tensor);
            self.parked_storages.remove(&e.storage);
            self.stats.pending_count -= 1;
            self.stats.pending_bytes -= e.nbytes;
            self.stats.drained += 1;
            if let Err(err) = rt.release(e.payload, e.action) {
                first_err.get_or_insert(err);
            }
        }
        self.queues[qi].entries = entries;
        first_err.map_or(Ok(n), Err)
    }

    /// Terminal hand-back (rule 7): every owner stream with parked tensors waits on the plan
    /// event and drains. Tensors bound but never retired are an error (nothing changes, the
    /// manager stays open so the caller can retire them and finalize again).
    pub fn finalize<R: Runtime<Payload = P, Event = E>>(&mut self, rt: &mut R) -> Result<Stats> {
        self.check_open()?;
        if !self.bindings.is_empty() {
            let bytes: u64 = self.bindings.values().map(|b| b.nbytes).sum();
            let owners: std::collections::BTreeSet<String> =
                self.bindings.values().map(|b| b.owner.to_string()).collect();
            return Err(Error::Protocol(format!(
                "plan '{}': finalize: {} tensor(s) ({bytes} bytes) were bound but never retired \
                 (owners: {}); retire them before finalize",
                self.name,
                self.bindings.len(),
                owners.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
        let _span = tracing::debug_span!("finalize", plan = %self.name).entered();
        let owners: SmallVec<[StreamId; 4]> =
            self.queues.iter().filter(|q| !q.entries.is_empty()).map(|q| q.owner).collect();
        for owner in owners {
            self.drain(rt, owner)?;
            self.stats.handbacks += 1;
        }
        self.spent.clear();
        self.finalized = true;
        Ok(self.stats())
    }

    /// Tear down without a schedule (the plan was abandoned, e.g. after an exception): parked
    /// tensors take the `record_stream(consumer)` fallback so no block is reused early, and
    /// bindings are dropped. Leaves the manager finalized.
    pub fn abandon<R: Runtime<Payload = P, Event = E>>(&mut self, rt: &mut R) -> Result<()> {
        let mut first_err = None;
        for q in self.queues.iter_mut() {
            for e in q.entries.drain(..) {
                self.stats.abandoned += 1;
                self.stats.pending_count -= 1;
                self.stats.pending_bytes -= e.nbytes;
                let r = if e.consumer.is_host() { Ok(()) } else { rt.record_stream(e.payload, e.consumer) };
                if let Err(err) = r {
                    first_err.get_or_insert(err);
                }
            }
            q.consumers.clear();
        }
        self.parked.clear();
        self.parked_storages.clear();
        self.spent.clear();
        self.bindings.clear();
        self.finalized = true;
        first_err.map_or(Ok(()), Err)
    }

    /// Number of tensors parked, per owner stream (for tests and reports).
    pub fn parked_on(&self, owner: StreamId) -> usize {
        self.queues.iter().find(|q| q.owner == owner).map_or(0, |q| q.entries.len())
    }
}

impl<P, E> Drop for Manager<P, E> {
    fn drop(&mut self) {
        if self.stats.pending_count > 0 {
            tracing::warn!(plan = %self.name, pending = self.stats.pending_count,
                "lifetime manager dropped with parked tensors; call finalize() or abandon()");
        }
    }
}
