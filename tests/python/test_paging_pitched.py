"""The pitched page copy (`paging/pitched.py`, `groups.compact`): a saved tensor with one level of
gaps (a slice of a wider one: the halves of a fused gate/up projection) laid out on the host with
its gaps removed and moved by one `cudaMemcpy2DAsync`, with no gather or scatter kernel."""

import pytest
import torch

import sched_lifetime as sl
from sched_lifetime.paging import pitched, streams
from sched_lifetime.paging.groups import compact


def layout(t):
    return tuple(t.shape), t.stride(), t.element_size()


def test_pitch_of_names_rows_of_a_dense_block_at_a_constant_pitch_and_nothing_else():
    gate_up = torch.empty(64, 2 * 256, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert pitched.pitch_of(*layout(gate)) == (512, 64, 1024) == pitched.pitch_of(*layout(up))
    three = torch.empty(2, 8, 3 * 128)[..., 128:256]  # (batch, tokens, 3n)[..., n:2n]: batch x tokens rows
    assert pitched.pitch_of(*layout(three)) == (512, 16, 3 * 512)
    assert pitched.pitch_of(*layout(torch.empty(4, 1, 2 * 128)[..., :128])) == (512, 4, 1024)  # size-1 dims do not count
    assert pitched.pitch_of(*layout(torch.empty(64, 256))) is None  # dense
    assert pitched.pitch_of(*layout(torch.empty(256, 64).t())) is None  # dense, transposed
    assert pitched.pitch_of(*layout(torch.empty(8, 2 * 256)[::2, :256])) == (1024, 4, 4096)  # every other row: one pitch
    assert pitched.pitch_of(*layout(torch.empty(4, 8, 2 * 256)[::2, :, :256])) is None  # a second level of gaps
    assert pitched.pitch_of(*layout(torch.empty(64, 2 * 64)[:, :64])) is None  # 256-byte rows: torch's copy
    assert pitched.pitch_of(*layout(torch.empty(64, 512)[:, ::2])) is None  # no dense rows at all
    assert pitched.pitch_of(*layout(torch.empty(0, 2 * 256)[:, :256])) is None  # empty
    assert pitched.pitch_of(*layout(torch.ones(3, 1).expand(3, 512))) is None  # elements share memory
    assert pitched.pitch_of((2, 256), (pitched.MAX_PITCH // 2 + 1, 1), 2) is None  # a pitch past the 2D copy's widest


def test_compact_keeps_the_dimension_order_and_drops_the_gaps():
    x = torch.empty(4, 6)[:, 3:]
    assert compact(tuple(x.shape), x.stride()) == (3, 1)
    t = torch.empty(6, 4).t()[:, :2]  # shape (4, 2), strides (1, 4): a slice of a transposed tensor
    assert compact(tuple(t.shape), t.stride()) == (1, 4)
    d = torch.empty(3, 5).t()
    assert compact(tuple(d.shape), d.stride()) == d.stride()  # a dense layout is its own


@pytest.mark.parametrize("make", [
    lambda: torch.arange(64 * 512, dtype=torch.float32).reshape(64, 512).chunk(2, dim=-1)[1],
    lambda: torch.arange(6 * 40, dtype=torch.float32).reshape(6, 40).t()[:, 1:4],  # transposed rows 1-3: dense
    lambda: torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)[:, 1:4].t(),  # gaps, transposed
    lambda: torch.arange(4 * 8 * 512, dtype=torch.float32).reshape(4, 8, 512)[::2, :, :256],  # two levels of gaps
])
@pytest.mark.parametrize("pitched_layout", [False, True])
def test_a_tensor_with_gaps_comes_back_with_its_strides_from_either_host_layout(make, pitched_layout, monkeypatch):
    """`HostPool`: a tensor with gaps sits contiguous on the host unless a pitched copy moves it
    (`pitched.usable`: never on the CPU; forced here), then dense in its own dimension order
    (`compact`, kept in the handle); page_out / page_in give it back equal, strides kept, either
    way, and in a group (always contiguous there)."""
    t = make()
    if pitched_layout:
        monkeypatch.setattr(pitched, "usable", lambda x: True)
    n = t.numel() * t.element_size()
    pool = sl.HostPool([n])
    p = pool.page_out(t)
    host = pool.view_of(p)
    shape = tuple(t.shape)
    if pitched_layout:
        want = compact(shape, t.stride())
    else:  # its own strides when dense (no gaps), else contiguous
        want = t.stride() if sl.paging._dense(shape, t.stride()) else torch.empty(shape).stride()
    assert host.stride() == want and torch.equal(host, t) and p.host_stride == (want if pitched_layout else None)
    back = pool.page_in(p)
    assert torch.equal(back, t) and back.stride() == t.stride()
    plan = sl.paging.group_plan([t, torch.randn(5)])
    gpool = sl.HostPool([plan.nbytes])
    gback, _ = gpool.page_in_group(gpool.page_out_group([t, torch.randn(5)]))
    assert torch.equal(gback[0], t) and gback[0].stride() == t.stride()


def test_usable_and_args_on_the_cpu():
    """On the CPU no tensor is `usable` (no device side), so every host layout stays
    contiguous; `args` puts the packed host side and the pitched device side where
    `cudaMemcpy2DAsync` wants them, for either way."""
    t = torch.empty(64, 512).chunk(2, dim=-1)[0]
    assert not pitched.usable(t)
    host = torch.empty_strided(tuple(t.shape), compact(tuple(t.shape), t.stride()))
    assert pitched.plan(host, t) is None and pitched.plan(t, host) is None
    d2h = pitched.args(pitched._D2H, dev_ptr=1000, host_ptr=2000, row=1024, rows=64, pitch=2048)
    assert d2h == (2000, 1024, 1000, 2048, 1024, 64, pitched._D2H)  # dst (host) packed, src (device) at the pitch
    h2d = pitched.args(pitched._H2D, dev_ptr=1000, host_ptr=2000, row=1024, rows=64, pitch=2048)
    assert h2d == (1000, 2048, 2000, 1024, 1024, 64, pitched._H2D)


def test_queue_copy_sends_a_pitched_copy_with_the_waits_and_records_around_it(monkeypatch):
    """`PageStreams._queue_copy` (CPU, stand-ins): a copy `pitched.plan` takes is queued as one
    pitched copy after the compute stream's work and the slot rule's wait, with the done and
    slot events recorded behind it; `pitched_copy = False` sends it to torch's copy."""
    log = []

    class Ev:
        def __init__(self, h):
            self.cuda_event = h

        def record(self, stream):
            log.append(("record", self.cuda_event, stream.name))

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", ev.cuda_event, self.name))

    monkeypatch.setattr(pitched, "plan", lambda dst, src: ("args",))
    refuse = [False]

    def queue(args, stream):
        log.append(("pitched", args, stream.name))
        return not refuse[0]

    monkeypatch.setattr(pitched, "queue", queue)
    monkeypatch.setattr(streams, "record", lambda ev, stream: log.append(("record", ev.cuda_event, stream.name)))
    monkeypatch.setattr(streams, "_page_copy", lambda *a: log.append(("page_copy",)))
    ps = streams.PageStreams("cpu")
    monkeypatch.setattr(ps, "_after", lambda page, comp: log.append(("after", page.name, comp.name)))
    monkeypatch.setattr(ps, "_on", lambda page: log.append(("on", page.name)))
    monkeypatch.setattr(ps, "_back", lambda prev: log.append(("back",)))
    handles = iter([11, 12, 13])
    order = sl.paging.SlotOrder(2, event=lambda: Ev(next(handles)), capturing=lambda: False)
    out, inn, comp = Stream("out"), Stream("in"), Stream("comp")
    dst, src = torch.zeros(4, 8)[:, :4], torch.zeros(4, 4)  # not contiguous: a candidate
    ps._spare = [Ev(21)]
    ps._queue_copy(out, comp, dst, src, order, 0)
    assert log[:3] == [("after", "out", "comp"), ("pitched", ("args",), "out"), ("record", 21, "out")], log
    log.clear()
    ps._spare = [Ev(22)]
    ps._queue_copy(inn, comp, dst, src, order, 0)  # slot 0's last copy ran on `out`: its wait first
    assert [x[0] for x in log][:4] == ["after", "wait", "pitched", "record"] and log[1][2] == "in", log
    log.clear()
    refuse[0] = True  # the runtime refuses it: torch's copy on the same stream, between the same wait and records
    ps._spare = [Ev(24)]
    dst.fill_(0.0)
    src.copy_(torch.arange(16.0).reshape(4, 4))
    ps._queue_copy(out, comp, dst, src, order, 0)
    assert [x[0] for x in log] == ["after", "wait", "pitched", "on", "back", "record", "record"] and torch.equal(dst, src), log
    log.clear()
    monkeypatch.setattr(streams.PageStreams, "pitched_copy", False)
    ps._spare = [Ev(23)]
    ps._mark = Ev(1)
    ps._queue_copy(out, comp, dst, src, order, 1)
    assert ("pitched", ("args",), "out") not in log and log[0] == ("page_copy",), log


@pytest.mark.cuda
@pytest.mark.parametrize("two_way", [False, True])
def test_pitched_page_copies_are_bit_exact_leave_the_gaps_and_run_no_kernel(two_way):
    """On the GPU: the halves of a fused projection paged out and in through a `HostPool` go by
    pitched copies (counted), come back bit-exact with their strides, and the page streams run
    no kernel for them (profiled); torch's copy (`pitched_copy = False`), the control, runs
    gather and scatter kernels."""
    assert pitched.available()
    gate_up = torch.randn(4096, 2 * 1024, device="cuda").to(torch.bfloat16)
    halves = gate_up.chunk(2, dim=-1)
    want = [h.clone() for h in halves]
    calls = []
    real = pitched.queue

    def counted(args, stream):
        calls.append(args)
        return real(args, stream)

    def run(use):
        streams.PageStreams.pitched_copy = use
        try:
            pool = sl.HostPool([h.numel() * h.element_size() for h in halves], "cuda", two_way=two_way)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                ps = [pool.page_out(h) for h in halves]
                outs = []
                for p in ps:
                    out, ev = pool.page_in_launch(p)
                    pool.page_wait(ev)
                    outs.append(out)
                torch.cuda.synchronize()
            pool.drain()
        finally:
            streams.PageStreams.pitched_copy = True
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name and "emset" not in e.name]
        return outs, kernels

    pitched.queue = counted
    try:
        outs, kernels = run(True)
    finally:
        pitched.queue = real
    assert len(calls) == 4  # two page-outs, two page-ins
    for o, h, w in zip(outs, halves, want):
        assert o.stride() == h.stride() and torch.equal(o, w)
    assert kernels == [], kernels
    outs, kernels = run(False)
    assert all(torch.equal(o, w) for o, w in zip(outs, want)) and len(kernels) >= 4, kernels  # the control gathers and scatters


def test_a_refused_pitched_copy_is_cleared_said_once_and_not_tried_again(monkeypatch):
    """`pitched.queue` (CPU, a stand-in runtime): an error from `cudaMemcpy2DAsync` is cleared
    (`cudaGetLastError`, else the next launch would report it), warned about, answered False, and
    `available()` is False from then on; a copy that goes through answers True."""
    calls = []

    class Runtime:
        err = 0

        def cudaMemcpy2DAsync(self, *args):
            calls.append(("copy", args))
            return self.err

        def cudaGetLastError(self):
            calls.append(("clear",))
            return 0

    class Stream:
        cuda_stream = 77

    rt = Runtime()
    monkeypatch.setattr(pitched, "_runtime", lambda: rt)
    monkeypatch.setattr(pitched, "_refused", [])
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    planned = pitched.args(pitched._D2H, 1000, 2000, 1024, 64, 2048) + (0,)
    assert pitched.available() and pitched.queue(planned, Stream()) is True
    assert calls == [("copy", (2000, 1024, 1000, 2048, 1024, 64, pitched._D2H, 77))]
    calls.clear()
    rt.err = 1
    with pytest.warns(UserWarning, match="refused a pitched page copy"):
        assert pitched.queue(planned, Stream()) is False
    assert [c[0] for c in calls] == ["copy", "clear"] and not pitched.available()


def test_a_pool_that_queued_pitched_copies_waits_for_its_device_at_its_end(monkeypatch):
    """`pool._settle`, a CUDA pool's finalizer (CPU, stand-ins): nothing to wait for when no
    pitched copy was queued; else a device synchronize before the buffers go; during a capture
    the buffers are parked and released after a synchronize by the next settle outside one."""
    from sched_lifetime.paging import pool as pool_mod

    synced, cap = [], [False]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: synced.append(dev))
    monkeypatch.setattr(pool_mod, "capturing", lambda: cap[0])
    monkeypatch.setattr(pool_mod, "_parked", [])
    pool_mod._settle("cuda:0", [False], ["buf"])
    assert synced == [] and pool_mod._parked == []
    pool_mod._settle("cuda:0", [True], ["buf"])
    assert synced == ["cuda:0"]
    cap[0] = True
    pool_mod._settle("cuda:1", [True], ["b1"])
    assert synced == ["cuda:0"] and pool_mod._parked == [("cuda:1", ["b1"])]  # held: no host wait in a capture
    cap[0] = False
    pool_mod._settle("cuda:0", [True], ["b2"])
    assert synced == ["cuda:0", "cuda:0", "cuda:1"] and pool_mod._parked == []
