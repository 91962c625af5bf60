"""The graph of a chunk (`nodes/graph.py`): the forward/backward tables, the checks on a
chunk's description, order settings, and the graph of two microbatches of one phase."""

from dataclasses import replace

import pytest
import torch

import sched_lifetime.nodes as nodes_pkg
from sched_lifetime.models import CONFIGS, MoEModel
from sched_lifetime.nodes import Chunk, NodeDef, _two_graph, two_schedule


def test_every_name_of_the_single_nodes_module_is_still_importable():
    # What `sched_lifetime/nodes.py` defined before it became a package (tests, benches, the
    # pipelining hooks and train.py import these from `sched_lifetime.nodes`).
    old = [
        "NodeDef", "MicrobatchState", "GradReduce", "Chunk", "run_pair", "two_schedule", "run_two", "accumulate_grads",
        "combined_step", "train_step", "_Ctx", "_grad_name", "_pair_graph", "_order_schedule", "_executor",
        "_feed_forward", "_feed_backward", "_compute_stream", "_loss_grad", "_renamed", "_twin", "_two_graph", "_WeightSplit",
    ]
    missing = [x for x in old if not hasattr(nodes_pkg, x)]
    assert not missing, missing
    assert Chunk.ORDERS == ("calibrated", "ours", "b_then_f", "sequential")


def test_dw_nodes_are_wgrad_and_read_what_di_reads():
    ch = MoEModel(CONFIGS["tiny"]).chunk()
    b = {n["name"]: n for n in ch.graph(False, True)["nodes"]}
    assert b["B.L0.experts.dw"]["wgrad"] and b["B.L0.experts.dw"]["inputs"] == b["B.L0.experts"]["inputs"]
    assert b["B.L0.dispatch"]["kind"] == "comm_launch" and b["B.L0.dispatch"]["outputs"][0]["alloc"] == "consumer"
    assert "B.embed" not in b and b["B.embed.dw"]["wgrad"]  # tokens take no gradient


def test_fused_dw_nodes_leave_only_dw_without_di():
    ch = MoEModel(CONFIGS["tiny"]).chunk(dw_nodes=False)
    b = {n["name"] for n in ch.graph(False, True)["nodes"]}
    assert "B.L0.experts" in b and "B.L0.experts.dw" not in b
    assert not any(n.endswith(".dw") for n in b if n != "B.embed.dw")
    assert "B.embed.dw" in b  # tokens take no gradient: the embedding's whole backward is dW


def test_chunk_rejects_bad_descriptions_naming_the_node():
    f = lambda x: x  # noqa: E731
    with pytest.raises(ValueError, match="node 'b' reads 'y' before any node produces it"):
        Chunk([NodeDef("a", "compute", ["x"], ["z"], f), NodeDef("b", "compute", ["y"], ["w"], f)], ["x"], "w", torch.device("cpu"))
    with pytest.raises(ValueError, match="comm node 'c' needs a transpose"):
        Chunk([NodeDef("c", "comm", ["x"], ["y"], f)], ["x"], "y", torch.device("cpu"))
    with pytest.raises(ValueError, match="node 'a': grad input 'q' is not an input"):
        Chunk([NodeDef("a", "compute", ["x"], ["y"], f, grad_inputs=["q"])], ["x"], "y", torch.device("cpu"))


def test_order_settings_reach_the_scheduler_and_bad_ones_are_named():
    from sched_lifetime.nodes import _order_schedule

    g = MoEModel(CONFIGS["tiny"]).chunk().graph(True, True)
    assert _order_schedule(g, "ours:ep_budget=1")["budgets"]["ep"] == 1
    assert _order_schedule(g, "ours:classic,ep_budget=3,page_budget=1")["budgets"] == {"ep": 3, "page": 1}
    with pytest.raises(ValueError, match="ep_budget must be a positive integer, got 'x'"):
        _order_schedule(g, "ours:ep_budget=x")
    with pytest.raises(ValueError, match="unknown setting 'speed'"):
        _order_schedule(g, "ours:speed=2")
    with pytest.raises(ValueError, match="1..=1024"):
        _order_schedule(g, "ours:ep_budget=0")


def test_paired_ends_hide_each_transfer_under_the_other_microbatch_and_keep_the_accumulation_order():
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    ch = MoEModel(cfg, seed=0, device="cpu").chunk(torch.device("cpu"))
    for phase in ("F", "B"):
        s = two_schedule(ch, phase)
        graph = _two_graph(ch, phase)
        kinds = {n["name"]: (n["kind"], n["source"]) for n in graph["nodes"]}
        assert {src for _, src in kinds.values()} == {phase, phase + "2"}
        waits = {n["launch"]: n["name"] for n in graph["nodes"] if n["kind"] == "comm_wait"}
        order = s["order"]
        pos = {x: i for i, x in enumerate(order)}
        under = [any(kinds[x][0] == "compute" and kinds[x][1] != kinds[l][1] for x in order[pos[l] : pos[w]]) for l, w in waits.items()]
        assert len(under) == 8 and all(under), (phase, under)  # 2 MoE layers x 2 transfers x 2 microbatches
        if phase == "B":
            # Every node with weights: the second microbatch's gradient accumulation after the first's.
            acc = [n for n in ch.nodes if n.params]
            for n in acc:
                first = f"B.{n.name}.dw" if f"B.{n.name}.dw" in kinds else f"B.{n.name}"
                assert [first, "B2" + first[1:]] in graph["control"], first
                assert pos[first] < pos["B2" + first[1:]]
