//! Paging plans (DESIGN.md §4): which saved activations to page out to pinned host memory.
//!
//! Calibration records the *live prefix* at the forward -> backward boundary: every tensor the
//! forward saved for its backward, with its bytes, the forward step that saved it and the
//! backward step that reads it back. [`choose`] pages out the tensors whose backward use is
//! furthest away first (they would sit on the device longest; a page-in has the most time to
//! hide), ties by larger bytes then name, until the byte target is met; tensors read within
//! `min_distance` steps of the boundary are never paged (their page-in could not hide). No
//! activation checkpointing: nothing is recomputed. The choice depends only on its inputs, so
//! every rank makes the same one.
//!
//! With a [`Timing`] (the calibration step's measured timeline: when each save and each
//! unpack ran on the compute stream, and the link's copy rates) [`choose_timed`] also places
//! the copies so they hide: a page-out is queued at its save and the device->host copies run one
//! after another; a tensor is paged only if its copy, behind the ones before it, ends before a
//! later save of the forward, and that save is where the compute stream waits on it and its
//! storage is released (the wait finds the copy done, and the bytes are gone before the
//! forward's peak). Page-ins are queued as late as the host->device queue allows, each
//! finishing by its use: memory comes back just in time, not a fixed count of unpacks early.
//!
//! Two-way (the timing has `both_bytes_per_us`: page-outs and page-ins on a stream each, the
//! link's two directions at once): a page-out may also end after the forward, while the
//! backward runs; it is released at the first unpack after its copy ends (a release *point*
//! indexes saves then unpacks: `ns + u` is unpack `u`). The backward's first unpack is taken to
//! follow the last save at once (the real gap only finishes copies earlier). Copies that run
//! while the other direction is busy are planned at half the two-way rate: every page-out time
//! after the forward, and every page-in time before the last page-out ends.
//!
//! Host time (the timing's `page_host_us`: what one page-out and its page-in cost the host
//! thread that runs the step, measured on this host): a tensor whose device->host copy is
//! shorter than that is never paged. Its copy would hide, but the host calls that queue it
//! would not: on a model whose host runs barely ahead of the GPU, paging many small tensors
//! makes the GPU wait for the host (measured: Qwen3-MoE on one H200, docs/results.md).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One saved tensor of the live prefix.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Saved {
    /// Stable name (e.g. "L3.attn#2": node and save index).
    pub name: String,
    /// Bytes of its storage.
    pub bytes: u64,
    /// Forward step that saved it (0-based, in save order).
    pub saved_at: u32,
    /// Backward step that reads it (0-based, in backward order).
    pub used_at: u32,
}

/// The target: bytes to page out, or a fraction of the live prefix's bytes.
#[derive(Copy, Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    /// Page out at least this many bytes.
    Bytes(u64),
    /// Page out at least this fraction (0..=1) of the live prefix.
    Fraction(f64),
}

/// What to page, and why.
#[derive(Clone, Debug, Serialize)]
pub struct PagePlan {
    /// Names of the tensors to page out, in the order they were saved.
    pub page: Vec<String>,
    /// Bytes paged out (and in again: the two must match every step).
    pub bytes_paged: u64,
    /// Bytes of the whole live prefix.
    pub bytes_live: u64,
    /// The byte target the budget asked for.
    pub target: u64,
    /// True when the target could not be met without paging tensors read too soon.
    pub short: bool,
    /// One line per tensor: paged or kept, and why.
    pub explain: Vec<String>,
    /// With a timing, per paged tensor (in `page`'s order): the point at which the compute
    /// stream waits on its page-out and its device storage is released: a save index, or (a
    /// two-way plan) the number of saves plus an unpack index. Empty without one.
    pub release_at: Vec<u32>,
    /// With a timing, per paged tensor (in `page`'s order): the unpack index at which its
    /// page-in is queued (before that unpack's own wait). Empty without one.
    pub launch_at: Vec<u32>,
}

/// The calibration step's timeline, measured on the compute stream, and the link's rates.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Timing {
    /// Time of each save, us from the first save, by save index (`Saved::saved_at`).
    pub save_us: Vec<f64>,
    /// Time of each unpack, us from the first unpack, by unpack index (`Saved::used_at`).
    pub unpack_us: Vec<f64>,
    /// Device -> host copy rate, bytes per us.
    pub d2h_bytes_per_us: f64,
    /// Host -> device copy rate, bytes per us.
    pub h2d_bytes_per_us: f64,
    /// Copies are planned as this many times slower than the measured rate (>= 1: a margin for
    /// the link's other traffic and the timeline's noise).
    #[serde(default = "default_slack")]
    pub slack: f64,
    /// Optional memory timeline (all three or none): the most bytes allocated in the interval
    /// ending at each save (from the previous one, or the step's start) ...
    #[serde(default)]
    pub save_peak: Vec<u64>,
    /// ... in the interval ending at each unpack (from the previous one, or the last save) ...
    #[serde(default)]
    pub unpack_peak: Vec<u64>,
    /// ... and after the last unpack. With it, a tensor is paged only if that lowers the
    /// step's peak: one released after the peak, or back before it, only costs copies.
    #[serde(default)]
    pub tail_peak: u64,
    /// Two-way: bytes per us of a device->host and a host->device copy running at once on two
    /// streams, both directions together. With it, page-outs may end in the backward (see the
    /// module docs); without it (one page stream) every page-out ends under the forward.
    #[serde(default)]
    pub both_bytes_per_us: Option<f64>,
    /// Host time, us, one page-out and its page-in take on the thread that runs the step (0:
    /// not counted). A tensor whose device->host copy is shorter is kept (see the module docs).
    #[serde(default)]
    pub page_host_us: f64,
}

fn default_slack() -> f64 {
    1.25
}

impl Timing {
    fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidInput(format!("paging timing: {what}")));
        let finite = |v: &[f64]| v.iter().all(|x| x.is_finite() && *x >= 0.0);
        if !finite(&self.save_us) || !finite(&self.unpack_us) {
            return bad("times must be finite and >= 0");
        }
        if self.save_us.windows(2).any(|w| w[1] < w[0]) || self.unpack_us.windows(2).any(|w| w[1] < w[0]) {
            return bad("times must not decrease with the index");
        }
        let both = ("both_bytes_per_us", self.both_bytes_per_us.unwrap_or(1.0));
        for (what, r) in [("d2h_bytes_per_us", self.d2h_bytes_per_us), ("h2d_bytes_per_us", self.h2d_bytes_per_us), both] {
            if !(r.is_finite() && r > 0.0) {
                return bad(&format!("{what} must be > 0, got {r}"));
            }
        }
        if !(self.slack.is_finite() && self.slack >= 1.0) {
            return bad(&format!("slack must be >= 1, got {}", self.slack));
        }
        if !(self.page_host_us.is_finite() && self.page_host_us >= 0.0) {
            return bad(&format!("page_host_us must be finite and >= 0, got {}", self.page_host_us));
        }
        Ok(())
    }

    /// What a timeline measured on a user's graphs may not match (a memory line with fewer
    /// peaks than saves, tensors outside the time line): never an error. A partial memory line
    /// is dropped (the plan is made from the time line alone) and a tensor the time line cannot
    /// place is not paged; `explain` gets a line for each. Returns the timing to plan with and
    /// the placeable part of `prefix`.
    fn usable<'a>(&self, prefix: &'a [Saved], explain: &mut Vec<String>) -> (Timing, Vec<&'a Saved>) {
        let mut t = self.clone();
        let partial = t.save_peak.len() != t.save_us.len() || t.unpack_peak.len() != t.unpack_us.len();
        if (!t.save_peak.is_empty() || !t.unpack_peak.is_empty()) && partial {
            explain.push(format!(
                "memory timeline not used: it has {} save and {} unpack peaks for {} saves and {} unpacks (planned from the time line alone)",
                t.save_peak.len(), t.unpack_peak.len(), t.save_us.len(), t.unpack_us.len()
            ));
            (t.save_peak, t.unpack_peak, t.tail_peak) = (Vec::new(), Vec::new(), 0);
        }
        let (ns, nu) = (t.save_us.len(), t.unpack_us.len());
        let mut placed = Vec::with_capacity(prefix.len());
        for s in prefix {
            let copy_us = s.bytes as f64 / t.d2h_bytes_per_us;
            if s.saved_at as usize >= ns || s.used_at as usize >= nu {
                explain.push(format!(
                    "{}: kept (not placed: saved at {} and used at {}, but the timeline has {ns} saves and {nu} unpacks)",
                    s.name, s.saved_at, s.used_at
                ));
            } else if copy_us < t.page_host_us {
                explain.push(format!(
                    "{}: kept (its copy takes {copy_us:.1} us, less than the {:.1} us of host time a page-out and its page-in take)",
                    s.name, t.page_host_us
                ));
            } else {
                placed.push(s);
            }
        }
        (t, placed)
    }

    /// Two-way: each direction's rate while the other one is busy (half the two-way rate, at
    /// most the one-way rate), device->host and host->device. None: one page stream.
    fn shared(&self) -> Option<(f64, f64)> {
        self.both_bytes_per_us.map(|b| ((b / 2.0).min(self.d2h_bytes_per_us), (b / 2.0).min(self.h2d_bytes_per_us)))
    }

    /// The forward's last save, us: where the backward's unpack times start (two-way).
    fn boundary(&self) -> f64 {
        self.save_us.last().copied().unwrap_or(0.0)
    }

    /// When each page-out of `set` (in save order) ends, us on the save timeline, queued one
    /// after another on the link; two-way, the part after the forward at the shared rate.
    fn page_out_ends(&self, set: &[&Saved]) -> Vec<f64> {
        let b = self.boundary();
        let mut free_at = 0.0f64; // when the link is done with the copies queued so far
        set.iter()
            .map(|s| {
                let start = free_at.max(self.save_us[s.saved_at as usize]);
                let mut end = start + s.bytes as f64 / self.d2h_bytes_per_us * self.slack;
                if let Some((d2h, _)) = self.shared().filter(|_| end > b) {
                    let before = (b - start).max(0.0) * self.d2h_bytes_per_us / self.slack;
                    end = start.max(b) + (s.bytes as f64 - before) / d2h * self.slack;
                }
                free_at = end;
                end
            })
            .collect()
    }

    /// The page-outs of `set` (in save order) queued one after another on the link: per tensor
    /// the release point (a save index, or two-way `ns + u` for unpack `u`) where the compute
    /// stream can wait on it for free, or the first that cannot end in time (before the
    /// forward's last save; two-way, before the unpack that reads it).
    fn releases(&self, set: &[&Saved]) -> std::result::Result<Vec<u32>, String> {
        let (ns, b) = (self.save_us.len(), self.boundary());
        let mut out = Vec::with_capacity(set.len());
        for (s, end) in set.iter().zip(self.page_out_ends(set)) {
            let after = (s.saved_at as usize + 1..ns).find(|&j| self.save_us[j] >= end);
            // Two-way: the first unpack after the copy, before the one that reads the tensor.
            let spill = || (0..s.used_at as usize).find(|&u| b + self.unpack_us[u] >= end).map(|u| ns + u);
            match after.or_else(|| self.shared().and_then(|_| spill())) {
                Some(j) => out.push(j as u32),
                None => return Err(s.name.clone()),
            }
        }
        Ok(out)
    }

    fn has_memory(&self) -> bool {
        !self.save_peak.is_empty()
    }

    /// The step's peak with `set` paged (in save order; `None` when a page-out would not hide),
    /// as (the highest interval, how many intervals reach it): a paged tensor is off the device
    /// from the interval after its release save through the interval of its page-in's unpack
    /// (the intervals, saves then unpacks then the tail, make that one range).
    fn peak_with(&self, set: &[&Saved]) -> Option<(u64, usize)> {
        let rel = self.releases(set).ok()?;
        let launch = self.launches(set, &mut Vec::new());
        let (ns, nu) = (self.save_peak.len(), self.unpack_peak.len());
        let mut diff = vec![0i128; ns + nu + 2];
        for (k, s) in set.iter().enumerate() {
            let (from, to) = (rel[k] as usize + 1, ns + launch[k] as usize);
            if from <= to {
                diff[from] += i128::from(s.bytes);
                diff[to + 1] -= i128::from(s.bytes);
            }
        }
        let (mut off, mut best, mut count) = (0i128, 0u64, 0usize);
        for (i, &p) in self.save_peak.iter().chain(&self.unpack_peak).chain(std::iter::once(&self.tail_peak)).enumerate() {
            off += diff[i];
            let v = (i128::from(p) - off).max(0) as u64;
            match v.cmp(&best) {
                std::cmp::Ordering::Greater => (best, count) = (v, 1),
                std::cmp::Ordering::Equal => count += 1,
                std::cmp::Ordering::Less => {}
            }
        }
        Some((best, count))
    }

    /// Per tensor of `set` (in save order), the unpack index at which to queue its page-in:
    /// the host->device copies, in order of use, each ending by its use, as late as that
    /// allows. `late` gets a line for each whose chain must start before the backward does (it
    /// is queued at the first unpack and may make it wait) and, two-way, each queued before its
    /// own page-out ends.
    fn launches(&self, set: &[&Saved], late: &mut Vec<String>) -> Vec<u32> {
        let mut by_use: Vec<usize> = (0..set.len()).collect();
        by_use.sort_by_key(|&k| (set[k].used_at, set[k].saved_at));
        let mut out = vec![0u32; set.len()];
        // Two-way: until the last page-out ends (us on the unpack timeline), page-ins share the link.
        let ends: Vec<f64> = self.page_out_ends(set).iter().map(|e| e - self.boundary()).collect();
        let shared = self.shared().map(|(_, h2d)| (h2d, ends.last().copied().unwrap_or(0.0)));
        let mut next_start = f64::INFINITY; // the latest the copy after this one may start
        for &k in by_use.iter().rev() {
            let s = set[k];
            let end = self.unpack_us[s.used_at as usize].min(next_start);
            let mut start = end - s.bytes as f64 / self.h2d_bytes_per_us * self.slack;
            if let Some((h2d, busy_until)) = shared.filter(|&(_, until)| start < until) {
                // The part after the page-outs end at the one-way rate, the rest at the shared one.
                let alone = (end - busy_until).max(0.0) * self.h2d_bytes_per_us / self.slack;
                start = end.min(busy_until) - (s.bytes as f64 - alone) / h2d * self.slack;
            }
            next_start = start;
            // The last unpack at or before `start` (the queue point is an unpack's host time,
            // where the compute stream has reached that unpack).
            let v = (0..=s.used_at as usize).rev().find(|&v| self.unpack_us[v] <= start);
            out[k] = match v {
                Some(v) => {
                    if shared.is_some() && start < ends[k] {
                        // Two-way: its own page-out, still running then, holds it back.
                        late.push(format!("{}: page-in held back by its own page-out, still running when it is queued", s.name));
                    }
                    v as u32
                }
                None => {
                    late.push(format!("{}: page-in cannot end by its use at the planned rate; queued at the first unpack", s.name));
                    0
                }
            };
        }
        out
    }
}

/// Choose what to page for `prefix` under `budget`; tensors read within `min_distance` backward
/// steps of the boundary stay on the device.
pub fn choose(prefix: &[Saved], budget: Budget, min_distance: u32) -> Result<PagePlan> {
    choose_timed(prefix, budget, min_distance, None)
}

/// [`choose`], and with a `timing` only tensors whose page-out hides under the forward, with
/// their release and page-in points (see the module docs).
pub fn choose_timed(prefix: &[Saved], budget: Budget, min_distance: u32, timing: Option<&Timing>) -> Result<PagePlan> {
    let mut explain = Vec::new();
    let usable = match timing {
        Some(t) => {
            t.check()?;
            Some(t.usable(prefix, &mut explain))
        }
        None => None,
    };
    let timing = usable.as_ref().map(|(t, _)| t);
    let mut names = std::collections::HashSet::new();
    for s in prefix {
        if !names.insert(s.name.as_str()) {
            return Err(Error::InvalidInput(format!("live prefix names '{}' twice", s.name)));
        }
    }
    let live: u64 = prefix.iter().map(|s| s.bytes).sum();
    let target = match budget {
        Budget::Bytes(b) => b,
        Budget::Fraction(f) if (0.0..=1.0).contains(&f) => (live as f64 * f).ceil() as u64,
        Budget::Fraction(f) => {
            return Err(Error::InvalidInput(format!("paging budget fraction must be in 0..=1, got {f}")));
        }
    };
    // Furthest backward use first; then larger; then by name (total order: reproducible).
    let mut by_pref: Vec<&Saved> = match &usable {
        Some((_, placed)) => placed.clone(),
        None => prefix.iter().collect(),
    };
    by_pref.sort_by(|a, b| b.used_at.cmp(&a.used_at).then(b.bytes.cmp(&a.bytes)).then(a.name.cmp(&b.name)));
    // A tensor with no elements frees nothing, and a host buffer of no bytes is no buffer.
    by_pref.retain(|s| {
        if s.bytes == 0 {
            explain.push(format!("{}: kept (no bytes: paging it frees nothing)", s.name));
        }
        s.bytes > 0
    });
    let mut page: Vec<&Saved> = Vec::new(); // in save order
    let mut bytes = 0u64;
    match timing {
        Some(t) if t.has_memory() => lower_the_peak(t, &by_pref, target, min_distance, &mut page, &mut bytes, &mut explain),
        _ => by_budget(timing, by_pref, target, min_distance, &mut page, &mut bytes, &mut explain),
    }
    let (mut release_at, mut launch_at) = (Vec::new(), Vec::new());
    if let Some(t) = timing {
        release_at = t.releases(&page).map_err(|n| Error::Runtime(format!("paging plan: '{n}' was accepted but does not hide")))?;
        let mut late = Vec::new();
        launch_at = t.launches(&page, &mut late);
        let ns = t.save_us.len() as u32;
        for (s, (&r, l)) in page.iter().zip(release_at.iter().zip(&launch_at)) {
            let at = if r < ns { format!("save {r}") } else { format!("unpack {} (after the forward)", r - ns) };
            explain.push(format!("{}: released at {at}, paged in at unpack {l} (used at {})", s.name, s.used_at));
        }
        explain.extend(late);
    }
    Ok(PagePlan {
        page: page.iter().map(|s| s.name.clone()).collect(),
        bytes_paged: bytes,
        bytes_live: live,
        target,
        short: bytes < target,
        explain,
        release_at,
        launch_at,
    })
}

/// Why `s` stays on the device when it is read within `min_distance` backward steps.
fn read_too_soon(s: &Saved, min_distance: u32) -> String {
    format!("{}: kept (read {} step(s) after the boundary, within {min_distance})", s.name, s.used_at)
}

/// Where `s` goes in `page` (save order).
fn slot_of(page: &[&Saved], s: &Saved) -> usize {
    page.partition_point(|p| (p.saved_at, &p.name) < (s.saved_at, &s.name))
}

/// The budget alone (and, with a timing, only what hides): furthest use first until the target.
fn by_budget<'a>(
    timing: Option<&Timing>, by_pref: Vec<&'a Saved>, target: u64, min_distance: u32, page: &mut Vec<&'a Saved>, bytes: &mut u64,
    explain: &mut Vec<String>,
) {
    for s in by_pref {
        if *bytes >= target {
            explain.push(format!("{}: kept (target of {target} bytes met)", s.name));
        } else if s.used_at < min_distance {
            explain.push(read_too_soon(s, min_distance));
        } else {
            let at = slot_of(page, s);
            page.insert(at, s);
            if let Some(Err(blocked)) = timing.map(|t| t.releases(page)) {
                page.remove(at);
                explain.push(format!(
                    "{}: kept (its page-out, queued behind the others, would leave '{blocked}' unfinished at the forward's last save)",
                    s.name
                ));
                continue;
            }
            *bytes += s.bytes;
            explain.push(format!("{}: paged ({} bytes, read at backward step {})", s.name, s.bytes, s.used_at));
        }
    }
}

/// With the memory timeline: repeatedly page the first tensor (furthest use first) whose page-out
/// hides and that lowers the step's peak (or the number of intervals at it), until the target
/// or until no tensor lowers it.
fn lower_the_peak<'a>(
    t: &Timing, by_pref: &[&'a Saved], target: u64, min_distance: u32, page: &mut Vec<&'a Saved>, bytes: &mut u64,
    explain: &mut Vec<String>,
) {
    let mut cur = t.peak_with(page).unwrap_or((u64::MAX, 0));
    let start = cur.0;
    let mut done: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for s in by_pref {
        if s.used_at < min_distance {
            explain.push(read_too_soon(s, min_distance));
            done.insert(&s.name);
        }
    }
    while *bytes < target {
        let mut took = false;
        let open: Vec<&'a Saved> = by_pref.iter().copied().filter(|s| !done.contains(s.name.as_str())).collect();
        for s in open {
            let at = slot_of(page, s);
            page.insert(at, s);
            match t.peak_with(page) {
                None => {
                    // Adding tensors only delays the queue: it will not hide later either.
                    explain.push(format!("{}: kept (its page-out, queued behind the others, would not finish under the forward)", s.name));
                    done.insert(&s.name);
                }
                Some(p) if p < cur => {
                    explain.push(format!("{}: paged ({} bytes, read at backward step {}; peak {} -> {} bytes)", s.name, s.bytes, s.used_at, cur.0, p.0));
                    *bytes += s.bytes;
                    cur = p;
                    done.insert(&s.name);
                    took = true;
                    break;
                }
                Some(_) => {}
            }
            page.remove(at);
        }
        if !took {
            break;
        }
    }
    for s in by_pref.iter().filter(|s| !done.contains(s.name.as_str())) {
        let why = if *bytes >= target { format!("target of {target} bytes met") } else { format!("paging it does not lower the peak of {} bytes", cur.0) };
        explain.push(format!("{}: kept ({why})", s.name));
    }
    explain.push(format!("peak {start} -> {} bytes (planned, from the calibration step's timeline)", cur.0));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(name: &str, bytes: u64, saved_at: u32, used_at: u32) -> Saved {
        Saved { name: name.into(), bytes, saved_at, used_at }
    }

    fn prefix() -> Vec<Saved> {
        // Layer 0's tensors are saved first and read last in backward.
        vec![s("L0.a", 100, 0, 5), s("L0.b", 50, 1, 4), s("L1.a", 100, 2, 3), s("L1.b", 50, 3, 2), s("head", 10, 4, 0)]
    }

    #[test]
    fn pages_the_furthest_backward_use_first_until_the_target() {
        let p = choose(&prefix(), Budget::Bytes(120), 1).unwrap();
        assert_eq!(p.page, ["L0.a", "L0.b"]);
        assert_eq!((p.bytes_paged, p.bytes_live, p.short), (150, 310, false));
        let p = choose(&prefix(), Budget::Fraction(0.5), 1).unwrap();
        assert_eq!(p.target, 155);
        assert_eq!(p.page, ["L0.a", "L0.b", "L1.a"]);
    }

    #[test]
    fn never_pages_what_is_read_too_soon_and_says_so() {
        let p = choose(&prefix(), Budget::Fraction(1.0), 3).unwrap();
        assert_eq!(p.page, ["L0.a", "L0.b", "L1.a"]);
        assert!(p.short);
        assert!(p.explain.iter().any(|l| l.starts_with("head: kept (read 0 step(s)")), "{:?}", p.explain);
    }

    #[test]
    fn a_tensor_with_no_bytes_is_never_paged_and_said() {
        let mut pre = prefix();
        pre[1].bytes = 0; // L0.b: a tensor with no elements (an empty batch's branch)
        let said = |p: &PagePlan| p.explain.iter().any(|l| l == "L0.b: kept (no bytes: paging it frees nothing)");
        for p in [
            choose(&pre, Budget::Fraction(1.0), 0).unwrap(),
            choose(&pre, Budget::Bytes(u64::MAX), 0).unwrap(),
            choose_timed(&pre, Budget::Fraction(1.0), 0, Some(&timing(10.0))).unwrap(),
        ] {
            assert!(!p.page.iter().any(|n| n == "L0.b") && !p.page.is_empty(), "{:?}", p.page);
            assert!(said(&p), "{:?}", p.explain);
        }
    }

    #[test]
    fn same_inputs_same_choice_whatever_the_input_order() {
        let mut rev = prefix();
        rev.reverse();
        let a = choose(&prefix(), Budget::Bytes(200), 1).unwrap();
        let b = choose(&rev, Budget::Bytes(200), 1).unwrap();
        assert_eq!(a.page, b.page);
        assert_eq!(a.bytes_paged, b.bytes_paged);
    }

    #[test]
    fn bad_budgets_and_duplicates_are_errors() {
        assert!(choose(&prefix(), Budget::Fraction(1.5), 0).unwrap_err().to_string().contains("0..=1"));
        let mut dup = prefix();
        dup.push(s("L0.a", 1, 9, 9));
        assert!(choose(&dup, Budget::Bytes(1), 0).unwrap_err().to_string().contains("'L0.a' twice"));
        assert!(choose(&[], Budget::Fraction(0.5), 0).unwrap().page.is_empty());
    }

    fn timing(h2d: f64) -> Timing {
        Timing {
            save_us: vec![0.0, 10.0, 20.0, 30.0, 40.0],
            unpack_us: vec![0.0, 10.0, 20.0, 30.0, 40.0, 50.0],
            d2h_bytes_per_us: 10.0,
            h2d_bytes_per_us: h2d,
            slack: 1.0,
            save_peak: vec![],
            unpack_peak: vec![],
            tail_peak: 0,
            both_bytes_per_us: None,
            page_host_us: 0.0,
        }
    }

    fn with_memory(tail: u64) -> Timing {
        Timing { save_peak: vec![100, 200, 300, 400, 500], unpack_peak: vec![450, 400, 300, 200, 100, 50], tail_peak: tail, ..timing(10.0) }
    }

    #[test]
    fn with_the_memory_timeline_only_what_lowers_the_peak_is_paged() {
        // The peak is the forward's end (save 4, 500). L0.a (released at save 1, back at
        // unpack 4) takes it to 400, L0.b to 350, L1.a to 250 (saves 3 and 4); L1.b is off
        // only from after save 4 to unpack 1, below the peak: not paged, and said.
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&with_memory(10))).unwrap();
        assert_eq!(p.page, ["L0.a", "L0.b", "L1.a"]);
        assert_eq!((p.release_at.clone(), p.launch_at.clone()), (vec![1, 2, 3], vec![4, 3, 2]));
        assert!(p.explain.iter().any(|l| l == "L1.b: kept (paging it does not lower the peak of 250 bytes)"), "{:?}", p.explain);
        assert!(p.explain.iter().any(|l| l == "L0.b: paged (50 bytes, read at backward step 4; peak 400 -> 350 bytes)"), "{:?}", p.explain);
        assert!(p.explain.iter().any(|l| l == "peak 500 -> 250 bytes (planned, from the calibration step's timeline)"), "{:?}", p.explain);
        // The budget still caps it.
        let p = choose_timed(&prefix(), Budget::Bytes(120), 1, Some(&with_memory(10))).unwrap();
        assert_eq!(p.page, ["L0.a", "L0.b"]);
        // A peak after the last unpack cannot be lowered: nothing is paged.
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&with_memory(1000))).unwrap();
        assert!(p.page.is_empty() && p.short, "{:?}", p.page);
        // A partial memory timeline (fewer peaks than saves or unpacks, as a user's graphs can
        // give) is not an error: it is dropped, said, and the plan comes from the time line.
        let bad = Timing { unpack_peak: vec![1, 2], ..with_memory(10) };
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&bad)).unwrap();
        let timeline_only = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&timing(10.0))).unwrap();
        assert_eq!((p.page.clone(), p.release_at.clone()), (timeline_only.page, timeline_only.release_at));
        assert!(p.explain.iter().any(|l| l.contains("memory timeline not used") && l.contains("2 unpack peaks for 5 saves and 6 unpacks")), "{:?}", p.explain);
    }

    #[test]
    fn timed_pages_only_what_hides_and_releases_at_the_first_save_after_the_copy() {
        let mut pre = prefix();
        pre[3].bytes = 150; // L1.b: saved at 30 us, its copy would end at 45, after the last save (40)
        let p = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&timing(10.0))).unwrap();
        assert_eq!(p.page, ["L0.a", "L0.b", "L1.a"]);
        // L0.a copies 0-10 (save 1 is at 10), L0.b queues behind it 10-15 (save 2), L1.a 20-30.
        assert_eq!(p.release_at, [1, 2, 3]);
        assert!(p.short);
        assert!(p.explain.iter().any(|l| l.starts_with("L1.b: kept (its page-out") && l.contains("'L1.b' unfinished")), "{:?}", p.explain);
        // A slower link: L0.b now ends at 20 behind L0.a (0-10), released at save 2 still; at
        // slack 2 L0.a itself ends at 20 and L0.b at 30.
        let slow = Timing { slack: 2.0, ..timing(10.0) };
        let q = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&slow)).unwrap();
        assert_eq!(q.release_at[..2], [2, 3]);
        // Untimed: the same budget pages L1.b too, and places nothing.
        let u = choose(&pre, Budget::Fraction(1.0), 1).unwrap();
        assert!(u.page.contains(&"L1.b".to_string()) && u.release_at.is_empty() && u.launch_at.is_empty());
    }

    #[test]
    fn timed_page_ins_are_queued_as_late_as_the_link_allows() {
        let mut pre = prefix();
        pre[3].bytes = 150;
        // Uses: L1.a at unpack 3 (30 us), L0.b at 4 (40), L0.a at 5 (50). Backwards: L0.a must
        // copy 40-50 (queued at unpack 4), L0.b 35-40 (unpack 3), L1.a 20-30 (unpack 2).
        let p = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&timing(10.0))).unwrap();
        assert_eq!(p.launch_at, [4, 3, 2]);
        // At 2 bytes/us L0.a needs 0-50 (queued at unpack 0), and the two before it cannot end
        // in time: queued at the first unpack, and said.
        let p = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&timing(2.0))).unwrap();
        assert_eq!(p.launch_at, [0, 0, 0]);
        assert!(p.explain.iter().any(|l| l.starts_with("L0.b: page-in cannot end by its use")), "{:?}", p.explain);
        assert!(!p.explain.iter().any(|l| l.starts_with("L0.a: page-in cannot")), "{:?}", p.explain);
    }

    #[test]
    fn bad_timings_are_errors() {
        type Edit = Box<dyn Fn(&mut Timing)>;
        let cases: [(Edit, &str); 5] = [
            (Box::new(|t| t.both_bytes_per_us = Some(f64::NAN)), "both_bytes_per_us must be > 0"),
            (Box::new(|t| t.unpack_us[2] = -1.0), "finite and >= 0"),
            (Box::new(|t| t.save_us[1] = 50.0), "must not decrease"),
            (Box::new(|t| t.h2d_bytes_per_us = 0.0), "h2d_bytes_per_us must be > 0"),
            (Box::new(|t| t.slack = 0.5), "slack must be >= 1"),
        ];
        for (edit, msg) in cases {
            let mut t = timing(10.0);
            edit(&mut t);
            let e = choose_timed(&prefix(), Budget::Fraction(0.5), 1, Some(&t)).unwrap_err().to_string();
            assert!(e.contains(msg), "{e}");
        }
    }

    #[test]
    fn a_tensor_whose_copy_is_shorter_than_its_host_time_is_kept_and_said() {
        // At 10 bytes/us, L0.b and L1.b (50 bytes) copy in 5 us, L0.a and L1.a (100) in 10.
        let host = Timing { page_host_us: 6.0, ..timing(10.0) };
        let all = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&timing(10.0))).unwrap();
        assert!(all.page.contains(&"L0.b".to_string()), "{:?}", all.page);
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&host)).unwrap();
        assert_eq!(p.page, ["L0.a", "L1.a"]);
        assert!(
            p.explain.iter().any(|l| l == "L0.b: kept (its copy takes 5.0 us, less than the 6.0 us of host time a page-out and its page-in take)"),
            "{:?}",
            p.explain
        );
        // A copy exactly as long as the host time is paged; the memory-timeline plan obeys it too.
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&Timing { page_host_us: 5.0, ..timing(10.0) })).unwrap();
        assert!(p.page.contains(&"L0.b".to_string()), "{:?}", p.page);
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&Timing { page_host_us: 6.0, ..with_memory(10) })).unwrap();
        assert_eq!(p.page, ["L0.a", "L1.a"]);
        // Absent from the JSON: not counted; negative or not finite: an error.
        let t: Timing = serde_json::from_str(r#"{"save_us": [0], "unpack_us": [0], "d2h_bytes_per_us": 1, "h2d_bytes_per_us": 1}"#).unwrap();
        assert_eq!(t.page_host_us, 0.0);
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let e = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&Timing { page_host_us: bad, ..timing(10.0) })).unwrap_err();
            assert!(e.to_string().contains("page_host_us must be finite and >= 0"), "{e}");
        }
    }

    #[test]
    fn timing_defaults_and_edges_of_its_checks() {
        // The slack defaults to 1.25 when the timeline does not say.
        let t: Timing = serde_json::from_str(r#"{"save_us": [0, 10], "unpack_us": [0], "d2h_bytes_per_us": 1, "h2d_bytes_per_us": 1}"#).unwrap();
        assert_eq!((t.slack, t.save_peak.len(), t.tail_peak), (1.25, 0, 0));
        // Equal consecutive times are a valid timeline (two saves in one kernel's shadow).
        let flat = Timing { save_us: vec![0.0, 0.0, 20.0, 30.0, 40.0], unpack_us: vec![0.0, 10.0, 10.0, 30.0, 40.0, 50.0], ..timing(10.0) };
        assert!(choose_timed(&prefix(), Budget::Bytes(100), 1, Some(&flat)).is_ok());
        // Save peaks without unpack peaks is a partial memory timeline: dropped, and said.
        let half = Timing { save_peak: vec![1; 5], ..timing(10.0) };
        let p = choose_timed(&prefix(), Budget::Bytes(100), 1, Some(&half)).unwrap();
        assert!(p.explain.iter().any(|l| l.contains("5 save and 0 unpack peaks")), "{:?}", p.explain);
        // A tensor outside the time line (the 48-of-52 case: a timeline shorter than the prefix)
        // is not paged, and said; the others still are.
        let short = Timing { save_us: vec![0.0, 10.0, 20.0], ..timing(10.0) };
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&short)).unwrap();
        assert!(!p.page.iter().any(|n| n == "L1.b" || n == "head"), "{:?}", p.page);
        assert!(p.page.contains(&"L0.a".to_string()), "{:?}", p.page);
        assert!(p.explain.iter().any(|l| l.starts_with("L1.b: kept (not placed: saved at 3") && l.contains("3 saves and 6 unpacks")), "{:?}", p.explain);
        // A copy that takes almost no time (1 byte) is released at the next save, never at its own.
        let mut zero = prefix();
        zero[1].bytes = 1;
        let p = choose_timed(&zero[1..2], Budget::Bytes(0), 1, Some(&timing(10.0))).unwrap();
        assert!(p.page.is_empty(), "a target of 0 bytes is met at once");
        let p = choose_timed(&zero[..2], Budget::Bytes(101), 1, Some(&timing(10.0))).unwrap();
        assert_eq!((p.page.clone(), p.release_at.clone()), (vec!["L0.a".to_string(), "L0.b".to_string()], vec![1, 2]));
        // Page-in time scales with the slack: L0.a's 10 us copy planned as 30 us ends by its use
        // at 50 us from 20 us, queued at unpack 2 (its page-out, 0-30 us, at save 3).
        let slow = Timing { slack: 3.0, ..timing(10.0) };
        let p = choose_timed(&prefix(), Budget::Bytes(100), 1, Some(&slow)).unwrap();
        assert_eq!((p.page.clone(), p.release_at.clone(), p.launch_at.clone()), (vec!["L0.a".to_string()], vec![3], vec![2]));
        // A target met exactly is not short.
        let p = choose(&prefix(), Budget::Bytes(150), 1).unwrap();
        assert_eq!((p.bytes_paged, p.short), (150, false));
    }

    #[test]
    fn the_peak_model_counts_the_page_in_interval_ties_and_the_budget() {
        // The peak is at unpack 4, the interval that ends where L0.a's page-in is queued: L0.a is
        // still off the device there, so paging it lowers the peak; nothing else reaches it.
        let at_launch = Timing { save_peak: vec![100; 5], unpack_peak: vec![100, 100, 100, 100, 500, 100], tail_peak: 0, ..timing(10.0) };
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&at_launch)).unwrap();
        assert_eq!(p.page, ["L0.a"]);
        // Two intervals at the peak (saves 1 and 3): L0.a, released at save 1, lowers only the
        // second; one fewer interval at the peak counts as lower, and nothing lowers save 1's.
        let plateau = Timing { save_peak: vec![100, 500, 100, 500, 100], unpack_peak: vec![100; 6], tail_peak: 0, ..timing(10.0) };
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 1, Some(&plateau)).unwrap();
        assert_eq!(p.page, ["L0.a"]);
        assert!(p.explain.iter().any(|l| l == "peak 500 -> 500 bytes (planned, from the calibration step's timeline)"), "{:?}", p.explain);
        // min_distance 3 still lets L1.a (read at 3) go, and keeps L1.b (read at 2).
        let p = choose_timed(&prefix(), Budget::Fraction(1.0), 3, Some(&with_memory(10))).unwrap();
        assert_eq!(p.page, ["L0.a", "L0.b", "L1.a"]);
        assert!(p.explain.iter().any(|l| l.starts_with("L1.b: kept (read 2 step(s)")), "{:?}", p.explain);
        // A byte target met exactly stops the peak search there.
        let p = choose_timed(&prefix(), Budget::Bytes(150), 1, Some(&with_memory(10))).unwrap();
        assert_eq!((p.page.clone(), p.short), (vec!["L0.a".to_string(), "L0.b".to_string()], false));
    }
    #[test]
    fn two_way_page_outs_may_end_in_the_backward_and_page_ins_share_the_link_meanwhile() {
        let pre = vec![s("A", 60, 0, 2), s("B", 200, 3, 5)];
        // One page stream: B's copy (30-50 us) would end after the last save (40 us): kept.
        let one = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&timing(10.0))).unwrap();
        assert_eq!((one.page.clone(), one.release_at.clone(), one.launch_at.clone()), (vec!["A".to_string()], vec![1], vec![1]));
        // Two-way at 10 bytes/us for both directions together (5 each while both run): B copies
        // 100 bytes by the last save and the other 100 in 20 us after it, done by unpack 2
        // (20 us): released there, point 5 + 2. A's page-in (read at unpack 2, 20 us) runs
        // while B's page-out does: 60 bytes at 5/us from 8 us, queued at unpack 0 (alone it
        // would take 14-20 us, queued at unpack 1).
        let two = Timing { both_bytes_per_us: Some(10.0), ..timing(10.0) };
        let p = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&two)).unwrap();
        assert_eq!((p.page.clone(), p.release_at.clone(), p.launch_at.clone()), (vec!["A".to_string(), "B".to_string()], vec![1, 7], vec![0, 3]));
        assert!(p.explain.iter().any(|l| l == "B: released at unpack 2 (after the forward), paged in at unpack 3 (used at 5)"), "{:?}", p.explain);
        // Both directions at the one-way rate each (20 bytes/us together): B is done by unpack 1
        // (10 us), and A's page-in, after it, runs alone.
        let fast = Timing { both_bytes_per_us: Some(20.0), ..timing(10.0) };
        let p = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&fast)).unwrap();
        assert_eq!((p.release_at.clone(), p.launch_at.clone()), (vec![1, 6], vec![1, 3]));
        // A tensor read before its spilled page-out could be released stays, and says why.
        let soon = vec![s("A", 60, 0, 4), s("B", 200, 3, 2)];
        let p = choose_timed(&soon, Budget::Fraction(1.0), 1, Some(&two)).unwrap();
        assert_eq!(p.page, ["A"]);
        assert!(p.explain.iter().any(|l| l.starts_with("B: kept (its page-out")), "{:?}", p.explain);
        // A page-in that would have to start before its own page-out ends is said to be held back.
        let p = choose_timed(&[s("C", 150, 3, 2)], Budget::Fraction(1.0), 1, Some(&two)).unwrap();
        assert_eq!((p.release_at.clone(), p.launch_at.clone()), (vec![6], vec![0]));
        assert!(p.explain.iter().any(|l| l.starts_with("C: page-in held back by its own page-out")), "{:?}", p.explain);
    }

    #[test]
    fn two_way_a_page_out_released_in_the_backward_lowers_a_backward_peak() {
        // The peak is at unpack 3. Only B's spilled page-out (released at unpack 2, back at
        // unpack 3) is off the device there: two-way pages it (500 -> 300); one page stream
        // cannot (B does not end under the forward), and A alone does not lower the peak.
        let pre = vec![s("A", 60, 0, 2), s("B", 200, 3, 5)];
        let mem = Timing { save_peak: vec![100; 5], unpack_peak: vec![100, 100, 100, 500, 100, 100], tail_peak: 0, ..timing(10.0) };
        let one = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&mem)).unwrap();
        assert!(one.page.is_empty(), "{:?}", one.explain);
        let two = Timing { both_bytes_per_us: Some(10.0), ..mem };
        let p = choose_timed(&pre, Budget::Fraction(1.0), 1, Some(&two)).unwrap();
        assert_eq!((p.page.clone(), p.release_at.clone()), (vec!["B".to_string()], vec![7]));
        assert!(p.explain.iter().any(|l| l == "peak 500 -> 300 bytes (planned, from the calibration step's timeline)"), "{:?}", p.explain);
    }
}
