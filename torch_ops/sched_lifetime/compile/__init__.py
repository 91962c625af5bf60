"""torch.compile backend "sched_lifetime" (wiring only: the order comes from Rust's scheduler).

    model = torch.compile(model, backend="sched_lifetime", options={"explain": True})

One file a pass, GraphModule in, GraphModule out (torchtitan's graph_trainer layout), except
that the pass that orders a graph asks Rust for the order: `to_ir` (the analysis),
`order_pass` (the graph in Rust's order), `multiplex_pass` (a forward and a backward graph as
two sources of one schedule), `graph_step` (training on compiled graphs).

AOTAutograd gives a forward and a backward FX graph (no Inductor). Each graph becomes an IR
table (`to_ir`): call nodes are compute nodes; functional collectives (`_c10d_functional.*`,
`_c10d_functional_autograd.*`) are comm launches and their `wait_tensor` the matching wait, and so are the emulated EP link's
ops (`sched_lifetime_link.*`: a model on `HostLinkAllToAll` traces to them, see `ep_link.py`,
so compiled graphs and `GraphStep` run EP on one GPU); views and `getitem` are noops;
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
microbatch with a backward graph of another into one module (two sources). `paging=True`
adds the paging pass (`paging_pass`): saved activations to pinned host memory after their
producer, back before their first backward use, on the page stream (eager, not with
`cudagraphs`).

`cudagraphs=True` captures each rewritten graph in a CUDA graph the way torch's own
"cudagraphs" backend does (cudagraph trees: static parameters, a private memory pool, replays
that copy the other inputs in), after our rewrite; a graph that cannot be captured (CPU tensors,
several devices, an incompatible op, a mutated non-static input) is an error that says why,
never a quiet eager run.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.fx as fx

from ..schedule import format_explain, schedule
from .graph_step import GraphStep, capture_graphs, compile_graphs
from .multiplex_pass import multiplex
from .order_pass import reorder, rewrite
from .paging_pass import GraphPager
from .to_ir import _is_collective, _is_wait, to_ir

__all__ = ["OPTIONS", "GraphStep", "backend", "boxed", "capture_graphs", "check_options", "compile_fx_graph", "compile_graphs", "history", "multiplex", "reorder", "rewrite", "to_ir"]

#: Options and their defaults; anything else is an error listing these.
OPTIONS: dict[str, Any] = {
    "overlap": True,  # schedule the graph (False: keep AOTAutograd's order)
    "explain": False,  # print each graph's schedule and what each launch ran under
    "ep_budget": None,  # launches in flight (None: SCHED_LIFETIME_EP_LAUNCH_BUDGET, else 1)
    "lifetime": "scheduled",  # cross-stream lifetime; compiled graphs have no side-stream values yet
    "paging": False,  # saved activations to host memory and back (eager only, not with cudagraphs)
    "paging_budget": 0.5,  # what to page: a fraction of the saved activations' bytes, or bytes (int)
    "paging_prefetch": 2,  # a page-in is launched this many compute nodes before its first use
    "paging_buffers": 2,  # static: run slots made at compile time (more are made as more forwards run before their backwards)
    "paging_min_bytes": 1 << 16,  # smaller saved values stay on the device
    "paging_timed": True,  # sl.Pager decides at run time after calibration (False: the static plan)
    "paging_slack": 1.25,  # timed: copies planned this many times slower than measured
    "paging_count_host": True,  # timed: a value whose copy is shorter than a page-out's host time stays (False: every one may be paged)
    "paging_two_way": False,  # True: page-ins on their own stream beside the page-outs (opt-in: not bit-exact under capture yet)
    "paging_group_out": 1,  # page-outs queued together behind one wait for the compute stream (sl.Pager's group_out)
    "cudagraphs": False,  # capture each compiled graph in a CUDA graph (torch's cudagraph trees)
    # The order may raise a graph's estimated peak (liveness of the values' bytes) over
    # AOTAutograd's order by at most this fraction, else the graph keeps AOTAutograd's order; a
    # graph with nothing to overlap keeps it anyway. None: no memory guard.
    "memory_slack": 0.02,
    # AOTAutograd's joint-graph partition: "min_cut" (what aot_eager uses) recomputes cheap ops
    # in the backward instead of saving their outputs (H200, embedded model: peak 6797 MiB as
    # aot_eager's, against 7161 with "default", at equal step time); "default" saves what eager
    # autograd saves.
    "partition": "min_cut",
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
        if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)) and hasattr(v, "item"):
            v = v.item()  # a NumPy (or 0-d tensor-like) scalar: the Python number it holds
        opts[k] = v
    for k in ("overlap", "explain", "paging", "cudagraphs", "paging_timed", "paging_two_way", "paging_count_host"):
        if not isinstance(opts[k], bool):
            raise ValueError(f"sched_lifetime backend: option {k!r} must be a bool, got {opts[k]!r}")
    if opts["ep_budget"] is not None:
        from .._ops import INFO

        lo, hi, b = INFO["budget"]["min"], INFO["budget"]["max"], opts["ep_budget"]
        if isinstance(b, bool) or not isinstance(b, int) or not lo <= b <= hi:
            raise ValueError(f"sched_lifetime backend: option 'ep_budget' must be an int in {lo}..={hi} (launches in flight) or None, got {b!r}")
    if opts["partition"] not in ("default", "min_cut"):
        raise ValueError(f"sched_lifetime backend: option 'partition' must be 'default' or 'min_cut', got {opts['partition']!r}")
    if opts["lifetime"] not in ("scheduled", "record_stream"):
        raise ValueError(f"sched_lifetime backend: option 'lifetime' must be 'scheduled' or 'record_stream', got {opts['lifetime']!r}")
    if opts["paging"] and opts["cudagraphs"]:
        raise ValueError(
            "sched_lifetime backend: paging=True with cudagraphs=True is not supported: releasing a paged-out "
            "tensor's device storage queries its copy's event, which capture does not allow"
        )
    ms = opts["memory_slack"]
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms < math.inf):
        raise ValueError(f"sched_lifetime backend: option 'memory_slack' must be a finite number >= 0 (a fraction of the peak) or None, got {ms!r}")
    b = opts["paging_budget"]
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b or (isinstance(b, float) and not b <= 1):
        raise ValueError(f"sched_lifetime backend: option 'paging_budget' must be a fraction in [0, 1] or bytes (int >= 0), got {b!r}")
    sl_ = opts["paging_slack"]
    if isinstance(sl_, bool) or not isinstance(sl_, (int, float)) or not 1 <= sl_ < math.inf:
        raise ValueError(f"sched_lifetime backend: option 'paging_slack' must be a finite number >= 1, got {sl_!r}")
    for k, lo in (("paging_prefetch", 0), ("paging_buffers", 1), ("paging_min_bytes", 0), ("paging_group_out", 1)):
        if isinstance(opts[k], bool) or not isinstance(opts[k], int) or opts[k] < lo:
            raise ValueError(f"sched_lifetime backend: option {k!r} must be an int >= {lo}, got {opts[k]!r}")
    return opts


def backend(gm: fx.GraphModule, example_inputs: list, options: Optional[dict] = None, mode: Optional[str] = None) -> Callable:
    """The torch.compile backend, registered as `backend="sched_lifetime"` (on import, and
    through the package's `torch_dynamo_backends` entry point after `pip install`).
    AOTAutograd's forward and backward graphs (no Inductor) are scheduled by Rust and rebuilt
    in that order: collectives launched early and waited late, optionally paged activations
    (`paging=True`) and CUDA-graph capture (`cudagraphs=True`). `options`: see `OPTIONS`
    (an unknown name or a bad value is a ValueError listing the valid ones). Guide:
    docs/compile.md.

    Example:

        >>> import torch, sched_lifetime as sl
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> compiled = torch.compile(model, backend="sched_lifetime", options={"overlap": True})
        >>> compiled(torch.randn(8, 16)).sum().backward()
        >>> [h["phase"] for h in sl.compile.history[-2:]]     # what the backend built
        ['fwd', 'bwd']
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    if mode is not None:  # torch.compile passes `mode` through to any backend; its modes are Inductor's
        raise ValueError(
            f"sched_lifetime backend: mode={mode!r} is an Inductor mode; this backend takes options instead: "
            f"options={{'cudagraphs': True}} for CUDA graphs (what 'reduce-overhead' turns on), see sched_lifetime.compile.OPTIONS"
        )
    opts = check_options(options)
    captured = _Capture(len(example_inputs)) if opts["cudagraphs"] else None
    pager = None
    partition = min_cut_rematerialization_partition if opts["partition"] == "min_cut" else default_partition
    if opts["paging"]:
        pager = GraphPager(
            opts["paging_budget"], opts["paging_prefetch"], opts["paging_buffers"], opts["paging_min_bytes"],
            timed=opts["paging_timed"], slack=opts["paging_slack"], two_way=opts["paging_two_way"], count_host=opts["paging_count_host"],
            group_out=opts["paging_group_out"],
        )
        partition = pager.partition(partition)

    def compiler(phase: str, inference: bool = False) -> Callable:
        def compile_graph(g: fx.GraphModule, inputs: list) -> Callable:
            out = compile_fx_graph(g, phase, opts)
            if pager is not None and not inference:
                out = pager.forward(out) if phase == "fwd" else pager.backward(out)
                out.sched_lifetime["paging"] = pager
                if opts["explain"] and pager.candidates:
                    print(tagged(f"  paging (its nodes go in after the order above): {pager.summary(phase)}"))
            if captured is not None:
                return captured(out, inputs, phase, inference)
            return boxed(out)

        return compile_graph

    compiled = aot_autograd(
        fw_compiler=compiler("fwd"), bw_compiler=compiler("bwd"), inference_compiler=compiler("fwd", inference=True), partition_fn=partition
    )(gm, example_inputs)
    return compiled if pager is None else pager.beside_outer_hooks(compiled)


def boxed(gm: fx.GraphModule) -> Callable:
    """`gm` under AOTAutograd's boxed calling convention, as aot_eager runs its graphs
    (`boxed_nop`): the runner takes the argument list and clears it once the graph has bound
    its inputs, so each input (a saved activation in the backward) is freed at its last use in
    the graph, not when the graph returns. `gm` itself keeps its plain signature (history,
        multiplexing and tests call it with positional arguments); the runner is a copy of it,
    `gm.sched_lifetime["runner"]`, and the returned function's `.module` is `gm`."""
    from torch.fx.graph import _BoxedCodeGen

    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})  # nodes copied; their other arguments (streams, keys) shared
    g.output(out)
    g.set_codegen(_BoxedCodeGen())
    runner = fx.GraphModule(gm, g)
    gm.sched_lifetime["runner"] = runner  # what runs: hooks on it see the argument list

    def run(args: list) -> Any:
        return runner(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    run.module = gm  # type: ignore[attr-defined]  (keeps what gm holds alive: its pager)
    return run


class _Capture:
    """Our rewritten graphs under torch's cudagraph trees, as torch's "cudagraphs" backend wraps
    AOTAutograd's graphs (`torch/_dynamo/backends/cudagraphs.py`): the forward's parameters
    and buffers (AOTAutograd's `static_input_indices`, as Inductor's `get_static_input_idxs`
    reads them: with modules inlined they are ordinary Dynamo inputs) and the backward's
    tangents are static inputs, read in place; everything else is copied into the graph's
    inputs at each replay. A graph that cannot be captured raises. The trees run the graph
    through `boxed` (a copy takes the argument list), so `gm`, the module `history` and
    `explain` show, keeps its plain positional signature as without capture.
    Capture waits for the first call, as Inductor's `compile_fx.cudagraphify` does: the tree
    keys its recordings on the call's int inputs, which at compile time are symbols under
    dynamic shapes (a graph recorded for 15 tokens would then replay for 14)."""

    def __init__(self, n_dynamo_inputs: int) -> None:
        self.n_dynamo_inputs = n_dynamo_inputs

    def __call__(self, gm: fx.GraphModule, inputs: list, phase: str, inference: bool) -> Callable:
        from torch._dynamo.backends import cudagraphs as cg
        from torch._dynamo.utils import preserve_rng_state
        from torch._inductor.compile_fx import get_static_input_idxs
        from torch._inductor.cudagraph_trees import cudagraphify_impl
        from torch._inductor.cudagraph_utils import get_placeholder_info
        from torch._inductor.utils import count_tangents, num_fw_fixed_arguments

        backward = phase == "bwd"
        fixed = count_tangents(gm) if backward else num_fw_fixed_arguments(self.n_dynamo_inputs, len(inputs))
        skip = cg.check_for_skip(gm, fixed)
        if skip:
            hint = "; cudagraphs=True needs the model and its inputs on a CUDA device" if "cpu device" in skip else ""
            raise RuntimeError(f"sched_lifetime backend: cudagraphs=True cannot capture the {phase} graph: {skip}{hint}")
        static = list(range(fixed)) if backward else get_static_input_idxs(fixed)
        model = boxed(gm)  # not torch's boxed_nop, which switches `gm` itself (history's module) to the list convention
        settings = dict(
            device_index=cg.get_device_index(gm),
            is_backward=backward,
            is_inference=inference,
            stack_traces=cg.get_stack_traces(gm),
            placeholders=get_placeholder_info(gm.graph),
            mutated_input_idxs=cg.find_input_mutations(gm.graph),
        )
        captured = None

        def run(args: list) -> Any:
            nonlocal captured
            if captured is None:
                with preserve_rng_state():
                    captured = cudagraphify_impl(model, args, static, **settings)
            return captured(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        run.module = gm  # type: ignore[attr-defined]
        gm.sched_lifetime["cudagraphs"] = True
        return run


def compile_fx_graph(gm: fx.GraphModule, phase: str, opts: dict, in_place: bool = False) -> fx.GraphModule:
    """One AOT graph: IR, Rust's order, the rebuilt GraphModule (`gm.sched_lifetime` holds
    the IR and the schedule). `phase`: "fwd", "bwd", or "step" (a whole traced training step,
    forward and backward in one graph, as torchtitan's graph_trainer traces it). `in_place`:
    move `gm`'s own nodes (`reorder`) instead of building a new module (`rewrite`)."""
    table = to_ir(gm, phase)
    result = None
    if opts["overlap"]:
        result = schedule(table, ep_budget=opts["ep_budget"], explain=opts["explain"], memory_slack=opts.get("memory_slack"))
        order = list(result["order"])
    else:
        order = [n["name"] for n in table["nodes"]]
    out = reorder(gm, order) if in_place else rewrite(gm, order)
    out.sched_lifetime = {"ir": table, "schedule": result, "phase": phase, "order": order}
    history.append({**out.sched_lifetime, "module": out})
    del history[:-64]
    if opts["explain"]:
        print(explain_text(out, table, result, phase))
    return out


def explain_text(gm: fx.GraphModule, table: dict, result: Optional[dict], phase: str) -> str:
    """What `explain` prints for one graph: its size, the EP launch budget, each launch with what
    it is (the collective, and its EP role and layer where annotated) and what ran under it, and
    the memory guard's verdict. Under several ranks each line says which rank printed it."""
    launches = sum(1 for n in table["nodes"] if n["kind"] == "comm_launch")
    head = f"{phase} graph: {len(table['nodes'])} nodes, {launches} comm launches"
    lines = []
    if result is not None:
        head += f", EP launch budget {result['budgets']['ep']}"
        lines.append(format_explain(result, labels=_launch_labels(gm)) or "  (no launches)")
        why = (result.get("memory") or {}).get("why")
        if why and why.startswith("nothing to overlap"):  # the paging pass's copies come after this order
            lines.append("  order: the graph's own (no collective to overlap; paging's nodes, if on, are placed into it after)")
        elif why:
            lines.append(f"  memory: {why}")
    return tagged("\n".join([head, *lines]))


def tagged(text: str) -> str:
    """`text` with each line starting "[sched_lifetime]", or "[sched_lifetime rank N]" under
    several ranks (each rank prints its own)."""
    tag = "[sched_lifetime]"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tag = f"[sched_lifetime rank {dist.get_rank()}]"
    return "\n".join(f"{tag} {line}" for line in text.splitlines())


def _launch_labels(gm: fx.GraphModule) -> dict[str, str]:
    """Each collective launch of `gm` by node name: its op, and its EP role and layer
    (`node.meta["custom"]`'s `ep` and `layer`) where annotated."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and _is_collective(n.target) and not _is_wait(n.target):
            custom = n.meta.get("custom") or {}
            label = getattr(n.target, "_overloadpacket", n.target).__name__
            if custom.get("ep") in ("dispatch", "combine"):
                label += f", EP {custom['ep']}" + (f", layer {custom['layer']}" if custom.get("layer") is not None else "")
            out[n.name] = label
    return out


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "sched_lifetime" not in _BACKENDS:
        register_backend(name="sched_lifetime")(backend)


_register()
