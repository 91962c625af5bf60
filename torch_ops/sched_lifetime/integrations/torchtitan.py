"""torchtitan (>= 0.3.0) graph_trainer integration: our scheduler as a graph_trainer pass
pipeline, chosen from torchtitan's own command line, no patch to torchtitan.

    torchrun ... -m torchtitan.train \\
        --module sched_lifetime.integrations.torchtitan \\
        --config graph_trainer_deepseek_v3_debugmodel

`--module` names this file as the config registry: every `graph_trainer_*` config of
graph_trainer's models (llama3, deepseek_v3, qwen3) is offered under its own name, the same
config with two changes: `compile.pass_pipeline` is `"sched_lifetime"` (registered here with
graph_trainer's `register_pass_pipeline`), and `compile.sched_lifetime` holds our options
(`SchedLifetimeOptions`), so `--compile.sched_lifetime.ep_budget 2` sets them on the command
line like any torchtitan field (an unknown one is tyro's error naming it; a bad value is an
error naming the flag, when the command line is parsed). torchtitan 0.3.0 reads no toml: its
configs are Python functions and command-line flags.

The pipeline is graph_trainer's default one with one pass added, `sched_lifetime_order_pass`,
after torchtitan's own graph passes (cleanup, memory policy, its `cpu_offload`, EP chunking,
FSDP bucketing) and before Inductor and cudagraph: the traced step (forward, loss and
backward in one FX graph) becomes our IR (`compile.to_ir`, phase "step"), Rust orders it
(collectives launched early, waited late, within the EP launch budget) and the nodes are moved
into that order in place (`compile.reorder`). Reordering changes no value: losses and
gradients are bit-exact against torchtitan's own pipeline (tests/python/test_torchtitan.py).

EP: the token-exchange all-to-alls carry torchtitan's own annotation
(`EP_token_exchange: dispatch|combine`, from graph_trainer's `annotate_moe_ep_regions`); the
pass turns it into ours (`ep`, with the layer from `module_fqn`) so a dispatch without its
combine is caught. With expert parallelism on, an all-to-all without any EP annotation (a
model whose dispatcher graph_trainer did not annotate) is an error naming the node, and so is
a graph with no all-to-all at all.

Paging: torchtitan's `--compile.memory_policy sac_and_offload` (its `cpu_offload` pass) stays
in the pass list, before ours (not tried together yet: it needs an accelerator); our own paging
(`--compile.sched_lifetime.paging`, `compile.joint_paging_pass`: the static plan on the whole
traced step, forward values the backward reads) runs after our order.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch
import torch.fx as fx
from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig
from torchtitan.experiments.graph_trainer.passes import (
    compile_time_passes,
    cudagraph_pass,
    final_inductor_compile_passes,
)
from torchtitan.experiments.graph_trainer.registry import register_pass_pipeline, register_post_init_hook
from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

from ..compile import check_options, compile_fx_graph, tagged

__all__ = [
    "PIPELINE",
    "SchedLifetimeCompileConfig",
    "SchedLifetimeOptions",
    "SchedLifetimeTrainer",
    "sched_lifetime_order_pass",
    "sched_lifetime_passes",
    "to_sched_lifetime_config",
]

#: The name graph_trainer's `--compile.pass_pipeline` selects us by.
PIPELINE = "sched_lifetime"

#: graph_trainer's model folders whose `graph_trainer_*` configs this registry offers.
_MODELS = ("deepseek_v3", "qwen3", "llama3")

#: torchtitan's annotations (graph_trainer `common_utils`: `annotate_moe_ep_regions`).
_TT_EXCHANGE = "EP_token_exchange"
_TT_EP_KEYS = ("EP", _TT_EXCHANGE, "EP_token_count_exchange", "EP_token_count_sync")


@dataclass(kw_only=True, slots=True)
class SchedLifetimeOptions:
    """Our options in torchtitan's config (`--compile.sched_lifetime.<name>`); they are the
    compile backend's options of the same name (docs/compile.md), checked by
    `sched_lifetime.compile.check_options`."""

    overlap: bool = True
    """Order the traced step with Rust's scheduler (False: keep torchtitan's order; the pass
    still checks the graph)."""

    ep_budget: Optional[int] = None
    """Collective launches in flight (1..=1024); None: SCHED_LIFETIME_EP_LAUNCH_BUDGET, else 1."""

    explain: bool = False
    """Print the schedule: what each launch ran under."""

    paging: bool = False
    """Page forward values the backward reads to pinned host memory and back (static plan,
    `compile.joint_paging_pass`), after our order."""

    paging_budget: float = 0.5
    """What to page: a fraction (0..1) of the candidates' bytes."""

    paging_prefetch: int = 2
    """A page-in is launched this many backward nodes before its first use."""

    paging_min_bytes: int = 1 << 16
    """Smaller values stay on the device."""

    memory_slack: float = 0.02
    """How much our order may raise the step's estimated peak over torchtitan's order, a
    fraction >= 0; past it the step keeps torchtitan's compute order with launches early and
    waits late (`explain` says when). (The backend's `None`, no guard, is not offered here.)"""

    def __post_init__(self) -> None:
        # A bad value is an error when the command line is parsed, naming the flag.
        if isinstance(self.paging_budget, int) and not isinstance(self.paging_budget, bool):
            self.paging_budget = float(self.paging_budget)  # a fraction here (the backend reads an int as bytes)
        try:
            self.to_options()
        except ValueError as e:
            msg = re.sub(r"^sched_lifetime backend: option '(\w+)'", r"--compile.sched_lifetime.\1", str(e))
            msg = msg.replace(" or bytes (int >= 0)", "")  # bytes are the backend's; here a fraction
            if msg.startswith("--compile.sched_lifetime.memory_slack"):
                msg = msg.replace(" or None", "")
            raise ValueError(msg) from None

    def to_options(self) -> dict:
        """The backend's option dict, checked (ValueError on a bad value); paging here is the
        static plan (`paging_timed=False`)."""
        return check_options({**{f.name: getattr(self, f.name) for f in fields(self)}, "paging_timed": False})


@dataclass(kw_only=True, slots=True)
class SchedLifetimeCompileConfig(GraphTrainerCompileConfig):
    """graph_trainer's compile config with our pipeline selected and our options beside it."""

    pass_pipeline: str = PIPELINE
    sched_lifetime: SchedLifetimeOptions = field(default_factory=SchedLifetimeOptions)
    """Options of the sched_lifetime pass pipeline."""


class SchedLifetimeTrainer(GraphTrainer):
    """graph_trainer's trainer, unchanged; its config carries `SchedLifetimeCompileConfig`."""

    @dataclass(kw_only=True, slots=True)
    class Config(GraphTrainer.Config):
        compile: SchedLifetimeCompileConfig = field(default_factory=SchedLifetimeCompileConfig)


def to_sched_lifetime_config(config: GraphTrainer.Config, **options: Any) -> SchedLifetimeTrainer.Config:
    """`config` (a graph_trainer config) with our pipeline selected and `options`
    (`SchedLifetimeOptions` fields; an unknown name is a TypeError naming it)."""
    if not isinstance(config, GraphTrainer.Config):
        raise TypeError(f"to_sched_lifetime_config needs a graph_trainer config (GraphTrainer.Config), got {type(config).__qualname__}")
    compile_fields = {f.name: getattr(config.compile, f.name) for f in fields(config.compile) if f.init}
    compile_fields.pop("sched_lifetime", None)
    compile_fields["pass_pipeline"] = PIPELINE
    ours = SchedLifetimeCompileConfig(**compile_fields, sched_lifetime=SchedLifetimeOptions(**options))
    rest = {f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name != "compile"}
    return SchedLifetimeTrainer.Config(**rest, compile=ours)


def _options_of(config: Any) -> dict:
    ours = getattr(config.compile, "sched_lifetime", None)
    if ours is None:
        return check_options({})
    if not isinstance(ours, SchedLifetimeOptions):
        raise TypeError(f"compile.sched_lifetime must be SchedLifetimeOptions, got {type(ours).__qualname__}")
    return ours.to_options()


def _ep_degree(config: Any, parallel_dims: Any) -> int:
    if parallel_dims is not None and hasattr(parallel_dims, "ep"):
        return int(parallel_dims.ep)
    return int(getattr(config.parallelism, "expert_parallel_degree", 1))


@register_pass_pipeline(PIPELINE)
def sched_lifetime_passes(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[Callable]:
    """graph_trainer's default pass list (`construct_default_graph_passes`) with
    `sched_lifetime_order_pass` between torchtitan's graph passes and Inductor/cudagraph.
    Options come from `config.compile.sched_lifetime` (defaults when the config has none)."""
    opts = _options_of(config)
    _check_paging(config, opts)
    if config.compile.precompile_artifact_dir:
        raise ValueError(
            "sched_lifetime pass pipeline: --compile.precompile_artifact_dir is not supported (a precompiled "
            "artifact was built with another pipeline's passes); leave it unset"
        )
    want_cudagraph = "cudagraph_pass" not in config.compile.disable_passes
    passes = compile_time_passes(
        traced_result, config, use_cudagraph=want_cudagraph, parallel_dims=parallel_dims, include_inductor=False
    )
    passes.append(functools.partial(sched_lifetime_order_pass, options=opts, ep_degree=_ep_degree(config, parallel_dims)))
    passes.extend(final_inductor_compile_passes(config.compile, use_cudagraph=want_cudagraph))
    if want_cudagraph:
        passes.append(
            functools.partial(
                cudagraph_pass,
                static_input_indices=list(range(traced_result.num_static_inputs)),
                tensor_input_indices=traced_result.tensor_input_indices,
            )
        )
    return passes


def _check_paging(config: Any, opts: dict) -> None:
    """Paging's refusals (at start-up and when the passes are built)."""
    if opts["paging"] and config.compile.inductor_compilation == "full":
        raise ValueError(
            "sched_lifetime pass pipeline: --compile.sched_lifetime.paging needs the step to stay an FX graph "
            "(its page nodes are Python calls): --compile.inductor_compilation full compiles it whole; use 'regional'"
        )
    if opts["paging"] and "cudagraph_pass" not in config.compile.disable_passes:
        raise ValueError(
            "sched_lifetime pass pipeline: --compile.sched_lifetime.paging with torchtitan's cudagraph_pass: a paged "
            "step's release of device storage queries its copy's event, which capture does not allow; "
            "add cudagraph_pass to --compile.disable_passes"
        )


@register_post_init_hook(PIPELINE)
def _check_trainer(trainer: Any) -> None:
    """The pipeline runs only on graph_trainer's aot_fx_trace path: anything else would leave
    it unused without a word, so it is an error here."""
    c = trainer.config.compile
    why = None
    if not c.enable:
        why = "--compile.enable is off"
    elif c.mode != "aot_fx_trace":
        why = f"--compile.mode is {c.mode!r} (the pass pipeline runs in 'aot_fx_trace' mode only)"
    elif not c.enable_passes:
        why = "--compile.enable_passes is off"
    elif trainer.parallel_dims.pp_enabled:
        why = "pipeline parallelism is on (graph_pp builds its own passes)"
    if why is not None:
        raise ValueError(f"--compile.pass_pipeline {PIPELINE}: {why}, so the sched_lifetime pipeline would never run")
    _check_paging(trainer.config, _options_of(trainer.config))  # bad values fail at start-up, not at the first step


def _layer_of(node: fx.Node) -> str:
    fqn = str((node.meta.get("custom") or {}).get("module_fqn", ""))
    m = re.match(r"layers\.(\d+)", fqn)
    return m.group(1) if m else fqn


def _all_to_alls() -> tuple:
    """The all-to-all ops a traced step may hold: the functional one and, from torch 2.15, its
    autograd alias (`_c10d_functional_autograd`, kept as is in AOT graphs)."""
    ops = [torch.ops._c10d_functional.all_to_all_single.default]
    if hasattr(torch.ops, "_c10d_functional_autograd") and hasattr(torch.ops._c10d_functional_autograd, "all_to_all_single"):
        ops.append(torch.ops._c10d_functional_autograd.all_to_all_single.default)
    return tuple(ops)


def _is_all_to_all(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _all_to_alls()


def _annotate_ep(gm: fx.GraphModule, ep_degree: int) -> None:
    """torchtitan's EP annotations as ours (`ep`, `layer`); with EP on, every all-to-all must
    carry one (ValueError naming the first that does not), and there must be one."""
    a2a = [n for n in gm.graph.nodes if _is_all_to_all(n)]
    if ep_degree > 1:
        if not a2a:
            raise ValueError(
                f"sched_lifetime pass: expert parallelism is {ep_degree} but the traced step has no all-to-all "
                "(_c10d_functional.all_to_all_single): the MoE dispatch did not trace to functional collectives"
            )
        bare = [n for n in a2a if not any(k in (n.meta.get("custom") or {}) for k in _TT_EP_KEYS)]
        if bare:
            raise ValueError(
                f"sched_lifetime pass: expert parallelism is {ep_degree} but all-to-all '{bare[0].name}' "
                f"({len(bare)} of {len(a2a)}) carries no EP annotation (node.meta['custom'] has none of "
                f"{list(_TT_EP_KEYS)}): annotate the model's token dispatcher before tracing, as graph_trainer's "
                "parallelize_fn does (common_utils.annotate_moe_ep_regions)"
            )
    for n in a2a:
        custom = n.meta.get("custom")
        phase = (custom or {}).get(_TT_EXCHANGE)
        if phase in ("dispatch", "combine"):
            direction = "bwd" if n.meta.get("autograd_backward", False) else "fwd"
            custom = dict(custom)
            custom.update(ep=phase, layer=f"{_layer_of(n)}.{direction}")
            n.meta["custom"] = custom


def sched_lifetime_order_pass(
    gm: fx.GraphModule, example_inputs: Any, *, options: Optional[dict] = None, ep_degree: int = 1
) -> fx.GraphModule:
    """graph_trainer pass (GraphModule in, GraphModule out): the traced step in Rust's order,
    nodes moved in place. `options`: the compile backend's (`check_options`: an unknown name
    or a bad value is a ValueError listing the valid ones); `ep_degree`: torchtitan's expert
    parallel degree (> 1: every all-to-all must carry torchtitan's EP annotation)."""
    opts = check_options(options)
    if opts["cudagraphs"]:
        raise ValueError(
            "sched_lifetime pass: option 'cudagraphs' is not available in the torchtitan pass pipeline "
            "(torchtitan's cudagraph_pass captures the step)"
        )
    if opts["paging"] and opts["paging_timed"]:
        raise ValueError(
            "sched_lifetime pass: paging in the torchtitan pass pipeline is the static plan (paging_timed=False): "
            "the timed plan calibrates per saved tensor, which needs AOTAutograd's forward/backward split"
        )
    _annotate_ep(gm, ep_degree)
    gm = compile_fx_graph(gm, "step", opts, in_place=True)
    if opts["paging"]:
        from ..compile.joint_paging_pass import page_step

        pager = page_step(gm, opts["paging_budget"], prefetch=opts["paging_prefetch"], min_bytes=opts["paging_min_bytes"])
        gm.sched_lifetime["paging"] = pager
        if opts["explain"]:
            print(tagged("paging: " + (pager.explain() if pager is not None else "nothing to page")))
    return gm


def __getattr__(name: str) -> Callable[[], SchedLifetimeTrainer.Config]:
    """`--config graph_trainer_<model>_<flavor>`: graph_trainer's config function of that name
    with our pipeline selected (torchtitan's ConfigManager looks the name up here)."""
    if not name.startswith("graph_trainer_"):
        raise AttributeError(name)
    for model in _MODELS:
        registry = importlib.import_module(f"torchtitan.experiments.graph_trainer.{model}.config_registry")
        fn = getattr(registry, name, None)
        if callable(fn):

            @functools.wraps(fn)
            def config_fn() -> SchedLifetimeTrainer.Config:
                return to_sched_lifetime_config(fn())

            return config_fn
    raise AttributeError(
        f"module {__name__!r} has no config {name!r}: it offers graph_trainer's graph_trainer_* configs of {list(_MODELS)}"
    )


def __dir__() -> list[str]:
    """The configs this registry offers, and no other lower-case callable: torchtitan's
    ConfigManager lists a module's lower-case callables as "Available config functions" when
    `--config` names none of them."""
    g = globals()
    names = {n for n in g if n.startswith("_") or n[0].isupper() or not callable(g[n])}
    for model in _MODELS:
        registry = importlib.import_module(f"torchtitan.experiments.graph_trainer.{model}.config_registry")
        names.update(n for n in dir(registry) if n.startswith("graph_trainer_") and callable(getattr(registry, n)))
    return sorted(names)
