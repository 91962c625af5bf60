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
}

/// Choose what to page for `prefix` under `budget`; tensors read within `min_distance` backward
/// steps of the boundary stay on the device.
pub fn choose(prefix: &[Saved], budget: Budget, min_distance: u32) -> Result<PagePlan> {
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
    let mut by_pref: Vec<&Saved> = prefix.iter().collect();
    by_pref.sort_by(|a, b| b.used_at.cmp(&a.used_at).then(b.bytes.cmp(&a.bytes)).then(a.name.cmp(&b.name)));
    let mut paged = std::collections::HashSet::new();
    let mut bytes = 0u64;
    let mut explain = Vec::new();
    for s in by_pref {
        if bytes >= target {
            explain.push(format!("{}: kept (target of {target} bytes met)", s.name));
        } else if s.used_at < min_distance {
            explain.push(format!("{}: kept (read {} step(s) after the boundary, within {min_distance})", s.name, s.used_at));
        } else {
            bytes += s.bytes;
            paged.insert(s.name.as_str());
            explain.push(format!("{}: paged ({} bytes, read at backward step {})", s.name, s.bytes, s.used_at));
        }
    }
    let mut page: Vec<&Saved> = prefix.iter().filter(|s| paged.contains(s.name.as_str())).collect();
    page.sort_by_key(|s| (s.saved_at, s.name.clone()));
    Ok(PagePlan {
        page: page.into_iter().map(|s| s.name.clone()).collect(),
        bytes_paged: bytes,
        bytes_live: live,
        target,
        short: bytes < target,
        explain,
    })
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
}
