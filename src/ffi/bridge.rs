//! The one `#[cxx::bridge]` (raw layer): the C++ shim's adapters (tensor lists, c10 events,
//! storage release, record_stream) and the Rust entry points its TORCH_LIBRARY kernels call.
//! Declarations only; the entry points live in `lifetime_ops` (typed tensor/stream ops) and
//! `json_ops` (every JSON-in/JSON-out op, through one table).

#[cxx::bridge(namespace = "sched_lifetime")]
pub(crate) mod ffi {
    /// `c10::Stream::pack3()`.
    #[derive(Copy, Clone, Debug)]
    struct StreamKey {
        id: i64,
        device_index: i8,
        device_type: i8,
    }

    /// What the manager needs to know of one tensor.
    #[derive(Copy, Clone, Debug)]
    struct TensorInfo {
        tensor: u64,
        storage: u64,
        nbytes: u64,
        /// The tensor's elements span its whole storage (offset 0, nothing before or after).
        covers_storage: bool,
        device_type: i8,
        device_index: i8,
    }

    unsafe extern "C++" {
        include!("sched-lifetime/cpp/shim.h");

        /// One strong reference to an `at::Tensor`.
        type TensorRef;
        /// The `Tensor[]` argument of the op being executed (borrowed for the call).
        type TensorList;
        /// A `c10::Event`.
        type EventRef;

        fn list_len(list: &TensorList) -> usize;
        fn list_info(list: &TensorList, i: usize) -> TensorInfo;
        fn list_take(list: &TensorList, i: usize) -> UniquePtr<TensorRef>;
        fn new_event(stream: &StreamKey) -> Result<UniquePtr<EventRef>>;
        fn event_record(event: Pin<&mut EventRef>, stream: &StreamKey) -> Result<()>;
        fn event_block(event: &EventRef, stream: &StreamKey) -> Result<()>;
        fn empty_storage(tensor: &TensorRef) -> Result<()>;
        fn record_stream(tensor: &TensorRef, stream: &StreamKey) -> Result<()>;
        fn registration_anchor() -> u32;
    }

    extern "Rust" {
        // Lifetime manager ops (typed: tensors and streams).
        fn sl_create(name: &str) -> Result<u64>;
        fn sl_bind(mgr: u64, tensors: &TensorList, owner: StreamKey) -> Result<()>;
        fn sl_retire(mgr: u64, tensors: &TensorList, consumer: StreamKey, action: i64) -> Result<()>;
        fn sl_retire_owned(mgr: u64, tensors: &TensorList, owner: StreamKey, consumer: StreamKey, action: i64) -> Result<()>;
        fn sl_release(mgr: u64, tensors: &TensorList, owner: StreamKey, consumer: StreamKey, action: i64) -> Result<i64>;
        fn sl_passthrough(mgr: u64, tensors: &TensorList) -> Result<()>;
        fn sl_acquire(mgr: u64, stream: StreamKey) -> Result<i64>;
        fn sl_finalize(mgr: u64) -> Result<Vec<i64>>;
        fn sl_stats(mgr: u64) -> Result<Vec<i64>>;
        fn sl_destroy(mgr: u64) -> Result<()>;
        // JSON ops: their schemas, and one call that dispatches on the op's name.
        fn sl_json_schemas() -> Vec<String>;
        fn sl_json_call(op: &str, args: &str) -> Result<String>;
    }
}

use super::json_ops::{sl_json_call, sl_json_schemas};
use super::lifetime_ops::{sl_acquire, sl_bind, sl_create, sl_destroy, sl_finalize, sl_passthrough, sl_release, sl_retire, sl_retire_owned, sl_stats};
