"""Training on compiled graphs without torch.compile's runtime: `capture_graphs` (AOTAutograd's
forward and backward graphs of `functional_call`, arguments known) and `GraphStep` (the
combined-1F1B steady state on them, through the multiplexing pass)."""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ..calibrate import CALIBRATED, Calibration, apply_plans
from ..ep import agree_across_ranks, digest
from ..nodes import accumulate_grads
from .multiplex_pass import build, multiplex, multiplex_table

#: GraphStep's orders of the multiplexed module: measured costs (the default) or timing-free.
ORDERS = (CALIBRATED, "ours")


def capture_graphs(model: torch.nn.Module, example_inputs: tuple) -> tuple:
    """AOTAutograd's forward and backward graphs (no Inductor) of
    `functional_call(model, state, inputs)`, where the state is the module's parameters then
    its buffers (a rotary cache, a scale: graph inputs, not constants baked into the graph):
    the forward takes the state then the inputs and returns the output then what the backward
    saves; the backward takes the saved values then the output's gradient and returns one
    gradient per forward argument (None for the buffers). Runs the model once on
    `example_inputs` (forward and a zero backward) to capture both; the parameters' `.grad`
    are left as they were. A forward that updates a buffer (BatchNorm's running statistics)
    is refused: the compiled graphs would drop the update. Returns (state names, state:
    parameters then buffers, {"fwd", "bwd"} graphs, output)."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition

    _refuse_shared_submodules(model)
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    names = [n for n, _ in params] + [n for n, _ in buffers]
    state = [p for _, p in params] + [b for _, b in buffers]
    graphs: dict[str, fx.GraphModule] = {}
    n_state = len(state)

    def fn(*flat: Any) -> torch.Tensor:
        return torch.func.functional_call(model, dict(zip(names, flat[:n_state])), tuple(flat[n_state:]))

    def keep(phase: str) -> Callable:
        def compiler(gm: fx.GraphModule, inputs: list) -> Callable:
            graphs[phase] = gm
            return make_boxed_func(gm)

        return compiler

    traced = aot_function(fn, fw_compiler=keep("fwd"), bw_compiler=keep("bwd"), partition_fn=default_partition)
    versions = [b._version for _, b in buffers]
    # The capture runs the model once: its random ops (dropout) must not move the caller's
    # generators, or every later step draws other masks than the same code without us.
    devices = sorted({t.device.index for t in [*state, *example_inputs] if isinstance(t, torch.Tensor) and t.is_cuda and t.device.index is not None})
    rng = torch.random.fork_rng(devices=devices)
    rng.__enter__()
    try:
        out = traced(*state, *example_inputs)
    except Exception as e:
        from ..executor import add_note

        add_note(
            e,
            "sched_lifetime: capturing the model's forward and backward graphs (AOTAutograd, static shapes) failed "
            "with the error above. If it comes from tracing: Python control flow on tensor values and data-dependent "
            "shapes (x.item(), .tolist(), nonzero(), `if (x > 0).all():`) cannot be captured; "
            "docs/nodes.md#graphstep-the-same-step-on-compiled-graphs lists what can and a recipe for Hugging Face models"
        )
        raise
    finally:
        rng.__exit__(None, None, None)
    updated = [n for (n, b), v in zip(buffers, versions) if b._version != v]
    if updated:
        raise ValueError(
            f"the module's forward updates its buffers {updated[:5]} (e.g. BatchNorm's running statistics in training "
            "mode): compiled graphs run here would drop those updates; freeze them (module.eval() for BatchNorm, or "
            "track_running_stats=False) or train this module eagerly"
        )
    if not isinstance(out, torch.Tensor):
        what = f"{len(out)} outputs (a tuple or list)" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ValueError(f"the module must return one tensor (a GraphStep's loss, a GraphStage's activation), got {what}")
    before = [p.grad for p in state]
    out.backward(torch.zeros_like(out))  # the backward graph is compiled on first use
    for p, g in zip(state, before):
        p.grad = g
    _drop_dead_forward_ops(graphs["bwd"])
    return names, state, graphs, out.detach()


def _refuse_shared_submodules(model: torch.nn.Module) -> None:
    """A submodule with parameters or buffers of its own registered under two names (`self.b =
    self.a[1]`) is refused: `functional_call` swaps its tensors in under one name only, and
    torch leaves a traced tensor in the module's attribute behind (the model's parameter
    replaced, its gradient lost: measured on torch 2.11). A parameter tied by assignment
    (`lm_head.weight = embed.weight`, as transformers ties embeddings) is fine."""
    seen: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if not any(True for _ in mod.parameters(recurse=False)) and not any(True for _ in mod.buffers(recurse=False)):
            continue
        first = seen.setdefault(id(mod), name)
        if first != name:
            raise ValueError(
                f"GraphStep: the submodule {type(mod).__name__} is registered as both '{first or '(the model)'}' and '{name}'; "
                "capturing its graphs through torch.func.functional_call would replace its parameters with traced tensors. "
                "Register it once and call it from both places (or tie its parameters by assignment: "
                "`b.weight = a.weight`), or train this model with torch.compile(backend='sched_lifetime')"
            )


def _drop_dead_forward_ops(bwd: fx.GraphModule) -> None:
    """Remove the forward ops AOTAutograd's partitioner copied into the backward graph that
    nothing reads. Dead-code elimination keeps a random op (it counts as impure): a dropout
    whose output the backward does not use (it reads the forward's saved mask) would still
    draw from the generator at every backward, so every forward after it would get another
    mask than eager's. Eager's backward runs no forward op, so none of them is kept."""

    def impure(n: fx.Node) -> bool:
        return n.op in ("placeholder", "output") or (n.is_impure() and n.meta.get("partitioner_tag") != "is_forward")

    if bwd.graph.eliminate_dead_code(is_impure_node=impure):
        bwd.recompile()


def compile_graphs(graphs: dict, ep_budget: Optional[int] = None) -> tuple:
    """`capture_graphs`' forward and backward graphs each in Rust's order (the ordering pass),
    and how many values the forward returns (its output, then what the backward saves)."""
    from . import check_options, compile_fx_graph  # the package's pipeline of passes

    opts = check_options({"ep_budget": ep_budget})
    fwd = compile_fx_graph(graphs["fwd"], "fwd", opts)
    bwd = compile_fx_graph(graphs["bwd"], "bwd", opts)
    n_fwd_out = len(list(graphs["fwd"].graph.nodes)[-1].args[0])
    return fwd, bwd, n_fwd_out


class GraphStep:
    """A training step on compiled graphs, in the steady state of combined 1F1B: the forward
    of microbatch 0, then the forward of i+1 multiplexed with the backward of i (one module
    from `multiplex`, compiled once), then the backward of the last. What a graph pipeline
    stage runs; here one stage (the whole model).

    `model(*inputs)` must return a scalar loss. The forward and backward graphs come from
    AOTAutograd (no Inductor) on `torch.func.functional_call(model, state, inputs)`, so their
    arguments are known: the forward takes the state (parameters, then buffers: `self.params`
    holds both) then the inputs and returns the loss
    then what the backward saves; the backward takes the saved values then the loss's
    gradient and returns one gradient per forward argument. `step` accumulates the
    parameters' gradients into `.grad` (microbatch order, as eager accumulation does) and
    returns the losses. With torch.distributed, the ranks first agree on the microbatch count,
    the modes and the graphs' orders (`rank_check`, as `train_step`'s): a disagreement raises
    on every rank instead of hanging in a collective. `ep_budget`: EP launches in flight
    (default: the environment, else 1); `explain`: print what each launch of the multiplexed
    module ran under. Guide: docs/nodes.md#graphstep-the-same-step-on-compiled-graphs.

    `order`: `"calibrated"` (default) or `"ours"` (timing-free). Calibrated: in the first
    `calibration.steps` steps (`self.calibration`, an `sl.Calibration`) every node of the
    multiplexed module is timed where it runs (CUDA events around each node, one sync at the
    step's end; host clock on CPU), the ranks agree on the costs with one collective, and the
    module is scheduled again under rule `search` with them, rebuilt only when its order
    changed (the ranks then check their orders are identical); later steps time nothing.
    Numerics do not change: every order keeps the graphs' edges, and gradients accumulate
    outside the module in microbatch order. The warm-up and cool-down graphs (and
    `paired_ends`' modules) keep the timing-free order. A timed step runs a copy of the module with a tick
    (an event, or the host clock on CPU) before and after each node, compiled like the module
    (each value freed at its last use). By default (`Calibration(background=True)`) the
    search runs in a thread beside the next steps, and the module it gives is built and takes
    over at the start of the first step that finds every rank's search done; the calibration step
    then ends with the sync and the costs' agreement only (`background=False`: the search at
    its end, the module rebuilt from the next step).


    Example (bit-exact against eager backward per microbatch):

        >>> import torch, sched_lifetime as sl
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        ...     def forward(self, x, y):
        ...         return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)
        >>> _ = torch.manual_seed(0)
        >>> net = Net()
        >>> mbs = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(3)]
        >>> step = sl.GraphStep(net, mbs[0])
        >>> losses = step.step(mbs)                 # F(0), F(1)+B(0), F(2)+B(1), B(2)
        >>> ours = [p.grad.clone() for p in net.parameters()]
        >>> net.zero_grad()
        >>> for mb in mbs:
        ...     net(*mb).backward()
        >>> all(torch.equal(a, p.grad) for a, p in zip(ours, net.parameters()))
        True
    """

    def __init__(
        self, model: torch.nn.Module, example_inputs: tuple, ep_budget: Optional[int] = None, explain: bool = False, order: str = CALIBRATED
    ) -> None:
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
            raise TypeError(
                f"GraphStep: example_inputs must be a tuple of the model's positional inputs, got {type(example_inputs).__name__} "
                "(one input: `(x,)`)"
            )
        self.order = order
        #: Cost calibration of order "calibrated" (`sched_lifetime.calibrate`): replace it to
        #: change the settings (`Calibration(steps=3, smoothing=0.5)`); its `group` defaults
        #: to `rank_group`.
        self.calibration = Calibration()
        self.model = model
        #: The inputs' shapes and dtypes the graphs were captured for (static: `step` checks them).
        self.input_meta = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in example_inputs]
        #: The non-tensor inputs' values (position -> value): constants of the captured graphs.
        self.input_constants = {j: v for j, v in enumerate(example_inputs) if not isinstance(v, torch.Tensor)}
        self.names, self.params, self.graphs, loss = capture_graphs(model, example_inputs)
        if loss.dim() != 0:
            raise ValueError(f"GraphStep needs a scalar loss, the model returned shape {tuple(loss.shape)}")
        self.fwd, self.bwd, self.n_fwd_out = compile_graphs(self.graphs, ep_budget)
        self._mux_table = multiplex_table(self.graphs["fwd"], self.graphs["bwd"])
        self.mux = multiplex(self.graphs["fwd"], self.graphs["bwd"], ep_budget=ep_budget, explain=explain)
        # What runs: the boxed runners (each clears its argument list once bound, so a saved
        # activation dies at its last use in the backward, not when the call returns).
        from . import boxed

        self._fwd, self._bwd, self._mux = boxed(self.fwd), boxed(self.bwd), boxed(self.mux)
        self.ep_budget = ep_budget
        self._ends: Optional[tuple] = None
        #: Cross-rank agreement of `step` (as `train_step`'s: "new_plan", "every_step" or
        #: "off", over `rank_group`): the microbatch count, the modes and the graphs' orders.
        self.rank_check = "new_plan"
        self.rank_group: Any = None
        self._rank_agreed: Optional[str] = None
        self._runs: Optional[list] = None  # a calibration step's timed runs of the module
        self._mux_calls, self._timed_call = 0, 0  # runs of the module in this step; the one timed
        # (the module, its timed runner): made here for a calibrated order and again at a
        # calibration step's end that rebuilt the module while calibration steps remain, so no
        # timed run pays for the timed module's code generation (about as long as a step on
        # the H200); dropped when calibration ends. A module taken over at a step's start
        # (a background search) or a restarted calibration makes it at its next timed run.
        self._timed_mux: Optional[tuple] = None
        if order == CALIBRATED:
            self._ensure_timed()
        self._graphs_digest = digest([g.sched_lifetime["order"] for g in (self.fwd, self.bwd, self.mux)])

    @property
    def order(self) -> str:
        """The module's order: "calibrated" (measured costs, the default) or "ours" (timing-free);
        may be changed between steps."""
        return self._order

    @order.setter
    def order(self, order: str) -> None:
        if order not in ORDERS:
            raise ValueError(f"GraphStep: order must be one of {ORDERS}, got {order!r}")
        self._order = order

    def _check_state(self) -> None:
        """The model's parameters and buffers are still the tensors the graphs were captured
        with (each step reads them, and accumulates into their `.grad`): one replaced since
        (`load_state_dict(..., assign=True)`, `module.w = nn.Parameter(...)`, a buffer
        registered again) is an error, not a step on the old tensors. Changes in place are
        seen (`p.copy_`, an optimizer's step)."""
        now = [t for _, t in self.model.named_parameters()] + [t for _, t in self.model.named_buffers()]
        if len(now) != len(self.params) or any(a is not b for a, b in zip(now, self.params)):
            names = [n for n, _ in self.model.named_parameters()] + [n for n, _ in self.model.named_buffers()]
            changed = [n for n, a, b in zip(names, now, self.params) if a is not b] or names[len(self.params) :] or self.names[len(now) :]
            raise RuntimeError(
                f"GraphStep: the model's parameters or buffers were replaced since it was built ({changed[:3]}"
                f"{' ...' if len(changed) > 3 else ''}): its graphs read the tensors they were captured with; change them in place "
                "(load_state_dict without assign=True, p.data.copy_(...)) or build a new GraphStep"
            )

    def _forward(self, inputs: tuple) -> tuple:
        with torch.no_grad():
            out = self._fwd([*self.params, *inputs])
        return out[0], list(out[1:])

    def _accumulate(self, grads: Any) -> None:
        accumulate_grads(self.params, grads[: len(self.params)])

    def _paired(self) -> tuple:
        """The boxed runners of F(i) with F(i+1) and of B(i) with B(i+1), built on first use
        (each runner's `.module` is its multiplexed module)."""
        if self._ends is None:
            from . import boxed

            self._ends = tuple(
                boxed(multiplex(self.graphs[ph], self.graphs[ph], ep_budget=self.ep_budget, phases=(ph, ph))) for ph in ("fwd", "bwd")
            )
        return self._ends

    def step(self, microbatches: list[tuple], multiplexed: bool = True, paired_ends: bool = False) -> list[torch.Tensor]:
        """One step over the microbatches (each a tuple of model inputs); returns the losses.
        `multiplexed=False`: F(i) then B(i), one microbatch at a time (the baseline).
        `paired_ends` (multiplexed, 2+ microbatches): the warm-up and cool-down multiplexed too,
        F(0) with F(1) and B(n-2) with B(n-1), as the node path's `train_step(...,
        paired_ends=True)`; three microbatches' saved values live at once instead of two.
        Gradients accumulate in microbatch order either way."""
        if not microbatches:
            raise ValueError("GraphStep.step needs at least one microbatch")
        if paired_ends and not multiplexed:
            raise ValueError("GraphStep.step: paired_ends needs multiplexed=True")
        self._check_inputs(microbatches)
        self._check_state()
        if self.order == CALIBRATED:  # a background search's module takes over (the same step on every rank)
            self._apply(self.calibration.take_plans(wait=False))
        if paired_ends and len(microbatches) == 1:  # a setting that selects nothing: say so
            warnings.warn("GraphStep.step: paired_ends pairs two microbatches; with 1 the step runs F(0) then B(0) unpaired", stacklevel=2)
        facts = {"microbatch count": len(microbatches), "multiplexed": multiplexed, "paired_ends": paired_ends, "graphs": self._graphs_digest}
        agree_across_ranks(self, "GraphStep.step", facts)
        # Every rank times the same step (the facts above agree): the module runs in it.
        # The module runs once per microbatch after the warm-up's (and before the cool-down's)
        # forwards or backwards: n - 1 times, n - 2 with paired ends.
        mux_runs = len(microbatches) - (2 if paired_ends else 1) if multiplexed else 0
        timing = self.order == CALIBRATED and self.calibration.active and mux_runs >= 1
        self._runs = [] if timing else None
        # One run of the module is timed (the second when it runs twice or more: the first
        # follows the warm-up's forward): its runs are the same graph, and a tick per node
        # costs the host a few microseconds (timing every run cost the step 5% on the H200).
        self._mux_calls, self._timed_call = 0, min(1, mux_runs - 1)
        try:
            losses = self._step(microbatches, multiplexed, paired_ends)
            if timing:
                self._end_calibration()
        finally:
            self._runs = None
        return losses

    def _step(self, microbatches: list[tuple], multiplexed: bool, paired_ends: bool) -> list[torch.Tensor]:
        if paired_ends and len(microbatches) >= 2:
            return self._step_paired(microbatches)
        losses = []
        # The saved activations travel in argument lists only (no other reference), which the
        # runners clear: each dies at its last use in the backward.
        if not multiplexed:
            for mb in microbatches:
                loss, saved = self._forward(mb)
                losses.append(loss)
                saved.append(torch.ones_like(loss))
                with torch.no_grad():
                    self._accumulate(self._bwd(saved))
            return losses
        loss, saved = self._forward(microbatches[0])
        losses.append(loss)
        n_saved = self.n_fwd_out - 1
        for nxt in microbatches[1:]:
            args = [*self.params, *nxt, *saved, torch.ones_like(loss)]
            saved = None
            with torch.no_grad():
                out = self._run_mux(args)
            f_out, grads = out[: self.n_fwd_out], out[self.n_fwd_out :]
            self._accumulate(grads)
            loss, saved = f_out[0], list(f_out[1 : 1 + n_saved])
            losses.append(loss)
            del out, f_out
        saved.append(torch.ones_like(loss))
        with torch.no_grad():
            grads = self._bwd(saved)
        self._accumulate(grads)
        return losses

    def _check_inputs(self, microbatches: list[tuple]) -> None:
        """Each microbatch has the captured inputs' count, shapes and dtypes (the graphs are
        static): a ValueError naming the first that does not, instead of an error from inside
        a graph."""
        want = self.input_meta
        for i, mb in enumerate(microbatches):
            if not isinstance(mb, (tuple, list)):
                raise TypeError(
                    f"GraphStep.step: microbatch {i} is a {type(mb).__name__}; each microbatch is a tuple of the model's inputs "
                    "(one input: `(x,)`)"
                )
            if len(mb) != len(want):
                raise ValueError(f"GraphStep.step: microbatch {i} has {len(mb)} inputs, the graphs were captured with {len(want)}")
            for j, (t, w) in enumerate(zip(mb, want)):
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None
                if got != w:
                    raise ValueError(
                        f"GraphStep.step: microbatch {i} input {j} is {_meta(got)}, the graphs were captured for {_meta(w)} "
                        "(static shapes and dtypes): give every microbatch the example's, or make a GraphStep per shape"
                    )
                if j in self.input_constants and not _same_constant(t, self.input_constants[j]):
                    raise ValueError(
                        f"GraphStep.step: microbatch {i} input {j} is {t!r}, the graphs were captured with {self.input_constants[j]!r}: "
                        "a non-tensor input is a constant of the captured graphs; pass a value that changes as a tensor "
                        "(torch.tensor(...)), or make a GraphStep per value"
                    )

    def _run_mux(self, args: list) -> Any:
        """The multiplexed module on `args` (boxed: the list is cleared), timed per node in one
        of a calibration step's runs."""
        call, self._mux_calls = self._mux_calls, self._mux_calls + 1
        if self._runs is None or call != self._timed_call:
            return self._mux(args)
        dev = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        self._ensure_timed()
        global _TIMER
        timer = _TIMER = _Timer(torch.cuda.current_stream(dev) if dev is not None else None)
        try:
            out = self._timed_mux[1](args)
        finally:
            _TIMER = None
        self._runs.append(timer.marks)
        return out

    def _end_calibration(self) -> None:
        """A calibration step's end: an earlier calibration step's background search applied
        first, then one sync, the nodes' costs agreed across the ranks and smoothed, and the
        module scheduled again under rule `search` (rebuilt if its order changed), or, with
        `background=True`, that search started in a thread (`step` applies it two steps on)."""
        marks, self._runs = self._runs, None
        if len(marks) != 1:  # `step` times one run of the module: none would leave the costs empty
            raise RuntimeError(f"GraphStep: a calibration step timed {len(marks)} runs of the multiplexed module, expected 1")
        self.calibration.finish_step(
            lambda: [_times(m) for m in marks], {"mux": self._mux_table}, self._apply, group=self.rank_group, ep_budget=self.ep_budget
        )
        if self.calibration.active:  # the next calibration step times the module as it is now
            self._ensure_timed()
        else:
            self._timed_mux = None

    def _ensure_timed(self) -> None:
        """The timed copy of the current module (`_timed_runner`), generated if it is not made yet."""
        if self._timed_mux is None or self._timed_mux[0] is not self.mux:
            self._timed_mux = (self.mux, _timed_runner(self.mux))

    def _apply(self, plans: Optional[dict]) -> None:
        """The calibrated schedule takes over: the module rebuilt when its order changed, then
        the ranks' orders checked identical. Nothing when `plans` is None."""
        if plans is None:
            return

        def rebuild(label: str, result: dict) -> None:
            from . import boxed

            self.mux = build(self.graphs["fwd"], self.graphs["bwd"], self._mux_table, result)
            self._mux = boxed(self.mux)
            self._graphs_digest = digest([g.sched_lifetime["order"] for g in (self.fwd, self.bwd, self.mux)])

        apply_plans(self.calibration, plans, {"mux": self.mux.sched_lifetime["order"]}, rebuild, what="GraphStep's calibrated order")

    def _step_paired(self, microbatches: list[tuple]) -> list[torch.Tensor]:
        ff, bb = self._paired()
        k, n_saved = self.n_fwd_out, self.n_fwd_out - 1
        with torch.no_grad():
            out = ff([*self.params, *microbatches[0], *self.params, *microbatches[1]])
        losses = [out[0], out[k]]
        # Saved values of the two microbatches in flight, oldest first, held only here.
        older, newer = list(out[1 : 1 + n_saved]), list(out[k + 1 : k + 1 + n_saved])
        del out
        for nxt in microbatches[2:]:
            args = [*self.params, *nxt, *older, torch.ones_like(losses[-2])]
            older = None
            with torch.no_grad():
                out = self._run_mux(args)
            self._accumulate(out[k:])
            losses.append(out[0])
            older, newer = newer, list(out[1 : 1 + n_saved])
            del out
        args = [*older, torch.ones_like(losses[-2]), *newer, torch.ones_like(losses[-1])]
        older = newer = None
        with torch.no_grad():
            grads = bb(args)
        half = len(grads) // 2
        self._accumulate(grads[:half])  # microbatch n-2 first, as in every other order
        self._accumulate(grads[half:])
        return losses


def _same_constant(a: Any, b: Any) -> bool:
    """Whether a microbatch's non-tensor input is the captured one (equal and of one type)."""
    if a is b or (type(a) is float and type(b) is float and a != a and b != b):  # (NaN: unequal to itself)
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # no truth value (an array): only the same object passes
        return False


def _meta(m: Optional[tuple]) -> str:
    return "not a tensor" if m is None else f"shape {list(m[0])} {str(m[1]).replace('torch.', '')}"


#: The timer of the timed run in progress (one at a time: GraphStep runs its module on the
#: calling thread); the timed module's tick nodes record into it.
_TIMER: Optional["_Timer"] = None


class _Timer:
    """One timed run's marks by IR name: CUDA event pairs recorded on `stream` (read after one
    sync, `_times`), or host-clock microseconds on CPU (`stream` None)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.marks: dict[str, Any] = {}
        self._open: dict[str, Any] = {}


def _tick(name: str, end: bool) -> None:
    """A tick node of a timed module: the start or the end of node `name`."""
    t = _TIMER
    if t.stream is not None:
        now: Any = torch.cuda.Event(enable_timing=True)
        now.record(t.stream)
    else:
        now = time.perf_counter()
    if not end:
        t._open[name] = now
    elif t.stream is not None:
        t.marks[name] = (t._open.pop(name), now)
    else:
        t.marks[name] = (now - t._open.pop(name)) * 1e6


# Tick nodes return nothing and have no users: dead-code elimination must keep them.
fx.node._side_effectful_functions.add(_tick)


def _timed_runner(mux: fx.GraphModule) -> Callable:
    """`mux` with a tick before and after each node that has an IR name, compiled like the
    module itself (boxed: each value still freed at its last use), so a timed run costs the
    host the ticks only, not an interpreter's per-node work."""
    from . import boxed

    names = mux.sched_lifetime["ir_names"]
    g = fx.Graph()
    env: dict = {}
    for n in mux.graph.nodes:
        name = names.get(n.name) if n.op == "call_function" else None
        if name is not None:
            g.call_function(_tick, (name, False))
        env[n] = g.node_copy(n, lambda x: env[x])
        if name is not None:
            g.call_function(_tick, (name, True))
    timed = fx.GraphModule(mux, g)
    timed.sched_lifetime = {}
    return boxed(timed)


def _times(marks: dict) -> dict[str, float]:
    """A timed run's node times in us (CUDA event pairs: synchronizes on the last one first)."""
    pairs = [v for v in marks.values() if isinstance(v, tuple)]
    if pairs:
        pairs[-1][1].synchronize()
    return {k: (v[0].elapsed_time(v[1]) * 1e3 if isinstance(v, tuple) else v) for k, v in marks.items()}
