//! Live managers, addressed by the integer handles Python holds, and the guarded entry every
//! op goes through: logging set up once, the registry locked, panics caught, input errors
//! tagged so the shim raises `ValueError` instead of `RuntimeError`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use once_cell::sync::Lazy;

use super::runtime::{empty_graveyard, Event, Payload};
use crate::error::{Error, Result};
use crate::lifetime::Manager;

/// A manager driving torch tensors and c10 events.
pub(super) type TorchManager = Manager<Payload, Event>;

/// Prefix the shim looks for to raise `ValueError` instead of `RuntimeError`.
const VALUE_ERROR_TAG: &str = "[ValueError] ";

/// Live managers, addressed by `generation << 32 | (slot + 1)` so a stale handle is caught.
#[derive(Default)]
pub(super) struct Registry {
    slots: Vec<(u32, Option<TorchManager>)>,
    free: Vec<usize>,
}

static REGISTRY: Lazy<Mutex<Registry>> = Lazy::new(|| Mutex::new(Registry::default()));

impl Registry {
    pub(super) fn insert(&mut self, m: TorchManager) -> u64 {
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

    pub(super) fn get(&mut self, h: u64) -> Result<&mut TorchManager> {
        let slot = self.slot(h).ok_or(Error::UnknownManager(h))?;
        self.slots[slot].1.as_mut().ok_or(Error::UnknownManager(h))
    }

    /// Live managers, and the tensors they hold (bound + parked): what a leak check watches.
    pub(super) fn live(&self) -> (usize, u64) {
        let live = self.slots.iter().filter_map(|(_, m)| m.as_ref());
        let held = live.clone().map(|m| m.stats().bound_now + m.stats().pending_count).sum();
        (live.count(), held)
    }

    pub(super) fn remove(&mut self, h: u64) -> Result<TorchManager> {
        let slot = self.slot(h).ok_or(Error::UnknownManager(h))?;
        self.free.push(slot);
        self.slots[slot].1.take().ok_or(Error::UnknownManager(h))
    }
}

/// Live managers and the tensors they hold.
pub(super) fn live() -> (usize, u64) {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner()).live()
}

/// Run an entry point with the registry locked; otherwise as [`pure`].
///
/// Lock rule (issue 35): the registry lock is the only lock here, and no Python object is
/// released while it is held: the tensor references an entry drops go to the thread's
/// graveyard ([`super::runtime::Payload`]) and are released after the lock is let go. Callers
/// never wait for the lock while holding the GIL (the torch.ops dispatcher releases it;
/// `cpp/direct.cc` releases it around every entry). Together: no thread holds the lock and
/// waits for the GIL, so none can hold the GIL and wait for the lock forever.
pub(super) fn enter<T>(f: impl FnOnce(&mut Registry) -> Result<T>) -> std::result::Result<T, String> {
    let out = pure(|| {
        let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut reg)
    });
    empty_graveyard();
    out
}

/// Run an entry point: turn on logging if asked (once), catch panics, tag value errors for
/// the shim. Entry points that need no manager use it directly, so a long schedule or
/// simulation never holds the registry's lock.
pub(super) fn pure<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, String> {
    crate::init_logging();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.is_value_error() => Err(format!("{VALUE_ERROR_TAG}{e}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(format!(
            "internal error (panic in sched_lifetime): {}",
            p.downcast_ref::<&str>().copied().or(p.downcast_ref::<String>().map(|s| s.as_str())).unwrap_or("?")
        )),
    }
}
