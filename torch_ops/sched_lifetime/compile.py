"""torch.compile backend "sched_lifetime" (wiring only: the order comes from Rust's scheduler).

    model = torch.compile(model, backend="sched_lifetime", options={"explain": True})

AOTAutograd gives a forward and a backward FX graph (no Inductor). Each graph becomes an IR
table (`to_ir`): call nodes are compute nodes; functional collectives (`_c10d_functional.*`)
are comm launches and their `wait_tensor` the matching wait; views and `getitem` are noops;
ops that write an input give mutation edges; `node.meta["custom"]` (as
`torch.fx.traceback.annotate` writes it) can name a node's source (`"sched_lifetime_source"`)
and mark EP regions (`"ep": "dispatch" | "combine"` with a `"layer"`); RNG and other
side-effecting ops keep their relative order (control edges), so results stay bit-exact. Rust schedules the
table and the graph is rebuilt in that order (`rewrite`): launches as early and waits as late
as the policy and the launch budget allow. The result is a plain GraphModule.

Streams: a functional collective is issued on the caller's stream and runs on its process
group's own (high-priority, for `ep.new_ep_group`) NCCL stream; c10d holds its inputs until
`wait_tensor`, so no cross-stream value is left for the lifetime manager in these graphs, and
none of its calls is inserted. `multiplex(fwd, bwd)` schedules a forward graph of one
microbatch with a backward graph of another into one module (two sources). Not yet: nodes on
our own side streams (page nodes), the paging and CUDA-graph options (they raise).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .schedule import format_explain, schedule

#: Options and their defaults; anything else is an error listing these.
OPTIONS: dict[str, Any] = {
    "overlap": True,  # schedule the graph (False: keep AOTAutograd's order)
    "explain": False,  # print each graph's schedule and what each launch ran under
    "ep_budget": None,  # launches in flight (None: SCHED_LIFETIME_EP_LAUNCH_BUDGET, else 2)
    "lifetime": "scheduled",  # cross-stream lifetime; compiled graphs have no side-stream values yet
    "paging": False,  # activation paging (not in the compile path yet)
    "cudagraphs": False,  # capture the compiled graphs (not in the compile path yet)
}

_COLLECTIVES = "_c10d_functional"

#: The last compiled graphs (phase, IR, schedule, GraphModule), newest last: for tests and
#: for looking at what the backend did.
history: list[dict] = []
_SOURCE_KEY = "sched_lifetime_source"


def check_options(options: Optional[dict]) -> dict:
    """The options with defaults filled in; ValueError on an unknown name or a bad value."""
    opts = dict(OPTIONS)
    for k, v in (options or {}).items():
        if k not in OPTIONS:
            raise ValueError(f"sched_lifetime backend: unknown option {k!r}; valid options: {sorted(OPTIONS)}")
        opts[k] = v
    for k in ("overlap", "explain", "paging", "cudagraphs"):
        if not isinstance(opts[k], bool):
            raise ValueError(f"sched_lifetime backend: option {k!r} must be a bool, got {opts[k]!r}")
    if opts["lifetime"] not in ("scheduled", "record_stream"):
        raise ValueError(f"sched_lifetime backend: option 'lifetime' must be 'scheduled' or 'record_stream', got {opts['lifetime']!r}")
    if opts["paging"]:
        raise ValueError("sched_lifetime backend: paging=True is not available in the compile path yet (use sl.Pager around eager steps)")
    if opts["cudagraphs"]:
        raise ValueError("sched_lifetime backend: cudagraphs=True is not available in the compile path yet")
    return opts


def backend(gm: fx.GraphModule, example_inputs: list, options: Optional[dict] = None) -> Callable:
    """The torch.compile backend (registered as "sched_lifetime")."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    opts = check_options(options)

    def compiler(phase: str) -> Callable:
        def compile_graph(g: fx.GraphModule, inputs: list) -> Callable:
            return make_boxed_func(compile_fx_graph(g, phase, opts))

        return compile_graph

    return aot_autograd(fw_compiler=compiler("fwd"), bw_compiler=compiler("bwd"), inference_compiler=compiler("fwd"), partition_fn=default_partition)(
        gm, example_inputs
    )


def compile_fx_graph(gm: fx.GraphModule, phase: str, opts: dict) -> fx.GraphModule:
    """One AOT graph: IR, Rust's order, the rebuilt GraphModule (`gm.sched_lifetime` holds
    the IR and the schedule)."""
    table = to_ir(gm, phase)
    result = None
    if opts["overlap"]:
        result = schedule(table, ep_budget=opts["ep_budget"], explain=opts["explain"])
        order = list(result["order"])
    else:
        order = [n["name"] for n in table["nodes"]]
    out = rewrite(gm, order)
    out.sched_lifetime = {"ir": table, "schedule": result, "phase": phase, "order": order}
    history.append({**out.sched_lifetime, "module": out})
    del history[:-64]
    if opts["explain"]:
        launches = sum(1 for n in table["nodes"] if n["kind"] == "comm_launch")
        print(f"[sched_lifetime] {phase} graph: {len(table['nodes'])} nodes, {launches} comm launches")
        if result is not None:
            text = format_explain(result)
            print(text if text else "  (no launches)")
    return out


def _is_collective(t: Any) -> bool:
    return isinstance(t, torch._ops.OpOverload) and t.namespace == _COLLECTIVES


def _is_wait(t: Any) -> bool:
    return _is_collective(t) and t.__name__.startswith("wait_tensor")


def _is_view(t: Any) -> bool:
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in t._schema.returns)


def _is_seeded(t: Any) -> bool:
    """Ops that draw from the RNG: reordering them would change the random numbers."""
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def _written_args(n: fx.Node) -> list[fx.Node]:
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            for x in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(x, fx.Node):
                    out.append(x)
    return out


def _inputs(n: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    for x in n.all_input_nodes:
        if x not in seen:
            seen.append(x)
    return seen


def to_ir(gm: fx.GraphModule, phase: str) -> dict:
    """The IR table of an AOT graph (see the module docstring). Raises ValueError naming the
    FX node when the graph breaks a contract: a collective whose result is never waited, a
    wait of something that is not a collective, an EP dispatch region without its combine."""
    g = gm.graph
    src_phase = "F" if phase == "fwd" else "B"
    default_source = phase
    sources: dict[str, str] = {default_source: src_phase}
    inputs: list[str] = []
    nodes: list[dict] = []
    value_of: dict[fx.Node, str] = {}  # FX node -> the IR value it reads as
    waited: set[fx.Node] = set()
    regions: dict[Any, dict[str, str]] = {}
    control: list[list[str]] = []
    last_ordered: Optional[str] = None  # RNG and side-effecting ops keep their order
    for n in g.nodes:
        if n.op in ("placeholder", "get_attr"):
            inputs.append(n.name)
            value_of[n] = n.name
            continue
        if n.op == "output":
            continue
        if n.op != "call_function":
            raise ValueError(f"FX node '{n.name}': op {n.op!r} is not supported by the sched_lifetime backend")
        custom = n.meta.get("custom") or {}
        source = str(custom.get(_SOURCE_KEY, default_source))
        sources.setdefault(source, src_phase)
        ep = custom.get("ep")
        if ep is not None:
            if ep not in ("dispatch", "combine"):
                raise ValueError(f"FX node '{n.name}': annotation ep={ep!r}, expected 'dispatch' or 'combine'")
            regions.setdefault(custom.get("layer"), {}).setdefault(ep, n.name)
        ins = [value_of[x] for x in _inputs(n) if x in value_of]
        if _is_wait(n.target) and isinstance(n.args[0] if n.args else None, fx.Node) and _is_wait(n.args[0].target):
            # Waiting again for a waited tensor is a no-op (a user's explicit wait after the
            # autograd collective's own).
            nodes.append({"name": n.name, "source": source, "kind": "noop", "inputs": ins, "outputs": [n.name]})
            value_of[n] = n.name
            continue
        if _is_wait(n.target):
            launch = n.args[0] if n.args else None
            if not isinstance(launch, fx.Node) or not _is_collective(launch.target) or _is_wait(launch.target):
                raise ValueError(f"FX node '{n.name}' waits for '{getattr(launch, 'name', launch)}', which is not a functional collective")
            waited.add(launch)
            nodes.append({"name": n.name, "source": source, "kind": "comm_wait", "launch": launch.name})
            value_of[n] = value_of[launch]  # the launch's output, usable from here on
            continue
        node: dict[str, Any] = {"name": n.name, "source": source, "inputs": ins, "outputs": [n.name]}
        if _is_collective(n.target):
            node["kind"] = "comm_launch"
            # Allocated by the collective on the caller's (compute) stream at launch.
            node["outputs"] = [{"value": n.name, "alloc": "consumer"}]
        elif _is_view(n.target):
            node["kind"] = "noop"
        else:
            node["kind"] = "compute"
        written = [value_of[x] for x in _written_args(n) if x in value_of]
        if written:
            node["mutates"] = written
        nodes.append(node)
        value_of[n] = n.name
        if not _is_collective(n.target) and (_is_seeded(n.target) or n.is_impure()):
            if last_ordered is not None:
                control.append([last_ordered, n.name])
            last_ordered = n.name
    for n in g.nodes:
        if n.op == "call_function" and _is_collective(n.target) and not _is_wait(n.target) and n not in waited:
            raise ValueError(f"FX node '{n.name}' ({n.target}) is a collective whose result is never waited (no wait_tensor)")
    for layer, kinds in regions.items():
        if "dispatch" in kinds and "combine" not in kinds:
            raise ValueError(f"FX node '{kinds['dispatch']}' opens an EP dispatch region (layer {layer!r}) with no combine")
    table = {"sources": [{"name": s, "phase": p} for s, p in sources.items()], "inputs": inputs, "nodes": nodes}
    if control:
        table["control"] = control
    return table


def rewrite(gm: fx.GraphModule, order: list[str]) -> fx.GraphModule:
    """A new GraphModule with the call nodes in `order` (placeholders first, output last)."""
    old = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            env[n] = graph.node_copy(n, lambda x: env[x])
    for name in order:
        n = old[name]
        env[n] = graph.node_copy(n, lambda x: env[x])
    for n in gm.graph.nodes:
        if n.op == "output":
            graph.node_copy(n, lambda x: env[x])
    missing = [n.name for n in gm.graph.nodes if n not in env and n.op != "output"]
    if missing:
        raise ValueError(f"the schedule's order leaves out FX nodes {missing[:5]}")
    graph.lint()
    return fx.GraphModule(gm, graph)


def multiplex(fwd: fx.GraphModule, bwd: fx.GraphModule, ep_budget: Optional[int] = None, explain: bool = False) -> fx.GraphModule:
    """One GraphModule running a forward graph (of microbatch i) and a backward graph (of
    microbatch j) as two sources scheduled together by Rust, so each one's transfers run
    under the other's compute: `module(*fwd_args, *bwd_args) -> (*fwd_outputs,
    *bwd_outputs)`. Both are AOT graphs (e.g. the `module`s in `history`), compiled once and
    reused for every pair; the result is a plain GraphModule (`.sched_lifetime` holds the IR
    and the schedule)."""
    tables = [_prefixed(to_ir(fwd, "fwd"), "F", "f:"), _prefixed(to_ir(bwd, "bwd"), "B", "b:")]
    table = {
        "sources": [s for t in tables for s in t["sources"]],
        "inputs": [v for t in tables for v in t["inputs"]],
        "nodes": [n for t in tables for n in t["nodes"]],
    }
    control = [c for t in tables for c in t.get("control", [])]
    if control:
        table["control"] = control
    result = schedule(table, ep_budget=ep_budget, explain=explain)
    if explain:
        print(format_explain(result) or "  (no launches)")
    graph = fx.Graph()
    envs: list[dict[fx.Node, fx.Node]] = [{}, {}]
    parts = [(fwd, "f:"), (bwd, "b:")]
    for k, (gm, _) in enumerate(parts):
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                envs[k][n] = graph.placeholder(f"{'fb'[k]}_{n.name}")
            elif n.op == "get_attr":
                raise ValueError(f"multiplex takes AOT graphs without get_attr nodes; '{n.name}' in the {('forward', 'backward')[k]} graph")
    by_name = {p + n.name: (k, n) for k, (gm, p) in enumerate(parts) for n in gm.graph.nodes}
    for name in result["order"]:
        k, n = by_name[name]
        envs[k][n] = graph.node_copy(n, lambda x, env=envs[k]: env[x])
    outs: list[Any] = []
    for k, (gm, _) in enumerate(parts):
        (ret,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        outs += list(fx.map_arg(ret if isinstance(ret, (list, tuple)) else (ret,), lambda x, env=envs[k]: env[x]))
    graph.output(tuple(outs))
    graph.lint()
    out = fx.GraphModule(torch.nn.Module(), graph)
    out.sched_lifetime = {"ir": table, "schedule": result, "order": list(result["order"])}
    return out


def capture_graphs(model: torch.nn.Module, example_inputs: tuple) -> tuple:
    """AOTAutograd's forward and backward graphs (no Inductor) of
    `functional_call(model, params, inputs)`: the forward takes the parameters then the inputs
    and returns the output then what the backward saves; the backward takes the saved values
    then the output's gradient and returns one gradient per forward argument. Runs the model
    once on `example_inputs` (forward and a zero backward) to capture both; the parameters'
    `.grad` are left as they were. Returns (parameter names, parameters, {"fwd", "bwd"} graphs, output)."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition

    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    graphs: dict[str, fx.GraphModule] = {}
    n_params = len(params)

    def fn(*flat: Any) -> torch.Tensor:
        return torch.func.functional_call(model, dict(zip(names, flat[:n_params])), tuple(flat[n_params:]))

    def keep(phase: str) -> Callable:
        def compiler(gm: fx.GraphModule, inputs: list) -> Callable:
            graphs[phase] = gm
            return make_boxed_func(gm)

        return compiler

    traced = aot_function(fn, fw_compiler=keep("fwd"), bw_compiler=keep("bwd"), partition_fn=default_partition)
    out = traced(*params, *example_inputs)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the module must return one tensor, got {type(out).__name__}")
    before = [p.grad for p in params]
    out.backward(torch.zeros_like(out))  # the backward graph is compiled on first use
    for p, g in zip(params, before):
        p.grad = g
    return names, params, graphs, out.detach()


class GraphStep:
    """A training step on compiled graphs, in the steady state of combined 1F1B: the forward
    of microbatch 0, then the forward of i+1 multiplexed with the backward of i (one module
    from `multiplex`, compiled once), then the backward of the last. What a graph pipeline
    stage runs; here one stage (the whole model).

    `model(*inputs)` must return a scalar loss. The forward and backward graphs come from
    AOTAutograd (no Inductor) on `torch.func.functional_call(model, params, inputs)`, so their
    arguments are known: the forward takes the parameters then the inputs and returns the loss
    then what the backward saves; the backward takes the saved values then the loss's
    gradient and returns one gradient per forward argument. `step` accumulates the
    parameters' gradients into `.grad` (microbatch order, as eager accumulation does) and
    returns the losses."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple, ep_budget: Optional[int] = None, explain: bool = False) -> None:
        self.model = model
        self.names, self.params, self.graphs, loss = capture_graphs(model, example_inputs)
        if loss.dim() != 0:
            raise ValueError(f"GraphStep needs a scalar loss, the model returned shape {tuple(loss.shape)}")
        self.fwd = compile_fx_graph(self.graphs["fwd"], "fwd", check_options({"ep_budget": ep_budget}))
        self.bwd = compile_fx_graph(self.graphs["bwd"], "bwd", check_options({"ep_budget": ep_budget}))
        self.mux = multiplex(self.graphs["fwd"], self.graphs["bwd"], ep_budget=ep_budget, explain=explain)
        self.n_fwd_out = len(list(self.graphs["fwd"].graph.nodes)[-1].args[0])

    def _forward(self, inputs: tuple) -> tuple:
        with torch.no_grad():
            out = self.fwd(*self.params, *inputs)
        return out[0], list(out[1:])

    def _accumulate(self, grads: Any) -> None:
        from .nodes import accumulate_grads

        accumulate_grads(self.params, grads[: len(self.params)])

    def step(self, microbatches: list[tuple], multiplexed: bool = True) -> list[torch.Tensor]:
        """One step over the microbatches (each a tuple of model inputs); returns the losses.
        `multiplexed=False`: F(i) then B(i), one microbatch at a time (the baseline)."""
        if not microbatches:
            raise ValueError("GraphStep.step needs at least one microbatch")
        losses = []
        if not multiplexed:
            for mb in microbatches:
                loss, saved = self._forward(mb)
                losses.append(loss)
                with torch.no_grad():
                    self._accumulate(self.bwd(*saved, torch.ones_like(loss)))
            return losses
        loss, saved = self._forward(microbatches[0])
        losses.append(loss)
        n_saved = self.n_fwd_out - 1
        for nxt in microbatches[1:]:
            one = torch.ones_like(loss)
            with torch.no_grad():
                out = self.mux(*self.params, *nxt, *saved, one)
            f_out, grads = out[: self.n_fwd_out], out[self.n_fwd_out :]
            self._accumulate(grads)
            loss, saved = f_out[0], list(f_out[1 : 1 + n_saved])
            losses.append(loss)
        with torch.no_grad():
            grads = self.bwd(*saved, torch.ones_like(loss))
        self._accumulate(grads)
        return losses


def _prefixed(table: dict, source: str, p: str) -> dict:
    """A graph's table with its node and value names prefixed and one source."""
    def v(x: Any) -> Any:
        return p + x if isinstance(x, str) else {**x, "value": p + x["value"]}

    nodes = []
    for n in table["nodes"]:
        m = {**n, "name": p + n["name"], "source": source}
        for key in ("inputs", "mutates"):
            if key in m:
                m[key] = [p + x for x in m[key]]
        if "outputs" in m:
            m["outputs"] = [v(x) for x in m["outputs"]]
        if "launch" in m:
            m["launch"] = p + m["launch"]
        nodes.append(m)
    phase = table["sources"][0]["phase"]
    out = {"sources": [{"name": source, "phase": phase}], "inputs": [p + x for x in table["inputs"]], "nodes": nodes}
    if table.get("control"):
        out["control"] = [[p + a, p + b] for a, b in table["control"]]
    return out


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "sched_lifetime" not in _BACKENDS:
        register_backend(name="sched_lifetime")(backend)


_register()
