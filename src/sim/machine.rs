//! The discrete-event machine: a host issuing operations in order (each costs host time), FIFO
//! streams with virtual time, one compute and one comm engine, events, the allocator model,
//! and the race checker. Each operation is resolved when it is issued: a kernel starts at
//! max(host time, its stream's tail, its engine's free time), so the whole run is one pass.
//!
//! Race checker: every use of a value's block has a completion time. When a block is freed its
//! tenancy (address range, last use end) is kept; a later allocation overlapping it whose use
//! starts before that end is a hazard, reported with both values, nodes and streams.

use smallvec::SmallVec;

use super::alloc::{Allocator, Mode, Placement};
use crate::error::{Error, Result};

/// Which engine a stream's kernels run on: kernels on one engine run one at a time.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    /// SMs: GEMMs, attention, elementwise.
    Compute,
    /// Copy/communication engine: all-to-all, page copies.
    Comm,
}

/// A reuse hazard: `new` used the block before `old`'s last use completed.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Hazard {
    /// Address of the overlap.
    pub addr: u64,
    /// Previous tenant value and the node/stream of its last use.
    pub old_value: u32,
    /// Node of the earlier use.
    pub old_node: u32,
    /// Stream of the earlier use.
    pub old_stream: u16,
    /// When the previous tenant's last use completes.
    pub old_end_us: f64,
    /// New tenant value and the node/stream of the offending use.
    pub new_value: u32,
    /// Node of the reusing allocation.
    pub new_node: u32,
    /// Stream of the reusing allocation.
    pub new_stream: u16,
    /// When the offending use starts.
    pub new_start_us: f64,
}

#[derive(Copy, Clone, Debug)]
struct Tenancy {
    freed_seq: u64,
    addr: u64,
    size: u64,
    end: f64,
    value: u32,
    node: u32,
    stream: u16,
}

#[derive(Clone, Debug, Default)]
struct ValueState {
    bytes: u64,
    place: Option<Placement>,
    freed: bool,
    parked: bool,
    first_start: f64,
    last_end: f64,
    last_node: u32,
    last_stream: u16,
    used: bool,
    rs_streams: SmallVec<[u16; 2]>,
    alloc_seq: u64,
}

/// Tenancies of one segment, by start address; `max_size` bounds how far back an
/// overlapping tenancy can start. Each address keeps the latest end of its tenancies, so a
/// use that starts after it skips the whole list.
#[derive(Default)]
struct SegmentTenancies {
    /// Start address -> (latest end, largest size, tenancies starting there).
    by_addr: std::collections::BTreeMap<u64, (f64, u64, Vec<Tenancy>)>,
    max_size: u64,
}

impl SegmentTenancies {
    /// Tenancies freed before `alloc_seq`, overlapping [addr, addr + size), still in use at
    /// `start`. Tenancies that ended by `now` are dropped as they are met: no use issued from
    /// now on can start before `now`.
    fn conflicts(&mut self, addr: u64, size: u64, alloc_seq: u64, start: f64, now: f64, out: &mut Vec<Tenancy>) {
        let lo = addr.saturating_sub(self.max_size.saturating_sub(1));
        let mut dead: SmallVec<[u64; 4]> = SmallVec::new();
        for (&a, (max_end, max_size, ts)) in self.by_addr.range_mut(lo..addr + size) {
            if *max_end <= now {
                dead.push(a);
                continue;
            }
            if *max_end <= start || a + *max_size <= addr {
                continue;
            }
            ts.retain(|t| t.end > now);
            out.extend(ts.iter().filter(|t| {
                t.end > start && t.freed_seq < alloc_seq && t.addr < addr + size && addr < t.addr + t.size
            }));
        }
        for a in dead {
            self.by_addr.remove(&a);
        }
    }

    fn insert(&mut self, t: Tenancy, now: f64) {
        self.max_size = self.max_size.max(t.size);
        let slot = self.by_addr.entry(t.addr).or_insert((f64::MIN, 0, Vec::new()));
        if slot.2.len() >= 8 {
            slot.2.retain(|x| x.end > now);
        }
        slot.0 = slot.0.max(t.end);
        slot.1 = slot.1.max(t.size);
        slot.2.push(t);
    }
}

/// One kernel on the timeline.
#[derive(Copy, Clone, Debug)]
pub struct Kernel {
    /// Node index.
    pub node: u32,
    /// Stream index.
    pub stream: u16,
    /// Start, end (us).
    pub start: f64,
    /// End time (us).
    pub end: f64,
}

/// A peak and when (host time, us) it was reached.
#[derive(Copy, Clone, Debug, Default, serde::Serialize)]
pub struct Peak {
    /// Size in bytes.
    pub bytes: u64,
    /// Host time it occurred (us).
    pub at_us: f64,
}

impl Peak {
    fn update(&mut self, bytes: u64, at: f64) {
        if bytes > self.bytes {
            *self = Peak { bytes, at_us: at };
        }
    }
}

/// Machine parameters.
#[derive(Copy, Clone, Debug)]
pub struct Config {
    /// Allocator behaviour.
    pub mode: Mode,
    /// Host time per issued operation (us).
    pub host_us_per_op: f64,
    /// Extra fraction of duration for compute kernels that start while a comm kernel runs.
    pub sm_contention: f64,
    /// Keep a memory-over-time series (for plots and traces).
    pub timeline: bool,
    /// Keep every allocation and use (for independent checks of the race checker).
    pub log: bool,
    /// Kernels a stream holds in flight before a launch blocks the host (CUDA's queue).
    pub max_queued: usize,
}

/// Every allocation and use, in issue order (when `Config::log` is set).
#[derive(Clone, Debug, Default)]
pub struct Log {
    /// (value, addr, size, issue index of the malloc, issue index of the free or u64::MAX).
    pub allocs: Vec<(u32, u64, u64, u64, u64)>,
    /// (value, node, stream, start, end).
    pub uses: Vec<(u32, u32, u16, f64, f64)>,
}

/// The simulated machine.
pub struct Machine {
    cfg: Config,
    host: f64,
    engines: Vec<Engine>,
    tails: Vec<f64>,
    busy: Vec<f64>,
    engine_free: [f64; 2],
    events: Vec<Option<f64>>,
    values: Vec<ValueState>,
    /// Freed tenancies whose last use may still be running, per segment (only blocks of one
    /// segment can overlap), by address.
    tenancies: Vec<SegmentTenancies>,
    /// Ends of the kernels in flight per stream (bounded by the launch queue depth).
    queued: Vec<std::collections::VecDeque<f64>>,
    alloc: Allocator,
    parked_bytes: u64,
    parked_blocks: u64,
    /// Kernels in issue order.
    pub kernels: Vec<Kernel>,
    /// Hazards found.
    pub hazards: Vec<Hazard>,
    /// Peaks.
    pub allocated_peak: Peak,
    /// Peak of reserved bytes.
    pub reserved_peak: Peak,
    /// record_stream blocks freed but waiting on events (allocator `active_pending_free`).
    pub pending_peak: Peak,
    /// Tensors the lifetime manager parked until their owner's next acquire.
    pub parked_peak: Peak,
    /// Bytes not reusable although logically dead: pending + parked.
    pub unusable_peak: Peak,
    /// Most record_stream blocks pending at once.
    pub pending_blocks_peak: u64,
    /// Most tensors parked at once.
    pub parked_blocks_peak: u64,
    /// (host us, allocated, reserved, pending + parked) after each change, when `timeline` is set.
    pub timeline: Vec<(f64, u64, u64, u64)>,
    /// Operations processed.
    pub ops: u64,
    /// Allocation and use log, when `Config::log` is set.
    pub log: Log,
    alloc_entry: Vec<usize>,
    scratch: Vec<Tenancy>,
}

fn engine_slot(e: Engine) -> usize {
    match e {
        Engine::Compute => 0,
        Engine::Comm => 1,
    }
}

impl Machine {
    /// A machine with these streams (by engine) and `n_values` values.
    pub fn new(cfg: Config, engines: Vec<Engine>, n_values: usize, value_bytes: impl Fn(usize) -> u64) -> Self {
        let n = engines.len();
        Machine {
            cfg,
            host: 0.0,
            engines,
            tails: vec![0.0; n],
            busy: vec![0.0; n],
            engine_free: [0.0; 2],
            events: Vec::new(),
            values: (0..n_values).map(|i| ValueState { bytes: value_bytes(i), ..Default::default() }).collect(),
            tenancies: Vec::new(),
            queued: vec![std::collections::VecDeque::new(); n],
            alloc: Allocator::new(cfg.mode),
            parked_bytes: 0,
            parked_blocks: 0,
            kernels: Vec::new(),
            hazards: Vec::new(),
            allocated_peak: Peak::default(),
            reserved_peak: Peak::default(),
            pending_peak: Peak::default(),
            parked_peak: Peak::default(),
            unusable_peak: Peak::default(),
            pending_blocks_peak: 0,
            parked_blocks_peak: 0,
            timeline: Vec::new(),
            ops: 0,
            log: Log::default(),
            alloc_entry: Vec::new(),
            scratch: Vec::new(),
        }
    }

    fn tick(&mut self) {
        self.host += self.cfg.host_us_per_op;
        self.ops += 1;
    }

    fn mem_changed(&mut self) {
        let pending = self.alloc.pending_bytes;
        self.allocated_peak.update(self.alloc.allocated, self.host);
        self.reserved_peak.update(self.alloc.reserved, self.host);
        self.pending_peak.update(pending, self.host);
        self.parked_peak.update(self.parked_bytes, self.host);
        self.unusable_peak.update(pending + self.parked_bytes, self.host);
        self.pending_blocks_peak = self.pending_blocks_peak.max(self.alloc.pending_blocks());
        self.parked_blocks_peak = self.parked_blocks_peak.max(self.parked_blocks);
        if self.cfg.timeline {
            self.timeline.push((self.host, self.alloc.allocated, self.alloc.reserved, pending + self.parked_bytes));
        }
    }

    fn stream(&self, s: u16) -> Result<usize> {
        let i = s as usize;
        if i < self.tails.len() {
            Ok(i)
        } else {
            Err(Error::InvalidInput(format!("unknown stream index {s} (the machine has {})", self.tails.len())))
        }
    }

    fn value(&mut self, v: u32) -> Result<&mut ValueState> {
        let n = self.values.len();
        self.values.get_mut(v as usize).ok_or_else(|| Error::InvalidInput(format!("unknown value index {v} (of {n})")))
    }

    /// Host time now (us).
    pub fn host_us(&self) -> f64 {
        self.host
    }

    /// Allocate value `v` on stream `s`.
    pub fn malloc(&mut self, v: u32, s: u16) -> Result<()> {
        self.stream(s)?;
        let host = self.host;
        let bytes = self.value(v)?.bytes;
        if self.values[v as usize].place.is_some() {
            return Err(Error::Protocol(format!("value {v} allocated twice")));
        }
        let place = self.alloc.malloc(s, bytes, host);
        if self.cfg.log {
            self.alloc_entry.resize(self.values.len(), usize::MAX);
            self.alloc_entry[v as usize] = self.log.allocs.len();
            self.log.allocs.push((v, place.addr, place.size, self.ops, u64::MAX));
        }
        let seq = self.ops;
        let val = &mut self.values[v as usize];
        val.place = Some(place);
        val.alloc_seq = seq;
        self.tick();
        self.mem_changed();
        Ok(())
    }

    /// Launch node `node`'s kernel on stream `s` for `us`, using `values` (reads and writes).
    pub fn launch(&mut self, node: u32, s: u16, us: f64, values: &[u32]) -> Result<()> {
        let si = self.stream(s)?;
        // A full launch queue blocks the host until the oldest kernel in it completes.
        let q = &mut self.queued[si];
        while q.front().is_some_and(|&e| e <= self.host) {
            q.pop_front();
        }
        if q.len() >= self.cfg.max_queued {
            let oldest = q.len() - self.cfg.max_queued;
            self.host = self.host.max(q[oldest]);
            q.drain(..=oldest);
        }
        let eng = engine_slot(self.engines[si]);
        let start = self.host.max(self.tails[si]).max(self.engine_free[eng]);
        let mut dur = us;
        if eng == 0 && self.cfg.sm_contention > 0.0 && self.engine_free[1] > start {
            dur *= 1.0 + self.cfg.sm_contention;
        }
        let end = start + dur;
        for &v in values {
            self.value(v)?;
            let val = &self.values[v as usize];
            let Some(p) = val.place.filter(|_| !val.freed) else {
                return Err(Error::Protocol(format!("node {node} uses value {v}, which is not allocated")));
            };
            let alloc_seq = val.alloc_seq;
            if let Some(ts) = self.tenancies.get_mut(p.segment as usize) {
                self.scratch.clear();
                ts.conflicts(p.addr, p.size, alloc_seq, start, self.host, &mut self.scratch);
                for c in self.scratch.iter() {
                    self.hazards.push(Hazard {
                        addr: p.addr.max(c.addr),
                        old_value: c.value,
                        old_node: c.node,
                        old_stream: c.stream,
                        old_end_us: c.end,
                        new_value: v,
                        new_node: node,
                        new_stream: s,
                        new_start_us: start,
                    });
                }
            }
            if self.cfg.log {
                self.log.uses.push((v, node, s, start, end));
            }
            let val = &mut self.values[v as usize];
            if !val.used || start < val.first_start {
                val.first_start = start;
            }
            if !val.used || end >= val.last_end {
                val.last_end = end;
                val.last_node = node;
                val.last_stream = s;
            }
            val.used = true;
        }
        self.tails[si] = end;
        self.busy[si] += dur;
        self.engine_free[eng] = end;
        self.queued[si].push_back(end);
        self.kernels.push(Kernel { node, stream: s, start, end });
        self.tick();
        Ok(())
    }

    /// The host blocks until stream `s` has drained (a `.item()`, a blocking P2P receive).
    pub fn host_sync(&mut self, s: u16) -> Result<()> {
        let si = self.stream(s)?;
        self.host = self.host.max(self.tails[si]);
        self.tick();
        Ok(())
    }

    /// A new, unrecorded event.
    pub fn new_event(&mut self) -> u32 {
        self.events.push(None);
        (self.events.len() - 1) as u32
    }

    /// Record event `e` on stream `s`.
    pub fn record(&mut self, e: u32, s: u16) -> Result<()> {
        let si = self.stream(s)?;
        let slot = self.events.get_mut(e as usize).ok_or_else(|| Error::InvalidInput(format!("unknown event {e}")))?;
        *slot = Some(self.tails[si]);
        self.tick();
        Ok(())
    }

    /// Make stream `s` wait for event `e`.
    pub fn wait(&mut self, e: u32, s: u16) -> Result<()> {
        let si = self.stream(s)?;
        let t = self
            .events
            .get(e as usize)
            .copied()
            .flatten()
            .ok_or_else(|| Error::InvalidInput(format!("stream {s} waits on event {e}, which was never recorded")))?;
        self.tails[si] = self.tails[si].max(t);
        self.tick();
        Ok(())
    }

    /// `record_stream(v, s)`: the block's free will be deferred until `s` passes that point.
    pub fn record_stream(&mut self, v: u32, s: u16) -> Result<()> {
        self.stream(s)?;
        let val = self.value(v)?;
        if !val.rs_streams.contains(&s) {
            val.rs_streams.push(s);
        }
        self.tick();
        Ok(())
    }

    /// The lifetime manager parked `v` (logically dead, not yet reusable).
    pub fn park(&mut self, v: u32) -> Result<()> {
        let val = self.value(v)?;
        if !val.parked && !val.freed {
            val.parked = true;
            let b = val.place.map_or(0, |p| p.size);
            self.parked_bytes += b;
            self.parked_blocks += 1;
            self.mem_changed();
        }
        Ok(())
    }

    /// True once `v` was freed.
    pub fn is_freed(&self, v: u32) -> bool {
        self.values.get(v as usize).is_some_and(|x| x.freed)
    }

    /// Free `v` (host side). Blocks with record_stream uses stay pending until the events
    /// recorded now on those streams complete and a later malloc polls.
    pub fn free(&mut self, v: u32) -> Result<()> {
        let host = self.host;
        let val = self.value(v)?;
        let place = val.place.filter(|_| !val.freed).ok_or_else(|| Error::Protocol(format!("value {v} freed twice or never allocated")))?;
        val.freed = true;
        let parked = std::mem::take(&mut val.parked);
        let rs: SmallVec<[u16; 2]> = std::mem::take(&mut val.rs_streams);
        let (used, end, node, stream) = (val.used, val.last_end, val.last_node, val.last_stream);
        if parked {
            self.parked_bytes -= place.size;
            self.parked_blocks -= 1;
        }
        let ready_at = rs.iter().map(|&s| self.tails[s as usize]).fold(None, |a: Option<f64>, t| Some(a.map_or(t, |a| a.max(t))));
        let ready_at = ready_at.filter(|&t| t > host);
        if used && end > host && self.cfg.mode == Mode::Caching {
            let seg = place.segment as usize;
            if self.tenancies.len() <= seg {
                self.tenancies.resize_with(seg + 1, SegmentTenancies::default);
            }
            let freed_seq = self.ops;
            self.tenancies[seg].insert(Tenancy { freed_seq, addr: place.addr, size: place.size, end, value: v, node, stream }, host);
        }
        self.alloc.free(place, ready_at);
        if self.cfg.log {
            if let Some(&i) = self.alloc_entry.get(v as usize) {
                self.log.allocs[i].4 = self.ops;
            }
        }
        self.tick();
        self.mem_changed();
        Ok(())
    }

    /// Per-stream busy time (us).
    pub fn busy(&self) -> &[f64] {
        &self.busy
    }

    /// Latest completion over all streams.
    pub fn makespan(&self) -> f64 {
        self.tails.iter().copied().fold(0.0, f64::max)
    }

    /// Stream engines.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Peak over time of bytes whose [first use start, last use end] interval is open: no
    /// allocator can do with less.
    pub fn liveness_lower_bound(&self) -> u64 {
        let mut pts: Vec<(f64, i64)> = Vec::with_capacity(self.values.len() * 2);
        for v in self.values.iter().filter(|v| v.used) {
            pts.push((v.first_start, v.bytes as i64));
            pts.push((v.last_end, -(v.bytes as i64)));
        }
        // Ends before starts at equal times: a block can be reused the instant its use ends.
        pts.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut cur, mut peak) = (0i64, 0i64);
        for (_, d) in pts {
            cur += d;
            peak = peak.max(cur);
        }
        peak as u64
    }
}
