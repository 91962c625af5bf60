//! The torch boundary (feature `torch`), in cudarc's layers: `bridge` is the raw cxx bridge
//! (declarations only), `runtime` the safe [`crate::Runtime`] over the shim's c10 adapters,
//! `registry` the handle table of live managers and the guarded entry (panics caught, errors
//! tagged for Python), then the op groups: `lifetime_ops` (typed ops on tensors and streams)
//! and `json_ops` (every JSON-in/JSON-out op, one table row each; the shim registers them all
//! from that table, so adding one touches one Rust function and one row); `direct` exports the
//! Python module that runs bind / retire / acquire without the torch.ops round trip.

//!
//! Imports point down: the entry points (`lifetime_ops`, `json_ops`) -> `registry` ->
//! `runtime` -> `bridge`'s raw declarations. The one edge back up is cxx's own: the bridge's
//! `extern "Rust"` block is resolved in the bridge's scope, so `bridge.rs` names the entry
//! points it declares (two `use` lines, nothing else); no entry point imports the bridge.

mod bridge;
mod direct;
mod json_ops;
mod lifetime_ops;
mod registry;
mod runtime;
