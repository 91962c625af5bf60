"""torch.compile backend "sched_lifetime" (wiring only: the order comes from Rust's scheduler).

    model = torch.compile(model, backend="sched_lifetime", options={"explain": True})

One file a pass, GraphModule in, GraphModule out (torchtitan's graph_trainer layout), except
that the pass that orders a graph asks Rust for the order: `to_ir` (the analysis),
`order_pass` (the graph in Rust's order), `multiplex_pass` (a forward and a backward graph as
two sources of one schedule), `graph_step` (training on compiled graphs).

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

from typing import Any, Callable, Optional

import torch.fx as fx

from ..schedule import format_explain, schedule
from .graph_step import GraphStep, capture_graphs, compile_graphs
from .multiplex_pass import multiplex
from .order_pass import rewrite
from .to_ir import to_ir

__all__ = ["OPTIONS", "GraphStep", "backend", "capture_graphs", "check_options", "compile_fx_graph", "compile_graphs", "history", "multiplex", "rewrite", "to_ir"]

#: Options and their defaults; anything else is an error listing these.
OPTIONS: dict[str, Any] = {
    "overlap": True,  # schedule the graph (False: keep AOTAutograd's order)
    "explain": False,  # print each graph's schedule and what each launch ran under
    "ep_budget": None,  # launches in flight (None: SCHED_LIFETIME_EP_LAUNCH_BUDGET, else 1)
    "lifetime": "scheduled",  # cross-stream lifetime; compiled graphs have no side-stream values yet
    "paging": False,  # activation paging (not in the compile path yet)
    "cudagraphs": False,  # capture the compiled graphs (not in the compile path yet)
}

#: The last compiled graphs (phase, IR, schedule, GraphModule), newest last: for tests and
#: for looking at what the backend did.
history: list[dict] = []


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


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "sched_lifetime" not in _BACKENDS:
        register_backend(name="sched_lifetime")(backend)


_register()
