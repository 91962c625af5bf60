"""The embedded MoE model trained with EP over 2 gloo processes (CPU, in CI): every arm
bit-exact against sequential F then B over several optimizer steps, the main job's loop end to
end (`sched_lifetime.train.loop` through its command line), and a rank-identical check that
fails on every rank, naming the rank, instead of hanging."""

import json
import os
import socket
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _spawned


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch_ops"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _spawned.start()
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _parity_worker(rank: int, port: int, out: str, config: str, capacity: float) -> None:
    _init(rank, port)
    from sched_lifetime import ep
    from sched_lifetime.models import CONFIGS
    from sched_lifetime.train.arms import ARMS, Arm, same_grads
    from sched_lifetime.train.loop import _parity
    from sched_lifetime.train.reference import Reference, all_ranks, compare

    base = CONFIGS[config] if config in CONFIGS else replace(
        # A made-up shape: odd sizes, 6 experts top-3 (3 per rank), no shared expert, 2 dense layers.
        CONFIGS["tiny"], vocab=97, hidden=48, heads=3, layers=4, dense_layers=2, experts=6, topk=3,
        expert_ffn=40, shared_ffn=0, dense_ffn=72, seq=12, batch=3,
    )
    cfg = replace(base, capacity_factor=capacity or None)
    t = ep.AllToAll(ep.new_ep_group())
    # ours+ends: the warm-up and cool-down multiplexed too (two forwards, two backwards);
    # ours+reduce_after: the data-parallel all-reduce after the step instead of in it.
    # ours+page (fixed capacity only: counted dispatch changes the saved shapes): page nodes
    # with their release points among the EP collectives, calibrated on both ranks together.
    extra = ["ours+ends", "ours+reduce_after"] + (["ours+page"] if capacity else [])
    arms = {a: Arm(a, cfg, t, torch.device("cpu"), lr=0.05) for a in [*ARMS, *extra]}
    if capacity:
        plan = arms["ours+page"].chunk.enable_paging(arms["ours+page"].model.batch(0, 0), budget=0.5, min_bytes=1024)
        assert plan["page"] and arms["ours+page"].chunk._release_at, plan
    ref = arms["sequential"]
    # The independent reference: plain autograd over the same steps (no node API).
    plain = Reference(cfg, t.group, torch.device("cpu"), lr=0.05)
    grads = {a: True for a in arms}
    vs_plain = {}
    for step in range(3):
        for arm in arms.values():
            arm.step(step, 3)
        plain.step(step, 3)
        for a, arm in arms.items():  # every gradient, after every step
            grads[a] = grads[a] and same_grads(arm, ref)
            v = plain.check_grads(arm.model)
            vs_plain[a] = v if a not in vs_plain else vs_plain[a].merge(v)
    res = {}
    for a, arm in arms.items():
        v = vs_plain[a].merge(plain.check_end(arm.model, arm.losses))
        res[a] = {
            "losses": all(torch.equal(x, y) for x, y in zip(arm.losses, ref.losses)),
            "grads": grads[a],
            "weights": all(torch.equal(p, q) for p, q in zip(arm.model.parameters(), ref.model.parameters())),
            # Against plain autograd: bit-exact expected here (2 ranks, float32, CPU).
            "plain": [plain.exact, v.exact, v.within, v.where],
            "n_grads": sum(p.grad is not None for p in arm.model.parameters()),
            "loss_moved": bool((arm.losses[0] != arm.losses[-1]).any()),
            # All-reduce buckets launched over the 3 steps (None: reduced after the step by Arm).
            "buckets": None if arm.chunk.grad_reduce is None else arm.chunk.grad_reduce.buckets,
            "paged": dict(arm.chunk.page_stats),
        }
    # Bad input: a parameter of no node, or one listed twice, is a clear error.
    chunk = arms["ours"].chunk
    errs = []
    for bad in ([torch.nn.Parameter(torch.zeros(1))], [chunk.nodes[1].params[0]] * 2):
        try:
            chunk.enable_grad_reduce(bad)
        except ValueError as e:
            errs.append(str(e))
    res["errors"] = errs
    res["controls"] = _negative_controls(rank, arms, ref, plain, _parity, same_grads, compare, all_ranks)
    # The experts are sharded: this rank's slice differs from the other's.
    res["expert_shard"] = arms["ours"].model.expert_parameters()[0].flatten()[:4].tolist()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    _spawned.leave()


def _negative_controls(rank, arms, ref, plain, _parity, same_grads, compare, all_ranks) -> dict:
    """The parity checks fail when one number of one arm on one rank is off: one gradient
    element of `ours` one ulp up, one weight element of `b_then_f` one ulp up, one loss of
    `ours+record` one ulp up, each on one rank only (both ranks must report it)."""
    out = {}
    inf = torch.tensor(float("inf"))
    bump = lambda t: t.view(-1)[:1].copy_(torch.nextafter(t.view(-1)[:1], inf))  # noqa: E731
    grads_ok = {a: same_grads(arm, ref) for a, arm in arms.items()}
    out["clean"] = _parity(arms, ref, grads_ok, torch.device("cpu"))
    g = next(p.grad for p in arms["ours"].model.dense_parameters() if p.grad is not None)
    w = next(arms["b_then_f"].model.parameters())
    if rank == 1:
        bump(g)
        with torch.no_grad():
            bump(w)
    if rank == 0:
        bump(arms["ours+record"].losses[-1])
    grads_ok = {a: same_grads(arm, ref) for a, arm in arms.items()}
    out["same_grads"] = grads_ok
    out["parity"] = _parity(arms, ref, grads_ok, torch.device("cpu"))
    mine = {a: plain.check_grads(arm.model).merge(plain.check_end(arm.model, arm.losses)) for a, arm in arms.items()}
    every = all_ranks(mine, ref.model.transport.group)
    out["plain"] = {a: [v.exact, v.within] for a, v in every.items()}
    # The tolerance path (other dtypes, more ranks): one ulp passes, a thousandth of the
    # tensor's magnitude does not.
    want = {"g": torch.linspace(-1, 1, 64)}
    near = {"g": want["g"].clone()}
    bump(near["g"])
    far = {"g": want["g"].clone()}
    far["g"][5] += 1e-3
    out["tolerance"] = [bool(compare(near, want, exact=False)), compare(near, want, exact=True).within, bool(compare(far, want, exact=False))]
    return out


@pytest.mark.parametrize("config,capacity", [("tiny", 0.0), ("tiny_dense", 1.0), ("odd", 0.75)])
def test_every_arm_bit_exact_against_sequential_over_two_gloo_ranks(tmp_path, config, capacity):
    out = str(tmp_path / "res")
    mp.spawn(_parity_worker, args=(_port(), out, config, capacity), nprocs=2, join=True)
    shards = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            res = json.load(f)
        shards.append(res.pop("expert_shard"))
        errs = res.pop("errors")
        ctl = res.pop("controls")
        # Before the perturbation every arm passes; after it, exactly the perturbed arms fail,
        # on both ranks (the grad on rank 1, the weight on rank 1, the loss on rank 0).
        assert all(ctl["clean"].values()), ctl
        assert ctl["same_grads"]["ours"] == (rank == 0) and ctl["same_grads"]["b_then_f"], ctl
        bad = {"ours", "b_then_f", "ours+record"}
        assert {a for a, ok in ctl["parity"].items() if not ok} == bad, ctl
        assert {a for a, (exact, within) in ctl["plain"].items() if not within} == bad, ctl
        assert all(exact for a, (exact, _) in ctl["plain"].items() if a not in bad), ctl
        assert ctl["tolerance"] == [True, False, False], ctl
        assert len(errs) == 2 and "belong to no node" in errs[0] and "listed twice" in errs[1], errs
        for arm, r in res.items():
            assert r["losses"] and r["grads"] and r["weights"], (rank, arm, r)
            assert r["plain"][:3] == [True, True, True], (rank, arm, r["plain"])  # bit-exact against plain autograd
            assert r["n_grads"] > 10 and r["loss_moved"], (rank, arm, r)
        # Baselines reduce once per step, ours once per node with weights in the last backward
        # (so they start under the rest of it), ours+reduce_after after the step.
        assert res["sequential"]["buckets"] == res["b_then_f"]["buckets"] == 3, res
        assert res["ours"]["buckets"] >= 3 * 4 and res["ours+ends"]["buckets"] == res["ours"]["buckets"], res
        assert res["ours+reduce_after"]["buckets"] is None, res
        if capacity:
            moved = res["ours+page"]["paged"]
            assert moved["bytes_out"] == moved["bytes_in"] > 0, moved
    assert shards[0] != shards[1]


def _digest_worker(rank: int, port: int, out: str) -> None:
    _init(rank, port)
    from sched_lifetime import ep
    from sched_lifetime.models import CONFIGS, MoEModel

    cfg = CONFIGS["tiny"] if rank == 0 else replace(CONFIGS["tiny"], layers=3)
    t = ep.AllToAll(ep.new_ep_group())
    chunk = MoEModel(cfg, t).chunk()
    start = time.monotonic()
    try:
        ep.check_rank_identical("schedule", ep.digest(chunk.order_schedule(True, True, "ours"), cfg.as_dict()), t.group)
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"msg": msg, "seconds": time.monotonic() - start}, f)
    _spawned.leave()


def test_a_digest_mismatch_raises_on_both_ranks_naming_the_rank(tmp_path):
    out = str(tmp_path / "dig")
    mp.spawn(_digest_worker, args=(_port(), out), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            r = json.load(f)
        assert "ranks [1] disagree with rank 0" in r["msg"], r
        assert r["seconds"] < 10, r


def test_main_job_loop_over_two_gloo_ranks_prints_the_table_and_writes_its_files(tmp_path, capfd):
    """`python -m sched_lifetime train` in small: both ranks run every arm (warm-up, timed
    steps, parity over the ranks, node times, the simulated memory on CPU); rank 0 prints the
    table and writes train.json, durations.json and the simulated memory plot."""
    from sched_lifetime.train.cli import main

    out = tmp_path / "out"
    arms = "sequential,ours,ours+ends,calibrated"
    assert main(["--cpu", "--steps", "1", "--microbatches", "2", "--arms", arms, "--quiet", "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "MEASURED (CPU, EP=2, config tiny, 2 microbatches, 1 timed steps)" in printed, printed
    assert "SIMULATED (Rust model, not measured)" in printed, printed
    with open(out / "train.json") as f:
        res = json.load(f)
    assert res["world"] == 2 and list(res["rows"]) == arms.split(","), res
    assert all(r["parity"] for r in res["rows"].values()), res["rows"]
    # Against plain autograd (the reference sharing no step code): bit-exact on CPU.
    assert all(r["ref"] == "exact" and r["ref_within"] and r["ref_worst"] == 0 for r in res["rows"].values()), res["rows"]
    for i, a in enumerate(arms.split(",")):  # the first arm is the others' parity base
        assert any(line.split()[:3] == [a, "base" if i == 0 else "equal", "exact"] for line in printed.splitlines()), (a, printed)
    # The calibrated arm: step 0 (the warm-up) timed, its costs agreed over both ranks, the
    # order re-planned from the next step on; the table says so.
    cal = res["rows"]["calibrated"]["calibration"]
    assert cal["from_step"] == 0 and cal["steps_done"] == 1 and cal["nodes"] > 0, cal
    assert "calibrated: calibrated order from step 0's costs" in printed, printed
    text = (out / "calibrated_calibrated.txt").read_text()
    assert text.startswith("calibrated order from step 0's costs") and " us) [F] ran under: " in text, text
    assert json.load(open(out / "calibrated_calibrated.json"))["costs_us"].keys() >= {"F.L0.attn", "B.L0.attn"}
    with open(out / "durations.json") as f:
        durations = json.load(f)
    assert durations and all(v >= 0 for v in durations.values()), durations
    assert (out / "memory_over_time_simulated.png").stat().st_size > 1000


def test_main_job_on_the_emulated_link_runs_one_process_and_every_arm_is_equal(tmp_path, capfd, monkeypatch):
    """`train --ep-link host:4 --cpu`: one process (nothing spawned), no process group, the
    table's header says the link is emulated, and every arm (page nodes included) is bit-exact
    against sequential after 2 steps."""
    import torch.multiprocessing

    from sched_lifetime.train.cli import main

    def no_spawn(*a, **k):
        raise AssertionError("the emulated link runs one process")

    monkeypatch.setattr(torch.multiprocessing, "spawn", no_spawn)
    out = tmp_path / "out"
    arms = "sequential,ours,ours+page"
    assert main(["--cpu", "--ep-link", "host:4", "--steps", "2", "--microbatches", "2", "--arms", arms, "--quiet", "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert "MEASURED (CPU, emulated link: EP=4 over host memory (CPU: numerics only), full duplex" in printed, printed
    assert "EMULATED EP on CPU" in printed, printed
    assert not dist.is_initialized()
    with open(out / "train.json") as f:
        res = json.load(f)
    assert (res["world"], res["ep_link"]) == (1, "host:4") and res["link"].startswith("emulated link: EP=4"), res
    assert list(res["rows"]) == arms.split(",") and all(r["parity"] for r in res["rows"].values()), res["rows"]
    for i, a in enumerate(arms.split(",")):
        assert any(line.split()[:2] == [a, "base" if i == 0 else "equal"] for line in printed.splitlines()), (a, printed)


def test_ep_link_option_defaults_by_machine_and_bad_settings_name_it(monkeypatch):
    """`--ep-link`: host (EP=8 emulated) on a machine with exactly one GPU, nccl with 2+ GPUs,
    on CPU, or under torchrun; a link that cannot run is a SystemExit naming it."""
    from sched_lifetime.train.cli import parser, resolve_ep_link

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    a = parser().parse_args(["--config", "h200"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_ep_link(a, use_cuda=True) == "host"
    assert resolve_ep_link(a, use_cuda=False) == "nccl"
    monkeypatch.setenv("RANK", "0")
    assert resolve_ep_link(a, use_cuda=True) == "nccl"  # under torchrun: the real group
    monkeypatch.delenv("RANK")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_ep_link(a, use_cuda=True) == "nccl"
    for spec in ("nccl", "host:4", "host"):
        assert resolve_ep_link(parser().parse_args(["--config", "h200", "--ep-link", spec]), use_cuda=False) == spec
    bad = [
        (["--config", "tiny", "--ep-link", "host"], r"--ep-link host: .*k=8 does not divide the model's 4 experts"),
        (["--config", "tiny", "--ep-link", "host:1"], r"--ep-link host:1: .*k=1 "),
        (["--ep-link", "ring:4"], r"unknown kind 'ring'"),
        (["--ep-link", "host:x"], r"K='x' is not an integer"),
    ]
    for argv, msg in bad:
        with pytest.raises(SystemExit, match=msg):
            resolve_ep_link(parser().parse_args(argv), use_cuda=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"one process.*WORLD_SIZE=2"):
        resolve_ep_link(parser().parse_args(["--config", "tiny", "--ep-link", "host:2"]), use_cuda=False)
