//! Every op whose arguments and result are plain values (strings, ints, bools; JSON text for
//! graphs, programs and reports), in one table. The shim registers each row's schema at load
//! with one boxed kernel that packs the arguments into a JSON object keyed by the schema's
//! argument names and calls [`sl_json_call`]; so a new op of this kind is one function and one
//! row here, and no edit in C++ or in the bridge.

use serde_json::{Map, Value};

use super::registry::pure;
use crate::ep::{self, Budgets, Role};
use crate::error::{Error, Result};
use crate::ir::Graph;
use crate::lifetime::Stats;
use crate::runtime::Action;
use crate::sim::{self, Mode, Policy, Program, SimOptions};

/// The arguments of one call, by schema name.
struct Args(Map<String, Value>);

impl Args {
    fn get(&self, name: &str) -> Result<&Value> {
        self.0.get(name).ok_or_else(|| Error::Runtime(format!("op argument '{name}' missing (schema and table disagree)")))
    }
    fn str(&self, name: &str) -> Result<&str> {
        self.get(name)?.as_str().ok_or_else(|| Error::Runtime(format!("op argument '{name}' is not a str")))
    }
    fn flag(&self, name: &str) -> Result<bool> {
        self.get(name)?.as_bool().ok_or_else(|| Error::Runtime(format!("op argument '{name}' is not a bool")))
    }
}

/// One JSON op: its torch schema and its body (`None`: the op returns nothing).
struct JsonOp {
    schema: &'static str,
    run: fn(&Args) -> Result<Option<String>>,
}

const OPS: &[JsonOp] = &[
    JsonOp { schema: "info() -> str", run: info },
    JsonOp { schema: "stats_fields() -> str", run: |_| Ok(Some(Stats::FIELDS.join(","))) },
    JsonOp { schema: "simulate(str plan, str policy, str mode, bool trace) -> str", run: simulate },
    JsonOp { schema: "scenario(str name) -> str", run: scenario },
    JsonOp { schema: "schedule(str graph, str ep_budget, str page_budget, bool explain, str rules=\"\", str memory_slack=\"\") -> str", run: schedule },
    JsonOp { schema: "validate(str graph, str order, str syncs, str ep_budget, str page_budget) -> ()", run: validate },
    JsonOp { schema: "schedule_order(str graph, str order, str ep_budget, str page_budget) -> str", run: schedule_order },
    JsonOp { schema: "lower(str graph, str order, bool serial, bool launch_waits=False) -> str", run: lower },
    JsonOp { schema: "simulate_schedule(str graph, str order, str costs, str policy, bool trace) -> str", run: simulate_schedule },
    JsonOp { schema: "page_plan(str prefix, str budget, int min_distance, str timing=\"\") -> str", run: page_plan },
    JsonOp { schema: "live() -> str", run: |_| {
        let (managers, tensors) = super::registry::live();
        to_text(&serde_json::json!({"managers": managers, "tensors": tensors}), "live")
    } },
    JsonOp { schema: "selftest_panic(str message) -> ()", run: selftest_panic },
];

fn op_name(schema: &str) -> &str {
    schema.split('(').next().unwrap_or(schema)
}

fn to_text<T: serde::Serialize>(v: &T, what: &str) -> Result<Option<String>> {
    serde_json::to_string(v).map(Some).map_err(|e| Error::Runtime(format!("{what} serialization: {e}")))
}

/// Names, codes and ranges Python must not copy: actions, budgets, roles, stats fields,
/// simulator policies and modes.
fn info(_: &Args) -> Result<Option<String>> {
    let actions: Map<String, Value> = Action::ALL.iter().map(|a| (a.name().to_string(), Value::from(a.code()))).collect();
    let d = Budgets::default();
    to_text(
        &serde_json::json!({
            "actions": actions,
            // What `retire` does without an action, and which actions free the storage itself
            // (a value that must outlive its retire cannot take them).
            "default_action": Action::EmptyStorage.name(),
            "storage_emptying_actions": [Action::EmptyStorage.name()],
            "budget": {
                "min": ep::MIN_BUDGET, "max": ep::MAX_BUDGET,
                "ep_var": ep::EP_BUDGET_VAR, "page_var": ep::PAGE_BUDGET_VAR,
                "default_ep": d.ep, "default_page": d.page,
            },
            "roles": Role::ALL.iter().map(|r| r.name()).collect::<Vec<_>>(),
            "stats_fields": Stats::FIELDS,
            "policies": ["record_stream", "scheduled"],
            "scheduler_rules": crate::sched::Rules::NAMES,
            "modes": ["caching", "no_caching"],
        }),
        "info",
    )
}

fn simulate(a: &Args) -> Result<Option<String>> {
    let (policy, mode) = (Policy::parse(a.str("policy")?)?, Mode::parse(a.str("mode")?)?);
    let program = Program::from_json(a.str("plan")?)?;
    let report = sim::simulate(&program, SimOptions { policy, mode, trace: a.flag("trace")?, log: false })?;
    to_text(&report, "report")
}

fn scenario(a: &Args) -> Result<Option<String>> {
    to_text(&crate::scenarios::by_name(a.str("name")?)?, "scenario")
}

/// "" means "from the environment, else the default".
fn budgets(a: &Args) -> Result<Budgets> {
    let opt = |s: &'_ str| (!s.is_empty()).then_some(s.to_string());
    let (ep, page) = (opt(a.str("ep_budget")?), opt(a.str("page_budget")?));
    Budgets::resolve(ep.as_deref(), page.as_deref())
}

/// `memory_slack`: "" for no memory guard, else a fraction >= 0 (`sched::memory::guard`: the
/// order may raise the liveness peak over the graph's own order by at most that much).
fn schedule(a: &Args) -> Result<Option<String>> {
    let g = Graph::from_json(a.str("graph")?)?;
    let mut s = crate::sim::schedule(&g, budgets(a)?, crate::sched::Rules::parse(a.str("rules")?)?)?;
    let slack = a.str("memory_slack")?;
    let mut memory = None;
    if !slack.is_empty() {
        let x: f64 = slack.parse().ok().filter(|x: &f64| x.is_finite() && *x >= 0.0).ok_or_else(|| {
            Error::InvalidInput(format!("memory_slack must be a number >= 0 (a fraction of the peak), got '{slack}'"))
        })?;
        let (order, check) = crate::sched::memory::guard(&g, s.order.clone(), s.budgets, x);
        if order != s.order {
            s = crate::sched::finish(&g, order, s.budgets);
        }
        memory = Some(check);
    }
    let ex = a.flag("explain")?.then(|| crate::sched::explain(&g, &s));
    let mut named = crate::sched::named(&g, &s, ex);
    named.memory = memory;
    to_text(&named, "schedule")
}

fn validate(a: &Args) -> Result<Option<String>> {
    let g = Graph::from_json(a.str("graph")?)?;
    let order: Vec<String> = serde_json::from_str(a.str("order")?)
        .map_err(|e| Error::InvalidInput(format!("order must be a list of node names: {e}")))?;
    let syncs: Option<Vec<(String, String)>> = serde_json::from_str(a.str("syncs")?)
        .map_err(|e| Error::InvalidInput(format!("syncs must be null or a list of [producer, consumer] names: {e}")))?;
    crate::sched::validate_named(&g, &order, syncs.as_deref(), budgets(a)?)?;
    Ok(None)
}

fn order_of(g: &Graph, a: &Args) -> Result<Vec<crate::ir::NodeId>> {
    let names: Vec<String> = serde_json::from_str(a.str("order")?)
        .map_err(|e| Error::InvalidInput(format!("order must be a list of node names: {e}")))?;
    crate::sched::order_by_names(g, &names)
}

/// A given order (a baseline's, or a user's) with its streams, minimal record/wait edges and
/// lifetime actions, in `schedule`'s output format; the order is validated first.
fn schedule_order(a: &Args) -> Result<Option<String>> {
    let g = Graph::from_json(a.str("graph")?)?;
    let order = order_of(&g, a)?;
    let s = crate::sched::finish(&g, order, budgets(a)?);
    crate::sched::validate(&g, &s)?;
    to_text(&crate::sched::named(&g, &s, Some(crate::sched::explain(&g, &s))), "schedule")
}

/// The simulator program that issues `order` (derived from the graph; `serial`: one stream;
/// `launch_waits`: each EP launch also waits for the compute issued before it, rule `search`'s
/// model, [`sim::lower_launch_waits`]).
fn lower(a: &Args) -> Result<Option<String>> {
    let g = Graph::from_json(a.str("graph")?)?;
    let order = order_of(&g, a)?;
    let (serial, waits) = (a.flag("serial")?, a.flag("launch_waits")?);
    if serial && waits {
        return Err(Error::InvalidInput("lower: serial and launch_waits exclude each other (one stream has no launch to hold)".into()));
    }
    let program = if waits { sim::lower_launch_waits(&g, &order) } else { sim::lower(&g, &order, serial) };
    to_text(&program, "program")
}

/// Any graph through the simulator under an order (ours when `order` is "" or "null"), with
/// per-node costs from `costs` (`{"node": us}`), else the graph's `cost`, else a per-kind
/// default ([`crate::sim::lower::DEFAULT_COST_US`]). The report adds the order it simulated.
fn simulate_schedule(a: &Args) -> Result<Option<String>> {
    let g = Graph::from_json(a.str("graph")?)?;
    let order_text = a.str("order")?.trim();
    let budgets = Budgets::resolve(None, None)?;
    let order = if order_text.is_empty() || order_text == "null" { crate::sched::schedule(&g, budgets)?.order } else { order_of(&g, a)? };
    let costs_text = a.str("costs")?.trim();
    let costs: std::collections::HashMap<String, f64> = if costs_text.is_empty() || costs_text == "null" {
        Default::default()
    } else {
        serde_json::from_str(costs_text).map_err(|e| Error::InvalidInput(format!("costs must be a JSON object {{\"node\": us}}: {e}")))?
    };
    let program = sim::costed(&g, &order, &costs)?;
    let policy = Policy::parse(a.str("policy")?)?;
    let report = sim::simulate(&Program::new(program)?, SimOptions { policy, mode: Mode::Caching, trace: a.flag("trace")?, log: false })?;
    let mut v = serde_json::to_value(&report).map_err(|e| Error::Runtime(format!("report serialization: {e}")))?;
    v["order"] = serde_json::json!(order.iter().map(|&u| g.nodes[u].name.clone()).collect::<Vec<_>>());
    v["budgets"] = serde_json::json!(budgets);
    to_text(&v, "report")
}

/// What to page out of a live prefix (`[{"name", "bytes", "saved_at", "used_at"}]`) under a
/// budget (`{"bytes": n}` or `{"fraction": f}`), with an optional measured timeline
/// (`crate::paging::Timing` as JSON; "" for none), as [`crate::paging::choose_timed`] decides.
fn page_plan(a: &Args) -> Result<Option<String>> {
    let prefix: Vec<crate::paging::Saved> = serde_json::from_str(a.str("prefix")?)
        .map_err(|e| Error::InvalidInput(format!("live prefix is not valid: {e}")))?;
    let budget: crate::paging::Budget = serde_json::from_str(a.str("budget")?)
        .map_err(|e| Error::InvalidInput(format!("paging budget must be {{\"bytes\": n}} or {{\"fraction\": f}}: {e}")))?;
    let d = a.get("min_distance")?.as_i64().filter(|d| (0..=i64::from(u32::MAX)).contains(d)).ok_or_else(|| {
        Error::InvalidInput("min_distance must be an integer >= 0".into())
    })?;
    let timing: Option<crate::paging::Timing> = match a.str("timing")? {
        "" => None,
        t => Some(serde_json::from_str(t).map_err(|e| Error::InvalidInput(format!("paging timing is not valid: {e}")))?),
    };
    to_text(&crate::paging::choose_timed(&prefix, budget, d as u32, timing.as_ref())?, "page plan")
}

/// Panics on purpose with `message`: proves a panic inside an entry point surfaces as a Python
/// RuntimeError carrying the message, and the process and later calls survive.
fn selftest_panic(a: &Args) -> Result<Option<String>> {
    let message = a.str("message")?.to_string();
    std::panic::panic_any(message)
}

/// Every JSON op's schema, for the shim to register.
pub(super) fn sl_json_schemas() -> Vec<String> {
    OPS.iter().map(|o| o.schema.to_string()).collect()
}

/// Run the JSON op `op` with `args` (a JSON object keyed by argument name).
pub(super) fn sl_json_call(op: &str, args: &str) -> std::result::Result<String, String> {
    pure(|| {
        let row = OPS.iter().find(|o| op_name(o.schema) == op).ok_or_else(|| Error::Runtime(format!("unknown JSON op '{op}'")))?;
        let map = match serde_json::from_str(args) {
            Ok(Value::Object(m)) => m,
            _ => return Err(Error::Runtime(format!("op '{op}': arguments are not a JSON object"))),
        };
        Ok((row.run)(&Args(map))?.unwrap_or_default())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_unique_and_schemas_well_formed() {
        let mut names: Vec<&str> = OPS.iter().map(|o| op_name(o.schema)).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), OPS.len());
        for o in OPS {
            assert!(o.schema.contains('(') && o.schema.contains(") -> "), "{}", o.schema);
        }
    }
}
