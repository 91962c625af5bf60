"""The scheduler from Python (CPU, in CI): one MoE layer of a forward and a backward."""

import pytest

import sched_lifetime as sl
from sched_lifetime.schedule import format_explain


def comm(name, source, inp, out):
    return [
        {"name": name, "source": source, "kind": "comm_launch", "inputs": [inp], "outputs": [{"value": out, "bytes": 1 << 30}]},
        {"name": f"{name}.wait", "source": source, "kind": "comm_wait", "launch": name},
    ]


def compute(name, source, inp, out, wgrad=False):
    return {"name": name, "source": source, "kind": "compute", "wgrad": wgrad, "inputs": [inp], "outputs": [out]}


def moe_layer() -> dict:
    nodes = [compute("F.attn", "F1", "x", "a")]
    nodes += comm("F.dispatch", "F1", "a", "d")
    nodes += [compute("F.mlp", "F1", "d", "m")]
    nodes += comm("F.combine", "F1", "m", "y")
    nodes += comm("B.combine", "B0", "gy", "gc")
    nodes += [compute("B.mlp", "B0", "gc", "gm"), compute("B.mlp.dw", "B0", "gc", "wm", wgrad=True)]
    nodes += comm("B.dispatch", "B0", "gm", "gd")
    nodes += [compute("B.attn", "B0", "gd", "gx"), compute("B.attn.dw", "B0", "gd", "wa", wgrad=True)]
    return {
        "sources": [{"name": "F1", "microbatch": 1, "phase": "F"}, {"name": "B0", "microbatch": 0, "phase": "B"}],
        "inputs": ["x", "gy"],
        "nodes": nodes,
    }


def under(order, comm_name, compute_name):
    p = {n: i for i, n in enumerate(order)}
    return p[comm_name] < p[compute_name] < p[f"{comm_name}.wait"]


@pytest.mark.parametrize("budget", [1, 2])
def test_moe_layer_gets_megatrons_four_overlaps(budget):
    s = sl.schedule(moe_layer(), ep_budget=budget, explain=True)
    o = s["order"]
    assert under(o, "B.combine", "F.attn")
    assert under(o, "F.dispatch", "B.mlp")
    assert under(o, "B.dispatch", "F.mlp")
    assert under(o, "F.combine", "B.attn")
    assert s["budgets"]["ep"] == budget
    text = format_explain(s)
    assert "F.dispatch [F1] ran under: " in text and "B.mlp" in text
    streams = dict(s["streams"])
    assert streams["F.dispatch"] == "ep" and streams["F.dispatch.wait"] == "compute"
    # Lifetime: the dispatched tokens (owner: ep) retire after their last compute consumer.
    r = {x["value"]: x for x in s["retires"]}
    assert r["d"]["owner"] == "ep" and r["d"]["last_consumer"] == "F.mlp" and r["d"]["action"] == "empty_storage"
    assert r["gc"]["action"] == "drop_reference"
    sl.validate(moe_layer(), o, [p[:2] for p in s["syncs"]], ep_budget=budget)
    sl.validate(moe_layer(), o, s["syncs"], ep_budget=budget)  # the schedule's own entries, as they come


def test_same_input_same_schedule():
    assert sl.schedule(moe_layer()) == sl.schedule(moe_layer())


def test_validator_rejects_bad_schedules():
    g = moe_layer()
    s = sl.schedule(g)
    o = list(s["order"])
    i, j = o.index("F.attn"), o.index("F.mlp")
    bad = o[:]
    bad[i], bad[j] = bad[j], bad[i]
    with pytest.raises(ValueError, match="before its predecessor"):
        sl.validate(g, bad)
    with pytest.raises(ValueError, match="no wait covering it"):
        sl.validate(g, o, syncs=[])
    with pytest.raises(ValueError, match="issued twice"):
        sl.validate(g, o[:-1] + [o[0]])


def test_errors_name_the_node_or_setting(monkeypatch):
    g = moe_layer()
    g["nodes"][0]["source"] = "nowhere"
    with pytest.raises(ValueError, match="node 'F.attn' names source 'nowhere'"):
        sl.schedule(g)
    g = moe_layer()
    g["control"] = [["F.mlp", "F.attn"]]
    with pytest.raises(ValueError, match="cycle through node"):
        sl.schedule(g)
    g = moe_layer()
    g["control"] = [["F.attn", "F.attn"]]  # a cycle of one node
    with pytest.raises(ValueError, match="cycle through node 'F.attn': a control edge from it to itself"):
        sl.schedule(g)
    g = moe_layer()
    g["nodes"][0]["inputs"] = ["ghost"]
    with pytest.raises(ValueError, match="value 'ghost', which no node produces"):
        sl.schedule(g)
    with pytest.raises(ValueError, match="SCHED_LIFETIME_EP_LAUNCH_BUDGET=0 is out of range|expected an integer in 1..=1024"):
        sl.schedule(moe_layer(), ep_budget=0)
    with pytest.raises(ValueError, match="ep_budget must be an int"):
        sl.schedule(moe_layer(), ep_budget="2")
    monkeypatch.setenv("SCHED_LIFETIME_PAGE_LAUNCH_BUDGET", "many")
    with pytest.raises(ValueError, match="SCHED_LIFETIME_PAGE_LAUNCH_BUDGET='many' is not valid"):
        sl.schedule(moe_layer())
    monkeypatch.setenv("SCHED_LIFETIME_PAGE_LAUNCH_BUDGET", "3")
    assert sl.schedule(moe_layer())["budgets"]["page"] == 3


def test_moe_chunk_scenario_gives_graph_and_baseline_orders():
    sc = sl.scenario_graph("moe_chunk:2:1.0")
    g = sc["graph"]
    ours = sl.schedule(g)
    for name in ("megatron", "b_then_f"):
        o = sc["orders"][name]
        assert sorted(o["order"]) == sorted(ours["order"])
        # Megatron's order keeps two EP launches in flight: valid at budget 2, not at our default 1.
        sl.validate(g, o["order"], [p[:2] for p in o["syncs"]], ep_budget=2)
    with pytest.raises(ValueError, match="expected moe_chunk:LAYERS:RATIO"):
        sl.scenario_graph("moe_chunk:0:x")


def test_family_scenario_gives_a_member_with_its_baselines():
    sc = sl.scenario_graph("family:router+shared_4:1.0")
    g = sc["graph"]
    names = {n["name"] for n in g["nodes"]}
    assert "F.L0.router" in names and "F.L0.shared" in names
    assert set(sc["orders"]) == {"b_then_f", "pairing"}
    ours = sl.simulate_schedule(g)
    # Rule search rates orders with the launch waits (an EP launch waits for the compute issued before it).
    held = lambda order: sl.simulate(sl.lower(g, order, launch_waits=True))["makespan_us"]  # noqa: E731
    searched, ours_held = held(sl.schedule(g, rules="search")["order"]), held(ours["order"])
    for name, o in sc["orders"].items():
        assert sorted(o["order"]) == sorted(names)
        sl.validate(g, o["order"], [p[:2] for p in o["syncs"]])
        sim = sl.simulate_schedule(g, o["order"])
        assert not sim["hazards"]
        if name == "b_then_f":
            assert ours["makespan_us"] < sim["makespan_us"]
    assert searched <= ours_held
    # Unequal layer counts do not pair: no pairing baseline.
    assert set(sl.scenario_graph("family:F2_with_B4:0.5")["orders"]) == {"b_then_f"}
    for bad in ("family:nope:1.0", "family:mtp_3", "family:mtp_3:0", "family:mtp_3:1.0:x"):
        with pytest.raises(ValueError, match="expected family:MEMBER:RATIO, MEMBER one of symmetric_4, router"):
            sl.scenario_graph(bad)


def test_simulate_schedule_compares_any_order_with_ours():
    sc = sl.scenario_graph("moe_chunk:2:1.0")
    g = sc["graph"]
    ours = sl.simulate_schedule(g)
    btf = sl.simulate_schedule(g, sc["orders"]["b_then_f"]["order"])
    meg = sl.simulate_schedule(g, sc["orders"]["megatron"]["order"])
    assert ours["simulated"] and ours["order"] == sl.schedule(g)["order"]
    # The README sweep's row (2 layers, ratio 1): 5.10 / 8.70 / 5.10 ms.
    assert (round(ours["makespan_us"]), round(btf["makespan_us"]), round(meg["makespan_us"])) == (5103, 8703, 5103)
    assert not ours["hazards"] and not btf["hazards"]
    # A cost table overrides the graph's costs by node name.
    slow = sl.simulate_schedule(g, costs={"F.L0.attn": 10_000.0})
    assert slow["makespan_us"] > ours["makespan_us"] + 5_000
    with pytest.raises(ValueError, match="costs name node 'nope'"):
        sl.simulate_schedule(g, costs={"nope": 1.0})
    with pytest.raises(ValueError, match="cost of 'F.L0.attn' must be a finite number"):
        sl.simulate_schedule(g, costs={"F.L0.attn": -1.0})
    with pytest.raises(ValueError, match="not in the graph"):
        sl.simulate_schedule(g, ["F.nope"])


def test_simulate_schedule_uses_per_kind_defaults_without_costs():
    rep = sl.simulate_schedule(moe_layer())  # no costs in the table
    assert rep["compute_us"] == 100.0 * 6 and rep["comm_us"] == 100.0 * 4


def test_value_last_read_on_its_owner_after_a_side_stream_read_retires_on_the_side_stream():
    """`a` is read by the dispatch (EP stream) and, issued after it, by the shared expert on
    compute (its owner's stream). A retire on compute would release at once while the dispatch
    may still read it: the plan event goes on the EP stream, drained at or after the dispatch's
    wait."""
    nodes = [compute("F.attn", "F1", "x", "a")]
    nodes += comm("F.dispatch", "F1", "a", "d")
    nodes += [compute("F.shared", "F1", "a", "s"), compute("F.mlp", "F1", "d", "m")]
    graph = {"sources": [{"name": "F1", "microbatch": 0, "phase": "F"}], "inputs": ["x"], "nodes": nodes}
    s = sl.schedule(graph)
    o = s["order"]
    assert o.index("F.dispatch") < o.index("F.shared")
    (r,) = [r for r in s["retires"] if r["value"] == "a"]
    assert (r["owner"], r["last_consumer"], r["consumer_stream"]) == ("compute", "F.shared", "ep")
    assert r["drain_before"] is None or o.index(r["drain_before"]) >= o.index("F.dispatch.wait")


def test_rule_search_uses_the_graphs_costs_and_never_loses_to_the_default():
    """`rules="search"`: the order the simulator rates shortest with the graph's costs among
    the policy's variants and local moves; never longer than the default, the same twice."""
    import copy

    g = copy.deepcopy(sl.scenario_graph("moe_chunk:2:1.0")["graph"])
    for n in g["nodes"]:
        if n["name"] in ("F.L0.attn", "B.L1.mlp"):
            n["cost"] = 3 * n["cost"]  # skew it so the greedy's timing-free choice is not the best
    ours = sl.simulate_schedule(g)
    s = sl.schedule(g, rules="search")
    found = sl.simulate_schedule(g, s["order"])
    assert found["makespan_us"] <= ours["makespan_us"] and not found["hazards"]
    assert sl.schedule(g, rules="search")["order"] == s["order"]
    assert "search" in sl.INFO["scheduler_rules"]
    sl.validate(g, s["order"], [p[:2] for p in s["syncs"]])


def test_chunk_costs_reach_the_graph_and_order_ours_search_uses_them():
    """`Chunk.costs` (e.g. a run's durations.json) become the graph's node costs; order
    `ours:search` then picks by simulated makespan, never longer than `ours`, and without costs
    it is `ours`."""
    import json
    import os
    from dataclasses import replace

    from sched_lifetime.models import CONFIGS, MoEModel

    m = MoEModel(replace(CONFIGS["tiny"], layers=4))
    c = m.chunk()
    assert c.order_schedule(True, True, "ours:search")["order"] == c.order_schedule(True, True, "ours")["order"]
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "benches", "data", "h200_main_job_durations.json")) as f:
        c.costs = json.load(f)
    g = c.graph(True, True)
    assert all(n["cost"] == c.costs[n["name"]] for n in g["nodes"])
    ours, found = c.order_schedule(True, True, "ours"), c.order_schedule(True, True, "ours:search")
    # Rated as search rates them: an EP launch also waits for the compute issued before it.
    m_ours = sl.simulate(sl.lower(g, ours["order"], launch_waits=True))["makespan_us"]
    m_found = sl.simulate(sl.lower(g, found["order"], launch_waits=True))["makespan_us"]
    assert m_found < 0.99 * m_ours, (m_found, m_ours)
