"""torchtitan's graph_trainer with our pass pipeline (sched_lifetime.integrations.torchtitan):
torchtitan's own compile path (`--compile.pass_pipeline default`) against ours on its
DeepSeek-V3 and Qwen3 MoE debug models, 2 gloo ranks, EP=2, 2 training steps: losses and every
gradient bit-exact, and our pass really reordered the step; the config recipe of
docs/torchtitan.md; the misconfigurations. Skips without torchtitan (0.3.0 runs on torch 2.15
here: docs/torchtitan.md#which-torch).

The models are the debug flavours cut to 2 layers (one dense, one MoE), SDPA attention, seq 32:
both models, both pipelines, 2 steps take about a minute on 2 cores (tracing dominates).
torchtitan picks its device type from the machine (`cuda` even on a CPU-only one); the worker
points it at `cpu`, as a CPU run needs."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
from typing import Optional

import pytest

# ImportError too: torchtitan 0.3.0 installed beside torch 2.11 fails to import (docs/torchtitan.md#which-torch).
pytest.importorskip("torchtitan.experiments.graph_trainer.trainer", reason="needs torchtitan >= 0.3.0 (and the torch it runs on)", exc_type=ImportError)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.fx as fx  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _spawned  # noqa: E402

STEPS = 2
MODELS = ("deepseek_v3", "qwen3")
BATCH, SEQ = 2, 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(model: str, pipeline: str, world: int, options: Optional[dict] = None):
    """A graph_trainer config, its model (2 layers, EP=2, SDPA) parallelized over the gloo
    ranks, and a minimal GraphTrainer around it (what torchtitan's own tests build)."""
    import importlib

    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.utils import get_spmd_context
    from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

    from sched_lifetime.integrations import torchtitan as sltt

    flavor = {"deepseek_v3": "debugmodel", "qwen3": "debugmodel_moe"}[model]
    registry = importlib.import_module(f"torchtitan.experiments.graph_trainer.{model}.config_registry")
    config = getattr(registry, f"graph_trainer_{model}_{flavor}")()
    if pipeline == sltt.PIPELINE:
        config = sltt.to_sched_lifetime_config(config, **(options or {}))
    assert config.compile.pass_pipeline == pipeline
    spec_fn = importlib.import_module(f"torchtitan.experiments.graph_trainer.{model}").model_registry
    spec = spec_fn(flavor, attn_backend="sdpa")
    config.model_spec = spec
    mc = spec.model
    layers = mc.layers
    keep = [i for i, l in enumerate(layers) if getattr(l, "moe", None) is None][:1]
    keep += [i for i, l in enumerate(layers) if getattr(l, "moe", None) is not None][:1]
    mc.layers = [layers[i] for i in sorted(keep)]
    config.parallelism.expert_parallel_degree = 2
    config.training.local_batch_size = BATCH
    config.training.seq_len = SEQ
    config.compile.disable_passes = ["cudagraph_pass"]  # CPU
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    pd = ParallelDims.from_config(config.parallelism, world)
    pd.build_mesh()
    mc.update_from_config(config=config)
    torch.manual_seed(0)
    with torch.device("meta"):
        m = mc.build()
    m = spec.parallelize_fn(
        m, parallel_dims=pd, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder="",
    )
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        m.init_weights(buffer_device=None)
    m.train()
    t = object.__new__(GraphTrainer)
    t.config, t.model_parts, t.parallel_dims, t.model_config = config, [m], pd, mc
    t.device, t.train_context, t.tokenizer, t.ntokens_seen, t._traced_step = torch.device("cpu"), get_spmd_context(), None, 0, None
    t.loss_fn = config.loss.build(compile_config=config.compile)
    if hasattr(t.loss_fn, "set_lm_head"):
        t.loss_fn.set_lm_head(m.lm_head)
        m._skip_lm_head = True
    return t, m, mc.vocab_size


def _run(model: str, pipeline: str, rank: int, world: int, options: Optional[dict] = None) -> tuple[list, dict, object]:
    t, m, vocab = _build(model, pipeline, world, options)
    g = torch.Generator().manual_seed(1 + rank)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    losses, grads = [], {}
    for _ in range(STEPS):
        inp = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        lab = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        pos = torch.arange(SEQ).repeat(BATCH, 1)
        opt.zero_grad()
        loss = t.forward_backward_step(
            input_dict={"input": inp, "positions": pos}, labels=lab, global_valid_tokens=torch.tensor(float(BATCH * SEQ))
        )
        losses.append(loss.detach().clone())
        for n, p in m.named_parameters():
            if p.grad is not None:
                grads.setdefault(n, []).append((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone())
        opt.step()
    return losses, grads, t._traced_step.gm


def _compare(model: str, rank: int) -> dict:
    """torchtitan's own pipeline, then ours, from the same weights and tokens: what to assert."""
    import sched_lifetime.compile as slc

    ref_losses, ref_grads, ref_gm = _run(model, "default", rank, 2)
    n_hist = len(slc.history)
    losses, grads, gm = _run(model, "sched_lifetime", rank, 2)
    ours = [h for h in slc.history[n_hist:] if h["phase"] == "step"]
    res: dict = {"our_graphs": len(ours)}
    res["losses"] = [[float(x) for x in ref_losses], [float(x) for x in losses]]
    res["losses_equal"] = all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    res["grad_names"] = sorted(ref_grads) == sorted(grads) and len(grads) > 0
    res["grads_unequal"] = [n for n in ref_grads if not all(torch.equal(a, b) for a, b in zip(ref_grads[n], grads.get(n, [])))]
    if ours:
        ir = ours[0]["ir"]
        calls = [n.name for n in gm.graph.nodes if n.op == "call_function"]
        res["launches"] = sum(1 for n in ir["nodes"] if n["kind"] == "comm_launch")
        res["ep_marked"] = sum(1 for n in gm.graph.nodes if (n.meta.get("custom") or {}).get("ep") in ("dispatch", "combine"))
        res["reordered"] = calls != [n.name for n in ref_gm.graph.nodes if n.op == "call_function"]
        res["same_nodes"] = sorted(n.name for n in gm.graph.nodes) == sorted(n.name for n in ref_gm.graph.nodes)
        res["order_is_schedule"] = calls == [x for x in ours[0]["order"] if x in set(calls)]
    return res


def _worker(rank: int, port: int, out: str) -> None:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch_ops"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _spawned.start()
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    import torchtitan.distributed.parallel_dims as pdm

    pdm.device_type = "cpu"  # torchtitan's default is "cuda" when no accelerator is found
    res: dict = {}
    try:
        for model in MODELS:
            res[model] = _compare(model, rank)
    except Exception:
        import traceback

        res["error"] = traceback.format_exc()
        raise
    finally:
        with open(f"{out}.{rank}", "w") as f:  # written on failure too: the test prints it
            json.dump(res, f)
        if "error" not in res:
            _spawned.leave()
        dist.destroy_process_group()


def test_ours_matches_torchtitans_own_passes_bit_exact_on_deepseek_v3_and_qwen3_2_ranks_ep2(tmp_path):
    out = str(tmp_path / "res")
    got = []
    try:
        mp.spawn(_worker, args=(_port(), out), nprocs=2, join=True)
    finally:
        for rank in range(2):
            if os.path.exists(f"{out}.{rank}"):
                with open(f"{out}.{rank}") as f:
                    got.append(json.load(f))
        for r in got:
            print(r.get("error", ""))
    assert len(got) == 2
    for rank, res in enumerate(got):
        assert "error" not in res, res["error"]
        for model in MODELS:
            r = res[model]
            assert r["our_graphs"] == 1, (model, r)  # our pass ran once: one traced step
            assert r["launches"] >= 4, (model, r)  # the EP all-to-alls (forward and backward) reached the scheduler
            assert r["ep_marked"] >= 4, (model, r)  # torchtitan's EP annotations became ours
            assert r["same_nodes"] and r["reordered"] and r["order_is_schedule"], (model, r)
            assert r["losses_equal"], (model, rank, r["losses"], r["grads_unequal"])
            assert r["grad_names"] and r["grads_unequal"] == [], (model, rank, r["grads_unequal"])


PAGING = {"paging": True, "paging_budget": 1.0, "paging_min_bytes": 1024}


def _paging_worker(rank: int, port: int, out: str) -> None:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch_ops"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _spawned.start()
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    import torchtitan.distributed.parallel_dims as pdm

    pdm.device_type = "cpu"
    res: dict = {}
    try:
        ref_losses, ref_grads, _ = _run("deepseek_v3", "default", rank, 2)
        losses, grads, gm = _run("deepseek_v3", "sched_lifetime", rank, 2, PAGING)
        pager = gm.sched_lifetime["paging"]
        res = {
            "losses_equal": all(torch.equal(a, b) for a, b in zip(ref_losses, losses)),
            "grads_unequal": [n for n in ref_grads if not all(torch.equal(a, b) for a, b in zip(ref_grads[n], grads.get(n, [])))],
            "grad_names": sorted(ref_grads) == sorted(grads) and len(grads) > 0,
            "paged": len(pager.chosen) if pager is not None else 0,
            "stats": pager.stats if pager is not None else {},
            "page_nodes": sum(1 for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "_page_out"),
            "slots": [len(pager.runs), any(r.open for r in pager.runs), len(pager._held)] if pager is not None else None,
        }
    except Exception:
        import traceback

        res["error"] = traceback.format_exc()
        raise
    finally:
        with open(f"{out}.{rank}", "w") as f:
            json.dump(res, f)
        if "error" not in res:
            _spawned.leave()
        dist.destroy_process_group()


def test_our_paging_in_the_pass_pipeline_is_bit_exact_and_moves_what_it_planned(tmp_path):
    """`--compile.sched_lifetime.paging` on DeepSeek-V3 (2 gloo ranks, EP=2, 2 steps): the
    traced step with page nodes gives torchtitan's own losses and gradients bit for bit, and
    every byte paged out came back (CPU: host copies, numerics only)."""
    out = str(tmp_path / "res")
    mp.spawn(_paging_worker, args=(_port(), out), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            r = json.load(f)
        assert "error" not in r, r["error"]
        assert r["losses_equal"] and r["grad_names"] and r["grads_unequal"] == [], (rank, r)
        assert r["paged"] >= 4 and r["page_nodes"] == r["paged"], (rank, r)
        assert r["slots"] == [1, False, 0], (rank, r)  # one run slot, reused, closed, nothing held after the steps
        st = r["stats"]
        assert st["bytes_out"] == st["bytes_in"] > 0 and st["copies_out"] == st["copies_in"] == STEPS * r["paged"], (rank, st)


def _a2a_graph(annotated: bool, op: object = None) -> fx.GraphModule:
    """A step graph with a dispatch and a combine all-to-all (torchtitan's EP shape), built by
    hand; `annotated`: with torchtitan's EP annotations, as graph_trainer's tracer leaves them;
    `op`: the all-to-all op (default the functional one)."""
    op = op or torch.ops._c10d_functional.all_to_all_single.default
    g = fx.Graph()
    x = g.placeholder("x")
    h = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    for phase in ("dispatch", "combine"):
        a = g.call_function(op, (h, [2, 2], [2, 2], "0"))
        if annotated:
            a.meta["custom"] = {"EP_token_exchange": phase, "module_fqn": "layers.3.moe"}
        w = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (a,))
        h = g.call_function(torch.ops.aten.relu.default, (w,))
    g.output((h,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_an_option_the_pass_does_not_know_is_an_error_naming_it_and_the_valid_ones():
    from sched_lifetime.integrations.torchtitan import sched_lifetime_order_pass

    with pytest.raises(ValueError, match=r"unknown option 'overlpa'; valid options: \["):
        sched_lifetime_order_pass(_a2a_graph(True), [], options={"overlpa": True})
    with pytest.raises(ValueError, match=r"option 'ep_budget' must be an int in 1..=1024"):
        sched_lifetime_order_pass(_a2a_graph(True), [], options={"ep_budget": 0})
    with pytest.raises(ValueError, match=r"paging in the torchtitan pass pipeline is the static plan \(paging_timed=False\)"):
        sched_lifetime_order_pass(_a2a_graph(True), [], options={"paging": True})
    with pytest.raises(ValueError, match=r"option 'cudagraphs' is not available in the torchtitan pass pipeline"):
        sched_lifetime_order_pass(_a2a_graph(True), [], options={"cudagraphs": True})


def test_an_unknown_option_on_torchtitans_command_line_is_tyros_error_naming_it(capsys):
    from torchtitan.config import ConfigManager

    with pytest.raises(SystemExit):
        ConfigManager().parse_args(
            ["--module", "sched_lifetime.integrations.torchtitan", "--config", "graph_trainer_deepseek_v3_debugmodel",
             "--compile.sched_lifetime.ep_bugdet", "2"]
        )
    assert "ep_bugdet" in capsys.readouterr().err


def test_ep_without_annotated_collectives_is_an_error_naming_the_all_to_all():
    from sched_lifetime.integrations.torchtitan import sched_lifetime_order_pass

    with pytest.raises(ValueError, match=r"all-to-all 'all_to_all_single_default' \(2 of 2\) carries no EP annotation"):
        sched_lifetime_order_pass(_a2a_graph(False), [], ep_degree=2)
    with pytest.raises(ValueError, match=r"expert parallelism is 2 but the traced step has no all-to-all"):
        g = fx.Graph()
        x = g.placeholder("x")
        g.output((g.call_function(torch.ops.aten.relu.default, (x,)),))
        sched_lifetime_order_pass(fx.GraphModule(torch.nn.Module(), g), [], ep_degree=2)
    # annotated: accepted, our annotation added; without EP an unannotated collective is fine
    gm = sched_lifetime_order_pass(_a2a_graph(True), [], ep_degree=2)
    marked = [(n.meta["custom"]["ep"], n.meta["custom"]["layer"]) for n in gm.graph.nodes if "ep" in (n.meta.get("custom") or {})]
    assert marked == [("dispatch", "3.fwd"), ("combine", "3.fwd")]
    # a dispatch without its combine: our region check, on torchtitan's annotations
    gm = _a2a_graph(True)
    next(n for n in gm.graph.nodes if n.name == "all_to_all_single_default_1").meta["custom"] = {"EP": "combine"}
    with pytest.raises(ValueError, match=r"'all_to_all_single_default' opens an EP dispatch region \(layer '3.fwd'\) with no combine"):
        sched_lifetime_order_pass(gm, [], ep_degree=2)
    sched_lifetime_order_pass(_a2a_graph(False), [], ep_degree=1)


def test_the_autograd_alias_of_the_all_to_all_is_an_ep_collective_too():
    """torch 2.15 keeps `_c10d_functional_autograd.all_to_all_single` as is in AOT graphs: its
    all-to-alls are found (annotations become ours; unannotated ones are the same error)."""
    if not hasattr(torch.ops._c10d_functional_autograd, "all_to_all_single"):
        pytest.skip("this torch has no _c10d_functional_autograd.all_to_all_single")
    from sched_lifetime.integrations.torchtitan import sched_lifetime_order_pass

    op = torch.ops._c10d_functional_autograd.all_to_all_single.default
    gm = sched_lifetime_order_pass(_a2a_graph(True, op), [], ep_degree=2)
    marked = [(n.meta["custom"]["ep"], n.meta["custom"]["layer"]) for n in gm.graph.nodes if "ep" in (n.meta.get("custom") or {})]
    assert marked == [("dispatch", "3.fwd"), ("combine", "3.fwd")]
    with pytest.raises(ValueError, match=r"carries no EP annotation"):
        sched_lifetime_order_pass(_a2a_graph(False, op), [], ep_degree=2)


def _recipe_args() -> list:
    """The arguments after `-m torchtitan.train` of docs/torchtitan.md's first shell block."""
    import shlex

    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "torchtitan.md")).read()
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    return words[words.index("torchtitan.train") + 1 :]


def test_the_documented_recipe_parses_as_written_and_selects_our_pipeline():
    """docs/torchtitan.md's command line, word for word, through torchtitan's own parser."""
    from torchtitan.config import ConfigManager

    from sched_lifetime.integrations import torchtitan as sltt

    args = _recipe_args()
    assert "--parallelism.expert_parallel_degree" in args, args
    c = ConfigManager().parse_args(args)
    assert isinstance(c, sltt.SchedLifetimeTrainer.Config) and c.compile.pass_pipeline == "sched_lifetime"
    assert c.parallelism.expert_parallel_degree == 8


def test_bad_option_values_fail_at_parse_naming_the_flag(capsys):
    """A bad value of ours is tyro's error when the command line is parsed (not at start-up,
    after the model is built), naming our flag; paging_budget is a fraction here."""
    from torchtitan.config import ConfigManager

    from sched_lifetime.integrations.torchtitan import SchedLifetimeOptions

    base = ["--module", "sched_lifetime.integrations.torchtitan", "--config", "graph_trainer_qwen3_debugmodel_moe"]
    for flag, value, says in (
        ("ep_budget", "0", "--compile.sched_lifetime.ep_budget must be an int in 1..=1024"),
        ("paging_budget", "2.0", "--compile.sched_lifetime.paging_budget must be a fraction in [0, 1], got 2.0"),
        ("paging_min_bytes", "-1", "--compile.sched_lifetime.paging_min_bytes must be an int >= 0"),
        ("memory_slack", "-1", "--compile.sched_lifetime.memory_slack must be a finite number >= 0 (a fraction of the peak), got"),
    ):
        with pytest.raises(SystemExit):
            ConfigManager().parse_args([*base, f"--compile.sched_lifetime.{flag}", value])
        err = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().err).split())
        assert says in err and "or bytes" not in err, (flag, err)
    c = ConfigManager().parse_args([*base, "--compile.sched_lifetime.memory_slack", "0.5"])
    assert c.compile.sched_lifetime.to_options()["memory_slack"] == 0.5
    assert SchedLifetimeOptions().to_options()["memory_slack"] == 0.02  # the backend's guard, on by default
    assert SchedLifetimeOptions(paging_budget=1).paging_budget == 1.0  # all of it, not 1 byte


def test_a_config_name_that_does_not_exist_lists_only_the_configs(capsys):
    from torchtitan.config import ConfigManager

    with pytest.raises(ValueError, match="Available config functions") as e:
        ConfigManager().parse_args(["--module", "sched_lifetime.integrations.torchtitan", "--config", "graph_trainer_nope"])
    listed = re.search(r"Available config functions: \[(.*)\]", str(e.value)).group(1)
    names = [n.strip(" '") for n in listed.split(",")]
    assert "graph_trainer_deepseek_v3_debugmodel" in names and all(n.startswith("graph_trainer_") for n in names), names


def test_the_documented_options_select_our_pipeline():
    from torchtitan.config import ConfigManager
    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    from sched_lifetime.integrations import torchtitan as sltt

    c = ConfigManager().parse_args(
        ["--module", "sched_lifetime.integrations.torchtitan", "--config", "graph_trainer_qwen3_debugmodel_moe",
         "--compile.sched_lifetime.ep_budget", "2"]
    )
    assert isinstance(c, sltt.SchedLifetimeTrainer.Config)
    assert c.compile.pass_pipeline == "sched_lifetime" and c.compile.mode == "aot_fx_trace"
    assert c.compile.sched_lifetime.ep_budget == 2 and c.compile.sched_lifetime.overlap
    assert PASS_PIPELINE_REGISTRY["sched_lifetime"] is sltt.sched_lifetime_passes
    assert not c.compile.sched_lifetime.paging
    # Paging: one flag; the pipeline's options are the static plan. With torchtitan's
    # cudagraph_pass (on by default) or full Inductor, the pipeline refuses it.
    c = ConfigManager().parse_args(
        ["--module", "sched_lifetime.integrations.torchtitan", "--config", "graph_trainer_qwen3_debugmodel_moe",
         "--compile.sched_lifetime.paging", "--compile.sched_lifetime.paging_budget", "0.25"]
    )
    opts = c.compile.sched_lifetime.to_options()
    assert opts["paging"] and not opts["paging_timed"] and opts["paging_budget"] == 0.25
    with pytest.raises(ValueError, match="paging with torchtitan's cudagraph_pass"):
        sltt.sched_lifetime_passes(None, c)
    with pytest.raises(AttributeError, match="offers graph_trainer's graph_trainer_\\* configs"):
        sltt.graph_trainer_no_such_model


def test_a_trainer_that_would_never_run_the_pipeline_is_refused_at_start_up():
    from types import SimpleNamespace

    from sched_lifetime.integrations.torchtitan import SchedLifetimeCompileConfig, _check_trainer

    def trainer(**compile_kw):
        return SimpleNamespace(
            config=SimpleNamespace(compile=SchedLifetimeCompileConfig(enable=True, **compile_kw)),
            parallel_dims=SimpleNamespace(pp_enabled=False),
        )

    _check_trainer(trainer())
    with pytest.raises(ValueError, match=r"--compile.mode is 'jit' \(the pass pipeline runs in 'aot_fx_trace' mode only\)"):
        _check_trainer(trainer(mode="jit"))
    with pytest.raises(ValueError, match="--compile.enable_passes is off"):
        _check_trainer(trainer(enable_passes=False))
