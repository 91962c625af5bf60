//! Programs: the simulator's input, an issue list over named streams, derived from a graph and
//! a schedule (`sim::lower`) or written by hand (`sl.simulate`); its validation, and its
//! lowering onto the machine under a lifetime policy. A program is not a DESIGN.md plan: its
//! nodes name the plan (one lifetime manager) they belong to in their `plan` field. The `scheduled` policy drives the real
//! [`crate::lifetime::Manager`] through [`SimRuntime`], unchanged.
//!
//! Format (see README "Program format"):
//! ```json
//! {"streams": [{"name": "compute", "engine": "compute"}, {"name": "comm", "engine": "comm"}],
//!  "inputs":  [{"value": "x", "bytes": 1024, "stream": "compute"}],
//!  "nodes":   [{"name": "F0.attn", "plan": "F0", "stream": "compute", "us": 100,
//!               "inputs": ["x"], "outputs": [{"value": "h", "bytes": 4096}],
//!               "action": "empty_storage"}],
//!  "host_us_per_op": 1.0, "sm_contention": 0.0}
//! ```
//! Nodes are issued in list order. A value is retired after its last consumer; values that
//! no node consumes are plan outputs and stay allocated.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::alloc::Mode;
use super::machine::{Config, Engine, Hazard, Machine, Peak};
use crate::error::{Error, Result};
use crate::lifetime::Manager;
use crate::runtime::{Action, Device, Runtime, StreamId, TensorKey, DEVICE_CUDA};

/// A stream of the plan.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct StreamSpec {
    /// Unique name.
    pub name: String,
    #[serde(default = "default_engine")]
    /// The engine its kernels run on.
    pub engine: Engine,
}

fn default_engine() -> Engine {
    Engine::Compute
}

/// A value that exists before the first node (allocated on `stream`, never bound: it takes
/// the record_stream fallback, as an external input does).
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct InputSpec {
    /// The value.
    pub value: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Stream name.
    pub stream: String,
}

/// A value a node produces.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct OutputSpec {
    /// The value.
    pub value: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// One node.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct NodeSpec {
    /// Unique name.
    pub name: String,
    /// Which plan (microbatch chunk) it belongs to: one lifetime manager each.
    #[serde(default)]
    pub plan: Option<String>,
    /// Stream name.
    pub stream: String,
    /// Duration in microseconds.
    pub us: f64,
    #[serde(default)]
    /// Values it reads.
    pub inputs: Vec<String>,
    #[serde(default)]
    /// Values it produces.
    pub outputs: Vec<OutputSpec>,
    /// How inputs whose last consumer this is are retired (default empty_storage).
    #[serde(default)]
    pub action: Option<String>,
    /// The host waits for this node to finish before issuing more (`.item()`, blocking recv).
    #[serde(default)]
    pub host_sync: bool,
    /// With `explicit_acquire`: the plans whose queue for this node's stream is drained
    /// (`acquire`) just before it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub acquire: Vec<String>,
}

/// A whole plan.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct ProgramSpec {
    /// Streams of the program.
    pub streams: Vec<StreamSpec>,
    #[serde(default)]
    /// Values it reads.
    pub inputs: Vec<InputSpec>,
    /// Nodes, in table order.
    pub nodes: Vec<NodeSpec>,
    #[serde(default)]
    /// Host time per issued op (us).
    pub host_us_per_op: Option<f64>,
    #[serde(default)]
    /// Slow-down of compute kernels that start while comm runs (0..1).
    pub sm_contention: Option<f64>,
    /// Kernels in flight per stream before a launch blocks the host (default 1024).
    #[serde(default)]
    pub max_queued: Option<usize>,
    /// Drain only where nodes list it (a scheduler's drain points) instead of at every node
    /// of the plan on its stream (Megatron's rule); each plan still hands back at its end.
    #[serde(default)]
    pub explicit_acquire: bool,
}

/// How cross-stream values are freed.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// `record_stream(consumer)` then free after the last consumer.
    RecordStream,
    /// The lifetime manager (DESIGN.md §2).
    Scheduled,
    /// The manager with rule 1 broken: the owner never waits before the release (tests only).
    BrokenRule1,
}

impl Policy {
    /// Parse a policy name.
    pub fn parse(s: &str) -> Result<Policy> {
        match s {
            "record_stream" => Ok(Policy::RecordStream),
            "scheduled" => Ok(Policy::Scheduled),
            "broken_rule1" => Ok(Policy::BrokenRule1),
            _ => Err(Error::InvalidInput(format!(
                "unknown policy '{s}': expected record_stream, scheduled or broken_rule1"
            ))),
        }
    }
}

/// A validated plan with names resolved to indices.
pub struct Program {
    /// The validated spec.
    pub spec: ProgramSpec,
    stream_of: Vec<u16>,
    plan_of: Vec<u32>,
    plan_names: Vec<String>,
    inputs_of: Vec<SmallVec<[u32; 4]>>,
    outputs_of: Vec<SmallVec<[u32; 2]>>,
    action_of: Vec<Action>,
    value_names: Vec<String>,
    value_bytes: Vec<u64>,
    producer: Vec<Option<u32>>,
    input_stream: Vec<Option<u16>>,
    /// Consumer nodes of each value, in order.
    consumers: Vec<SmallVec<[u32; 2]>>,
    /// Plans drained before each node (explicit_acquire).
    acquire_of: Vec<SmallVec<[u32; 1]>>,
}

fn action_named(node: &str, a: Option<&str>) -> Result<Action> {
    match a.unwrap_or("empty_storage") {
        "empty_storage" => Ok(Action::EmptyStorage),
        "drop_reference" => Ok(Action::DropReference),
        "preserve" => Ok(Action::Preserve),
        other => Err(Error::InvalidInput(format!(
            "node '{node}': unknown action '{other}' (expected empty_storage, drop_reference or preserve)"
        ))),
    }
}

impl Program {
    /// Parse JSON text.
    pub fn from_json(text: &str) -> Result<Program> {
        let spec: ProgramSpec =
            serde_json::from_str(text).map_err(|e| Error::InvalidInput(format!("plan is not valid: {e}")))?;
        Program::new(spec)
    }

    /// Validate and index a spec; errors name the node, value or stream.
    pub fn new(spec: ProgramSpec) -> Result<Program> {
        if spec.streams.is_empty() {
            return Err(Error::InvalidInput("plan has no streams".into()));
        }
        if spec.streams.len() > u16::MAX as usize {
            return Err(Error::InvalidInput("too many streams".into()));
        }
        let mut streams: HashMap<&str, u16> = HashMap::new();
        for (i, s) in spec.streams.iter().enumerate() {
            if streams.insert(s.name.as_str(), i as u16).is_some() {
                return Err(Error::InvalidInput(format!("stream '{}' is declared twice", s.name)));
            }
        }
        let stream = |what: &str, name: &str| {
            streams.get(name).copied().ok_or_else(|| Error::InvalidInput(format!("{what}: unknown stream '{name}'")))
        };
        for (k, v) in [("host_us_per_op", spec.host_us_per_op), ("sm_contention", spec.sm_contention)] {
            if let Some(x) = v {
                if !x.is_finite() || x < 0.0 {
                    return Err(Error::InvalidInput(format!("{k} must be a finite number >= 0, got {x}")));
                }
            }
        }
        let mut values: HashMap<String, u32> = HashMap::new();
        let mut value_names: Vec<String> = Vec::new();
        let mut value_bytes = Vec::new();
        let mut producer = Vec::new();
        let mut input_stream = Vec::new();
        fn new_value(
            values: &mut HashMap<String, u32>,
            names: &mut Vec<String>,
            bytes_of: &mut Vec<u64>,
            name: &str,
            bytes: u64,
            who: &str,
        ) -> Result<u32> {
            if values.contains_key(name) {
                return Err(Error::InvalidInput(format!("{who}: value '{name}' is produced twice")));
            }
            let id = names.len() as u32;
            values.insert(name.to_string(), id);
            names.push(name.to_string());
            bytes_of.push(bytes);
            Ok(id)
        }
        for inp in &spec.inputs {
            let s = stream(&format!("input '{}'", inp.value), &inp.stream)?;
            new_value(&mut values, &mut value_names, &mut value_bytes, &inp.value, inp.bytes, "inputs")?;
            producer.push(None);
            input_stream.push(Some(s));
        }
        let mut plan_ids: HashMap<String, u32> = HashMap::new();
        let mut plan_names = Vec::new();
        let n = spec.nodes.len();
        let (mut stream_of, mut plan_of, mut inputs_of, mut outputs_of, mut action_of) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        let mut consumers: Vec<SmallVec<[u32; 2]>> = vec![SmallVec::new(); value_names.len()];
        for (ni, node) in spec.nodes.iter().enumerate() {
            let who = format!("node '{}'", node.name);
            stream_of.push(stream(&who, &node.stream)?);
            if !node.us.is_finite() || node.us < 0.0 {
                return Err(Error::InvalidInput(format!("{who}: duration must be a finite number >= 0, got {}", node.us)));
            }
            let pname = node.plan.clone().unwrap_or_else(|| "default".to_string());
            let next = plan_ids.len() as u32;
            let pid = *plan_ids.entry(pname.clone()).or_insert_with(|| {
                plan_names.push(pname);
                next
            });
            plan_of.push(pid);
            action_of.push(action_named(&node.name, node.action.as_deref())?);
            let mut ins: SmallVec<[u32; 4]> = SmallVec::new();
            for v in &node.inputs {
                let id = *values.get(v).ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "{who} consumes value '{v}', which has no producer (no earlier node makes it and it is not in inputs)"
                    ))
                })?;
                if ins.contains(&id) {
                    return Err(Error::InvalidInput(format!("{who} lists input '{v}' twice")));
                }
                ins.push(id);
                consumers[id as usize].push(ni as u32);
            }
            let mut outs: SmallVec<[u32; 2]> = SmallVec::new();
            for o in &node.outputs {
                outs.push(new_value(&mut values, &mut value_names, &mut value_bytes, &o.value, o.bytes, &who)?);
                producer.push(Some(ni as u32));
                input_stream.push(None);
                consumers.push(SmallVec::new());
            }
            inputs_of.push(ins);
            outputs_of.push(outs);
        }
        let mut acquire_of = Vec::with_capacity(n);
        for node in &spec.nodes {
            let mut ps = SmallVec::new();
            for a in &node.acquire {
                let p = *plan_ids.get(a).ok_or_else(|| {
                    Error::InvalidInput(format!("node '{}': acquire names plan '{a}', which has no node", node.name))
                })?;
                ps.push(p);
            }
            acquire_of.push(ps);
        }
        Ok(Program {
            acquire_of,
            spec,
            stream_of,
            plan_of,
            plan_names,
            inputs_of,
            outputs_of,
            action_of,
            value_names,
            value_bytes,
            producer,
            input_stream,
            consumers,
        })
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.stream_of.len()
    }

    /// True when the plan has no nodes.
    pub fn is_empty(&self) -> bool {
        self.stream_of.is_empty()
    }

    fn owner(&self, v: u32) -> u16 {
        match self.producer[v as usize] {
            Some(p) => self.stream_of[p as usize],
            None => self.input_stream[v as usize].unwrap_or(0),
        }
    }
}

/// Drives the machine for the lifetime manager: the same trait torch and cudarc implement.
pub struct SimRuntime<'m> {
    /// The machine.
    pub machine: &'m mut Machine,
    /// Drop the owner's wait (rule 1 broken), for tests of the race checker.
    pub skip_waits: bool,
}

fn sim_stream(s: u16) -> StreamId {
    StreamId::cuda(0, i64::from(s))
}

fn sim_index(s: StreamId) -> u16 {
    s.id as u16
}

impl Runtime for SimRuntime<'_> {
    type Payload = u32;
    type Event = u32;

    fn new_event(&mut self, _stream: StreamId) -> Result<u32> {
        Ok(self.machine.new_event())
    }
    fn record(&mut self, event: &mut u32, stream: StreamId) -> Result<()> {
        self.machine.record(*event, sim_index(stream))
    }
    fn wait(&mut self, event: &u32, stream: StreamId) -> Result<()> {
        if self.skip_waits {
            return Ok(());
        }
        self.machine.wait(*event, sim_index(stream))
    }
    fn release(&mut self, v: u32, action: Action) -> Result<()> {
        match action {
            Action::Preserve => Ok(()),
            Action::EmptyStorage | Action::DropReference => self.machine.free(v),
        }
    }
    fn record_stream(&mut self, v: u32, stream: StreamId) -> Result<()> {
        self.machine.record_stream(v, sim_index(stream))?;
        self.machine.free(v)
    }
}

/// What a simulation reports.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Lifetime policy simulated.
    pub policy: Policy,
    /// Allocator mode simulated.
    pub mode: Mode,
    /// Nodes, in table order.
    pub nodes: usize,
    /// Events processed.
    pub events: u64,
    /// Time until the last stream is idle (us).
    pub makespan_us: f64,
    /// Host time at the end (us).
    pub host_us: f64,
    /// Busy time per stream (us).
    pub stream_busy_us: Vec<(String, f64)>,
    /// Total compute kernel time (us).
    pub compute_us: f64,
    /// Total comm kernel time (us).
    pub comm_us: f64,
    /// Comm kernel time during which no compute kernel runs.
    pub exposed_comm_us: f64,
    /// Peak of allocated bytes.
    pub allocated_peak: Peak,
    /// Peak of reserved bytes.
    pub reserved_peak: Peak,
    /// record_stream blocks freed but waiting on their events (allocator pending-free).
    pub pending_free_peak: Peak,
    /// Blocks pending free at that peak.
    pub pending_free_peak_blocks: u64,
    /// Tensors parked by the lifetime manager until their owner's next acquire.
    pub parked_peak: Peak,
    /// Blocks parked by the manager at their peak.
    pub parked_peak_blocks: u64,
    /// Logically dead but not reusable: pending-free + parked, at once.
    pub unusable_peak: Peak,
    /// Liveness lower bound of the program (bytes).
    pub liveness_lower_bound_bytes: u64,
    /// Reuse hazards the race checker found.
    pub hazards: Vec<NamedHazard>,
    /// Tensors that took the record_stream fallback.
    pub fallback_record_stream: u64,
    /// (host us, allocated, reserved, pending-free + parked) when asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub memory_timeline: Vec<(f64, u64, u64, u64)>,
    /// Chrome trace events when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<serde_json::Value>,
}

/// A hazard with names.
#[derive(Clone, Debug, Serialize)]
pub struct NamedHazard {
    /// Address of the reused block.
    pub block_addr: u64,
    /// Value of the earlier use.
    pub old_value: String,
    /// Node of the earlier use.
    pub old_node: String,
    /// Stream of the earlier use.
    pub old_stream: String,
    /// When the earlier use ends (us).
    pub old_end_us: f64,
    /// Value of the reusing allocation.
    pub new_value: String,
    /// Node of the reusing allocation.
    pub new_node: String,
    /// Stream of the reusing allocation.
    pub new_stream: String,
    /// When the reusing use starts (us).
    pub new_start_us: f64,
}

/// Options of one simulation.
#[derive(Copy, Clone, Debug)]
pub struct SimOptions {
    /// Lifetime policy simulated.
    pub policy: Policy,
    /// Allocator mode simulated.
    pub mode: Mode,
    /// Keep the memory timeline and build a Chrome trace.
    pub trace: bool,
    /// Keep the machine's allocation/use log (tests).
    pub log: bool,
}

impl SimOptions {
    /// A policy with the caching allocator, no trace, no log.
    pub fn new(policy: Policy) -> Self {
        SimOptions { policy, mode: Mode::Caching, trace: false, log: false }
    }
}

fn key(v: u32, bytes: u64) -> TensorKey {
    TensorKey {
        covers_storage: true,
        tensor: u64::from(v) + 1,
        storage: u64::from(v) + 1,
        nbytes: bytes,
        device: Device { device_type: DEVICE_CUDA, index: 0 },
    }
}

/// Run `plan` under `opts`.
pub fn simulate(plan: &Program, opts: SimOptions) -> Result<Report> {
    run(plan, opts).map(|(r, _)| r)
}

/// Run `plan` under `opts`, returning the machine too (its log, kernels).
pub fn run(plan: &Program, opts: SimOptions) -> Result<(Report, Machine)> {
    let _span = tracing::debug_span!("simulate", nodes = plan.len()).entered();
    let cfg = Config {
        mode: opts.mode,
        host_us_per_op: plan.spec.host_us_per_op.unwrap_or(1.0),
        sm_contention: plan.spec.sm_contention.unwrap_or(0.0),
        timeline: opts.trace,
        log: opts.log,
        max_queued: plan.spec.max_queued.unwrap_or(1024).max(1),
    };
    let engines: Vec<Engine> = plan.spec.streams.iter().map(|s| s.engine).collect();
    let mut m = Machine::new(cfg, engines, plan.value_names.len(), |i| plan.value_bytes[i]);
    let managed = opts.policy != Policy::RecordStream;
    let skip_waits = opts.policy == Policy::BrokenRule1;
    let mut mgrs: Vec<Manager<u32, u32>> = plan.plan_names.iter().map(|n| Manager::new(n.clone())).collect();
    for (v, s) in plan.input_stream.iter().enumerate() {
        if let Some(s) = s {
            m.malloc(v as u32, *s)?;
        }
    }
    // Terminal hand-back (rule 7) at each plan's end, not at the end of the whole run.
    // A plan ends at its last node, or at the last use of a value it produced (a control
    // token into another source's node is retired there, in its producer's plan).
    let mut plan_last = vec![0usize; plan.plan_names.len()];
    for (n, &p) in plan.plan_of.iter().enumerate() {
        plan_last[p as usize] = plan_last[p as usize].max(n);
        for &o in &plan.outputs_of[n] {
            if let Some(&c) = plan.consumers[o as usize].last() {
                plan_last[p as usize] = plan_last[p as usize].max(c as usize);
            }
        }
    }
    let mut node_event: Vec<u32> = Vec::with_capacity(plan.len());
    for n in 0..plan.len() {
        let s = plan.stream_of[n];
        let sid = sim_stream(s);
        if managed {
            if plan.spec.explicit_acquire {
                for p in &plan.acquire_of[n] {
                    mgrs[*p as usize].acquire(&mut SimRuntime { machine: &mut m, skip_waits }, sid)?;
                }
            } else {
                mgrs[plan.plan_of[n] as usize].acquire(&mut SimRuntime { machine: &mut m, skip_waits }, sid)?;
            }
        }
        let own = plan.plan_of[n] as usize;
        // Data dependencies: wait on the producer's event when it ran on another stream.
        for &v in &plan.inputs_of[n] {
            if let Some(p) = plan.producer[v as usize] {
                if plan.stream_of[p as usize] != s {
                    m.wait(node_event[p as usize], s)?;
                }
            }
            // The last consumer is ordered after earlier consumers on other streams, so the
            // plan event it records covers every use; except on the owner's own stream, where
            // the retire goes to the last cross-stream consumer's stream instead (below, as
            // the scheduler's retire points say) and nothing waits here.
            let cons = &plan.consumers[v as usize];
            if cons.last() == Some(&(n as u32)) && !(managed && plan.owner(v) == s) {
                for &c in &cons[..cons.len() - 1] {
                    if plan.stream_of[c as usize] != s {
                        m.wait(node_event[c as usize], s)?;
                    }
                }
            }
        }
        for &o in &plan.outputs_of[n] {
            m.malloc(o, s)?;
            if managed && !plan.consumers[o as usize].is_empty() {
                let k = key(o, plan.value_bytes[o as usize]);
                mgrs[own].bind(&[k], sid, |_| o)?;
            }
        }
        let used: SmallVec<[u32; 8]> = plan.inputs_of[n].iter().chain(&plan.outputs_of[n]).copied().collect();
        m.launch(n as u32, s, plan.spec.nodes[n].us, &used)?;
        let ev = m.new_event();
        m.record(ev, s)?;
        node_event.push(ev);
        if plan.spec.nodes[n].host_sync {
            m.host_sync(s)?;
        }
        for &v in &plan.inputs_of[n] {
            let last = plan.consumers[v as usize].last() == Some(&(n as u32));
            if !managed {
                if plan.owner(v) != s {
                    m.record_stream(v, s)?;
                }
                if last {
                    m.free(v)?;
                }
            } else if last {
                let k = key(v, plan.value_bytes[v as usize]);
                // Last use on the owner's stream after a use on another stream: the plan event
                // goes on that other stream (its latest such use is queued there by now).
                let cons = &plan.consumers[v as usize];
                let on = if plan.owner(v) == s {
                    let other = cons.iter().rev().map(|&c| plan.stream_of[c as usize]).find(|&cs| cs != s);
                    // Drains at every node (no scheduled drain points, whose clocks cover each
                    // use): the event must cover uses on a third stream too.
                    if let (Some(o), false) = (other, plan.spec.explicit_acquire) {
                        for &c in cons.iter() {
                            let c_s = plan.stream_of[c as usize];
                            if c_s != s && c_s != o {
                                m.wait(node_event[c as usize], o)?;
                            }
                        }
                    }
                    other.map_or(sid, sim_stream)
                } else {
                    sid
                };
                // In the plan that bound it (its producer's), as the executor retires it.
                let owner_plan = plan.producer[v as usize].map_or(plan.plan_of[n], |p| plan.plan_of[p as usize]);
                mgrs[owner_plan as usize].retire(&mut SimRuntime { machine: &mut m, skip_waits }, &[k], on, plan.action_of[n], |_| v)?;
                if plan.action_of[n] != Action::Preserve {
                    m.park(v)?; // a no-op when the retire released it at once
                }
            }
        }
        // With explicit drains, a scheduled drain may come after the plan's last node: hand
        // back at the end of the run instead.
        if managed && !plan.spec.explicit_acquire {
            for (p, mgr) in mgrs.iter_mut().enumerate() {
                if plan_last[p] == n {
                    mgr.finalize(&mut SimRuntime { machine: &mut m, skip_waits })?;
                }
            }
        }
    }
    if managed && plan.spec.explicit_acquire {
        for mgr in mgrs.iter_mut() {
            mgr.finalize(&mut SimRuntime { machine: &mut m, skip_waits })?;
        }
    }
    let fallbacks = mgrs.iter().map(|mgr| mgr.stats().fallback_record_stream).sum();
    let r = report(plan, &m, opts, fallbacks);
    Ok((r, m))
}

fn union_len(mut iv: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(iv.len());
    for (s, e) in iv {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Comm time not covered by any compute interval.
fn exposed(comm: Vec<(f64, f64)>, compute: &[(f64, f64)]) -> f64 {
    let mut total = 0.0;
    let mut j = 0;
    for (s, e) in union_len(comm) {
        let mut covered = 0.0;
        while j < compute.len() && compute[j].1 <= s {
            j += 1;
        }
        let mut k = j;
        while k < compute.len() && compute[k].0 < e {
            covered += compute[k].1.min(e) - compute[k].0.max(s);
            k += 1;
        }
        total += (e - s) - covered;
    }
    total
}

fn report(plan: &Program, m: &Machine, opts: SimOptions, fallbacks: u64) -> Report {
    let engines = m.engines();
    let (mut comp, mut comm) = (Vec::new(), Vec::new());
    for k in &m.kernels {
        match engines[k.stream as usize] {
            Engine::Compute => comp.push((k.start, k.end)),
            Engine::Comm => comm.push((k.start, k.end)),
        }
    }
    let compute_us: f64 = comp.iter().map(|(s, e)| e - s).sum();
    let comm_us: f64 = comm.iter().map(|(s, e)| e - s).sum();
    let comp_u = union_len(comp);
    let sname = |s: u16| plan.spec.streams[s as usize].name.clone();
    let vname = |v: u32| plan.value_names[v as usize].clone();
    let nname = |n: u32| plan.spec.nodes[n as usize].name.clone();
    let hazards = m
        .hazards
        .iter()
        .map(|h: &Hazard| NamedHazard {
            block_addr: h.addr,
            old_value: vname(h.old_value),
            old_node: nname(h.old_node),
            old_stream: sname(h.old_stream),
            old_end_us: h.old_end_us,
            new_value: vname(h.new_value),
            new_node: nname(h.new_node),
            new_stream: sname(h.new_stream),
            new_start_us: h.new_start_us,
        })
        .collect();
    let trace = opts.trace.then(|| chrome_trace(plan, m));
    Report {
        policy: opts.policy,
        mode: opts.mode,
        nodes: plan.len(),
        events: m.ops,
        makespan_us: m.makespan(),
        host_us: m.host_us(),
        stream_busy_us: m.busy().iter().enumerate().map(|(i, b)| (sname(i as u16), *b)).collect(),
        compute_us,
        comm_us,
        exposed_comm_us: exposed(comm, &comp_u),
        allocated_peak: m.allocated_peak,
        reserved_peak: m.reserved_peak,
        pending_free_peak: m.pending_peak,
        pending_free_peak_blocks: m.pending_blocks_peak,
        parked_peak: m.parked_peak,
        parked_peak_blocks: m.parked_blocks_peak,
        unusable_peak: m.unusable_peak,
        liveness_lower_bound_bytes: m.liveness_lower_bound(),
        hazards,
        fallback_record_stream: fallbacks,
        memory_timeline: if opts.trace { m.timeline.clone() } else { Vec::new() },
        trace,
    }
}

/// Chrome trace (opens in Perfetto): one track per stream, memory counters.
fn chrome_trace(plan: &Program, m: &Machine) -> serde_json::Value {
    use serde_json::json;
    let mut ev = Vec::with_capacity(m.kernels.len() + m.timeline.len() + plan.spec.streams.len());
    for (i, s) in plan.spec.streams.iter().enumerate() {
        ev.push(json!({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": s.name}}));
    }
    for k in &m.kernels {
        let node = &plan.spec.nodes[k.node as usize];
        ev.push(json!({"ph": "X", "name": node.name, "cat": node.plan.as_deref().unwrap_or("default"),
                       "pid": 0, "tid": k.stream, "ts": k.start, "dur": k.end - k.start}));
    }
    for &(t, a, r, p) in &m.timeline {
        ev.push(json!({"ph": "C", "name": "memory (host time)", "pid": 1, "ts": t,
                       "args": {"allocated": a, "reserved": r, "pending_free": p}}));
    }
    json!({"traceEvents": ev, "displayTimeUnit": "ms"})
}

