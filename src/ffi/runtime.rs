//! [`TorchRuntime`]: executes the manager's decisions through c10 (events, storage release,
//! record_stream), and the conversions between the bridge's plain structs and the core's types.

use cxx::UniquePtr;

use super::bridge::ffi::{self, StreamKey, TensorInfo, TensorList};
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
        device: Device { device_type: i.device_type, index: i.device_index },
    }
}

/// The keys of every tensor of an op's `Tensor[]` argument (on the stack up to 8: the eager
/// hot path retires one or a few at a time).
pub(super) fn keys(list: &TensorList) -> smallvec::SmallVec<[TensorKey; 8]> {
    (0..ffi::list_len(list)).map(|i| tensor_key(ffi::list_info(list, i))).collect()
}

fn shim_err(e: cxx::Exception) -> Error {
    Error::Runtime(e.what().to_string())
}

/// A tensor reference held by the manager.
pub(super) type Payload = UniquePtr<ffi::TensorRef>;
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
            if let Some(t) = payload.as_ref() {
                ffi::empty_storage(t).map_err(shim_err)?;
            }
        }
        drop(payload);
        Ok(())
    }
    fn record_stream(&mut self, payload: Self::Payload, stream: StreamId) -> Result<()> {
        if let Some(t) = payload.as_ref() {
            ffi::record_stream(t, &key(stream)).map_err(shim_err)?;
        }
        Ok(())
    }
}
