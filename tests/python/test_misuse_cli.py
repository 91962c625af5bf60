"""The command line's checks (issue 30): every option is checked before any rank is spawned,
with the usage and a message naming the option and what it takes; and the main job says what
it is doing from its first second."""

import pytest
import torch

from sched_lifetime.__main__ import main as cli_main
from sched_lifetime.train import cli


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if a rank would start."""
    import torch.multiprocessing as mp

    def refuse(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(mp, "spawn", refuse)
    monkeypatch.setattr(cli, "worker", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "huge"], "--config 'huge' is not a config; valid: tiny, tiny_dense, h200"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
        (["--world", "0"], "--world must be at least 1, got 0"),
        (["--layers", "-1"], "--layers must be at least 0, got -1"),
        (["--lr", "0"], "--lr must be > 0 and finite, got 0.0"),
        (["--lr", "inf"], "--lr must be > 0 and finite, got inf"),
        (["--arms", ","], "--arms names no arm (got ',')"),
        (["--world", "3"], "--world 3: config 'tiny''s 4 experts do not shard over 3 EP ranks; use one of [1, 2, 4]"),
        (["--out", "/dev/null/x"], "--out '/dev/null/x': cannot make that directory"),
        (["--page-budget", "1.5"], "--page-budget is a fraction of the saved activations, in [0, 1]; got 1.5"),
        (["--page-prefetch", "-2"], "--page-prefetch must be at least 0, got -2"),
        (["--costs", "/nonexistent/durations.json"], "--costs '/nonexistent/durations.json': no such file"),
        (["--page-nodes", "L1.experts,L9.experts"], "--page-nodes 'L1.experts,L9.experts': ['L9.experts'] are not compute nodes of config 'tiny' with a backward; valid: embed,L0.attn,L0.shared,L0.experts,L0.post,L1.attn,L1.shared,L1.experts,L1.post,head"),
        (["--page-nodes", "L1.experts,"], "--page-nodes 'L1.experts,': [''] are not compute nodes"),
        (["--layers", "3", "--page-nodes", "L3.attn"], "['L3.attn'] are not compute nodes of config 'tiny' with a backward; valid: embed,L0.attn,L0.shared,L0.experts,L0.post,L1.attn,L1.shared,L1.experts,L1.post,L2.attn"),
        (["--config", "tiny_dense", "--page-nodes", "L0.experts"], "['L0.experts'] are not compute nodes of config 'tiny_dense' with a backward; valid: embed,L0.attn,L0.mlp,L1.attn"),
    ],
)
def test_train_options_are_checked_before_any_rank_starts(argv, message, no_spawn, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: sched_lifetime train" in err and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
@pytest.mark.parametrize("cmd", ["ab", "demo"])
def test_ab_on_cuda_without_a_gpu_says_so(cmd, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main([cmd, "--device", "cuda", "--n", "1", "--mib", "1", "--steps", "1"])
    assert info.value.code == 2
    assert "--device cuda: no CUDA GPU is available here (torch.cuda.is_available() is False); use --device cpu" in capsys.readouterr().err


@pytest.mark.parametrize("device, message", [("gpu", "--device 'gpu' is not a device; use cuda, cuda:N or cpu"), ("meta", "--device 'meta': the A/B runs on cuda or cpu")])
def test_ab_device_must_be_one_it_runs_on(device, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["ab", "--device", device])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_train_says_what_it_does_from_the_start(capsys):
    """One rank, one arm, one step: a progress line (seconds since the start) before each long
    phase: the ranks up, the arms built, each warm-up step, the timed steps; then the table."""
    assert cli.main(["--cpu", "--world", "1", "--layers", "1", "--steps", "1", "--microbatches", "2", "--arms", "sequential"]) == 0
    out = capsys.readouterr().out.splitlines()
    import re

    phases = ["running on one process", "building 1 arms on config tiny", "warm-up step (not timed): sequential", "timed steps: 1 round(s)"]
    where = [next(i for i, line in enumerate(out) if re.match(r"\[ *\d+\.\d s\] " + re.escape(p), line)) for p in phases]
    assert where == sorted(where) and where[0] == 0, out
    assert any(line.startswith("step 1 sequential") for line in out) and any("MEASURED" in line for line in out), out


def test_train_says_it_is_starting_the_ranks_before_spawning_them(monkeypatch, capsys):
    import torch.multiprocessing as mp

    seen = []
    monkeypatch.setattr(mp, "spawn", lambda *a, **k: seen.append(capsys.readouterr().out))
    assert cli.main(["--cpu", "--world", "2"]) == 0
    assert len(seen) == 1 and "] starting 2 gloo ranks" in seen[0], seen


def test_train_costs_must_be_a_json_object_of_node_costs(tmp_path, no_spawn, capsys):
    for text, message in (
        ("not json", "not a JSON file of node costs"),
        ("[1, 2]", "expected a JSON object"),
        ('{"F.L0.attn": -5}', "a node's cost is microseconds, finite and >= 0; 1 are not, e.g. ['F.L0.attn']"),
        ('{"F.L0.attn": NaN}', "finite and >= 0"),
        ('{"F.L0.atn": 10.0}', "1 name(s) are not nodes of config 'tiny''s step graph, e.g. ['F.L0.atn']"),  # before any rank starts
        ("{}", "names no node (an empty object)"),
    ):
        path = tmp_path / "costs.json"
        path.write_text(text)
        with pytest.raises(SystemExit) as info:
            cli.main(["--cpu", "--costs", str(path)])
        assert info.value.code == 2 and message in capsys.readouterr().err
    # A file that times only some nodes passes (the ranks would start), saying what rule search takes as free.
    path.write_text('{"F.L0.attn": 10.0}')
    with pytest.raises(AssertionError, match="a rank was started"):
        cli.main(["--cpu", "--costs", str(path)])
    assert "has no cost for " in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "scenario:nope"], "error: unknown scenario 'nope'"),
    (["simulate-schedule", "scenario:moe_chunk:x:y"], "error: 'moe_chunk:x:y': expected moe_chunk:LAYERS:RATIO"),
])
def test_simulate_with_a_bad_scenario_says_so_without_a_traceback(argv, message, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_output_file_in_a_missing_folder_is_refused_before_the_run(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["ab", "--device", "cpu", "--json", "/nonexistent-folder/ab.json"])
    assert info.value.code == 2 and "its folder '/nonexistent-folder' does not exist" in capsys.readouterr().err


def test_train_costs_that_name_no_node_of_the_step_graph_are_refused(tmp_path):
    """A costs file from another config, or with a typo, would leave those nodes at cost 0 for
    rule search: each rank refuses it before any step (the graph's names need the model, so the
    check runs where the arms are built), naming the names; a run's own names pass, a second
    microbatch's (`F2.`) as the first's."""
    import argparse
    import json

    from sched_lifetime.ep import AllToAll
    from sched_lifetime.models import CONFIGS
    from sched_lifetime.train.loop import build_arms

    path = tmp_path / "costs.json"
    args = argparse.Namespace(arms="ours+search", lr=1e-3, costs=str(path), config="tiny", page_nodes="", page_budget=0.2, page_prefetch=0, page_release=0, progress=False)
    path.write_text(json.dumps({"F.L0.attn": 5.0, "F.L0.atn": 5.0}))
    with pytest.raises(SystemExit, match=r"1 name\(s\) are not nodes of config 'tiny''s step graph, e\.g\. \['F\.L0\.atn'\]"):
        build_arms(args, CONFIGS["tiny"], AllToAll(), torch.device("cpu"), True)
    path.write_text(json.dumps({"F.L0.attn": 5.0, "F2.L0.attn": 4.0, "B.L0.attn.dw": 3.0}))
    arm = build_arms(args, CONFIGS["tiny"], AllToAll(), torch.device("cpu"), True)["ours+search"]
    assert arm.chunk.costs["F.L0.attn"] == 5.0 and arm.chunk.costs["B.L0.attn.dw"] == 3.0
