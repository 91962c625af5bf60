//! EP and paging stream roles, and their launch budgets (DESIGN.md §4).
//!
//! A schedule uses three streams: the caller's compute stream, one high-priority EP stream for
//! dispatch/combine, and one high-priority page stream. [`Role`] names them; [`PerRole`] holds
//! one value per role, so code indexes by role instead of by a number agreed by convention.
//! [`Budgets`] caps the launches in flight on each side stream; the settings come from the
//! environment and are validated here, with errors naming the variable and the accepted range.
//! The same settings give the same schedule on every rank.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::ir::Kind;

/// The stream a node's work (or wait) is issued to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The caller's current stream.
    Compute,
    /// High-priority EP stream (dispatch/combine).
    Ep,
    /// High-priority page stream (page-out / page-in copies).
    Page,
}

impl Role {
    /// Every role, in [`PerRole`] order.
    pub const ALL: [Role; 3] = [Role::Compute, Role::Ep, Role::Page];
    /// The side streams, whose launches count against a budget.
    pub const SIDE: [Role; 2] = [Role::Ep, Role::Page];

    /// Where a node of `kind` runs: launches on their side stream, everything else (waits
    /// included: the compute stream waits) on compute.
    pub fn of(kind: Kind) -> Role {
        match kind {
            Kind::CommLaunch => Role::Ep,
            Kind::PageOut | Kind::PageIn => Role::Page,
            _ => Role::Compute,
        }
    }

    /// The name Python and the JSON outputs use.
    pub fn name(self) -> &'static str {
        match self {
            Role::Compute => "compute",
            Role::Ep => "ep",
            Role::Page => "page",
        }
    }
}

/// One `T` per [`Role`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PerRole<T>([T; 3]);

impl<T> PerRole<T> {
    /// From a function of the role.
    pub fn from_fn(mut f: impl FnMut(Role) -> T) -> Self {
        PerRole(Role::ALL.map(&mut f))
    }
    /// (role, value) pairs in role order.
    pub fn iter(&self) -> impl Iterator<Item = (Role, &T)> {
        Role::ALL.into_iter().zip(self.0.iter())
    }
}

impl<T> std::ops::Index<Role> for PerRole<T> {
    type Output = T;
    fn index(&self, r: Role) -> &T {
        &self.0[r as usize]
    }
}

impl<T> std::ops::IndexMut<Role> for PerRole<T> {
    fn index_mut(&mut self, r: Role) -> &mut T {
        &mut self.0[r as usize]
    }
}

/// Variable that sets the EP stream's launch budget.
pub const EP_BUDGET_VAR: &str = "SCHED_LIFETIME_EP_LAUNCH_BUDGET";
/// Variable that sets the page stream's launch budget.
pub const PAGE_BUDGET_VAR: &str = "SCHED_LIFETIME_PAGE_LAUNCH_BUDGET";
/// Smallest accepted budget.
pub const MIN_BUDGET: u32 = 1;
/// Largest accepted budget.
pub const MAX_BUDGET: u32 = 1024;

/// Launches allowed in flight per side stream (a launch is in flight until its wait issues).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Budgets {
    /// EP stream budget.
    pub ep: u32,
    /// Page stream budget.
    pub page: u32,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets { ep: 1, page: 2 }
    }
}

fn range_error(var: &str, got: &str, why: &str) -> Error {
    Error::InvalidInput(format!("{var}={got} {why}: expected an integer in {MIN_BUDGET}..={MAX_BUDGET}"))
}

impl Budgets {
    /// Validated budgets.
    pub fn new(ep: u32, page: u32) -> Result<Budgets> {
        for (var, v) in [(EP_BUDGET_VAR, ep), (PAGE_BUDGET_VAR, page)] {
            if !(MIN_BUDGET..=MAX_BUDGET).contains(&v) {
                return Err(range_error(var, &v.to_string(), "is out of range"));
            }
        }
        Ok(Budgets { ep, page })
    }

    /// Parse one setting; `None` or empty gives `default`.
    pub fn parse(var: &str, text: Option<&str>, default: u32) -> Result<u32> {
        let Some(t) = text.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(default);
        };
        match t.parse::<u32>() {
            Ok(v) if (MIN_BUDGET..=MAX_BUDGET).contains(&v) => Ok(v),
            _ => Err(range_error(var, &format!("'{t}'"), "is not valid")),
        }
    }

    /// From the explicit settings, else the environment, else the defaults (2 and 2).
    pub fn resolve(ep: Option<&str>, page: Option<&str>) -> Result<Budgets> {
        let env = |v: &str| std::env::var(v).ok();
        let d = Budgets::default();
        let ep_text = ep.map(String::from).or_else(|| env(EP_BUDGET_VAR));
        let page_text = page.map(String::from).or_else(|| env(PAGE_BUDGET_VAR));
        Ok(Budgets {
            ep: Budgets::parse(EP_BUDGET_VAR, ep_text.as_deref(), d.ep)?,
            page: Budgets::parse(PAGE_BUDGET_VAR, page_text.as_deref(), d.page)?,
        })
    }

    /// The budget of a role's stream (compute has none).
    pub fn of(&self, r: Role) -> usize {
        match r {
            Role::Ep => self.ep as usize,
            Role::Page => self.page as usize,
            Role::Compute => usize::MAX,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_follow_kinds() {
        assert_eq!(Role::of(Kind::CommLaunch), Role::Ep);
        assert_eq!(Role::of(Kind::PageIn), Role::Page);
        assert_eq!(Role::of(Kind::PageOut), Role::Page);
        for k in [Kind::Compute, Kind::CommWait, Kind::PageWait, Kind::Noop] {
            assert_eq!(Role::of(k), Role::Compute);
        }
    }

    #[test]
    fn budget_errors_name_the_variable_and_range() {
        let e = Budgets::parse(EP_BUDGET_VAR, Some("0"), 2).unwrap_err().to_string();
        assert!(e.contains(EP_BUDGET_VAR) && e.contains("1..=1024"), "{e}");
        let e = Budgets::parse(PAGE_BUDGET_VAR, Some("x"), 2).unwrap_err().to_string();
        assert!(e.contains(PAGE_BUDGET_VAR), "{e}");
        assert!(Budgets::new(1, 1025).is_err());
        assert_eq!(Budgets::parse(EP_BUDGET_VAR, Some(" 4 "), 2).unwrap(), 4);
        assert_eq!(Budgets::parse(EP_BUDGET_VAR, None, 3).unwrap(), 3);
    }
}
