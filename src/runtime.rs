//! The safe boundary between the lifetime manager and whatever executes its decisions.
//!
//! Layering (as in cudarc): `ffi.rs` is the raw cxx bridge to the C++ shim, this module is the
//! safe `Runtime` trait, and the core (`lifetime`) only ever sees this trait. Implementations:
//! the torch shim (`ffi::TorchRuntime`, feature `torch`), cudarc (`cuda`, feature `cuda`) and
//! the `RecordingRuntime` below, which tests and benches use to check the order of operations.

use crate::error::Result;

/// c10's `DeviceType::CPU`.
pub const DEVICE_CPU: i8 = 0;
/// c10's `DeviceType::CUDA`.
pub const DEVICE_CUDA: i8 = 1;

/// A device as c10 names it: (device type, index); CPU has index -1.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct Device {
    /// c10 `DeviceType` code (0 = CPU, 1 = CUDA).
    pub device_type: i8,
    /// Device index, -1 for "the" CPU.
    pub index: i8,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // c10::DeviceType's numbers for the names a user may meet here.
        let name = match self.device_type {
            DEVICE_CPU => "cpu",
            DEVICE_CUDA => "cuda",
            6 => "hip",
            12 => "xpu",
            13 => "mps",
            14 => "meta",
            20 => "privateuseone",
            t => return write!(f, "device type {t}"),
        };
        if self.index < 0 {
            write!(f, "{name}")
        } else {
            write!(f, "{name}:{}", self.index)
        }
    }
}

/// A stream, packed the way `c10::Stream::pack3` does; opaque to the core except for its device.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct StreamId {
    /// c10 stream id (for CUDA: pool/priority bits and index, or the raw handle of an external stream).
    pub id: i64,
    /// The stream's device.
    pub device: Device,
}

impl StreamId {
    /// A stream on a CUDA device.
    pub const fn cuda(index: i8, id: i64) -> Self {
        StreamId { id, device: Device { device_type: DEVICE_CUDA, index } }
    }
    /// The CPU's one stream.
    pub const fn cpu() -> Self {
        StreamId { id: 0, device: Device { device_type: DEVICE_CPU, index: -1 } }
    }
    /// Host-ordered streams (CPU) need no events: work on them is done when the call returns.
    pub fn is_host(&self) -> bool {
        self.device.device_type == DEVICE_CPU
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stream {} on {}", self.id, self.device)
    }
}

/// What happens to a retired tensor's storage when its owner stream drains it (DESIGN.md §2 rule 3).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub enum Action {
    /// Forward inputs: `untyped_storage().resize_(0)`, then drop the manager's reference.
    EmptyStorage,
    /// Backward incoming gradients: hold one strong reference until drain, never resize.
    DropReference,
    /// Storage owned by someone else (EP library buffers, symmetric memory): never resize.
    Preserve,
}

impl Action {
    /// All actions, in the order of their integer codes.
    pub const ALL: [Action; 3] = [Action::EmptyStorage, Action::DropReference, Action::Preserve];

    /// Integer code used across the FFI (0, 1, 2).
    pub fn code(self) -> i64 {
        self as i64
    }

    /// Parse an integer code; the error names the accepted values.
    pub fn from_code(code: i64) -> Result<Action> {
        Action::ALL.get(usize::try_from(code).unwrap_or(usize::MAX)).copied().ok_or_else(|| {
            crate::Error::InvalidInput(format!(
                "unknown retire action code {code}: expected 0 (empty_storage), 1 (drop_reference) or 2 (preserve)"
            ))
        })
    }

    /// The name Python uses.
    pub fn name(self) -> &'static str {
        match self {
            Action::EmptyStorage => "empty_storage",
            Action::DropReference => "drop_reference",
            Action::Preserve => "preserve",
        }
    }
}

/// Identity and size of a tensor as the manager needs them; the runtime's payload holds the
/// tensor itself.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct TensorKey {
    /// Identity of the tensor object (the TensorImpl address while a reference is held).
    pub tensor: u64,
    /// Identity of its storage (the StorageImpl address), for alias checks.
    pub storage: u64,
    /// Storage size in bytes.
    pub nbytes: u64,
    /// The tensor spans its whole storage (not a view of part of it): only then may a retire
    /// empty the storage (`EmptyStorage` on a part would empty the base tensor's bytes too).
    pub covers_storage: bool,
    /// The tensor's device.
    pub device: Device,
}

/// What the lifetime manager drives: events on streams, and the release of held tensors.
///
/// Invariant the manager keeps (rule 1): for a cross-stream entry, `wait(event, owner)` is
/// called before `release(payload, ..)` of that entry.
pub trait Runtime {
    /// A strong reference to one tensor (dropping it drops the reference).
    type Payload;
    /// An event that can be recorded on one stream and waited on by others.
    type Event;

    /// Create an event usable on `stream`'s device.
    fn new_event(&mut self, stream: StreamId) -> Result<Self::Event>;
    /// Record `event` on `stream` (marks everything queued on `stream` so far).
    fn record(&mut self, event: &mut Self::Event, stream: StreamId) -> Result<()>;
    /// Make `stream` wait (device-side, no host sync) for the last record of `event`.
    fn wait(&mut self, event: &Self::Event, stream: StreamId) -> Result<()>;
    /// Carry out `action` on the held tensor and drop the reference.
    fn release(&mut self, payload: Self::Payload, action: Action) -> Result<()>;
    /// The conservative fallback: `tensor.record_stream(stream)`, then drop the reference.
    fn record_stream(&mut self, payload: Self::Payload, stream: StreamId) -> Result<()>;
}

/// One operation as seen by [`RecordingRuntime`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Op {
    /// An event was created (event id, stream).
    NewEvent(u32, StreamId),
    /// `record(event, stream)`.
    Record(u32, StreamId),
    /// `wait(event, stream)`.
    Wait(u32, StreamId),
    /// `release(tensor id, action)`.
    Release(u64, Action),
    /// `record_stream(tensor id, stream)`.
    RecordStream(u64, StreamId),
}

/// A runtime that executes nothing and records every call, in order; payloads are plain ids.
/// Tests use it to check the protocol's ordering rules; benches use it to time the core alone.
#[derive(Default, Debug)]
pub struct RecordingRuntime {
    /// Every call, in issue order.
    pub ops: Vec<Op>,
    /// When false, calls are counted but not stored (benches).
    pub keep: bool,
    events: u32,
    /// Number of calls seen.
    pub calls: u64,
    /// Make the next `wait` fail (to test that nothing is released after a failed wait).
    pub fail_next_wait: bool,
}

impl RecordingRuntime {
    /// A runtime that keeps its log.
    pub fn new() -> Self {
        RecordingRuntime { keep: true, ..Default::default() }
    }
    /// A runtime that only counts (for benchmarks).
    pub fn counting() -> Self {
        RecordingRuntime::default()
    }
    fn push(&mut self, op: Op) {
        self.calls += 1;
        if self.keep {
            self.ops.push(op);
        }
    }
}

impl Runtime for RecordingRuntime {
    type Payload = u64;
    type Event = u32;

    fn new_event(&mut self, stream: StreamId) -> Result<u32> {
        self.events += 1;
        self.push(Op::NewEvent(self.events, stream));
        Ok(self.events)
    }
    fn record(&mut self, event: &mut u32, stream: StreamId) -> Result<()> {
        self.push(Op::Record(*event, stream));
        Ok(())
    }
    fn wait(&mut self, event: &u32, stream: StreamId) -> Result<()> {
        if std::mem::take(&mut self.fail_next_wait) {
            return Err(crate::Error::Runtime(format!("injected wait failure on {stream}")));
        }
        self.push(Op::Wait(*event, stream));
        Ok(())
    }
    fn release(&mut self, payload: u64, action: Action) -> Result<()> {
        self.push(Op::Release(payload, action));
        Ok(())
    }
    fn record_stream(&mut self, payload: u64, stream: StreamId) -> Result<()> {
        self.push(Op::RecordStream(payload, stream));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_says_its_name() {
        let d = |device_type, index| Device { device_type, index }.to_string();
        assert_eq!((d(DEVICE_CPU, -1), d(DEVICE_CUDA, 1)), ("cpu".into(), "cuda:1".into()));
        assert_eq!((d(14, -1), d(13, 0), d(99, 0)), ("meta".into(), "mps:0".into(), "device type 99".into()));
    }
}
