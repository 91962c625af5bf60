"""The simulator from Python (CPU, in CI): plan dicts, reports, errors, CLI trace and plot."""

import json
import os
import subprocess
import sys

import pytest

import sched_lifetime as sl
from sched_lifetime import sim

HERE = os.path.dirname(os.path.abspath(__file__))

TINY = {
    "streams": [{"name": "compute", "engine": "compute"}, {"name": "comm", "engine": "comm"}],
    "nodes": [
        {"name": "attn", "plan": "F0", "stream": "compute", "us": 10, "outputs": [{"value": "a", "bytes": 64 << 20}]},
        {"name": "dispatch", "plan": "F0", "stream": "comm", "us": 500, "inputs": ["a"],
         "outputs": [{"value": "d", "bytes": 8}]},
        {"name": "attn2", "plan": "F0", "stream": "compute", "us": 10, "outputs": [{"value": "b", "bytes": 64 << 20}]},
        {"name": "dispatch2", "plan": "F0", "stream": "comm", "us": 500, "inputs": ["b", "d"],
         "outputs": [{"value": "e", "bytes": 8}]},
    ],
}


def test_simulate_returns_a_labelled_report():
    r = sl.simulate(TINY, "scheduled")
    assert r["simulated"] is True and r["policy"] == "scheduled" and r["nodes"] == 4
    assert r["hazards"] == []
    assert r["makespan_us"] >= 1000
    assert {"allocated_peak", "reserved_peak", "pending_free_peak", "liveness_lower_bound_bytes", "exposed_comm_us"} <= set(r)


def test_record_stream_pends_where_scheduled_reuses():
    res = sl.compare(TINY)
    rs, sc = res["record_stream"], res["scheduled"]
    assert rs["pending_free_peak"]["bytes"] >= 64 << 20
    assert sc["pending_free_peak"]["bytes"] == 0
    assert sc["reserved_peak"]["bytes"] < rs["reserved_peak"]["bytes"]


def test_no_caching_mode_gives_the_bound():
    r = sl.simulate(TINY, "scheduled", mode="no_caching")
    assert r["mode"] == "no_caching" and r["hazards"] == []


def test_hero_scenario_reduces_pending_by_90_percent():
    res = sl.compare(sl.scenario_program("megatron_hero"))
    rs, sc = res["record_stream"], res["scheduled"]
    assert rs["pending_free_peak_blocks"] >= 4
    assert sc["unusable_peak"]["bytes"] <= 0.1 * rs["unusable_peak"]["bytes"]


@pytest.mark.parametrize(
    "plan,needle",
    [
        ({"streams": [{"name": "c"}], "nodes": [{"name": "n1", "stream": "nope", "us": 1}]}, "node 'n1': unknown stream 'nope'"),
        ({"streams": [{"name": "c"}], "nodes": [{"name": "n1", "stream": "c", "us": -3}]}, "duration must be a finite number"),
        ({"streams": [{"name": "c"}], "nodes": [{"name": "n1", "stream": "c", "us": 1, "inputs": ["ghost"]}]},
         "consumes value 'ghost', which has no producer"),
        ("{oops", "plan is not valid"),
    ],
)
def test_bad_plans_raise_value_error_naming_the_item(plan, needle):
    with pytest.raises(ValueError, match=needle):
        sl.simulate(plan)


def test_bad_policy_mode_and_type():
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        sl.simulate(TINY, "fast")
    with pytest.raises(ValueError, match="unknown allocator mode"):
        sl.simulate(TINY, mode="magic")
    with pytest.raises(ValueError, match="plan must be a dict"):
        sl.simulate(42)
    with pytest.raises(ValueError, match="unknown scenario"):
        sl.scenario_program("nope")


def test_cli_writes_trace_and_plot(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(TINY))
    trace, png, out = tmp_path / "t.json", tmp_path / "m.png", tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "..", "torch_ops"))
    cmd = [sys.executable, "-m", "sched_lifetime", "simulate", str(plan), "--trace", str(trace), "--plot", str(png), "--json", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "SIMULATED" in p.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * len(TINY["nodes"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(json.loads(out.read_text())) == set(sim.POLICIES)


def test_durations_override_by_name():
    slow = sl.simulate(TINY, durations={"dispatch": 5000, "dispatch2": 5000})
    assert slow["makespan_us"] > sl.simulate(TINY)["makespan_us"] + 8000
    with pytest.raises(ValueError, match="not in the plan: \\['ghost'\\]"):
        sl.simulate(TINY, durations={"ghost": 1})


def test_lower_with_launch_waits_holds_each_ep_launch_behind_the_compute_issued_before_it():
    """`sl.lower(..., launch_waits=True)` (rule search's model): an EP launch also waits for every
    compute node issued before it, as the transports' wait_stream makes it on the GPU; the
    default lowering keeps edges only. On the moe chunk, ours' order (which issues weight-gradient
    filler before some launches) is slower under the launch waits, and serial with launch waits
    is an error."""
    graph = sl.scenario_graph("moe_chunk:2:1.0")["graph"]
    order = sl.schedule(graph)["order"]
    plain, held = sl.lower(graph, order), sl.lower(graph, order, launch_waits=True)
    tokens = [i for n in held["nodes"] for i in n["inputs"] if i.startswith("tok:issued:")]
    assert tokens and not any(i.startswith("tok:issued:") for n in plain["nodes"] for i in n["inputs"])
    assert sl.simulate(held)["makespan_us"] > sl.simulate(plain)["makespan_us"]
    first = sl.schedule(graph, rules="launch_first")["order"]
    assert sorted(first) == sorted(order) and first != order
    with pytest.raises(ValueError, match="serial and launch_waits exclude each other"):
        sl.lower(graph, order, serial=True, launch_waits=True)
