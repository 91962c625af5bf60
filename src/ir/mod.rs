//! The schedule IR (DESIGN.md §3): sources (graphs with their microbatch, phase and priority),
//! nodes (compute with a wgrad flag, comm launch + wait, page-out/in launch + wait, noop),
//! values (bytes, producer), and the edges between nodes: data, mutation order, control and
//! static-buffer reuse. Plain indices into vectors; built from Rust or from the JSON table
//! Python passes (`Graph::from_json`), validated on construction.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::error::{Error, Result};

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($int:ty)) => {
        $(#[$doc])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(transparent)]
        pub struct $name(pub $int);

        impl $name {
            /// The id of the `i`-th item.
            pub fn new(i: usize) -> Self {
                $name(i as $int)
            }
            /// Position in the graph's vector.
            pub fn ix(self) -> usize {
                self.0 as usize
            }
        }

        impl<T> std::ops::Index<$name> for Vec<T> {
            type Output = T;
            fn index(&self, i: $name) -> &T {
                &self[i.ix()]
            }
        }

        impl<T> std::ops::IndexMut<$name> for Vec<T> {
            fn index_mut(&mut self, i: $name) -> &mut T {
                &mut self[i.ix()]
            }
        }
    };
}

id_type!(
    /// Index of a node in [`Graph::nodes`].
    NodeId(u32)
);
id_type!(
    /// Index of a value in [`Graph::values`].
    ValueId(u32)
);
id_type!(
    /// Index of a source in [`Graph::sources`].
    SourceId(u16)
);

impl Graph {
    /// Ids of all nodes, in table order.
    pub fn node_ids(&self) -> impl DoubleEndedIterator<Item = NodeId> + ExactSizeIterator {
        (0..self.nodes.len()).map(NodeId::new)
    }
    /// The source a node belongs to.
    pub fn source_of(&self, u: NodeId) -> &Source {
        &self.sources[self.nodes[u].source]
    }
}

/// Which part of training a source is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
pub enum Phase {
    /// Forward.
    F,
    /// Full backward.
    B,
    /// Backward, input gradients only.
    #[serde(rename = "dI")]
    DI,
    /// Backward, weight gradients only.
    #[serde(rename = "dW")]
    DW,
}

/// One graph being multiplexed.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Source {
    /// Unique name.
    pub name: String,
    #[serde(default)]
    /// Microbatch index.
    pub microbatch: u32,
    /// Forward, backward, dI or dW.
    pub phase: Phase,
    /// Lower runs first on ties.
    #[serde(default)]
    pub priority: i32,
}

/// What a node is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Work on the compute stream.
    Compute,
    /// An EP dispatch/combine launched on the EP stream.
    CommLaunch,
    /// Where the compute stream waits for a comm launch.
    CommWait,
    /// Saved activations copied to pinned host memory (page stream).
    PageOut,
    /// Saved activations copied back (page stream).
    PageIn,
    /// Where the compute stream waits for a page copy.
    PageWait,
    /// A view / pass-through: no kernel.
    Noop,
}

impl Kind {
    /// Launches run on a side stream and occupy its budget until their wait.
    pub fn is_launch(self) -> bool {
        matches!(self, Kind::CommLaunch | Kind::PageOut | Kind::PageIn)
    }
    /// Waits publish a launch's outputs to the compute stream.
    pub fn is_wait(self) -> bool {
        matches!(self, Kind::CommWait | Kind::PageWait)
    }
}

/// Where a launch's output is allocated.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Alloc {
    /// On the producing node's stream (the default).
    #[default]
    Producer,
    /// On the stream that waits for the launch (compute), before the launch: the side stream
    /// only writes into it, so the value is the consumer stream's own and needs no cross-stream
    /// lifetime handling (what a value autograd saves for backward needs).
    Consumer,
}

/// The most bytes one value may have (1 PiB): far above any tensor, and low enough that sums over
/// millions of values (memory estimates, the simulator's allocator rounding) stay in a u64.
pub const MAX_VALUE_BYTES: u64 = 1 << 50;

/// An output as written in the table: a name, or a name with bytes (and, for launch outputs,
/// where it is allocated).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum OutputSpec {
    /// Just a name (0 bytes).
    Name(String),
    /// A launch output allocated somewhere else than its producer's stream.
    Placed {
        /// The value name.
        value: String,
        /// Size in bytes.
        #[serde(default)]
        bytes: u64,
        /// Where it is allocated.
        alloc: Alloc,
    },
    /// A name with its size in bytes.
    Sized {
        /// The value name.
        value: String,
        /// Size in bytes.
        bytes: u64,
    },
}

/// A node as written in the table.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct NodeSpec {
    /// Unique name.
    pub name: String,
    /// The source (graph) it belongs to.
    pub source: String,
    /// What the node is.
    pub kind: Kind,
    #[serde(default)]
    /// Weight-gradient work (fills gaps, never on the critical path).
    pub wgrad: bool,
    #[serde(default)]
    /// Values it reads.
    pub inputs: Vec<String>,
    #[serde(default)]
    /// Values it produces.
    pub outputs: Vec<OutputSpec>,
    /// Values this node writes in place (ordered after earlier readers and writers).
    #[serde(default)]
    pub mutates: Vec<String>,
    /// For waits: the launch they wait for.
    #[serde(default)]
    pub launch: Option<String>,
    /// Cost (us) for the simulator and reports; the default policy never reads it (it is
    /// timing-free), the opt-in cost rules (`soonest_launch`, `critical_path`, `search`) do.
    #[serde(default)]
    pub cost: f64,
}

/// The whole table.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct GraphSpec {
    /// The sources being multiplexed.
    pub sources: Vec<Source>,
    /// Nodes, in table order.
    pub nodes: Vec<NodeSpec>,
    /// Extra ordering: [before, after] node names.
    #[serde(default)]
    pub control: Vec<(String, String)>,
    /// Static-buffer reuse: [last user of the buffer, next writer] node names.
    #[serde(default)]
    pub reuse: Vec<(String, String)>,
    /// Values that exist before any node (graph inputs), with bytes.
    #[serde(default)]
    pub inputs: Vec<OutputSpec>,
    /// Values the graph returns: live to the end of any order (memory estimates).
    #[serde(default)]
    pub outputs: Vec<String>,
}

/// A node.
#[derive(Clone, Debug)]
pub struct Node {
    /// Unique name.
    pub name: String,
    /// The source (graph) it belongs to.
    pub source: SourceId,
    /// What the node is.
    pub kind: Kind,
    /// Weight-gradient work (fills gaps, never on the critical path).
    pub wgrad: bool,
    /// Values it reads.
    pub inputs: SmallVec<[ValueId; 4]>,
    /// Values it produces.
    pub outputs: SmallVec<[ValueId; 2]>,
    /// Cost in microseconds (simulator and reports only).
    pub cost: f64,
    /// For waits, the launch; for launches, their wait.
    pub partner: Option<NodeId>,
}

/// A value.
#[derive(Clone, Debug)]
pub struct Value {
    /// Unique name.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// The node producing it (None: a graph input).
    pub producer: Option<NodeId>,
    /// Where its storage is allocated.
    pub alloc: Alloc,
}

/// A validated graph: nodes, values and every dependency edge, deduplicated.
#[derive(Clone, Debug)]
pub struct Graph {
    /// The sources being multiplexed.
    pub sources: Vec<Source>,
    /// Nodes, in table order.
    pub nodes: Vec<Node>,
    /// Values, indexed by `ValueId`.
    pub values: Vec<Value>,
    /// Predecessors of each node (all edge kinds).
    pub preds: Vec<SmallVec<[NodeId; 4]>>,
    /// Successors of each node.
    pub succs: Vec<SmallVec<[NodeId; 4]>>,
    /// A topological order, found while checking the graph is acyclic.
    pub topo: Vec<NodeId>,
    /// Values the graph returns (live to the end of any order).
    pub outputs: Vec<ValueId>,
}

impl Graph {
    /// Parse the JSON table.
    pub fn from_json(text: &str) -> Result<Graph> {
        let spec: GraphSpec =
            serde_json::from_str(text).map_err(|e| Error::InvalidInput(format!("graph is not valid: {e}")))?;
        Graph::new(spec)
    }

    /// Validate and index a table; errors name the node, value or source. A value's bytes are at
    /// most [`MAX_VALUE_BYTES`], so byte sums in the scheduler and the simulator cannot overflow.
    pub fn new(spec: GraphSpec) -> Result<Graph> {
        let bad = |m: String| Error::InvalidInput(m);
        let mut src_ix: HashMap<&str, SourceId> = HashMap::new();
        for (i, s) in spec.sources.iter().enumerate() {
            if src_ix.insert(&s.name, SourceId::new(i)).is_some() {
                return Err(bad(format!("source '{}' is declared twice", s.name)));
            }
        }
        let mut node_ix: HashMap<&str, NodeId> = HashMap::new();
        for (i, n) in spec.nodes.iter().enumerate() {
            if node_ix.insert(&n.name, NodeId::new(i)).is_some() {
                return Err(bad(format!("node '{}' is declared twice", n.name)));
            }
        }
        let mut values: Vec<Value> = Vec::new();
        let mut val_ix: HashMap<String, ValueId> = HashMap::new();
        let mut add_value = |values: &mut Vec<Value>, o: &OutputSpec, producer: Option<NodeId>, who: &str| -> Result<ValueId> {
            let (name, bytes, alloc) = match o {
                OutputSpec::Name(n) => (n.clone(), 0, Alloc::Producer),
                OutputSpec::Sized { value, bytes } => (value.clone(), *bytes, Alloc::Producer),
                OutputSpec::Placed { value, bytes, alloc } => (value.clone(), *bytes, *alloc),
            };
            if val_ix.contains_key(&name) {
                return Err(bad(format!("{who}: value '{name}' is produced twice")));
            }
            if bytes > MAX_VALUE_BYTES {
                return Err(bad(format!("{who}: value '{name}' has {bytes} bytes, over the {MAX_VALUE_BYTES} (1 PiB) a value may have")));
            }
            let id = ValueId::new(values.len());
            val_ix.insert(name.clone(), id);
            values.push(Value { name, bytes, producer, alloc });
            Ok(id)
        };
        for o in &spec.inputs {
            add_value(&mut values, o, None, "inputs")?;
        }
        let n = spec.nodes.len();
        let mut nodes: Vec<Node> = Vec::with_capacity(n);
        for (i, ns) in spec.nodes.iter().enumerate() {
            let who = format!("node '{}'", ns.name);
            let source = *src_ix
                .get(ns.source.as_str())
                .ok_or_else(|| bad(format!("{who} names source '{}', which is not declared", ns.source)))?;
            if !ns.cost.is_finite() || ns.cost < 0.0 {
                return Err(bad(format!("{who}: cost must be a finite number >= 0, got {}", ns.cost)));
            }
            if ns.wgrad && ns.kind != Kind::Compute {
                return Err(bad(format!("{who}: only compute nodes can be weight-gradient work")));
            }
            let mut outputs = SmallVec::new();
            for o in &ns.outputs {
                if matches!(o, OutputSpec::Placed { alloc: Alloc::Consumer, .. }) && !ns.kind.is_launch() {
                    return Err(bad(format!("{who}: only launch outputs can be allocated on the consumer stream")));
                }
                outputs.push(add_value(&mut values, o, Some(NodeId::new(i)), &who)?);
            }
            nodes.push(Node {
                name: ns.name.clone(),
                source,
                kind: ns.kind,
                wgrad: ns.wgrad,
                inputs: SmallVec::new(),
                outputs,
                cost: ns.cost,
                partner: None,
            });
        }
        // Inputs are resolved after all outputs exist, so a use before its producer in the
        // table is a dependency, not an error; a value no one produces is.
        for (i, ns) in spec.nodes.iter().enumerate() {
            for v in ns.inputs.iter().chain(ns.mutates.iter()) {
                let id = *val_ix.get(v).ok_or_else(|| {
                    bad(format!("node '{}' uses value '{v}', which no node produces and is not a graph input", ns.name))
                })?;
                if !nodes[i].inputs.contains(&id) {
                    nodes[i].inputs.push(id);
                }
            }
        }
        // Waits pair with launches.
        for (i, ns) in spec.nodes.iter().enumerate() {
            let who = format!("node '{}'", ns.name);
            if ns.kind.is_wait() {
                let lname = ns.launch.as_deref().ok_or_else(|| bad(format!("{who} is a wait without a launch")))?;
                let l = *node_ix.get(lname).ok_or_else(|| bad(format!("{who} waits for '{lname}', which is not a node")))?;
                let lk = nodes[l].kind;
                let ok = match ns.kind {
                    Kind::CommWait => lk == Kind::CommLaunch,
                    _ => matches!(lk, Kind::PageOut | Kind::PageIn),
                };
                if !ok {
                    return Err(bad(format!("{who} waits for '{lname}', which is a {lk:?}, not a matching launch")));
                }
                if let Some(other) = nodes[l].partner {
                    return Err(bad(format!(
                        "'{lname}' has two waits: '{}' and '{}'",
                        nodes[other].name, ns.name
                    )));
                }
                nodes[l].partner = Some(NodeId::new(i));
                nodes[i].partner = Some(l);
            } else if ns.launch.is_some() {
                return Err(bad(format!("{who} names a launch but is not a wait")));
            }
        }
        for nd in &nodes {
            if nd.kind.is_launch() && nd.partner.is_none() {
                return Err(bad(format!("launch '{}' has no wait", nd.name)));
            }
        }
        let mut preds: Vec<SmallVec<[NodeId; 4]>> = vec![SmallVec::new(); n];
        let add = |preds: &mut Vec<SmallVec<[NodeId; 4]>>, a: NodeId, b: NodeId| {
            if a != b && !preds[b].contains(&a) {
                preds[b].push(a);
            }
        };
        // Data: a launch's outputs become usable at its wait.
        for i in 0..n {
            for &v in &nodes[i].inputs.clone() {
                if let Some(p) = values[v].producer {
                    if p.ix() == i {
                        return Err(Error::InvalidInput(format!(
                            "the graph has a cycle through node '{}': it reads its own output '{}'",
                            nodes[i].name, values[v].name
                        )));
                    }
                    let p = if nodes[p].kind.is_launch() && nodes[i].kind != Kind::CommWait && nodes[i].kind != Kind::PageWait {
                        nodes[p].partner.unwrap_or(p)
                    } else {
                        p
                    };
                    add(&mut preds, p, NodeId::new(i));
                }
            }
            if let (true, Some(l)) = (nodes[i].kind.is_wait(), nodes[i].partner) {
                add(&mut preds, l, NodeId::new(i));
            }
        }
        // Mutation order: a writer comes after earlier (table order) readers and writers.
        let mut touched: HashMap<ValueId, Vec<NodeId>> = HashMap::new();
        for (i, ns) in spec.nodes.iter().enumerate() {
            for v in &ns.mutates {
                let id = val_ix[v];
                for &u in touched.get(&id).map(|x| x.as_slice()).unwrap_or(&[]) {
                    add(&mut preds, u, NodeId::new(i));
                }
            }
            for &v in &nodes[i].inputs {
                touched.entry(v).or_default().push(NodeId::new(i));
            }
        }
        for (kind, edges) in [("control", &spec.control), ("reuse", &spec.reuse)] {
            for (a, b) in edges {
                let ia = *node_ix.get(a.as_str()).ok_or_else(|| bad(format!("{kind} edge names unknown node '{a}'")))?;
                let ib = *node_ix.get(b.as_str()).ok_or_else(|| bad(format!("{kind} edge names unknown node '{b}'")))?;
                if ia == ib {
                    return Err(Error::InvalidInput(format!("the graph has a cycle through node '{a}': a {kind} edge from it to itself")));
                }
                add(&mut preds, ia, ib);
            }
        }
        let mut succs: Vec<SmallVec<[NodeId; 4]>> = vec![SmallVec::new(); n];
        for (b, ps) in preds.iter().enumerate() {
            for &a in ps {
                succs[a].push(NodeId::new(b));
            }
        }
        let mut outputs = Vec::with_capacity(spec.outputs.len());
        for v in &spec.outputs {
            outputs.push(*val_ix.get(v).ok_or_else(|| bad(format!("graph output '{v}' is not a value of the graph")))?);
        }
        let mut g = Graph { sources: spec.sources, nodes, values, preds, succs, topo: Vec::new(), outputs };
        g.topo = g.topo_order()?;
        Ok(g)
    }

    /// Kahn's algorithm; a cycle is an error naming a node on it.
    fn topo_order(&self) -> Result<Vec<NodeId>> {
        let mut indeg: Vec<u32> = self.preds.iter().map(|p| p.len() as u32).collect();
        let mut stack: Vec<NodeId> = self.node_ids().filter(|&i| indeg[i.ix()] == 0).collect();
        let mut order = Vec::with_capacity(self.nodes.len());
        while let Some(u) = stack.pop() {
            order.push(u);
            for &s in &self.succs[u] {
                indeg[s.ix()] -= 1;
                if indeg[s.ix()] == 0 {
                    stack.push(s);
                }
            }
        }
        if order.len() == self.nodes.len() {
            return Ok(order);
        }
        // Walk predecessors inside the cyclic remainder until a node repeats: it is on a cycle.
        let mut u = NodeId::new(indeg.iter().position(|&d| d > 0).unwrap_or(0));
        let mut visited = vec![false; self.nodes.len()];
        while !visited[u.ix()] {
            visited[u.ix()] = true;
            u = self.preds[u].iter().copied().find(|&p| indeg[p.ix()] > 0).unwrap_or(u);
        }
        Err(Error::InvalidInput(format!("the graph has a cycle through node '{}'", self.nodes[u].name)))
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when there are no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}
