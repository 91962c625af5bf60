"""torch.distributed.pipelining with our OVERLAP_F_B handler (CPU, 2 gloo ranks, in CI): the
embedded MoE model as stages; losses and every gradient bit-exact against the same schedule
run on the plain stage modules with no handler, over several optimizer steps. `dualpipev_ep2`:
PP=2 x EP=2 over 4 ranks; `dualpipev_link`: PP=2 with EP=4 emulated inside each rank (the host
link of `ep_link`, which one GPU runs); `dualpipev_calibrated`: the stages' order "calibrated"
(step 0 times every node, the orders are searched with those costs from step 1)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from sched_lifetime.calibrate import Calibration
from sched_lifetime.ep import AllToAll, FunctionalAllToAll
from sched_lifetime.models.moe import CONFIGS, MoEModel, MoEStage, stage_io, with_overrides
from sched_lifetime.nodes import NodeDef
from sched_lifetime.pipelining import GraphStage, NodeStage, describe, enable_overlap, overlapped

import _spawned  # noqa: E402

N_MB = 4
STEPS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_self_p2p() -> None:
    """gloo cannot send to its own rank, and with a V mapping a neighbour stage can sit on the
    same rank: drop those warm-up ops (test-only; NCCL does not need it)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    orig = getattr(_PipelineStageBase, "_get_init_p2p_neighbors_ops", None)
    if orig is None:  # torch >= 2.15 has no warm-up exchange
        return

    def ops(self):
        me = dist.get_rank()
        return [op for op in orig(self) if op.peer != me]

    _PipelineStageBase._get_init_p2p_neighbors_ops = ops


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels.reshape(-1))


def _run_arm(kind: str, cfg, stage_ids, n_stages: int, handler: bool, steps: int, pp_group=None, ep_group=None, rank_group=None):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B

    # With EP, the autograd-aware functional all-to-all: the plain reference module must
    # differentiate through dispatch and combine (dist.all_to_all_single does not).
    transport = AllToAll(local=True) if ep_group is None else FunctionalAllToAll(ep_group)
    if kind == "dualpipev_link":  # EP=4 emulated inside each pipeline rank (sched_lifetime.ep_link)
        from sched_lifetime.ep_link import HostLinkAllToAll

        transport = HostLinkAllToAll(4, device="cpu", min_chunk_bytes=0)
    model = MoEModel(cfg, transport=transport, seed=0)
    per = len(model.layers) // n_stages
    mods, stages = [], []
    for k in stage_ids:
        m = MoEStage(model, k * per, (k + 1) * per)
        inp, out = stage_io(cfg, k, n_stages)
        if handler:
            if kind.endswith("_graph"):
                m = GraphStage(m, (inp,))
            elif kind == "dualpipev_calibrated":  # costs measured in step 0, orders searched from step 1
                m = NodeStage(m, order="calibrated", rank_group=rank_group)
                # The default background search, its orders taken at the end of the step after
                # (wait_after=1: then, however long the search takes on a busy CI machine).
                m.chunk.calibration = Calibration(wait_after=1)
            else:
                m = NodeStage(m, dw_nodes=kind != "dualpipev_fused")
        mods.append(m)
        stages.append(PipelineStage(m, k, n_stages, torch.device("cpu"), input_args=inp, output_args=out, group=pp_group))
    if kind.startswith("dualpipev"):
        sched = ScheduleDualPipeV(stages, N_MB, loss_fn=_loss)
    elif kind == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, N_MB, loss_fn=_loss)
    else:
        sched = Schedule1F1B(stages[0], N_MB, loss_fn=_loss)
    registered = enable_overlap(sched) if handler else None
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    losses, grads = [], []
    rank = dist.get_rank()
    ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step + 1000 * ep_rank)  # EP ranks see different tokens
        tok = torch.randint(0, cfg.vocab, (N_MB * cfg.batch, cfg.seq), generator=g)
        lab = torch.randint(0, cfg.vocab, (N_MB * cfg.batch, cfg.seq), generator=g)
        opt.zero_grad(set_to_none=True)
        out: list = []
        has_first = any(s.is_first for s in stages)
        has_last = any(s.is_last for s in stages)
        sched.step(*((tok,) if has_first else ()), **({"target": lab, "losses": out} if has_last else {}))
        losses.append([x.detach().clone() for x in out])
        grads.append([None if p.grad is None else p.grad.clone() for p in params])
        opt.step()
    overlaps = [m.overlapped for m in mods] if handler else []
    deferred = [
        {**m.dw_deferred, "dw_only": sum(1 for n in m.chunk.nodes if n.params and not n.grad_inputs),
         # Calibration steps done: the stage's own, and per other stage's forward paired with its backward.
         "calibrated": [m.chunk.calibration.steps_done] + [c.steps_done for c in m.chunk._pair_calibrations.values()],
         # The step whose costs the running orders come from (None: still the timing-free order).
         "from_step": [m.chunk.calibration.from_step] + [c.from_step for c in m.chunk._pair_calibrations.values()]}
        for m in mods
        if isinstance(m, NodeStage)
    ]
    return losses, grads, registered, (overlaps, deferred), rank


def _worker(rank: int, port: int, out: str, kind: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    world = 4 if kind == "dualpipev_ep2" else 2
    _spawned.start()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.use_deterministic_algorithms(True)
    _no_self_p2p()
    try:
        if kind == "dualpipev_ep2":
            # PP=2 x EP=2: pipeline rank = rank % 2, EP peers share a pipeline rank.
            pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            pp, ep = pp_groups[rank // 2], ep_groups[rank % 2]
            pr = rank % 2
            cfg = with_overrides(CONFIGS["tiny"], layers=4, batch=1)
            ref = _run_arm(kind, cfg, [pr, 3 - pr], 4, False, STEPS, pp, ep)
            ours = _run_arm(kind, cfg, [pr, 3 - pr], 4, True, STEPS, pp, ep)
            torch.save({"ref": ref, "ours": ours}, os.path.join(out, f"rank{rank}.pt"))
            _spawned.leave()
        if kind == "1f1b":
            n_stages, ids = 2, [rank]
        elif kind.startswith("dualpipev"):
            n_stages, ids = 4, [rank, 3 - rank]
        else:
            n_stages, ids = 4, [rank, rank + 2]
        # Compiled graphs need the fixed-capacity dispatch (no host-read split sizes).
        cap = 1.0 if kind.endswith("_graph") else None
        # Calibrated stages agree on their costs with the ranks that run the same stage: here each
        # rank alone (every rank calls new_group for every group).
        singles = [dist.new_group([r]) for r in range(world)] if kind == "dualpipev_calibrated" else None
        cfg = with_overrides(CONFIGS["tiny"], layers=n_stages, batch=1, capacity_factor=cap)
        if kind == "dualpipev_odd":
            # A made-up shape: dense first stages, no shared expert, 6 experts top-3, odd sizes,
            # capacity 0.75 (tokens dropped).
            cfg = with_overrides(cfg, vocab=97, hidden=48, heads=3, dense_layers=2, experts=6, topk=3,
                                 expert_ffn=40, shared_ffn=0, dense_ffn=72, seq=12, batch=2, capacity_factor=0.75)
        ref = _run_arm(kind, cfg, ids, n_stages, False, STEPS)
        ours = _run_arm(kind, cfg, ids, n_stages, True, STEPS, rank_group=singles[rank] if singles else None)
        torch.save({"ref": ref, "ours": ours}, os.path.join(out, f"rank{rank}.pt"))
        _spawned.leave()
    finally:  # a rank that raised: its traceback goes to the test
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kind", ["dualpipev", "dualpipev_fused", "dualpipev_odd", "dualpipev_graph", "dualpipev_ep2", "dualpipev_link", "dualpipev_calibrated", "interleaved", "1f1b"]
)
def test_pipeline_schedules_bit_exact_with_the_handler(tmp_path, kind):
    world = 4 if kind == "dualpipev_ep2" else 2
    mp.spawn(_worker, args=(_port(), str(tmp_path), kind), nprocs=world, join=True)
    loss_ranks = []
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        (rl, rg, _, _, _), (ol, og, registered, (overlaps, deferred), _) = got["ref"], got["ours"]
        assert len(rl) == STEPS and len(og) == STEPS
        for a, b in zip(rl, ol):
            assert len(a) == len(b)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank}: losses differ"
        for step, (a, b) in enumerate(zip(rg, og)):
            assert any(x is not None for x in a), "no gradient at all: the test would prove nothing"
            for i, (x, y) in enumerate(zip(a, b)):
                assert (x is None) == (y is None), f"rank {rank} step {step} param {i}: grad presence differs"
                assert x is None or torch.equal(x, y), f"rank {rank} step {step} param {i}: gradients differ"
        if kind.startswith("dualpipev"):
            assert registered is True
            # Overlap really happened on both stages of the rank (a forward ran inside a backward).
            assert all(n > 0 for n in overlaps), overlaps
            # A full backward (OVERLAP_F_B) ran its dW nodes inside the multiplexed pair; only
            # BACKWARD_INPUT deferred dW to BACKWARD_WEIGHT (none with fused dW nodes).
            if not kind.endswith("_graph"):
                assert all(d["full"] == 0 for d in deferred), deferred
                # Fused: only nodes whose whole backward is dW (no input takes a gradient,
                # e.g. the embedding) still have a dW node to defer.
                fused = kind == "dualpipev_fused"
                assert all((d["input"] == 0) == (fused and not d["dw_only"]) for d in deferred), deferred
            if kind == "dualpipev_calibrated":
                # Each stage calibrated once (step 0) for its own runs and for the other stage's
                # forward paired with its backward (OVERLAP_F_B), then kept its orders.
                assert all(d["calibrated"][0] == 1 and len(d["calibrated"]) >= 2 and set(d["calibrated"]) == {1} for d in deferred), deferred
                # The search ran beside step 1 and its orders took over at that step's end.
                assert all(set(d["from_step"]) == {0} for d in deferred), deferred
        else:
            assert registered is False  # no OVERLAP_F_B in these schedules: the handler stays out
            assert overlaps == [0] * len(overlaps)
        if rl[0]:
            loss_ranks.append(rank)
            assert len(rl[0]) == N_MB
    assert len(loss_ranks) == world // 2  # the last stage's rank (per EP rank) has every loss


def _two_stage_chunks(capacity=None):
    cfg = with_overrides(CONFIGS["tiny"], layers=2, batch=1, capacity_factor=capacity)
    model = MoEModel(cfg, transport=AllToAll(local=True), seed=0)
    return cfg, MoEStage(model, 0, 1), MoEStage(model, 1, 2)


@pytest.mark.parametrize("kind", ["node", "graph"])
def test_overlapped_forward_backward_matches_forward_then_backward(kind):
    """DualPipe's hook, one process: F of stage 0 (microbatch 1) with B of stage 1
    (microbatch 0) gives the same outputs, loss and gradients as running them one after the
    other on the plain modules; for NodeStage and for GraphStage."""
    torch.use_deterministic_algorithms(True)
    results = []
    for wrap in (False, True):
        cfg, s0, s1 = _two_stage_chunks(1.0 if kind == "graph" else None)
        if wrap and kind == "graph":
            m0, m1 = GraphStage(s0, (stage_io(cfg, 0, 2)[0],)), GraphStage(s1, (stage_io(cfg, 1, 2)[0],))
        else:
            m0, m1 = (NodeStage(s0), NodeStage(s1)) if wrap else (s0, s1)
        g = torch.Generator().manual_seed(3)
        tok = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g) for _ in range(2)]
        lab = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g) for _ in range(2)]
        h = m0(tok[0]).detach().requires_grad_(True)
        loss1 = _loss(m1(h), lab[0])
        if wrap:
            outs, loss0 = type(m0).overlapped_forward_backward(m0, [tok[1]], None, None, m1, loss1, None, None)
            assert m0.overlapped == 1
        else:
            loss1.backward()
            outs, loss0 = [m0(tok[1])], None
        assert loss0 is None
        grads = [p.grad.clone() for p in list(m1.parameters()) if p.grad is not None]
        results.append((outs[0].detach(), h.grad.clone(), grads))
    (o_a, h_a, g_a), (o_b, h_b, g_b) = results
    assert torch.equal(o_a, o_b) and torch.equal(h_a, h_b)
    assert len(g_a) == len(g_b) > 0 and all(torch.equal(x, y) for x, y in zip(g_a, g_b))


def test_overlapped_with_a_plain_backward_stage_runs_the_forward_alone():
    """When the backward reaches no NodeStage, nothing is lost: the forward runs afterwards."""
    cfg, s0, s1 = _two_stage_chunks()
    m0 = NodeStage(s0)
    tok = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long)
    h = torch.randn(cfg.batch * cfg.seq, cfg.hidden, requires_grad=True)
    loss = _loss(s1(h), torch.zeros(cfg.batch, cfg.seq, dtype=torch.long))
    out = overlapped(m0, (tok,), loss.backward)
    assert m0.overlapped == 0 and out.shape == (cfg.batch * cfg.seq, cfg.hidden)
    assert torch.equal(out, s0(tok))


def test_describe_and_non_reentrant_checkpoint_compose():
    """`describe` turns plain layers into nodes; a layer under non-reentrant activation
    checkpointing gives the same gradients through a NodeStage."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    def build(ckpt: bool):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)]
        if ckpt:
            layers[2] = Ckpt(layers[2])
        return torch.nn.Sequential(*layers)

    x = torch.randn(4, 8)
    ref = build(False)
    ref(x).square().sum().backward()
    seq = build(True)
    stage = NodeStage(seq, nodes=describe(list(seq)))
    assert [n.name for n in stage.chunk.nodes] == ["L0", "L1", "L2"]
    xi = x.clone().requires_grad_(True)
    stage(xi).square().sum().backward()
    for (n, a), b in zip(ref.named_parameters(), seq.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_describe_puts_a_layer_that_works_in_place_into_the_node_before_it():
    """`nn.ReLU(inplace=True)` and other `inplace=True` layers: a node of their own would modify
    a leaf of the node's autograd graph (an error); `describe` runs them in the node before,
    or on a copy of the input when they come first; gradients bit-exact with the plain model.
    A hand-made node that does so gets the error with a note saying why and what to do."""

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True), torch.nn.Dropout(0.0, inplace=True), torch.nn.Linear(16, 8)
        )

    x = torch.randn(4, 8)
    ref, seq = build(), build()
    xr = x.clone().requires_grad_(True)
    ref(xr * 1).square().sum().backward()  # (a leaf itself cannot go through an in-place ReLU)
    stage = NodeStage(seq, nodes=describe(list(seq)))
    assert [n.name for n in stage.chunk.nodes] == ["L0", "L1", "L4"]
    xi = x.clone().requires_grad_(True)
    stage(xi).square().sum().backward()
    assert torch.equal(xr.grad, xi.grad)
    for (n, a), b in zip(ref.named_parameters(), seq.parameters()):
        assert torch.equal(a.grad, b.grad), n
    relu = torch.nn.ReLU(inplace=True)
    own = NodeStage(relu, nodes=[NodeDef("r", "compute", ["x"], ["out"], relu, (), ["x"], ["out"])])
    with pytest.raises(RuntimeError, match="in-place operation") as info:
        own(x.clone().requires_grad_(True))
    assert any("may not modify an input in place" in note for note in getattr(info.value, "__notes__", [])), info.value


def test_refusals_name_what_is_wrong():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), checkpoint_wrapper(torch.nn.Linear(4, 4), checkpoint_impl=CheckpointImpl.REENTRANT))
    with pytest.raises(ValueError, match="layer '1'.*reentrant"):
        NodeStage(seq, nodes=describe(list(seq)))
    with pytest.raises(ValueError, match="no nodes"):
        NodeStage(torch.nn.Linear(2, 2))
    stage = NodeStage(torch.nn.Linear(2, 2), nodes=[NodeDef("l", "compute", ["x"], ["out"], torch.nn.Linear(2, 2), (), ["x"], ["out"])])
    with pytest.raises(ValueError, match="takes 1 inputs"):
        stage(torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="NodeStage: order must be one of"):
        NodeStage(torch.nn.Linear(2, 2), nodes=stage.chunk.nodes, order="fastest")


def test_describe_takes_a_first_layer_that_reads_token_ids():
    """A first stage starting with an Embedding: its input is token ids, which take no gradient
    (it raised "only Tensors of floating point dtype can require gradients": a new user's
    trial). Bit-exact against the plain modules, dI/dW split and fused."""
    import copy

    for dw_nodes in (True, False):
        torch.manual_seed(0)
        emb, lin = torch.nn.Embedding(11, 16), torch.nn.Linear(16, 16)
        ref = copy.deepcopy(torch.nn.Sequential(emb, lin))
        stage = NodeStage(torch.nn.Sequential(emb, lin), nodes=describe([emb, lin]), dw_nodes=dw_nodes)
        ids = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(1))
        stage(ids).square().sum().backward()
        ref(ids).square().sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip([emb.weight, lin.weight, lin.bias], ref.parameters())), dw_nodes


def test_enable_overlap_refuses_what_is_not_a_schedule_and_a_rank_of_two_stage_kinds():
    from types import SimpleNamespace

    with pytest.raises(TypeError, match="enable_overlap takes a torch.distributed.pipelining schedule .*got NodeStage"):
        enable_overlap(NodeStage(torch.nn.Linear(2, 2), nodes=describe([torch.nn.Linear(2, 2)])))
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    node = NodeStage(torch.nn.Linear(2, 2), nodes=describe([torch.nn.Linear(2, 2)]))
    graph = GraphStage(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    action = SimpleNamespace(computation_type=OVERLAP_F_B)
    sched = SimpleNamespace(
        _stages=[SimpleNamespace(submod=node, stage_index=0, _sl_split_wrapped=True), SimpleNamespace(submod=graph, stage_index=1)],
        pipeline_order={0: [action]}, register_custom_function=lambda *a: None,
    )
    with pytest.raises(ValueError, match=r"the stages of this rank are of two kinds \(\['GraphStage', 'NodeStage'\]\)"):
        enable_overlap(sched)


def test_describe_takes_an_moe_layers_own_nodes():
    """A layer that says where its dispatch and combine are (`sched_nodes`) is described by
    its own nodes; a middle stage built with `describe` matches the plain stage."""
    torch.use_deterministic_algorithms(True)
    cfg = with_overrides(CONFIGS["tiny"], layers=4, batch=1)
    model = MoEModel(cfg, transport=AllToAll(local=True), seed=0)
    stage = MoEStage(model, 1, 3)  # a middle stage: no embedding, no head
    nodes = describe(list(stage.layers))
    kinds = {n.name: n.kind for n in nodes}
    assert kinds["L0.dispatch"] == kinds["L1.combine"] == "comm" and kinds["L0.experts"] == "compute"
    ns = NodeStage(stage, nodes=nodes)
    h = torch.randn(cfg.batch * cfg.seq, cfg.hidden, generator=torch.Generator().manual_seed(0))
    a, b = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    ya, yb = stage(a), ns(b)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    pa = [p.grad.clone() for p in stage.parameters()]
    for p in stage.parameters():
        p.grad = None
    yb.square().sum().backward()
    assert torch.equal(a.grad, b.grad) and all(torch.equal(x, p.grad) for x, p in zip(pa, stage.parameters()))


def test_graph_stage_refuses_another_shape_and_leaves_the_random_state_alone():
    """A GraphStage's graphs are captured for the example's shapes: a call with another shape is
    an error (it ran silently and could compute wrong values: a mean written with x.shape[0]);
    building one (the capture runs the model once) leaves the random generators as they were, so
    dropout draws the masks the same code draws without us."""
    import copy

    from sched_lifetime.pipelining import GraphStage

    class Center(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(self.lin(x - x.sum(0) / x.shape[0]))

    torch.manual_seed(0)
    mod = Center()
    before = torch.get_rng_state()
    stage = GraphStage(copy.deepcopy(mod), (torch.zeros(2, 32),))
    assert torch.equal(before, torch.get_rng_state())
    with pytest.raises(ValueError, match=r"input 0 is shape \[4, 32\] torch.float32, the graphs were captured for shape \[2, 32\]"):
        stage(torch.randn(4, 32, requires_grad=True))
    x = torch.randn(2, 32)
    torch.manual_seed(1)
    ref = mod(x)
    torch.manual_seed(1)
    assert torch.equal(stage(x.clone().requires_grad_(True)), ref)


def test_node_stage_output_must_be_a_value_no_node_of_the_stage_reads():
    from sched_lifetime.pipelining import NodeStage, describe

    layers = [torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)]
    with pytest.raises(ValueError, match=r"output 'h1' is read by node 'L1' of the stage: the stage returns a value no node of it reads \(\['out'\]\)"):
        NodeStage(torch.nn.Sequential(*layers), nodes=describe(layers), output="h1")
