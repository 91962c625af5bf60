"""Hardening on CPU (in CI): bad input through the Python API and the raw ops leaves the
manager usable with its stats unchanged; a panic in Rust surfaces as a RuntimeError and the
process survives; managers driven from two threads stay isolated; nothing is kept alive after
finalize; the executor drains each plan's own manager (rule 5 with one caller, two plans)."""

import gc
import json
import threading
import weakref

import pytest
import torch

import sched_lifetime as sl
from sched_lifetime import ops
from test_schedule import moe_layer

CPU = sl.current_stream(torch.device("cpu"))


def _bad_inputs(m: sl.LifetimeManager, x: torch.Tensor):
    """(what, call, exception type, message fragment)."""
    view = x[: x.numel() // 2]
    return [
        ("non-tensor", lambda: m.bind([x, 3]), ValueError, "not a torch.Tensor"),
        ("bad stream type", lambda: m.bind(x, "cuda:0"), ValueError, "must be a torch.Stream"),
        ("unknown action", lambda: m.retire(x, action="shred"), ValueError, "unknown action"),
        ("raw unknown action code", lambda: ops.retire(m.handle, [x], CPU, 7), ValueError, "unknown retire action code 7"),
        ("same tensor twice", lambda: m.retire([x, x]), RuntimeError, "same tensor"),
        ("aliasing views", lambda: m.retire([x, view]), RuntimeError, "alias"),
        ("unknown handle", lambda: ops.stats(123456789), RuntimeError, "unknown lifetime manager handle"),
        ("malformed graph JSON", lambda: sl.schedule("{nodes"), ValueError, "graph is not valid"),
        ("empty graph", lambda: sl.validate({"sources": [], "nodes": []}, ["x"]), ValueError, "not in the graph"),
        ("bad budget", lambda: sl.schedule(moe_layer(), ep_budget=0), ValueError, "1..=1024"),
        ("bad budget type", lambda: sl.schedule(moe_layer(), ep_budget="2"), ValueError, "must be an int"),
        ("malformed program", lambda: sl.simulate("[1, 2"), ValueError, "plan is not valid"),
        ("wrong scenario kind", lambda: sl.scenario_program("moe_chunk:2:1.0"), ValueError, "is a graph"),
        # sigmoid saves its output: emptying it would make the backward read freed memory.
        ("empty a tensor autograd saved", lambda: m.retire(torch.sigmoid(torch.ones(4, requires_grad=True))), RuntimeError, "requires grad and something else holds its data"),
    ]


def test_bad_input_matrix_is_a_clear_error_and_changes_nothing():
    m = sl.LifetimeManager("matrix")
    x = torch.arange(64, dtype=torch.float32)
    y = torch.ones(8)
    m.bind(y)
    for what, call, exc, fragment in _bad_inputs(m, x):
        before = m.stats()
        with pytest.raises(exc, match=fragment):
            call()
        assert m.stats() == before, what
    # Still usable: the bound tensor retires and the plan finalizes.
    m.retire(y)
    assert m.finalize()["bound"] == 1


class _OpsRoute:
    """The raw ops behind the same signatures as `sl._ops.direct` (the eager hot path's entry)."""

    @staticmethod
    def bind(handle, ts, owner):
        return ops.bind(handle, ts, owner)

    @staticmethod
    def retire(handle, ts, consumer, code, owner):
        if owner is None:
            return ops.retire(handle, ts, consumer, code)
        return ops.retire_owned(handle, ts, owner, consumer, code)

    @staticmethod
    def acquire(handle, stream):
        return ops.acquire(handle, stream)

    @staticmethod
    def stats(handle):
        return ops.stats(handle)

    @staticmethod
    def finalize(handle):
        return ops.finalize(handle)

    @staticmethod
    def destroy(handle):
        return ops.destroy(handle)


@pytest.mark.parametrize("route", ["direct", "ops"])
def test_direct_entry_and_ops_fail_alike_and_change_nothing(route):
    """The eager entry (`sl._ops.direct`, no torch.ops round trip) and the ops run the same Rust
    calls: the same errors with the same messages, stats unchanged, manager usable after."""
    r = sl._ops.direct if route == "direct" else _OpsRoute
    m = sl.LifetimeManager(f"routes-{route}")
    x, y = torch.arange(64, dtype=torch.float32), torch.ones(8)
    view = x[:32]
    r.bind(m.handle, [y], CPU)
    cases = [
        ("unknown action code", lambda: r.retire(m.handle, [x], CPU, 7, None), ValueError, "unknown retire action code 7"),
        ("same tensor twice", lambda: r.retire(m.handle, [x, x], CPU, 0, None), RuntimeError, "same tensor"),
        ("aliasing views", lambda: r.retire(m.handle, [x, view], CPU, 0, CPU), RuntimeError, "alias"),
        ("unknown handle", lambda: r.acquire(123456789, CPU), RuntimeError, "unknown lifetime manager handle"),
        ("unknown handle stats", lambda: r.stats(123456789), RuntimeError, "unknown lifetime manager handle"),
        ("unknown handle finalize", lambda: r.finalize(123456789), RuntimeError, "unknown lifetime manager handle"),
        ("unknown handle destroy", lambda: r.destroy(123456789), RuntimeError, "unknown lifetime manager handle"),
    ]
    if route == "direct":  # type errors the ops' schema parser reports in its own words
        cases += [
            ("non-tensor", lambda: r.bind(m.handle, [x, 3], CPU), ValueError, "item 1 is a int, not a torch.Tensor"),
            ("bad stream type", lambda: r.retire(m.handle, [x], "cuda:0", 0, None), ValueError, "consumer_stream must be a torch.Stream"),
            ("bad owner type", lambda: r.retire(m.handle, [x], CPU, 0, 5), ValueError, "owner_stream must be a torch.Stream"),
            ("wrong arity", lambda: r.acquire(m.handle), TypeError, "takes 2 arguments"),
        ]
        r.retire(m.handle, torch.zeros(2), CPU, 0, CPU)  # a single tensor is a list of one
        assert m.stats()["immediate"] == 1
    for what, call, exc, fragment in cases:
        before = m.stats()
        with pytest.raises(exc, match=fragment):
            call()
        assert m.stats() == before, what
    r.retire(m.handle, [y], CPU, 0, None)
    r.retire(m.handle, [x], CPU, 0, CPU)
    assert r.acquire(m.handle, CPU) == 0  # same-stream retires released at once
    st = dict(zip(sl.STATS_FIELDS, r.finalize(m.handle)))
    assert list(st.values()) == list(r.stats(m.handle))
    with pytest.raises(RuntimeError, match="finaliz"):
        r.finalize(m.handle)  # twice
    extra = route == "direct"  # the single tensor above
    assert (st["bound"] - extra, st["immediate"] - extra, x.untyped_storage().nbytes()) == (2, 2, 0)


def test_direct_entry_is_the_ops_library_and_hands_subclasses_to_the_op():
    """`_direct` is loaded from the ops' own library file; a tensor subclass (which the op's
    dispatch may route elsewhere) is answered NotImplemented and LifetimeManager then uses the
    op, so the retire still happens."""
    assert sl._ops.direct.__file__ == sl._ops.LIBRARY

    class Sub(torch.Tensor):
        pass

    m = sl.LifetimeManager("subclass")
    t = torch.ones(4).as_subclass(Sub)
    assert sl._ops.direct.retire(m.handle, [t], CPU, 0, CPU) is NotImplemented
    assert m.stats()["bound"] == 0
    m.retire(t, CPU, owner_stream=CPU)
    assert (m.stats()["bound"], m.stats()["immediate"]) == (1, 1)
    # The one-call release_after the same way.
    t2 = torch.ones(4).as_subclass(Sub)
    assert sl._ops.direct.release(m.handle, [t2], CPU, 0, CPU) is NotImplemented
    assert m.stats()["bound"] == 1
    assert m.release_after(t2, CPU, CPU) == 0
    assert (m.stats()["bound"], m.stats()["immediate"]) == (2, 2)
    m.finalize()


def test_invalid_env_budget_names_the_variable(monkeypatch):
    b = sl.INFO["budget"]
    monkeypatch.setenv(b["ep_var"], "lots")
    with pytest.raises(ValueError, match=f"{b['ep_var']}='lots' is not valid"):
        sl.schedule(moe_layer())


def test_protocol_misuse_after_finalize_and_twice():
    m = sl.LifetimeManager("twice")
    x = torch.ones(4)
    m.bind(x)
    m.retire(x)
    with pytest.raises(RuntimeError, match="already retired"):
        m.retire(x)  # after an immediate release: an error, not a silent fallback
    m.finalize()
    before = m.stats()
    for call in (lambda: m.finalize(), lambda: m.retire(torch.ones(2)), lambda: m.bind(torch.ones(2))):
        with pytest.raises(RuntimeError, match="already finalized"):
            call()
    assert m.stats() == before


def test_panic_in_rust_is_a_runtime_error_and_the_process_survives():
    for _ in range(2):
        with pytest.raises(RuntimeError, match="panic in sched_lifetime.*deliberate 7"):
            ops.selftest_panic("deliberate 7")
    m = sl.LifetimeManager("after panic")
    x = torch.ones(3)
    m.bind(x)
    m.retire(x)
    assert m.finalize()["immediate"] == 1
    assert json.loads(ops.info())["actions"] == sl.ACTIONS


def test_two_managers_in_two_threads_stay_isolated():
    errors = []
    results = {}

    def work(name: str, n: int) -> None:
        try:
            m = sl.LifetimeManager(name)
            for i in range(200):
                ts = [torch.full((n,), float(i)) for _ in range(3)]
                m.bind(ts)
                m.retire(ts, action="drop_reference")
                m.acquire(CPU)
            results[name] = m.finalize()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(f"plan{k}", 4 + k)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        s = results[f"plan{k}"]
        assert (s["bound"], s["retired_drop_reference"], s["bound_now"], s["pending_count"]) == (600, 600, 0, 0)


def test_nothing_is_kept_alive_after_finalize():
    m = sl.LifetimeManager("leak")
    xs = [torch.ones(16) for _ in range(3)]
    refs = [weakref.ref(x) for x in xs]
    m.bind(xs)
    m.retire(xs[:1])  # empty_storage, released at once (held until the plan ends)
    m.retire(xs[1:], action="drop_reference")
    m.finalize()
    del xs
    gc.collect()
    assert all(r() is None for r in refs), "a tensor outlived its plan"


def test_executor_drains_each_plans_own_manager(monkeypatch):
    """Rule 5 with one caller: two plans whose values share one owner stream; every acquire
    the executor makes must go to the manager of the plan that produced the drained value."""
    graph = moe_layer()
    s = sl.schedule(graph)
    produced_by = {}
    for n in graph["nodes"]:
        for o in n.get("outputs", []):
            produced_by[o if isinstance(o, str) else o["value"]] = n["source"]
    want = {}
    for r in s["retires"]:
        if r["drain_before"] is not None:
            want.setdefault(r["drain_before"], set()).add(produced_by[r["value"]])
    assert len({p for ps in want.values() for p in ps}) == 2, "both plans drain on the compute stream"
    calls = []
    real = sl.LifetimeManager.acquire

    def spy(self, stream=None, event=None):
        calls.append(self.name)
        return real(self, stream, event)

    monkeypatch.setattr(sl.LifetimeManager, "acquire", spy)
    from test_executor import callables, inputs, weights

    ex = sl.Executor(graph, s, callables(weights()))
    order_calls = []
    issue = ex._issue

    def tracked(name, *a):
        before = len(calls)
        issue(name, *a)
        order_calls.append((name, set(calls[before:])))

    ex._issue = tracked
    ex.run(inputs())
    got = {name: plans for name, plans in order_calls if plans}
    assert got == want, (got, want)


@pytest.mark.parametrize("device,steps", [("cpu", 60), pytest.param("cuda", 1000, marks=pytest.mark.cuda)])
def test_many_training_steps_leak_nothing(device, steps):
    """Many steps of the embedded model (tiny, one rank, the node API and the executor with
    the lifetime manager; 60 on CPU, 1000 on a GPU with real side streams): after a warm-up,
    no growth in live managers, tensors held by managers, live Python tensors, process memory
    or GPU memory allocated."""
    import resource

    from sched_lifetime.models import CONFIGS, MoEModel
    from sched_lifetime.nodes import train_step

    m = MoEModel(CONFIGS["tiny"], device=device)
    ch = m.chunk()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        train_step(ch, [m.batch(i, k) for k in range(3)], "ours", "scheduled")
        opt.step()

    from torch._subclasses.fake_tensor import FakeTensor

    def tensors() -> int:
        # Real tensors only: fake ones are compile-time leftovers of earlier tests in the same
        # process (graph metadata), released whenever torch drops them, never made by a step.
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and not isinstance(o, FakeTensor))

    def gpu() -> int:
        if device != "cuda":
            return 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    for i in range(10):
        step(i)
    base = (json.loads(ops.live()), tensors(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, gpu())
    for i in range(10, 10 + steps):
        step(i)
    after = (json.loads(ops.live()), tensors(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, gpu())
    print(f"{steps} steps on {device}: live {after[0]}, tensors {base[1]} -> {after[1]}, "
          f"max RSS +{(after[2] - base[2]) / 1024:.1f} MiB, GPU allocated {base[3]} -> {after[3]} bytes")
    assert after[0] == base[0] == {"managers": 0, "tensors": 0}, (base, after)
    assert after[1] == base[1], f"live tensors {base[1]} -> {after[1]}"
    assert after[2] - base[2] < 64 * 1024, f"max RSS grew {(after[2] - base[2]) / 1024:.0f} MiB over {steps} steps"
    assert after[3] == base[3], f"GPU allocated {base[3]} -> {after[3]} bytes over {steps} steps"
