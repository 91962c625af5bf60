"""The executor (CPU in CI; the `cuda` tests run on the GPU machine): a schedule run with real
torch ops, outputs bit-exact against plain eager, the stream each node ran on taken from the
schedule, the lifetime manager in the loop, and errors naming the node."""

import pytest
import torch

import sched_lifetime as sl
from test_schedule import moe_layer


def weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(16, 16, generator=g) for k in ("attn", "mlp", "battn", "bmlp")}


def callables(w: dict, log: list | None = None) -> dict:
    def rec(name, fn):
        def run(*args):
            if log is not None:
                log.append((name, sl.current_stream(args[0].device) if args else None))
            return fn(*args)

        return run

    return {
        "F.attn": rec("F.attn", lambda x: torch.tanh(x @ w["attn"])),
        "F.dispatch": rec("F.dispatch", lambda a: a * 2),  # stands in for the all-to-all
        "F.mlp": rec("F.mlp", lambda d: torch.relu(d @ w["mlp"])),
        "F.combine": rec("F.combine", lambda m: m + 1),
        "B.combine": rec("B.combine", lambda g: g * 0.5),
        "B.mlp": rec("B.mlp", lambda gc: gc @ w["bmlp"].T),
        "B.mlp.dw": rec("B.mlp.dw", lambda gc: gc.sum(0)),
        "B.dispatch": rec("B.dispatch", lambda gm: gm - 1),
        "B.attn": rec("B.attn", lambda gd: gd @ w["battn"].T),
        "B.attn.dw": rec("B.attn.dw", lambda gd: gd.abs().sum(0)),
    }


def eager(w: dict, x: torch.Tensor, gy: torch.Tensor) -> dict:
    f = callables(w)
    a = f["F.attn"](x)
    y = f["F.combine"](f["F.mlp"](f["F.dispatch"](a)))
    gc = f["B.combine"](gy)
    gd = f["B.dispatch"](f["B.mlp"](gc))
    return {"y": y, "wm": f["B.mlp.dw"](gc), "gx": f["B.attn"](gd), "wa": f["B.attn.dw"](gd)}


def inputs(device="cpu"):
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(8, 16, generator=g).to(device), "gy": torch.randn(8, 16, generator=g).to(device)}


@pytest.mark.parametrize("lifetime", ["scheduled", "record_stream", "none"])
def test_outputs_bit_exact_against_eager(lifetime):
    graph, w, inp = moe_layer(), weights(), inputs()
    s = sl.schedule(graph, ep_budget=1)
    ex = sl.Executor(graph, s, callables(w), lifetime=lifetime)
    ref = eager(w, **inp)
    for _ in range(3):  # the same executor runs again and again
        out = ex.run(inp)
        assert set(out) >= set(ref)
        for k in ref:
            assert torch.equal(out[k], ref[k]), k
    if lifetime == "scheduled":
        # One manager per plan, every cross-stream value retired and drained, nothing left.
        assert set(ex.last_stats) == {"F1", "B0"}
        assert sum(st["bound"] for st in ex.last_stats.values()) == len(s["retires"])


def test_retired_values_are_bound_in_the_retire_call_not_at_the_producer(monkeypatch):
    """The host path: one owned retire call per (plan, consumer stream, action, owner) group
    after a node, and no bind call per produced tensor."""
    from sched_lifetime import lifetime as lt

    calls = {"bind": 0, "retire_owned": 0, "tensors": 0}
    real = lt.direct

    class Counting:
        def bind(self, *a):
            calls["bind"] += 1
            raise AssertionError("the executor bound a tensor at its producer")

        def retire(self, handle, ts, consumer, code, owner):
            assert owner is not None, "the executor retired a value without naming its owner"
            calls["retire_owned"] += 1
            calls["tensors"] += len(ts)
            return real.retire(handle, ts, consumer, code, owner)

        def __getattr__(self, name):  # acquire, create, finalize, ...: the real entry
            return getattr(real, name)

    counting = Counting()
    monkeypatch.setattr(lt, "direct", counting)
    monkeypatch.setattr(lt, "_direct_retire", counting.retire)  # the retire hot path's own reference
    monkeypatch.setattr(lt, "_bind", counting.bind)
    graph, w = moe_layer(), weights()
    s = sl.schedule(graph, ep_budget=1)
    ex = sl.Executor(graph, s, callables(w))
    ex.run(inputs())
    producer = {(o if isinstance(o, str) else o["value"]): n["name"] for n in graph["nodes"] for o in n.get("outputs", [])}
    source = {n["name"]: n["source"] for n in graph["nodes"]}
    role = dict(map(tuple, s["streams"]))
    groups = {
        (r["last_consumer"], source[producer[r["value"]]], r["consumer_stream"], r["action"], role[producer[r["value"]]])
        for r in s["retires"]
    }
    assert calls["bind"] == 0 and calls["tensors"] == len(s["retires"]) > 0
    assert calls["retire_owned"] == len(groups)
    assert sum(st["bound"] for st in ex.last_stats.values()) == len(s["retires"])


def test_consumed_values_are_dropped_unless_kept():
    graph, w = moe_layer(), weights()
    s = sl.schedule(graph)
    out = sl.Executor(graph, s, callables(w)).run(inputs())
    assert "a" not in out and "y" in out
    out = sl.Executor(graph, s, callables(w), keep=["gc"]).run(inputs())
    assert "gc" in out  # B.combine's output is retired with drop_reference: keeping it is fine


def test_keeping_an_emptied_value_is_refused():
    graph, w = moe_layer(), weights()
    s = sl.schedule(graph)
    emptied = next(r["value"] for r in s["retires"] if r["action"] in sl.INFO["storage_emptying_actions"])
    with pytest.raises(ValueError, match=f"value '{emptied}' is kept"):
        sl.Executor(graph, s, callables(w), keep=[emptied])


def test_callables_must_match_nodes():
    graph, w = moe_layer(), weights()
    s = sl.schedule(graph)
    f = callables(w)
    del f["F.mlp"]
    with pytest.raises(ValueError, match="node 'F.mlp' \\(compute\\) has no callable"):
        sl.Executor(graph, s, f)
    f = callables(w)
    f["F.nope"] = lambda x: x
    with pytest.raises(ValueError, match="F.nope"):
        sl.Executor(graph, s, f)
    f = callables(w)
    f["F.dispatch.wait"] = lambda: None
    with pytest.raises(ValueError, match="'F.dispatch.wait' is a wait"):
        sl.Executor(graph, s, f)
    f = callables(w)
    f["F.mlp"] = lambda d: (d, d)
    with pytest.raises(ValueError, match="node 'F.mlp' returned 2 outputs"):
        sl.Executor(graph, s, f).run(inputs())
    with pytest.raises(ValueError, match="lifetime must be one of"):
        sl.Executor(graph, s, callables(w), lifetime="magic")


def test_a_raising_node_leaves_nothing_behind_and_the_next_run_works():
    graph, w, inp = moe_layer(), weights(), inputs()
    s = sl.schedule(graph)
    boom = {"on": True}
    f = callables(w)
    mlp = f["F.mlp"]

    def flaky(d):
        if boom["on"]:
            raise RuntimeError("injected")
        return mlp(d)

    f["F.mlp"] = flaky
    ex = sl.Executor(graph, s, f)
    with pytest.raises(RuntimeError, match="(?s)injected.*in node 'F.mlp'"):
        ex.run(inp)
    boom["on"] = False
    out = ex.run(inp)
    ref = eager(w, **inp)
    assert all(torch.equal(out[k], ref[k]) for k in ref)
    assert sum(st["bound"] for st in ex.last_stats.values()) == len(s["retires"])


def test_noop_passes_the_same_object_through():
    graph = {
        "sources": [{"name": "F0", "phase": "F"}],
        "inputs": ["x"],
        "nodes": [
            {"name": "view", "source": "F0", "kind": "noop", "inputs": ["x"], "outputs": ["v"]},
            {"name": "use", "source": "F0", "kind": "compute", "inputs": ["v"], "outputs": ["y"]},
        ],
    }
    seen = []
    x = torch.ones(3)
    out = sl.Executor(graph, sl.schedule(graph), {"use": lambda v: seen.append(v) or v + 1}).run({"x": x})
    assert seen[0] is x and torch.equal(out["y"], x + 1)


@pytest.mark.cuda
def test_each_node_runs_on_the_stream_its_schedule_names():
    graph, w = moe_layer(), {k: v.cuda() for k, v in weights().items()}
    # A page copy beside the EP launches: page nodes go to the page stream, not compute.
    graph["nodes"] += [
        {"name": "F.page", "source": "F1", "kind": "page_out", "inputs": ["a"], "outputs": ["a_host"]},
        {"name": "F.page.wait", "source": "F1", "kind": "page_wait", "launch": "F.page"},
    ]
    s = sl.schedule(graph)
    log = []
    f = callables(w, log)
    f["F.page"] = lambda a: (log.append(("F.page", torch.cuda.current_stream())), a.to("cpu", non_blocking=True))[1]
    ex = sl.Executor(graph, s, f, device="cuda")
    inp = inputs("cuda")
    out = ex.run(inp)
    torch.cuda.synchronize()
    side = sl.SideStreams.of(torch.device("cuda", torch.cuda.current_device()))
    want = {"compute": torch.cuda.current_stream(), "ep": side.ep, "page": side.page}
    roles = dict(s["streams"])
    assert len(log) == len(f)
    for name, stream in log:
        assert stream == want[roles[name]], (name, roles[name])
    assert roles["F.page"] == "page" and side.page != want["compute"]
    ref = eager({k: v for k, v in w.items()}, **inp)
    for k in ref:
        assert torch.equal(out[k], ref[k]), k


def test_node_times_feed_the_simulator():
    graph, w = moe_layer(), weights()
    s = sl.schedule_order(graph, [n["name"] for n in graph["nodes"]])
    ex = sl.Executor(graph, s, callables(w), timing=True)
    ex.run(inputs())
    times = ex.node_times_us()
    assert set(times) == {n["name"] for n in graph["nodes"]}
    assert all(t >= 0 for t in times.values()) and times["F.attn"] > 0
    prog = sl.lower(graph, s["order"])
    names = {n["name"] for n in prog["nodes"]}
    rep = sl.simulate(prog, durations={k: v for k, v in times.items() if k in names})
    assert rep["simulated"] and rep["makespan_us"] > 0
    with pytest.raises(RuntimeError, match="timing=True"):
        sl.Executor(graph, s, callables(w)).node_times_us()


def _retires_by_plan_and_action(graph: dict, s: dict, tensors=None) -> dict:
    """{plan: {action: count}} of a schedule's retires (a value's plan is its producer's source);
    `tensors`: only these values (the others are not tensors: nothing to retire)."""
    producer = {(o if isinstance(o, str) else o["value"]): n for n in graph["nodes"] for o in n.get("outputs", [])}
    want: dict = {}
    for r in s["retires"]:
        if tensors is not None and r["value"] not in tensors:
            continue
        plan = producer[r["value"]]["source"]
        want.setdefault(plan, dict.fromkeys(sl.ACTIONS, 0))[r["action"]] += 1
    return want


def test_rule3_each_value_retires_with_the_action_the_schedule_names():
    """Rule 3 as the executor applies it: the manager's `retired_<action>` counters equal the
    schedule's retires per plan and action (forward inputs empty their storage, backward
    gradients drop a reference), so an executor that ignores the scheduled action is caught."""
    graph, w = moe_layer(), weights()
    s = sl.schedule(graph, ep_budget=1)
    want = _retires_by_plan_and_action(graph, s)
    assert {a for plan in want.values() for a, k in plan.items() if k} >= {"empty_storage", "drop_reference"}, want
    ex = sl.Executor(graph, s, callables(w))
    ex.run(inputs())
    got = {p: {a: st[f"retired_{a}"] for a in sl.ACTIONS} for p, st in ex.last_stats.items()}
    assert got == want


def test_rule3_each_value_of_the_embedded_model_retires_with_the_scheduled_action():
    """The same on a combined F(1) + B(0) of the embedded model in our order."""
    from dataclasses import replace

    from sched_lifetime.models import CONFIGS, MoEModel
    from sched_lifetime.nodes import MicrobatchState

    m = MoEModel(replace(CONFIGS["tiny"], capacity_factor=1.0))
    ch = m.chunk()
    st0, st1 = MicrobatchState(0), MicrobatchState(1)
    ch.run((st0, m.batch(0, 0)), None)
    ex = ch.executor(True, True)
    ex.value_bytes = {}  # the tensor values of the run (routing metadata is not one)
    ch.run((st1, m.batch(0, 1)), st0, grad_scale=0.5)
    want = _retires_by_plan_and_action(ch.graph(True, True), ch.order_schedule(True, True, "ours"), set(ex.value_bytes))
    assert want["F"]["empty_storage"] >= 2 and want["B"]["drop_reference"] >= 2, want
    got = {p: {a: st[f"retired_{a}"] for a in sl.ACTIONS} for p, st in ex.last_stats.items()}
    assert got == want


def test_a_node_returning_the_callers_tensor_or_a_view_of_it_never_empties_it():
    """A callable that returns its input reshaped (or as it is): the schedule retires that output
    with `empty_storage` after its cross-stream consumer, which would free the caller's tensor;
    the retire drops the reference instead (`kept_for_caller`), and the caller's tensor is whole."""
    graph = {
        "sources": [{"name": "F1", "microbatch": 1, "phase": "F"}],
        "inputs": ["x"],
        "nodes": [
            {"name": "F.flat", "source": "F1", "kind": "compute", "inputs": ["x"], "outputs": ["a"]},
            {"name": "F.dispatch", "source": "F1", "kind": "comm_launch", "inputs": ["a"], "outputs": ["d"]},
            {"name": "F.dispatch.wait", "source": "F1", "kind": "comm_wait", "launch": "F.dispatch"},
            {"name": "F.mlp", "source": "F1", "kind": "compute", "inputs": ["d"], "outputs": ["y"]},
        ],
    }
    s = sl.schedule(graph)
    assert ("a", "empty_storage") in [(r["value"], r["action"]) for r in s["retires"]]
    for flat in (lambda x: x.reshape(-1), lambda x: x):
        ex = sl.Executor(graph, s, {"F.flat": flat, "F.dispatch": lambda a: a.clone(), "F.mlp": lambda d: d.sum()}, device=torch.device("cpu"))
        x = torch.arange(8.0).reshape(2, 4)
        assert ex.run({"x": x})["y"].item() == 28.0
        assert x.untyped_storage().nbytes() == 32 and torch.equal(x, torch.arange(8.0).reshape(2, 4))
        assert ex.kept_for_caller == 1
