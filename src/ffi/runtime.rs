//! [`TorchRuntime`]: executes the manager's decisions through c10 (events, storage release,
//! record_stream), and the conversions between the bridge's plain structs and the core's types.

use cxx::UniquePtr;

use super::bridge::ffi::{self, TensorInfo};
pub(super) use super::bridge::ffi::{StreamKey, TensorList};
use crate::error::{Error, Result};
use crate::runtime::{Action, Device, Runtime, StreamId, TensorKey};

// SAFETY: at::Tensor and c10::Event hold atomically refcounted handles; the shim never shares
// one between threads without the registry's lock.
unsafe impl Send for ffi::TensorRef {}
unsafe impl Send for ffi::EventRef {}

impl From<StreamKey> for StreamId {
    fn from(k: StreamKey) -> Self {
        StreamId { id: k.id, device: Device { device_type: k.device_type, index: k.device_index } }
    }
}

fn key(s: StreamId) -> StreamKey {
    StreamKey { id: s.id, device_index: s.device.index, device_type: s.device.device_type }
}

fn tensor_key(i: TensorInfo) -> TensorKey {
    TensorKey {
        tensor: i.tensor,
        storage: i.storage,
        nbytes: i.nbytes,
        covers_storage: i.covers_storage,
        device: Device { device_type: i.device_type, index: i.device_index },
    }
}

/// The keys of every tensor of an op's `Tensor[]` argument (on the stack up to 8: the eager
/// hot path retires one or a few at a time).
pub(super) fn keys(list: &TensorList) -> smallvec::SmallVec<[TensorKey; 8]> {
    (0..ffi::list_len(list)).map(|i| tensor_key(ffi::list_info(list, i))).collect()
}

/// A new reference to tensor `i` of an op's `Tensor[]` argument, as the manager holds it.
pub(super) fn take(list: &TensorList, i: usize) -> Payload {
    Payload::new(ffi::list_take(list, i))
}

/// Keeps the shim's TORCH_LIBRARY registration object linked (see build.rs).
pub(super) fn anchor() {
    let _ = ffi::registration_anchor();
}

fn shim_err(e: cxx::Exception) -> Error {
    Error::Runtime(e.what().to_string())
}

/// A tensor reference held by the manager. Dropping one never drops the tensor where it is:
/// the reference moves to this thread's [`graveyard`], which [`super::registry::enter`] empties
/// only after it has let go of the registry lock. The last reference to a tensor runs its
/// Python object's deallocation, which takes the GIL (and may let other threads run Python);
/// under the registry lock that is a lock-order inversion with any thread that holds the GIL
/// and waits for the registry (issue 35's deadlock). Rule: no Python object is released while
/// the registry lock is held.
pub(super) struct Payload(Option<UniquePtr<ffi::TensorRef>>);

impl Payload {
    pub(super) fn new(t: UniquePtr<ffi::TensorRef>) -> Self {
        Payload(Some(t))
    }
    fn tensor(&self) -> Option<&ffi::TensorRef> {
        self.0.as_ref().and_then(|t| t.as_ref())
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        let mut t = self.0.take();
        // A thread being torn down has no graveyard left: `t` is then dropped here (no lock is
        // held then: the registry's entries never run during thread-local destruction).
        let _ = GRAVEYARD.try_with(|g| {
            if let Some(t) = t.take() {
                g.borrow_mut().push(t);
            }
        });
    }
}

thread_local! {
    /// Tensor references dropped while this thread held the registry lock, waiting to be
    /// released after it (see [`Payload`]).
    static GRAVEYARD: std::cell::RefCell<Vec<UniquePtr<ffi::TensorRef>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Releases the tensor references this thread's entries dropped; called with no lock held.
pub(super) fn empty_graveyard() {
    loop {
        // Take the list out first: a tensor's deallocation may run Python that calls back
        // into an entry, which pushes onto (and empties) the graveyard again.
        let dead = GRAVEYARD.try_with(|g| std::mem::take(&mut *g.borrow_mut())).unwrap_or_default();
        if dead.is_empty() {
            return;
        }
        drop(dead);
    }
}
/// A plan event.
pub(super) type Event = UniquePtr<ffi::EventRef>;

/// Executes the manager's decisions through c10 (events, storage, record_stream).
pub(super) struct TorchRuntime;

impl Runtime for TorchRuntime {
    type Payload = Payload;
    type Event = Event;

    fn new_event(&mut self, stream: StreamId) -> Result<Self::Event> {
        ffi::new_event(&key(stream)).map_err(shim_err)
    }
    fn record(&mut self, event: &mut Self::Event, stream: StreamId) -> Result<()> {
        let ev = event.as_mut().ok_or_else(|| Error::Runtime("null plan event".into()))?;
        ffi::event_record(ev, &key(stream)).map_err(shim_err)
    }
    fn wait(&mut self, event: &Self::Event, stream: StreamId) -> Result<()> {
        let ev = event.as_ref().ok_or_else(|| Error::Runtime("null plan event".into()))?;
        ffi::event_block(ev, &key(stream)).map_err(shim_err)
    }
    fn release(&mut self, payload: Self::Payload, action: Action) -> Result<()> {
        if action == Action::EmptyStorage {
            if let Some(t) = payload.tensor() {
                ffi::empty_storage(t).map_err(shim_err)?;
            }
        }
        drop(payload);
        Ok(())
    }
    fn record_stream(&mut self, payload: Self::Payload, stream: StreamId) -> Result<()> {
        if let Some(t) = payload.tensor() {
            ffi::record_stream(t, &key(stream)).map_err(shim_err)?;
        }
        Ok(())
    }
}
