//! The lifetime manager's ops (typed: `Tensor[]` and `Stream` arguments, so they trace and
//! capture): create, bind, retire, retire_owned, passthrough, acquire, finalize, stats, destroy.

use super::registry::enter;
use super::runtime::{anchor, keys, take, StreamKey, TensorList, TorchRuntime};
use crate::lifetime::Manager;
use crate::runtime::Action;

type Ret<T> = std::result::Result<T, String>;

pub(super) fn sl_create(name: &str) -> Ret<u64> {
    anchor();
    enter(|reg| Ok(reg.insert(Manager::new(name))))
}

pub(super) fn sl_bind(mgr: u64, tensors: &TensorList, owner: StreamKey) -> Ret<()> {
    enter(|reg| reg.get(mgr)?.bind(&keys(tensors), owner.into(), |i| take(tensors, i)))
}

pub(super) fn sl_retire(mgr: u64, tensors: &TensorList, consumer: StreamKey, action: i64) -> Ret<()> {
    enter(|reg| {
        let action = Action::from_code(action)?;
        reg.get(mgr)?.retire(&mut TorchRuntime, &keys(tensors), consumer.into(), action, |i| take(tensors, i))
    })
}

pub(super) fn sl_retire_owned(mgr: u64, tensors: &TensorList, owner: StreamKey, consumer: StreamKey, action: i64) -> Ret<()> {
    enter(|reg| {
        let action = Action::from_code(action)?;
        reg.get(mgr)?.retire_owned(&mut TorchRuntime, &keys(tensors), owner.into(), consumer.into(), action, |i| take(tensors, i))
    })
}

/// `retire_owned` then `acquire(owner)` under one registry lock: the direct entry's
/// `release_after` (record_stream's one-call replacement).
pub(super) fn sl_release(mgr: u64, tensors: &TensorList, owner: StreamKey, consumer: StreamKey, action: i64) -> Ret<i64> {
    enter(|reg| {
        let action = Action::from_code(action)?;
        let take = |i| take(tensors, i);
        reg.get(mgr)?.release_after(&mut TorchRuntime, &keys(tensors), owner.into(), consumer.into(), action, take).map(|n| n as i64)
    })
}

pub(super) fn sl_passthrough(mgr: u64, tensors: &TensorList) -> Ret<()> {
    enter(|reg| reg.get(mgr)?.passthrough(&keys(tensors)))
}

pub(super) fn sl_acquire(mgr: u64, stream: StreamKey) -> Ret<i64> {
    enter(|reg| reg.get(mgr)?.acquire(&mut TorchRuntime, stream.into()).map(|n| n as i64))
}

pub(super) fn sl_finalize(mgr: u64) -> Ret<Vec<i64>> {
    enter(|reg| reg.get(mgr)?.finalize(&mut TorchRuntime).map(|s| s.to_vec()))
}

pub(super) fn sl_stats(mgr: u64) -> Ret<Vec<i64>> {
    enter(|reg| Ok(reg.get(mgr)?.stats().to_vec()))
}

pub(super) fn sl_destroy(mgr: u64) -> Ret<()> {
    enter(|reg| {
        let mut m = reg.remove(mgr)?;
        if m.is_finalized() {
            Ok(())
        } else {
            m.abandon(&mut TorchRuntime)
        }
    })
}
