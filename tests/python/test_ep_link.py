"""The emulated EP link (`HostLinkAllToAll`, issue 28): EP of k ranks on one device, the rows
of the other ranks' experts moved through host buffers. It is a pure data movement: the model
on it gives the local `AllToAll()`'s loss and gradients bit for bit (plain backward and the
node path, both dispatch modes, uneven and empty experts), and the bytes that cross are the
other emulated ranks' rows. The full-duplex chunk split moves the same bytes as the serial
copies for any chunk count. Compiled (torch.compile with our backend, GraphStep) the link is
a launch/wait pair the backend schedules, bit-exact too. Bad settings are errors naming the
value. GPU tests (marker `cuda`) run it, duplex and serial, on side streams with messages in
flight, inside a captured step, compiled, and under the profiler."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from sched_lifetime import ep_link
from sched_lifetime.ep import AllToAll, HostLinkAllToAll
from sched_lifetime.ep_link import chunk_rows
from sched_lifetime.models import CONFIGS, MoEModel

from _compile_parity import assert_matches_eager  # noqa: E402
from sched_lifetime.nodes import train_step

#: Odd sizes beside the tiny config: 6 experts top-3 (k = 3 and 6 shard them), two dense
#: layers first, uneven batch and sequence.
ODD = replace(
    CONFIGS["tiny"], vocab=97, hidden=48, heads=3, layers=4, dense_layers=2, experts=6, topk=3,
    expert_ffn=40, shared_ffn=0, dense_ffn=72, seq=12, batch=3,
)


def _grads(m: MoEModel) -> dict:
    return {k: p.grad for k, p in m.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _dead_experts(m: MoEModel, dead: set) -> None:
    """Route no token to the experts in `dead`: the router gets a bias of -1e4 on them (their
    softmax weight is exactly 0, so top-k never picks them while enough experts are live)."""
    for layer in m.layers:
        if layer.dense:
            continue
        old = layer.router
        new = nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(torch.tensor([-1e4 if e in dead else 0.0 for e in range(old.out_features)]))
        layer.router = new


def _plain_step(m: MoEModel, n: int = 2) -> list:
    losses = []
    for i in range(n):
        loss = m(**m.batch(0, i)) / n
        loss.backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("capacity", [None, 1.0, 0.75], ids=["counted", "capacity", "dropping"])
@pytest.mark.parametrize("cfg,k", [(CONFIGS["tiny"], 2), (CONFIGS["tiny"], 4), (ODD, 3), (ODD, 6)], ids=["tiny-k2", "tiny-k4", "odd-k3", "odd-k6"])
def test_plain_forward_backward_bit_exact_against_local(cfg, k, capacity):
    """Loss and every gradient of the plain forward + backward equal the local transport's,
    and the forward and backward all-to-alls crossed the link."""
    cfg = replace(cfg, capacity_factor=capacity)
    ref, link = MoEModel(cfg), HostLinkAllToAll(k, device="cpu")
    m = MoEModel(cfg, link)
    assert torch.equal(torch.stack(_plain_step(ref)), torch.stack(_plain_step(m)))
    assert _same(_grads(ref), _grads(m))
    moved = link.moved()
    moe_layers = cfg.layers - cfg.dense_layers
    assert moved.messages == 2 * 4 * moe_layers  # 2 microbatches x (dispatch, combine) x (F, B)
    assert moved.d2h == moved.h2d > 0 and moved.local > 0


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["counted", "capacity"])
@pytest.mark.parametrize("order", ["ours", "sequential"])
def test_node_path_bit_exact_against_local(order, capacity):
    """The scheduled node path (dispatch/combine as comm nodes, their transposes in backward)
    on the link equals the same path on the local transport: losses and every gradient."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=capacity)
    ref, link = MoEModel(cfg), HostLinkAllToAll(2, device="cpu")
    m = MoEModel(cfg, link)
    lr = train_step(ref.chunk(), [ref.batch(0, i) for i in range(3)], order)
    lm = train_step(m.chunk(), [m.batch(0, i) for i in range(3)], order)
    assert all(torch.equal(a, b) for a, b in zip(lr, lm))
    assert _same(_grads(ref), _grads(m))
    assert link.moved().messages == 3 * 4 * cfg.layers and link.moved().d2h > 0


@pytest.mark.parametrize("capacity", [None, 1.0], ids=["counted", "capacity"])
@pytest.mark.parametrize(
    "k,dead", [(2, {2, 3}), (2, {0, 1}), (2, {1, 3}), (4, {0, 2}), (4, {1, 2})],
    ids=["k2-remote-empty", "k2-local-empty", "k2-mixed", "k4-0,2", "k4-1,2"],
)
def test_empty_experts_bit_exact_and_only_other_ranks_rows_cross(k, dead, capacity):
    """Routing that leaves experts without tokens (zero-size splits) stays bit-exact. With
    counted routing, the rows that cross are exactly the other emulated ranks' experts': none
    when ranks 1.. own only empty experts, all when rank 0 does (an even row split, or any
    split not by expert blocks, fails one of the two)."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=capacity)
    ref, link = MoEModel(cfg), HostLinkAllToAll(k, device="cpu")
    m = MoEModel(cfg, link)
    _dead_experts(ref, dead)
    _dead_experts(m, dead)
    assert torch.equal(torch.stack(_plain_step(ref)), torch.stack(_plain_step(m)))
    assert _same(_grads(ref), _grads(m))
    got = ref.layers[0].pre(ref.embed(ref.batch(0, 0)["tokens"].reshape(-1)))[-1].counts
    assert all(got[e] == 0 for e in dead) and got.sum() > 0  # the routing really left them empty
    moved, per = link.moved(), cfg.experts // k
    rank0 = set(range(per))
    if capacity is None and set(range(per, cfg.experts)) <= dead:
        assert moved.d2h == 0 and moved.local > 0, moved
    elif capacity is None and rank0 <= dead:
        assert moved.local == 0 and moved.d2h > 0, moved
    else:
        assert moved.d2h > 0 and moved.local > 0, moved


def _direct_cases():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(15, 8, generator=g)
    return [
        ("uneven", 4, x, [5, 0, 3, 7], 5),
        ("rank0-empty", 4, x, [0, 9, 0, 6], 0),
        ("others-empty", 4, x, [15, 0, 0, 0], 15),
        ("one-split", 4, x, [15], 3),  # a world-of-one caller: even row split
        ("equal-none", 4, x, None, 3),  # 15 // 4 rows stay
        ("empty", 2, x[:0], [0, 0], 0),
        ("empty-none", 2, x[:0], None, 0),
        ("bf16", 3, torch.randn(10, 6, generator=g).to(torch.bfloat16), [4, 4, 2], 4),
        ("int64-1d", 2, torch.randint(-(2**62), 2**62, (9,), generator=g), [2, 7], 2),
        ("strided", 2, torch.randn(8, 12, generator=g).t(), [3, 9], 3),
    ]


@pytest.mark.parametrize("name,k,x,splits,keep", _direct_cases(), ids=[c[0] for c in _direct_cases()])
def test_direct_all_to_all_equals_local_with_uneven_and_zero_splits(name, k, x, splits, keep):
    """A direct call returns the local all-to-all's tensor (compared bit for bit, bf16 as
    int16), a new tensor, and moves exactly the rows after emulated rank 0's through the host."""
    link = HostLinkAllToAll(k, device="cpu")
    want = AllToAll(local=True).all_to_all(x, x.shape[0], splits, splits)
    got = link.all_to_all(x, x.shape[0], splits, splits)
    as_bits = (lambda t: t.view(torch.int16)) if x.dtype == torch.bfloat16 else (lambda t: t)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(as_bits(got), as_bits(want))
    assert got.data_ptr() != x.data_ptr() or x.numel() == 0
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    cross = x.shape[0] - keep
    assert link.moved() == ep_link.LinkBytes(cross * row, cross * row, keep * row, 1, 1 if cross else 0)


def test_autograd_through_the_link_equals_local_and_the_gradient_crosses_too():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 4, generator=g)
    w = torch.randn(12, 4, generator=g)
    grads = []
    for t in (AllToAll(local=True), HostLinkAllToAll(3, device="cpu")):
        xi = x.clone().requires_grad_(True)
        ((t.all_to_all(xi, 12, [4, 2, 6], [4, 2, 6]) * w).square().sum()).backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])
    assert t.moved().messages == 2 and t.moved().d2h == 2 * 8 * 4 * 4  # forward and backward, 8 rows each


def test_exchange_counts_is_a_clone():
    c = torch.tensor([3, 0, 5, 1])
    got = HostLinkAllToAll(2, device="cpu").exchange_counts(c)
    assert torch.equal(got, c) and got.data_ptr() != c.data_ptr()


def test_host_buffers_allocated_once_and_reused():
    """After the first step no host buffer is allocated (fixed-capacity messages repeat)."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    link = HostLinkAllToAll(2, device="cpu", ring=3)
    m = MoEModel(cfg, link)
    train_step(m.chunk(), [m.batch(0, i) for i in range(2)], "ours")
    first = (link.allocations, link.host_bytes)
    assert first == (3, 3 * link.capacity) and link.capacity > 0
    for step in (1, 2):
        train_step(m.chunk(), [m.batch(step, i) for i in range(2)], "ours")
    assert (link.allocations, link.host_bytes) == first


def test_no_host_allocation_under_capture(monkeypatch):
    """Under CUDA graph capture a message bigger than the host buffers is an error asking for
    an eager step first (capture simulated on CPU: the capture check is patched to say yes)."""
    x = torch.randn(64, 1024)
    link = HostLinkAllToAll(2, device="cpu")
    monkeypatch.setattr(ep_link, "_capturing", lambda dev: True)
    with pytest.raises(RuntimeError, match="run one eager step first"):
        link.all_to_all(x, 64, None, None)
    assert link.allocations == 0
    monkeypatch.setattr(ep_link, "_capturing", lambda dev: False)
    link.all_to_all(x, 64, None, None)  # the eager step allocates
    allocated = link.allocations
    monkeypatch.setattr(ep_link, "_capturing", lambda dev: True)
    assert torch.equal(link.all_to_all(x, 64, None, None), x)  # fits: no allocation
    assert link.allocations == allocated
    big = torch.randn(64, 64 * 1024)
    with pytest.raises(RuntimeError, match=r"a 8388608-byte message during CUDA graph capture.*run one eager step first"):
        link.all_to_all(big, 64, None, None)
    assert link.allocations == allocated


@pytest.mark.parametrize("k", [1, 0, -2, 2.0, "8", True, None])
def test_bad_k_is_an_error_naming_it(k):
    with pytest.raises(ValueError, match=rf"k={k!r} .*integer >= 2"):
        HostLinkAllToAll(k, device="cpu")


def test_k_not_dividing_the_experts_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"k=8 does not divide the model's 4 experts.*pick k in \[2, 4\]"):
        MoEModel(CONFIGS["tiny"], HostLinkAllToAll(device="cpu"))  # default k = 8
    with pytest.raises(ValueError, match=r"k=4 does not divide the model's 6 experts.*\[2, 3, 6\]"):
        HostLinkAllToAll(4, device="cpu").check(6)
    with pytest.raises(ValueError, match=r"k=3 does not divide the model's 4 experts"):
        HostLinkAllToAll(3, device="cpu", num_experts=4)
    HostLinkAllToAll(3, device="cpu").check(6)
    MoEModel(replace(CONFIGS["tiny"], experts=8), HostLinkAllToAll(device="cpu"))


def test_host_link_on_cuda_without_a_gpu_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' asks for the host link.*no CUDA GPU is available.*device='cpu'"):
        HostLinkAllToAll(4, device="cuda")
    with pytest.raises(ValueError, match=r"device='cuda:1'"):
        HostLinkAllToAll(4, device="cuda:1")
    assert HostLinkAllToAll(4).device == torch.device("cpu")  # the default falls back to host copies
    with pytest.raises(ValueError, match=r"device='meta'"):
        HostLinkAllToAll(4, device="meta")
    with pytest.raises(ValueError, match=r"ring=0"):
        HostLinkAllToAll(4, device="cpu", ring=0)


def test_bad_calls_are_errors_naming_the_value():
    link, x = HostLinkAllToAll(4, device="cpu"), torch.zeros(10, 2)
    with pytest.raises(ValueError, match=r"in_splits=\[5, 5\] must be 4 .* or 1"):
        link.all_to_all(x, 10, [5, 5], [5, 5])
    with pytest.raises(ValueError, match=r"in_splits=\[5, 5, 1, 0\] .*summing to the input's 10 rows"):
        link.all_to_all(x, 10, [5, 5, 1, 0], [5, 5, 1, 0])
    with pytest.raises(ValueError, match=r"in_splits=\[12, -2, 0, 0\]"):
        link.all_to_all(x, 10, [12, -2, 0, 0], [12, -2, 0, 0])
    with pytest.raises(ValueError, match=r"out_splits=\[4, 6, 0, 0\] differ from in_splits=\[5, 5, 0, 0\]"):
        link.all_to_all(x, 10, [4, 6, 0, 0], [5, 5, 0, 0])
    with pytest.raises(ValueError, match=r"out_splits=None differ"):
        link.all_to_all(x, 10, None, [5, 5, 0, 0])
    with pytest.raises(ValueError, match=r"out_rows=9 but the input has 10 rows"):
        link.all_to_all(x, 9, None, None)
    with pytest.raises(ValueError, match=r"got a tensor on meta"):
        link.all_to_all(torch.zeros(10, 2, device="meta"), 10, None, None)


@pytest.mark.parametrize("spec,k", [("host", 8), ("host:2", 2), ("host:16", 16)])
def test_from_spec(spec, k):
    assert HostLinkAllToAll.from_spec(spec, device="cpu").emulated_ranks == k


@pytest.mark.parametrize("spec,msg", [("host:1", r"k=1 "), ("host:x", r"K='x' is not an integer"), ("nccl", r"unknown kind 'nccl'"),
                                      ("host:", r"K is missing after ':'")])
def test_from_spec_errors_name_the_setting(spec, msg):
    with pytest.raises(ValueError, match=msg):
        HostLinkAllToAll.from_spec(spec, device="cpu")


# -- the full-duplex chunk split ------------------------------------------------------------


@pytest.mark.parametrize(
    "rows,row_bytes,chunks,min_bytes,want",
    [
        (10, 4, 8, 0, [2, 2, 1, 1, 1, 1, 1, 1]),  # the first ones one row longer
        (3, 4, 8, 0, [1, 1, 1]),  # more chunks than rows: one a row
        (16, 4, 4, 0, [4, 4, 4, 4]),
        (0, 4, 8, 0, []),  # nothing crosses: no chunk
        (7, 4, 1, 0, [7]),
        (100, 1024, 8, 1 << 20, [100]),  # 100 KiB: below the minimum chunk, one chunk
        (64, 1 << 20, 8, 16 << 20, [16, 16, 16, 16]),  # 64 MiB in chunks of >= 16 MiB
        (64, 1 << 20, 8, 1 << 20, [8] * 8),
        (5, 0, 3, 1 << 20, [5]),  # rows of no bytes (a 0-wide tensor)
    ],
)
def test_chunk_rows_splits_every_row_once_within_the_settings(rows, row_bytes, chunks, min_bytes, want):
    got = chunk_rows(rows, row_bytes, chunks, min_bytes)
    assert got == want and sum(got) == rows
    assert len(got) <= max(chunks, 0) and all(n > 0 for n in got)
    assert len(got) <= 1 or min(got) * row_bytes >= min_bytes


def _split_cases():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(13, 5, generator=g)
    return [
        ("uneven", 4, x, [2, 4, 0, 7]),
        ("equal-none", 4, x, None),
        ("rank0-all", 4, x, [13, 0, 0, 0]),  # nothing crosses
        ("one-row-crosses", 2, x, [12, 1]),
        ("zero-rows", 2, x[:0], [0, 0]),
        ("bf16", 3, torch.randn(11, 3, generator=g).to(torch.bfloat16), [1, 6, 4]),
    ]


@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 8, 64])
@pytest.mark.parametrize("name,k,x,splits", _split_cases(), ids=[c[0] for c in _split_cases()])
def test_duplex_chunks_move_the_bytes_of_the_serial_copies_for_any_chunk_count(name, k, x, splits, chunks):
    """Duplex with any chunk count (more chunks than rows included, and messages with no row
    crossing or no row at all) returns the serial copies' tensor bit for bit and moves the same
    bytes each way, in as many device -> host copies as `chunk_rows` says."""
    serial = HostLinkAllToAll(k, device="cpu", duplex=False)
    duplex = HostLinkAllToAll(k, device="cpu", chunks=chunks, min_chunk_bytes=0)
    want = serial.all_to_all(x, x.shape[0], splits, splits)
    got = duplex.all_to_all(x, x.shape[0], splits, splits)
    bits = (lambda t: t.view(torch.int16)) if x.dtype == torch.bfloat16 else (lambda t: t)
    assert torch.equal(bits(got), bits(want)) and torch.equal(bits(got), bits(x))
    a, b = serial.moved(), duplex.moved()
    assert (a.d2h, a.h2d, a.local, a.messages) == (b.d2h, b.h2d, b.local, b.messages)
    keep = splits[0] if splits else x.shape[0] // k
    cross = x.shape[0] - keep
    assert a.chunks == (1 if cross else 0)
    assert b.chunks == len(chunk_rows(cross, x[0].numel() * x.element_size() if x.shape[0] else 0, chunks, 0)) == min(chunks, cross)


@pytest.mark.parametrize("duplex,chunks", [(False, 8), (True, 1), (True, 3), (True, 50)])
def test_model_on_duplex_and_serial_links_bit_exact_against_local(duplex, chunks):
    """Plain forward + backward and the node path, on chunked and serial links: the local
    transport's losses and gradients."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=None)
    ref, link = MoEModel(cfg), HostLinkAllToAll(2, device="cpu", duplex=duplex, chunks=chunks, min_chunk_bytes=0)
    m = MoEModel(cfg, link)
    assert torch.equal(torch.stack(_plain_step(ref)), torch.stack(_plain_step(m)))
    lr = train_step(ref.chunk(), [ref.batch(1, i) for i in range(2)], "ours")
    lm = train_step(m.chunk(), [m.batch(1, i) for i in range(2)], "ours")
    assert all(torch.equal(a, b) for a, b in zip(lr, lm)) and _same(_grads(ref), _grads(m))
    moved = link.moved()
    assert moved.chunks > moved.messages if duplex and chunks > 1 else moved.chunks <= moved.messages


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"duplex": 1}, r"duplex=1"),
        ({"chunks": 0}, r"chunks=0"),
        ({"chunks": 2.5}, r"chunks=2.5"),
        ({"min_chunk_bytes": -1}, r"min_chunk_bytes=-1"),
        ({"min_chunk_bytes": True}, r"min_chunk_bytes=True"),
    ],
)
def test_bad_duplex_settings_are_errors_naming_them(kw, msg):
    with pytest.raises(ValueError, match=msg):
        HostLinkAllToAll(4, device="cpu", **kw)


def test_from_spec_passes_the_link_settings_and_describe_says_what_it_is():
    link = HostLinkAllToAll.from_spec("host:4", device="cpu", duplex=False)
    assert (link.emulated_ranks, link.duplex) == (4, False)
    assert link.describe().startswith("emulated link: EP=4 over host memory") and "serial" in link.describe()
    assert "full duplex, up to 6 chunks" in HostLinkAllToAll.from_spec("host", device="cpu", chunks=6).describe()


@pytest.mark.parametrize("order", ["ours", "sequential"])
def test_page_nodes_on_the_link_bit_exact_against_local_without_paging(order):
    """EP + page nodes (the main job's `ours+page`) on the link: saved activations paged out
    and back while dispatch and combine cross the link; losses and gradients equal the local
    transport without paging over several steps, and both the link and the pager moved bytes."""
    cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
    ref, link = MoEModel(cfg), HostLinkAllToAll(2, device="cpu", chunks=4, min_chunk_bytes=0)
    m = MoEModel(cfg, link)
    cr, cp = ref.chunk(), m.chunk()
    plan = cp.enable_paging(m.batch(0, 0), budget=0.5, min_bytes=1024)
    assert plan["page"] and plan["bytes_paged"] > 0
    for step in range(2):
        for model in (ref, m):
            for p in model.parameters():
                p.grad = None
        lr = train_step(cr, [ref.batch(step, i) for i in range(3)], order)
        lp = train_step(cp, [m.batch(step, i) for i in range(3)], order)
        assert all(torch.equal(a, b) for a, b in zip(lr, lp)) and _same(_grads(ref), _grads(m)), step
    assert cp.page_stats["bytes_out"] == cp.page_stats["bytes_in"] == 2 * 3 * plan["bytes_paged"]
    assert link.moved().d2h > 0 and link.moved().chunks > link.moved().messages


# -- compiled graphs: the launch/wait ops -----------------------------------------------------


def _compiled_steps(m: MoEModel, backend, steps: int = 2) -> tuple:
    torch._dynamo.reset()
    run = m if backend is None else torch.compile(m, backend=backend)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = run(**m.batch(s, 0))
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in m.parameters()]


def test_compiled_model_on_the_link_bit_exact_against_eager_local_with_launch_wait_pairs():
    """torch.compile(model, backend="sched_lifetime") with the link as transport: the forward
    and backward graphs hold the link's launch/wait ops as comm launches and waits (the
    backward's are the gradient's trip), losses and weights after SGD steps equal the eager
    model on the local transport, and the link moved the crossing rows."""
    import sched_lifetime  # noqa: F401  (registers the backend)
    from sched_lifetime import compile as slc

    torch.use_deterministic_algorithms(True)
    try:
        cfg = replace(CONFIGS["tiny"], capacity_factor=1.0, layers=3, dense_layers=1)
        want = _compiled_steps(MoEModel(cfg, AllToAll(), seed=0), None)
        link = HostLinkAllToAll(2, device="cpu", chunks=3, min_chunk_bytes=0)
        slc.history.clear()  # it keeps the last 64: after other tests' graphs a length says nothing
        got = _compiled_steps(MoEModel(cfg, link, seed=0), "sched_lifetime")
        graphs = list(slc.history)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0])) and all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
    assert [h["phase"] for h in graphs] == ["fwd", "bwd"]
    for h in graphs:
        kinds = [n["kind"] for n in h["ir"]["nodes"]]
        assert kinds.count("comm_launch") == kinds.count("comm_wait") == 4, (h["phase"], kinds)  # 2 MoE layers x dispatch + combine
        assert any(n.target is torch.ops.sched_lifetime_link.all_to_all.default for n in h["module"].graph.nodes)
    moved = link.moved()
    assert moved.messages == 2 * 2 * 4 and moved.d2h > 0 and moved.chunks == 3 * moved.messages
    assert not link._pending  # every launch waited


def test_graph_step_on_the_link_bit_exact_against_eager_microbatch_by_microbatch():
    """GraphStep (compiled forward/backward graphs, F(i+1) multiplexed with B(i)) on the link:
    sequential, multiplexed and paired ends give eager's losses and gradients; the multiplexed
    module has the link's launches of both sources."""
    from sched_lifetime import compile as slc

    torch.use_deterministic_algorithms(True)
    try:
        cfg = replace(CONFIGS["tiny"], capacity_factor=1.0)
        link = HostLinkAllToAll(2, device="cpu", chunks=2, min_chunk_bytes=0)
        ref, m = MoEModel(cfg, AllToAll(), seed=0), MoEModel(cfg, link, seed=0)
        gs = slc.GraphStep(m, tuple(m.batch(0, 0).values()))
        for step, (mux, ends) in enumerate([(True, False), (False, False), (True, True)]):
            mbs = [tuple(m.batch(step, k).values()) for k in range(3)]
            assert_matches_eager(gs.step(mbs, multiplexed=mux, paired_ends=ends), m, ref, mbs, f"step {step}")
    finally:
        torch.use_deterministic_algorithms(False)
    nodes = gs.mux.sched_lifetime["ir"]["nodes"]
    assert sum(n["kind"] == "comm_launch" for n in nodes) == 8 and {n["source"] for n in nodes} == {"F", "B"}
    assert not link._pending


def test_a_wait_without_its_launch_is_an_error():
    link = HostLinkAllToAll(2, device="cpu")
    x = torch.randn(4, 2)
    token = torch.ops.sched_lifetime_link.all_to_all(x, 2, link._id)
    assert torch.equal(torch.ops.sched_lifetime_link.wait_tensor(token, x, 2, link._id), x)
    with pytest.raises(RuntimeError, match="not pending"):
        torch.ops.sched_lifetime_link.wait_tensor(token, x, 2, link._id)


# -- GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("duplex", [True, False], ids=["duplex", "serial"])
@pytest.mark.parametrize("ring", [1, 2])
def test_cuda_messages_in_flight_on_two_side_streams_are_bit_exact(ring, duplex):
    """Several 32 MiB messages queued at once, alternating between two side streams, so a host
    buffer is rewritten from one stream while the other's host -> device copy (on the helper
    stream in duplex) may still read it: without the wait on the buffer's event the outputs
    mix. Pinned, allocated once; duplex splits each message into 8 chunks."""
    dev = torch.device("cuda")
    link = HostLinkAllToAll(8, device=dev, ring=ring, duplex=duplex)
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    xs = [torch.randn(4096, 2048, device=dev) + i for i in range(6)]  # 32 MiB each
    torch.cuda.synchronize()
    main, outs = torch.cuda.current_stream(dev), []
    for rep in range(3):
        for i, x in enumerate(xs):
            s = streams[i % 2]
            s.wait_stream(main)
            with torch.cuda.stream(s):  # the output allocated on the consumer (main) stream
                outs.append(link.all_to_all(x, x.shape[0], None, None, alloc_stream=main))
        if rep == 0:
            allocated = link.allocations
    torch.cuda.synchronize()
    want = [AllToAll(local=True).all_to_all(x, x.shape[0], None, None) for x in xs] * 3
    assert all(torch.equal(a, b) for a, b in zip(outs, want))
    assert link.allocations == allocated == ring
    assert all(s.buf.is_pinned() for s in link._slots)
    assert link.moved().d2h == 18 * (4096 - 4096 // 8) * 2048 * 4
    assert link.moved().chunks == 18 * (8 if duplex else 1)


@pytest.mark.cuda
@pytest.mark.parametrize("duplex", [True, False], ids=["duplex", "serial"])
def test_cuda_captured_step_on_the_link_bit_exact_against_local_with_no_allocation_after_the_first_step(duplex):
    """The main job's arms on the GPU: `ours` (the EP stream) and `ours+graph` (the whole step
    captured, then replayed: in duplex the helper stream forks from and joins the capture) on
    the link, against `ours` on the local transport; the link's pinned buffers are allocated in
    the first (eager) step only."""
    from sched_lifetime.models import moe as moe_mod
    from sched_lifetime.train import Arm, same_grads

    torch.use_deterministic_algorithms(True)
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        moe_mod.deterministic_sdpa(dev, torch.float32)
        cfg = replace(CONFIGS["tiny"], capacity_factor=1.0, hidden=512, heads=8, expert_ffn=1024, shared_ffn=512, seq=256, batch=8)
        links = [HostLinkAllToAll(4, device=dev, duplex=duplex, min_chunk_bytes=1 << 16) for _ in range(2)]
        ref = Arm("ours", cfg, AllToAll(local=True), dev, 0.05)
        arms = [Arm("ours", cfg, links[0], dev, 0.05), Arm("ours+graph", cfg, links[1], dev, 0.05)]
        for step in range(4):
            ref.step(step, 3)
            for a in arms:
                a.step(step, 3)  # the graph arm: step 0 eager, step 1 captures, then replays
                assert same_grads(a, ref) and torch.equal(a.losses[-1], ref.losses[-1]), (a.name, step)
            if step == 0:
                allocated = [link.allocations for link in links]
        torch.cuda.synchronize()
        assert arms[1].graph is not None
        assert [link.allocations for link in links] == allocated and all(n > 0 for n in allocated)
        assert all(link.moved().d2h > 0 for link in links)
        assert all((link.moved().chunks > link.moved().messages) == duplex for link in links)
    finally:
        torch.use_deterministic_algorithms(False)
        moe_mod.SDPA_BACKENDS = None


def _copy_intervals(prof) -> dict:
    """Device <-> pinned host copy intervals of a profile, by direction."""
    out: dict = {"DtoH": [], "HtoD": []}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("Memcpy") and "Pinned" in e.name:
            out["DtoH" if "DtoH" in e.name else "HtoD"].append((e.time_range.start, e.time_range.end, e.id))
    return out


@pytest.mark.cuda
def test_cuda_duplex_sends_and_receives_at_once_and_the_profile_tells_link_copies_from_others():
    """One 56 MiB crossing under the profiler: duplex runs 8 device -> host and 8 host -> device
    copies with some of each direction at the same time (serial: never), and the main job's
    figures count exactly the link's copies as the link's, not a page-like copy of another
    stream (`link_copy_ids`)."""
    from torch.profiler import ProfilerActivity, profile

    from sched_lifetime.train.figures import exposed_comm_us, link_copy_ids

    dev = torch.device("cuda")
    x = torch.randn(8 * 1024, 2048, device=dev)  # 64 MiB, 56 MiB cross
    other_src, other_dst = torch.randn(1 << 20, device=dev), torch.empty(1 << 20, pin_memory=True)
    side = torch.cuda.Stream(dev)
    got = {}
    for duplex in (True, False):
        link = HostLinkAllToAll(8, device=dev, duplex=duplex)
        link.all_to_all(x, x.shape[0], None, None)  # warm: buffers, events, streams
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = link.all_to_all(x, x.shape[0], None, None)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                other_dst.copy_(other_src, non_blocking=True)  # a page copy's stand-in
            torch.cuda.synchronize()
        assert torch.equal(out, x)
        iv = _copy_intervals(prof)
        assert len(iv["DtoH"]) == (9 if duplex else 2) and len(iv["HtoD"]) == (8 if duplex else 1), iv
        ids = link_copy_ids(prof)
        mine = {i for d in iv.values() for *_, i in d} - ids
        assert len(mine) == 1 and len(ids & {i for d in iv.values() for *_, i in d}) == len(iv["DtoH"]) + len(iv["HtoD"]) - 1
        overlap = any(min(a[1], b[1]) > max(a[0], b[0]) for a in iv["DtoH"] if a[2] in ids for b in iv["HtoD"])
        got[duplex] = overlap
        exposed, total = exposed_comm_us(prof, link, paged=True)
        assert total > 0 and exposed <= total
    assert got == {True: True, False: False}, got


@pytest.mark.cuda
def test_cuda_compiled_model_on_the_link_bit_exact_against_eager_local():
    """torch.compile(backend="sched_lifetime") on the GPU with the link: the launch runs the
    move on the link's send stream, the wait joins it; equal to eager on the local transport."""
    import sched_lifetime  # noqa: F401
    from sched_lifetime.models import moe as moe_mod

    torch.use_deterministic_algorithms(True)
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        moe_mod.deterministic_sdpa(dev, torch.float32)
        cfg = replace(CONFIGS["tiny"], capacity_factor=1.0, layers=3, dense_layers=1, hidden=256, expert_ffn=512, seq=128, batch=4)
        want = _compiled_steps(MoEModel(cfg, AllToAll(), seed=0, device=dev), None, steps=3)
        link = HostLinkAllToAll(2, device=dev, min_chunk_bytes=1 << 14)
        got = _compiled_steps(MoEModel(cfg, link, seed=0, device=dev), "sched_lifetime", steps=3)
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
        moe_mod.SDPA_BACKENDS = None
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0])) and all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
    assert link.moved().chunks > link.moved().messages > 0 and not link._pending
