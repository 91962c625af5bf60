//! Counters of one lifetime manager, exported as a flat list so the FFI stays simple.

use crate::runtime::Action;

/// What a manager did so far.
#[derive(Copy, Clone, Default, Debug, PartialEq, Eq)]
pub struct Stats {
    /// Tensors bound to an owner stream.
    pub bound: u64,
    /// Tensors bound and not yet retired.
    pub bound_now: u64,
    /// Retired with `EmptyStorage`.
    pub retired_empty_storage: u64,
    /// Retired with `DropReference`.
    pub retired_drop_reference: u64,
    /// Retired with `Preserve`.
    pub retired_preserve: u64,
    /// Retired on their owner stream and released at once (rule 2).
    pub immediate: u64,
    /// Unbound tensors that took the `record_stream` fallback (rule 4).
    pub fallback_record_stream: u64,
    /// Tensors released by an owner-stream drain.
    pub drained: u64,
    /// Owner-stream waits on the plan event.
    pub waits: u64,
    /// Plan-event records on consumer streams.
    pub events_recorded: u64,
    /// Owner streams drained by the terminal hand-back (rule 7).
    pub handbacks: u64,
    /// Noop pass-throughs seen (rule 6).
    pub passthrough: u64,
    /// Parked tensors that took the fallback because the plan was abandoned.
    pub abandoned: u64,
    /// Tensors parked now.
    pub pending_count: u64,
    /// Bytes parked now.
    pub pending_bytes: u64,
    /// Most tensors parked at once.
    pub pending_peak_count: u64,
    /// Most bytes parked at once.
    pub pending_peak_bytes: u64,
}

impl Stats {
    /// Field names, in the order of [`Stats::to_vec`].
    pub const FIELDS: [&'static str; 17] = [
        "bound",
        "bound_now",
        "retired_empty_storage",
        "retired_drop_reference",
        "retired_preserve",
        "immediate",
        "fallback_record_stream",
        "drained",
        "waits",
        "events_recorded",
        "handbacks",
        "passthrough",
        "abandoned",
        "pending_count",
        "pending_bytes",
        "pending_peak_count",
        "pending_peak_bytes",
    ];

    /// Values in the order of [`Stats::FIELDS`].
    pub fn to_vec(&self) -> Vec<i64> {
        [
            self.bound,
            self.bound_now,
            self.retired_empty_storage,
            self.retired_drop_reference,
            self.retired_preserve,
            self.immediate,
            self.fallback_record_stream,
            self.drained,
            self.waits,
            self.events_recorded,
            self.handbacks,
            self.passthrough,
            self.abandoned,
            self.pending_count,
            self.pending_bytes,
            self.pending_peak_count,
            self.pending_peak_bytes,
        ]
        .iter()
        .map(|&v| v as i64)
        .collect()
    }

    pub(crate) fn count_retired(&mut self, action: Action) {
        match action {
            Action::EmptyStorage => self.retired_empty_storage += 1,
            Action::DropReference => self.retired_drop_reference += 1,
            Action::Preserve => self.retired_preserve += 1,
        }
    }
}
