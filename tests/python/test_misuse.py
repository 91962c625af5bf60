"""What a user's mistakes meet (issue 30), on CPU, one process: no silent wrong result, no silent
no-op, and an error that keeps its meaning. Each test fails when its guard is removed. The
cross-rank cases (two gloo ranks) are in test_misuse_dist.py, the command line's in
test_misuse_cli.py."""

import traceback
import warnings

import pytest
import torch

import sched_lifetime as sl
from test_schedule import moe_layer
from test_executor import callables, inputs, weights


# -- errors keep their meaning -----------------------------------------------------------


class _TwoArgError(Exception):
    """A user exception whose constructor does not take one message (rebuilding it as
    `type(e)(msg)` is a TypeError)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code


def test_a_node_exception_keeps_its_type_object_and_traceback_with_the_node_named():
    graph, w = moe_layer(), weights()
    f = callables(w)
    raised = []

    def bad(d):
        e = _TwoArgError(7, "user detail")
        raised.append(e)
        raise e

    f["F.mlp"] = bad
    ex = sl.Executor(graph, sl.schedule(graph), f)
    with pytest.raises(_TwoArgError) as info:
        ex.run(inputs())
    e = info.value
    assert e is raised[0] and e.code == 7 and e.args == (7, "user detail")
    assert any("in node 'F.mlp' (compute)" in n for n in getattr(e, "__notes__", []))
    # The traceback still reaches the frame that raised (not a rebuilt exception's).
    frames = [fr.name for fr in traceback.extract_tb(e.__traceback__)]
    assert frames[-1] == "bad", frames
    assert "in node 'F.mlp'" in "".join(traceback.format_exception(e))


def test_a_chunk_whose_loss_output_no_node_writes_is_refused_naming_it():
    from sched_lifetime.nodes import Chunk, NodeDef

    node = NodeDef("a", "compute", ["x"], ["y"], lambda x: x * 2, grad_inputs=["x"], grad_outputs=["y"])
    with pytest.raises(ValueError, match=r"loss output 'loss' is written by no node \(their outputs: \['y'\]\)"):
        Chunk([node], ["x"], "loss", torch.device("cpu"))
    with pytest.raises(ValueError, match="loss output 'x' is written by no node"):  # an input is not an output
        Chunk([node], ["x"], "x", torch.device("cpu"))
    Chunk([node], ["x"], "y", torch.device("cpu"))  # the right name is accepted


def test_a_node_stage_whose_nodes_never_write_its_output_is_refused_naming_it():
    from sched_lifetime.pipelining import NodeStage, describe

    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    nodes = describe(list(layers), output="y")  # the stage's default output is "out"
    with pytest.raises(ValueError, match=r"NodeStage: output 'out' is written by no node of Sequential \(their outputs: \['h1', 'y'\]\); pass output="):
        NodeStage(layers, nodes=nodes)
    stage = NodeStage(layers, nodes=nodes, output="y")
    x = torch.randn(2, 4)
    assert torch.equal(stage(x), layers(x))


# -- silent wrong gradients ----------------------------------------------------------------


def _sigmoid_loss(x, w, inplace, held):
    y = torch.sigmoid(x @ w)  # sigmoid saves its output
    if inplace:
        y.mul_(2)  # what eager autograd refuses at the backward
    held.append(y)
    return y.sum() if inplace else (2 * y).sum()


@pytest.mark.filterwarnings("ignore:Pager. nothing to page")  # the kept case pages nothing on purpose
@pytest.mark.parametrize("paged", [False, True], ids=["kept", "paged"])
def test_pager_keeps_autograds_inplace_check(paged):
    """saved_tensors_hooks turn autograd's version check off: without the Pager's own, the
    backward reads the changed tensor, every step, with no error."""
    torch.manual_seed(0)
    x, w = torch.randn(32, 64), torch.randn(64, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _sigmoid_loss(x, w, True, []).backward()  # eager
    pager = sl.Pager(budget=1.0, min_bytes=0 if paged else 1 << 30, timed=False, min_distance=0)
    # The calibration step keeps every saved tensor: checked too.
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: saved tensor #\d+ of this step \(\(32, 64\) torch.float32\) is at version 1; expected version 0"):
        with pager.step():
            _sigmoid_loss(x, w, True, []).backward()
    with pager.step():  # calibrates
        _sigmoid_loss(x, w, False, []).backward()
    assert pager.plan["page"] == (["#0", "#1"] if paged else []), pager.explain()  # #1: the sigmoid's output
    for _ in range(2):  # every later step, while the caller still holds the tensor
        held = []
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            with pager.step():
                _sigmoid_loss(x, w, True, held).backward()
    w.grad = None
    with pager.step():  # and the Pager still works
        _sigmoid_loss(x, w, False, []).backward()
    want = w.grad.clone()
    w.grad = None
    _sigmoid_loss(x, w, False, []).backward()
    assert torch.equal(want, w.grad)


def test_pager_refuses_a_paged_tensor_changed_then_dropped_as_eager_does():
    """A paged tensor changed in place and dropped before the backward: the check used to look at
    the tensor through a weak reference, gone by then, and the backward read the saved value
    without a word; it now keeps the tensor's version counter (not its storage:
    `SavedVersion`) and raises as eager autograd does (which holds the tensor itself)."""
    torch.manual_seed(0)
    x, w = torch.randn(32, 64), torch.randn(64, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _sigmoid_loss(x, w, True, []).backward()  # eager, y dropped as below
    pager = sl.Pager(budget=1.0, min_bytes=0, timed=False, min_distance=0)
    with pager.step():
        _sigmoid_loss(x, w, False, []).backward()
    assert pager.plan["page"] == ["#0", "#1"], pager.explain()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: saved tensor #\d+ of this step \(\(32, 64\) torch.float32\) is at version 1"):
        with pager.step():
            _sigmoid_loss(x, w, True, []).backward()  # y dropped before the backward
    w.grad = None
    with pager.step():  # and the Pager still works
        _sigmoid_loss(x, w, False, []).backward()


def _inplace_chunk(inplace):
    from sched_lifetime.nodes import Chunk, NodeDef

    torch.manual_seed(0)
    W, V = torch.nn.Parameter(torch.randn(64, 8)), torch.nn.Parameter(torch.randn(8, 8))

    def a(x):
        y = torch.sigmoid(x @ W)  # saves x (8 KiB) and its output y (1 KiB)
        if inplace:
            y.mul_(2)
        return y if inplace else 2 * y

    def b(y):
        return (y @ V).sum()

    nodes = [
        NodeDef("a", "compute", ["x"], ["y"], a, params=[W], grad_outputs=["y"]),
        NodeDef("b", "compute", ["y"], ["loss"], b, params=[V], grad_inputs=["y"], grad_outputs=["loss"]),
    ]
    return Chunk(nodes, ["x"], "loss", torch.device("cpu")), W


@pytest.mark.parametrize("min_bytes", [0, 4096], ids=["paged", "kept"])
def test_paged_nodes_keep_autograds_inplace_check(min_bytes):
    """A paged node's forward runs under saved_tensors_hooks (autograd's check off): an in-place
    change of what it saved raises as it does for an unpaged node."""
    from sched_lifetime.nodes import train_step

    x = {"x": torch.randn(32, 64)}
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train_step(_inplace_chunk(True)[0], [x])  # unpaged: autograd's own check
    chunk, _ = _inplace_chunk(True)
    plan = chunk.enable_paging(x, nodes=["a"], min_bytes=min_bytes)
    assert plan["page"] == ["a"]
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor node 'a' saved \(\(32, 8\) torch.float32\) is at version 1; expected version 0"):
        train_step(chunk, [x])
    ok, W = _inplace_chunk(False)
    ok.enable_paging(x, nodes=["a"], min_bytes=min_bytes)
    train_step(ok, [x])  # no false alarm
    assert W.grad is not None and ok.page_stats["bytes_out"] == ok.page_stats["bytes_in"] > 0


def test_empty_storage_is_refused_for_a_tensor_autograd_saved_and_changes_nothing():
    """Emptying a tensor the backward reads is a crash or garbage gradients with no error (the
    backward reads freed memory); a tensor in an autograd graph that something else references
    is refused, naming the fix, before any state changes. One nothing saved still empties."""
    cpu = sl.current_stream(torch.device("cpu"))
    w = torch.randn(1000, requires_grad=True)
    m = sl.LifetimeManager("refuse")
    out = torch.sigmoid(w)  # saved by sigmoid as its output (another tensor on its storage)
    h = w * 2
    prod = h * h  # saved by mul as its input (the same tensor, one more reference)
    m.bind([out, h], cpu)
    before = m.stats()
    for call in (
        lambda: m.retire(out, cpu, "empty_storage"),
        lambda: m.retire([h], cpu),  # the default action empties
        lambda: m.retire(x for x in [h]),  # any iterable
        lambda: m.release_after([h], cpu, cpu),
        lambda: sl.LifetimeManager("other").retire(h, cpu, owner_stream=cpu),  # bound in the call
    ):
        with pytest.raises(RuntimeError, match="requires grad and something else holds its data.*action='drop_reference'"):
            call()
        assert m.stats() == before
    m.retire([out, h], cpu, "drop_reference")  # the fix: the memory goes when autograd lets go
    assert m.finalize()["retired_drop_reference"] == 2
    (out.sum() + prod.sum()).backward()
    assert torch.allclose(w.grad, out * (1 - out) + 8 * w)
    # Consumed by an op that saves nothing (a scalar mul): no false alarm, the storage goes.
    g = w * 3
    keep = g * 2.0
    m2 = sl.LifetimeManager("fine")
    m2.bind(g, cpu)
    m2.retire(g, cpu, "empty_storage")
    m2.finalize()
    assert g.untyped_storage().nbytes() == 0 and keep.requires_grad
    # A binding counts as a holder: bound by bind() and again by owner_stream= is said so.
    k = w * 5
    m2 = sl.LifetimeManager("twice bound")
    m2.bind(k, cpu)
    with pytest.raises(RuntimeError, match=r"or bind\(\) bound it already and this call binds it again: bind it once"):
        m2.retire(k, cpu, owner_stream=cpu)
    m2.retire(k, cpu)  # bound once: fine
    m2.finalize()


def test_a_second_retire_is_the_counted_fallback_for_drop_reference_and_an_error_for_empty_storage():
    """What the README says a second retire does: the binding is gone after the first, so a
    second `drop_reference`/`preserve` retire is the unknown-owner fallback (rule 4), counted;
    a second `empty_storage` finds the storage emptied and raises."""
    cpu = sl.current_stream(torch.device("cpu"))
    for action in ("drop_reference", "preserve"):
        m = sl.LifetimeManager(action)
        x = torch.ones(8)
        m.bind(x, cpu)
        m.retire(x, cpu, action)
        assert m.stats()["fallback_record_stream"] == 0
        m.retire(x, cpu, action)  # no error
        assert m.finalize()["fallback_record_stream"] == 1
    m = sl.LifetimeManager("twice")
    x = torch.ones(8)
    m.bind(x, cpu)
    m.retire(x, cpu, "empty_storage")
    with pytest.raises(RuntimeError, match="already retired and its storage emptied"):
        m.retire(x, cpu, "empty_storage")


# -- silent no-ops -------------------------------------------------------------------------


def test_enable_paging_that_selects_nothing_warns_with_the_fix():
    """The tiny config saves nothing of 64 KiB (the default `min_bytes`): a budget, or named
    nodes, page nothing; that is said once, with the fix, and a smaller `min_bytes` pages."""
    from sched_lifetime.models import CONFIGS, MoEModel

    m = MoEModel(CONFIGS["tiny"])
    c = m.chunk()
    with pytest.warns(UserWarning, match=r"enable_paging\(budget=0.5\) pages nothing: no compute node saves an activation of at least min_bytes=65536 bytes \(the largest is \d+ bytes\); pass a smaller min_bytes"):
        assert c.enable_paging(m.batch(0, 0), budget=0.5)["page"] == []
    with pytest.warns(UserWarning, match=r"enable_paging: nodes \['L0.attn'\] save no activation of at least min_bytes=65536 bytes.*pass a smaller min_bytes"):
        assert c.enable_paging(m.batch(0, 0), nodes=["L0.attn"])["page"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say when something is paged
        assert c.enable_paging(m.batch(0, 0), nodes=["L0.attn"], min_bytes=1)["page"] == ["L0.attn"]
        assert c.enable_paging(m.batch(0, 0), budget=0.5, min_bytes=1)["page"]


def test_a_pager_that_selects_nothing_warns_with_the_fix():
    x, w = torch.randn(32, 64), torch.randn(64, 64, requires_grad=True)
    pager = sl.Pager(budget=0.5, timed=False)  # 8 KiB activations, 64 KiB min_bytes
    with pytest.warns(UserWarning, match=r"Pager: nothing to page: every saved activation is under min_bytes=65536 bytes \(the largest is 8192\); pass a smaller min_bytes"):
        with pager.step():
            torch.sigmoid(x @ w).sum().backward()
    assert pager.plan["page"] == []


def test_paired_ends_with_one_microbatch_warns_and_runs_unpaired():
    from sched_lifetime.compile import GraphStep
    from sched_lifetime.models import CONFIGS, MoEModel
    from sched_lifetime.nodes import train_step

    m = MoEModel(CONFIGS["tiny"])
    with pytest.warns(UserWarning, match=r"train_step: paired_ends pairs two microbatches; with 1 the step runs F\(0\) then B\(0\) unpaired"):
        (loss,) = train_step(m.chunk(), [m.batch(0, 0)], "ours", paired_ends=True)
    assert loss.dim() == 0
    gs = GraphStep(_ScalarLoss(), (torch.randn(3, 4),))
    with pytest.warns(UserWarning, match=r"GraphStep.step: paired_ends pairs two microbatches; with 1"):
        assert len(gs.step([(torch.randn(3, 4),)], paired_ends=True)) == 1


class _ScalarLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).square().sum()


@pytest.mark.parametrize("field,value,message", [
    ("heads", 3, "hidden 64 does not split over 3 heads"),
    ("heads", 0, "MoEConfig.heads must be an int >= 1"),
    ("topk", 5, "topk 5 is more than the 4 experts"),
    ("topk", 0, "MoEConfig.topk must be an int >= 1"),
    ("capacity_factor", -1.0, "capacity_factor must be None .* or a finite number > 0"),
    ("capacity_factor", 0, "capacity_factor must be None .* or a finite number > 0"),
    ("dense_layers", 3, "dense_layers 3 is more than the 2 layers"),
    ("dtype", "int8", "MoEConfig.dtype must be one of"),
])
def test_a_model_config_that_cannot_build_the_model_names_the_field(field, value, message):
    from dataclasses import replace

    from sched_lifetime.models import CONFIGS

    with pytest.raises(ValueError, match=message):
        replace(CONFIGS["tiny"], **{field: value})
