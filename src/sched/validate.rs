//! The validator: checks any schedule (ours or a user's) against its graph. Errors name the
//! node at fault.

use super::{Clocks, Schedule};
use crate::error::{Error, Result};
use crate::ir::{Graph, Stream};

fn bad(m: String) -> Error {
    Error::InvalidInput(m)
}

/// Topological, every cross-stream dependency covered by a wait (directly or through earlier
/// ones), budgets respected, every retire drained after it on the owner's stream.
pub fn validate(g: &Graph, s: &Schedule) -> Result<()> {
    let n = g.len();
    let name = |u: u32| g.nodes[u as usize].name.as_str();
    if s.order.len() != n || s.stream.len() != n {
        return Err(bad(format!("schedule has {} nodes, the graph {n}", s.order.len())));
    }
    let mut pos = vec![usize::MAX; n];
    for (i, &u) in s.order.iter().enumerate() {
        let slot = pos.get_mut(u as usize).ok_or_else(|| bad(format!("schedule names node index {u}, not in the graph")))?;
        if *slot != usize::MAX {
            return Err(bad(format!("node '{}' is issued twice", name(u))));
        }
        *slot = i;
    }
    for (i, nd) in g.nodes.iter().enumerate() {
        if s.stream[i] != nd.stream() {
            return Err(bad(format!("node '{}' is on {:?}, its kind needs {:?}", nd.name, s.stream[i], nd.stream())));
        }
    }
    // Syncs by consumer, to replay them with vector clocks.
    let mut syncs_of: Vec<Vec<u32>> = vec![Vec::new(); n];
    for e in &s.syncs {
        if e.producer as usize >= n || e.consumer as usize >= n {
            return Err(bad(format!("sync edge {e:?} names a node not in the graph")));
        }
        if pos[e.producer as usize] >= pos[e.consumer as usize] {
            return Err(bad(format!("sync: '{}' waits on '{}', which is issued later", name(e.consumer), name(e.producer))));
        }
        syncs_of[e.consumer as usize].push(e.producer);
    }
    let mut clocks = Clocks::new(n);
    let mut in_flight = [0usize; 3];
    for &c in &s.order {
        let x = s.stream[c as usize];
        for &p in &syncs_of[c as usize] {
            clocks.join(p, x);
        }
        for &p in &g.preds[c as usize] {
            if pos[p as usize] > pos[c as usize] {
                return Err(bad(format!("'{}' is issued before its predecessor '{}'", name(c), name(p))));
            }
            if clocks.need(p, x, &s.stream) {
                return Err(bad(format!(
                    "'{}' on {x:?} uses '{}' on {:?} with no wait covering it",
                    name(c),
                    name(p),
                    s.stream[p as usize]
                )));
            }
        }
        let nd = &g.nodes[c as usize];
        if nd.kind.is_launch() {
            let si = nd.stream().index();
            in_flight[si] += 1;
            let budget = s.budgets.of(nd.stream());
            if in_flight[si] > budget {
                return Err(bad(format!("'{}' exceeds the {:?} launch budget of {budget}", nd.name, nd.stream())));
            }
        }
        if let (true, Some(l)) = (nd.kind.is_wait(), nd.partner) {
            in_flight[g.nodes[l as usize].stream().index()] -= 1;
        }
        clocks.step(c, x);
    }
    for r in &s.retires {
        if let Some(d) = r.drain_before {
            if pos[d as usize] <= pos[r.last_consumer as usize] || s.stream[d as usize] != r.owner {
                return Err(bad(format!(
                    "value '{}' drains before '{}', which is not a later node on its owner stream {:?}",
                    g.values[r.value as usize].name,
                    name(d),
                    r.owner
                )));
            }
        }
    }
    Ok(())
}

/// Drains whose owner-stream node is not already ordered after the retire's last consumer:
/// there, the manager's wait adds a dependency (allowed, but ours never does that).
pub fn drains_adding_waits(g: &Graph, s: &Schedule) -> Vec<String> {
    let mut syncs_of: Vec<Vec<u32>> = vec![Vec::new(); g.len()];
    for e in &s.syncs {
        syncs_of[e.consumer as usize].push(e.producer);
    }
    let mut clocks = Clocks::new(g.len());
    for &c in &s.order {
        let x: Stream = s.stream[c as usize];
        for &p in &syncs_of[c as usize] {
            clocks.join(p, x);
        }
        clocks.step(c, x);
    }
    s.retires
        .iter()
        .filter(|r| {
            r.drain_before.is_some_and(|d| {
                let uncovered = |c: u32| {
                    let cs = s.stream[c as usize];
                    cs != r.owner && clocks.at[d as usize][cs.index()] < clocks.seq[c as usize]
                };
                // Every consumer of the value (waits aside) must be covered at the drain.
                g.nodes.iter().enumerate().any(|(i, n)| {
                    !n.kind.is_wait() && n.inputs.contains(&r.value) && uncovered(i as u32)
                })
            })
        })
        .map(|r| g.values[r.value as usize].name.clone())
        .collect()
}
