//! The one cxx bridge (feature `torch`): the only file that knows about C++.
//!
//! Raw layer: `bridge` declares the C++ shim's adapters (tensor lists, c10 events, storage
//! release, record_stream) and the Rust entry points the TORCH_LIBRARY kernels call.
//! Safe layer: `TorchRuntime` implements [`Runtime`] over the adapters, and a registry of
//! per-plan managers maps the integer handles Python holds to [`Manager`]s. Every entry point
//! returns `Result` (a C++ exception on the other side, turned into a torch error by the shim)
//! and catches panics, so nothing unwinds across the boundary.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use cxx::UniquePtr;
use once_cell::sync::Lazy;

use crate::error::{Error, Result};
use crate::lifetime::{Manager, Stats};
use crate::runtime::{Action, Device, Runtime, StreamId, TensorKey};

#[cxx::bridge(namespace = "sched_lifetime")]
mod bridge {
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
        fn sl_create(name: &str) -> Result<u64>;
        fn sl_bind(mgr: u64, tensors: &TensorList, owner: StreamKey) -> Result<()>;
        fn sl_retire(mgr: u64, tensors: &TensorList, consumer: StreamKey, action: i64) -> Result<()>;
        fn sl_passthrough(mgr: u64, tensors: &TensorList) -> Result<()>;
        fn sl_acquire(mgr: u64, stream: StreamKey) -> Result<i64>;
        fn sl_finalize(mgr: u64) -> Result<Vec<i64>>;
        fn sl_stats(mgr: u64) -> Result<Vec<i64>>;
        fn sl_stats_fields() -> String;
        fn sl_destroy(mgr: u64) -> Result<()>;
        fn sl_simulate(plan: &str, policy: &str, mode: &str, trace: bool) -> Result<String>;
        fn sl_scenario(name: &str) -> Result<String>;
        fn sl_schedule(graph: &str, ep_budget: &str, page_budget: &str, explain: bool) -> Result<String>;
        fn sl_validate(graph: &str, order: &str, syncs: &str, ep_budget: &str, page_budget: &str) -> Result<()>;
    }
}

// SAFETY: at::Tensor and c10::Event hold atomically refcounted handles; the shim never shares
// one between threads without the registry's lock.
unsafe impl Send for bridge::TensorRef {}
unsafe impl Send for bridge::EventRef {}

use bridge::{StreamKey, TensorInfo, TensorList};

/// Prefix the shim looks for to raise `ValueError` instead of `RuntimeError`.
const VALUE_ERROR_TAG: &str = "[ValueError] ";

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

fn shim_err(e: cxx::Exception) -> Error {
    Error::Runtime(e.what().to_string())
}

type TorchManager = Manager<UniquePtr<bridge::TensorRef>, UniquePtr<bridge::EventRef>>;

/// Executes the manager's decisions through c10 (events, storage, record_stream).
pub struct TorchRuntime;

impl Runtime for TorchRuntime {
    type Payload = UniquePtr<bridge::TensorRef>;
    type Event = UniquePtr<bridge::EventRef>;

    fn new_event(&mut self, stream: StreamId) -> Result<Self::Event> {
        bridge::new_event(&key(stream)).map_err(shim_err)
    }
    fn record(&mut self, event: &mut Self::Event, stream: StreamId) -> Result<()> {
        let ev = event.as_mut().ok_or_else(|| Error::Runtime("null plan event".into()))?;
        bridge::event_record(ev, &key(stream)).map_err(shim_err)
    }
    fn wait(&mut self, event: &Self::Event, stream: StreamId) -> Result<()> {
        let ev = event.as_ref().ok_or_else(|| Error::Runtime("null plan event".into()))?;
        bridge::event_block(ev, &key(stream)).map_err(shim_err)
    }
    fn release(&mut self, payload: Self::Payload, action: Action) -> Result<()> {
        if action == Action::EmptyStorage {
            if let Some(t) = payload.as_ref() {
                bridge::empty_storage(t).map_err(shim_err)?;
            }
        }
        drop(payload);
        Ok(())
    }
    fn record_stream(&mut self, payload: Self::Payload, stream: StreamId) -> Result<()> {
        if let Some(t) = payload.as_ref() {
            bridge::record_stream(t, &key(stream)).map_err(shim_err)?;
        }
        Ok(())
    }
}

/// Live managers, addressed by `generation << 32 | (slot + 1)` so a stale handle is caught.
#[derive(Default)]
struct Registry {
    slots: Vec<(u32, Option<TorchManager>)>,
    free: Vec<usize>,
}

static REGISTRY: Lazy<Mutex<Registry>> = Lazy::new(|| Mutex::new(Registry::default()));

impl Registry {
    fn insert(&mut self, m: TorchManager) -> u64 {
        let slot = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push((0, None));
                self.slots.len() - 1
            }
        };
        let entry = &mut self.slots[slot];
        entry.0 = entry.0.wrapping_add(1);
        entry.1 = Some(m);
        (u64::from(entry.0) << 32) | (slot as u64 + 1)
    }

    fn slot(&self, h: u64) -> Option<usize> {
        let slot = (h & 0xFFFF_FFFF).checked_sub(1)? as usize;
        let (gen, m) = self.slots.get(slot)?;
        (u64::from(*gen) == h >> 32 && m.is_some()).then_some(slot)
    }

    fn get(&mut self, h: u64) -> Result<&mut TorchManager> {
        let slot = self.slot(h).ok_or(Error::UnknownManager(h))?;
        self.slots[slot].1.as_mut().ok_or(Error::UnknownManager(h))
    }

    fn remove(&mut self, h: u64) -> Result<TorchManager> {
        let slot = self.slot(h).ok_or(Error::UnknownManager(h))?;
        self.free.push(slot);
        self.slots[slot].1.take().ok_or(Error::UnknownManager(h))
    }
}

/// Run an entry point: turn on logging if asked (once), lock the registry, catch panics, tag
/// value errors for the shim.
fn enter<T>(f: impl FnOnce(&mut Registry) -> Result<T>) -> std::result::Result<T, String> {
    crate::init_logging();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut reg)
    }));
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.is_value_error() => Err(format!("{VALUE_ERROR_TAG}{e}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(format!(
            "internal error (panic in sched_lifetime): {}",
            p.downcast_ref::<&str>().copied().or(p.downcast_ref::<String>().map(|s| s.as_str())).unwrap_or("?")
        )),
    }
}

fn keys(list: &TensorList) -> Vec<TensorKey> {
    (0..bridge::list_len(list)).map(|i| tensor_key(bridge::list_info(list, i))).collect()
}

fn sl_create(name: &str) -> std::result::Result<u64, String> {
    let _ = bridge::registration_anchor();
    enter(|reg| Ok(reg.insert(Manager::new(name))))
}

fn sl_bind(mgr: u64, tensors: &TensorList, owner: StreamKey) -> std::result::Result<(), String> {
    enter(|reg| reg.get(mgr)?.bind(&keys(tensors), owner.into(), |i| bridge::list_take(tensors, i)))
}

fn sl_retire(mgr: u64, tensors: &TensorList, consumer: StreamKey, action: i64) -> std::result::Result<(), String> {
    enter(|reg| {
        let action = Action::from_code(action)?;
        reg.get(mgr)?.retire(&mut TorchRuntime, &keys(tensors), consumer.into(), action, |i| {
            bridge::list_take(tensors, i)
        })
    })
}

fn sl_passthrough(mgr: u64, tensors: &TensorList) -> std::result::Result<(), String> {
    enter(|reg| reg.get(mgr)?.passthrough(&keys(tensors)))
}

fn sl_acquire(mgr: u64, stream: StreamKey) -> std::result::Result<i64, String> {
    enter(|reg| reg.get(mgr)?.acquire(&mut TorchRuntime, stream.into()).map(|n| n as i64))
}

fn sl_finalize(mgr: u64) -> std::result::Result<Vec<i64>, String> {
    enter(|reg| reg.get(mgr)?.finalize(&mut TorchRuntime).map(|s| s.to_vec()))
}

fn sl_stats(mgr: u64) -> std::result::Result<Vec<i64>, String> {
    enter(|reg| Ok(reg.get(mgr)?.stats().to_vec()))
}

fn sl_stats_fields() -> String {
    Stats::FIELDS.join(",")
}

fn sl_destroy(mgr: u64) -> std::result::Result<(), String> {
    enter(|reg| {
        let mut m = reg.remove(mgr)?;
        if m.is_finalized() {
            Ok(())
        } else {
            m.abandon(&mut TorchRuntime)
        }
    })
}

/// Entry points that need no registry: catch panics and tag value errors like `enter`.
fn pure<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, String> {
    enter(|_| f())
}

fn sl_simulate(plan: &str, policy: &str, mode: &str, trace: bool) -> std::result::Result<String, String> {
    use crate::sim::{self, Mode, Plan, Policy, SimOptions};
    pure(|| {
        let (policy, mode) = (Policy::parse(policy)?, Mode::parse(mode)?);
        let plan = Plan::from_json(plan)?;
        let report = sim::simulate(&plan, SimOptions { policy, mode, trace, log: false })?;
        serde_json::to_string(&report).map_err(|e| Error::Runtime(format!("report serialization: {e}")))
    })
}

fn sl_scenario(name: &str) -> std::result::Result<String, String> {
    pure(|| {
        let value = if name.starts_with("moe_chunk:") {
            crate::sched::moe::chunk_scenario(name)?
        } else {
            serde_json::to_value(crate::sim::scenarios::by_name(name)?)
                .map_err(|e| Error::Runtime(format!("plan serialization: {e}")))?
        };
        Ok(value.to_string())
    })
}

/// "" means "from the environment, else the default".
fn budgets(ep: &str, page: &str) -> Result<crate::sched::Budgets> {
    fn opt(s: &str) -> Option<&str> {
        (!s.is_empty()).then_some(s)
    }
    crate::sched::Budgets::resolve(opt(ep), opt(page))
}

fn sl_schedule(graph: &str, ep_budget: &str, page_budget: &str, explain: bool) -> std::result::Result<String, String> {
    pure(|| {
        let g = crate::ir::Graph::from_json(graph)?;
        let s = crate::sched::schedule(&g, budgets(ep_budget, page_budget)?)?;
        let ex = explain.then(|| crate::sched::explain(&g, &s));
        serde_json::to_string(&crate::sched::named(&g, &s, ex)).map_err(|e| Error::Runtime(format!("schedule serialization: {e}")))
    })
}

fn sl_validate(graph: &str, order: &str, syncs: &str, ep_budget: &str, page_budget: &str) -> std::result::Result<(), String> {
    pure(|| {
        let g = crate::ir::Graph::from_json(graph)?;
        let order: Vec<String> =
            serde_json::from_str(order).map_err(|e| Error::InvalidInput(format!("order must be a list of node names: {e}")))?;
        let syncs: Option<Vec<(String, String)>> = serde_json::from_str(syncs)
            .map_err(|e| Error::InvalidInput(format!("syncs must be null or a list of [producer, consumer] names: {e}")))?;
        crate::sched::validate_named(&g, &order, syncs.as_deref(), budgets(ep_budget, page_budget)?)
    })
}
