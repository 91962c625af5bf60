"""The host pool (`paging/pool.py`, `slots.py`, `release.py`, `slot_order.py`): the FIFO freelist that
never allocates in a step, page-out/page-in with the strides kept, a buffer's copies in order
across the two page streams (on the GPU, against a control that corrupts; the bookkeeping on the
CPU: test_paging_slot_order.py), and releases of exactly the page-outs a page-in proves done."""

import pytest
import torch

import sched_lifetime as sl


def test_host_pool_freelist_is_fifo_per_size_and_never_allocates_in_a_step():
    pool = sl.HostPool([64, 64, 32])
    a, b = pool.take(64), pool.take(64)
    assert a != b and pool.in_use() == 2
    with pytest.raises(RuntimeError, match="exhausted: all 2 buffers of 64 bytes"):
        pool.take(64)
    with pytest.raises(RuntimeError, match="no buffer of 48 bytes"):
        pool.take(48)
    pool.give(b)
    pool.give(a)
    assert pool.take(64) == b  # given back first, taken first: the freelist keeps give order
    with pytest.raises(RuntimeError, match="given back but not taken"):
        pool.give(a)
    with pytest.raises(ValueError, match="positive byte counts"):
        sl.HostPool([0])
    with pytest.raises(ValueError, match="group_out must be an int >= 1"):
        sl.HostPool([64], group_out=0)
    # page_out/page_in round-trip through a buffer, and the buffer is free again after page_in
    pool = sl.HostPool([4 * 6])
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    p = pool.page_out(x)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.page_out(x)
    assert torch.equal(pool.page_in(p), x) and pool.in_use() == 0


def test_page_in_restores_the_strides_and_elements_sharing_memory_are_not_paged():
    """A saved view (a chunk along the last dim) comes back with its strides: a backward kernel
    given another layout may round differently (it did on the made-up shape below). An expanded
    tensor cannot be rebuilt so: page_out refuses it, and both ways in keep it on the device."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = x.chunk(2, dim=-1)[1]
    assert not view.is_contiguous() and sl.paging.restorable(view)
    pool = sl.HostPool([4 * 12])
    back = pool.page_in(pool.page_out(view))
    assert torch.equal(back, view) and back.stride() == view.stride()
    expanded = torch.ones(3, 1).expand(3, 4)
    assert not sl.paging.restorable(expanded) and sl.paging.restorable(torch.ones(3, 4).t())
    with pytest.raises(ValueError, match="elements sharing memory"):
        pool.page_out(expanded)
    pager = sl.Pager(1.0, min_distance=0, min_bytes=1)
    w = torch.randn(4, requires_grad=True)
    for _ in range(2):
        with pager.step():
            (torch.ones(3, 1).expand(3, 4) * w).sum().backward()  # mul saves the expanded tensor
    assert pager.plan["page"] == [] and pager.stats()["bytes_out"] == 0


POISON_ITERS = 200
SLEEP = 20_000_000  # ~10 ms of GPU sleep on a page stream before a copy


def _slot_poison(case: str, two_way: bool = True, rule: bool = True) -> tuple[int, int]:
    """One host buffer reused at once while its last copy is held back on the GPU by a sleep:
    `read_then_write`: a prefetched page-in (queued behind a sleep on the page-in stream, not
    waited on yet, its buffer already back on the freelist), then at once a page-out of poison
    into the same buffer; `write_then_read`: the buffer poisoned on the host, a page-out queued
    behind a sleep on the page stream, then at once its page-in. The page-in must read what
    was paged out, bit for bit. `rule=False` is the control: `SlotOrder.wait_for` asks for no
    wait (the rule broken). Returns (iterations that reloaded a corrupt tensor, waits the rule
    queued)."""
    n = 1 << 20
    pool = sl.HostPool([4 * n], "cuda", two_way=two_way)
    assert (pool.page_in_stream != pool.page_stream) == two_way
    if not rule:
        pool.slot_order.wait_for = lambda slot, stream: None
    bad = 0
    for it in range(POISON_ITERS):
        want = torch.full((n,), float(it), device="cuda")
        poison = torch.full((n,), -1.0, device="cuda")
        if case == "read_then_write":
            p = pool.page_out(want)
            with torch.cuda.stream(pool.page_in_stream):
                torch.cuda._sleep(SLEEP)
            got, ev = pool.page_in_launch(p)
            q = pool.page_out(poison)
            assert q.slot == p.slot  # the only buffer: the one the page-in still reads
            pool.give(q.slot)
        else:
            torch.cuda.synchronize()  # nothing in flight: the host may write the buffer
            pool._bufs[0].view(torch.float32).fill_(-1.0)
            with torch.cuda.stream(pool.page_stream):
                torch.cuda._sleep(SLEEP)
            p = pool.page_out(want)
            got, ev = pool.page_in_launch(p)
        pool.page_wait(ev)
        pool.recycle(ev)
        torch.cuda.synchronize()
        bad += int(not torch.equal(got, want))
        pool.drain()
    assert pool.in_use() == 0
    return bad, pool.slot_order.waits


@pytest.fixture(params=["native", "python"])
def copy_calls(request, monkeypatch):
    """The pool's copies as one native call each (`page_copy`) or as the same CUDA calls from
    Python; the native calls are counted either way (`calls`, and `waits`: those that queued a
    slot wait), so a test knows which path its copies took."""
    from sched_lifetime.paging import streams

    native = streams._page_copy
    assert native is not None, "the library has no page_copy"
    count = {"mode": request.param, "calls": 0, "waits": 0}

    def counted(*args):
        count["calls"] += 1
        count["waits"] += args[5] != 0
        return native(*args)

    monkeypatch.setattr(streams, "_page_copy", counted)
    monkeypatch.setattr(streams.PageStreams, "native_copy", request.param == "native")
    yield count
    assert (count["calls"] > 0) == (request.param == "native"), count


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["read_then_write", "write_then_read"])
def test_two_way_buffer_reuse_waits_for_its_last_copy_and_the_control_corrupts(case, copy_calls):
    bad, waits = _slot_poison(case)
    assert bad == 0
    assert waits >= POISON_ITERS  # every iteration needed a wait across the two streams
    if copy_calls["mode"] == "native":  # after the first copies (their events new), the waits go through page_copy
        assert copy_calls["waits"] >= POISON_ITERS - 2, copy_calls
    corrupt, _ = _slot_poison(case, rule=False)
    assert corrupt > POISON_ITERS // 2, f"control corrupted only {corrupt}/{POISON_ITERS}: the test has no teeth here"


@pytest.mark.cuda
def test_one_page_stream_orders_buffer_reuse_by_itself(copy_calls):
    bad, waits = _slot_poison("read_then_write", two_way=False)
    assert bad == 0 and waits == 0  # one stream: its order, no event wait


class _Manager:
    """A lifetime manager stand-in for the release tests: records its acquire and finalize."""

    def __init__(self, k, calls):
        self.k, self.calls = k, calls

    def acquire(self, owner):
        self.calls.append(("acquire", self.k, owner))

    def finalize(self):
        self.calls.append(("finalize", self.k))

    def close(self):
        pass


def test_a_page_in_releases_exactly_the_page_outs_queued_before_it():
    """`release_queued_before(mark)`: the page-outs numbered below a page-in's mark ran before
    it on the page stream, so they (and no later one) give their device storage back, oldest
    first, each by its owner's acquire and finalize (no event query: capture-safe)."""
    pool = sl.HostPool([16], "cpu")
    calls = []
    for k in range(4):
        pool._retiring.append((_Manager(k, calls), f"ev{k}", f"owner{k}", k, 1))
    pool.page_outs = pool._held = 4
    pool.release_queued_before(2)
    assert calls == [("acquire", 0, "owner0"), ("finalize", 0), ("acquire", 1, "owner1"), ("finalize", 1)]
    assert [e[3] for e in pool._retiring] == [2, 3] and pool.released == 2
    assert pool._spare == ["ev0", "ev1"]  # their copy-done events are recycled
    pool.release_queued_before(2)  # nothing below the mark is left
    assert len(calls) == 4
    assert pool.mark() == 4
    pool.release_queued_before(pool.mark())
    assert not pool._retiring and pool.released == 4


def test_a_group_held_as_one_is_released_once_all_of_it_is_due():
    """A group of page-outs queued behind one wait is held by one manager (one wait of the
    compute stream to release it): a plan's release point (`release_until`) releases it only
    once every page-out in it is due, a page-in's mark only once it proves all of it done."""
    pool = sl.HostPool([16], "cpu")
    calls = []
    # page-out 0 alone, 1-3 as a group, 4 alone
    for k, (first, count) in enumerate(((0, 1), (1, 3), (4, 1))):
        pool._retiring.append((_Manager(k, calls), f"ev{k}", "owner", first, count))

    def order():  # the groups released, in order
        return [c[1] for c in calls if c[0] == "acquire"]

    pool.page_outs = pool._held = 5
    pool.release_until(3)  # 0, 1 and 2 due: the group is not all due
    assert order() == [0] and pool.released == 1 and pool._held == 4
    pool.release_queued_before(3)  # a page-in that proves 0-2 done: not all of the group
    assert order() == [0]
    pool.release_queued_before(4)
    assert order() == [0, 1] and pool.released == 4 and pool._held == 1 and pool._spare == ["ev0", "ev1"]
    pool.release_until(5)
    assert order() == [0, 1, 2] and not pool._retiring and pool._held == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_grouped_page_outs_wait_for_a_full_group_or_whatever_needs_them(device):
    """`group_out`: page-outs are queued only when the group is full (one wait on the GPU for all
    of them) or when something needs them: a page-in (any: FIFO), a release point past them,
    `drain`; a step cut short drops them unqueued and gets every buffer back. Until queued a
    copy has not run (on the CPU too: its buffer is still empty). Page-ins due at one point go
    behind one wait too (`page_in_launch_many`)."""
    pool = sl.HostPool([16] * 6, device, group_out=3)
    for b in pool._bufs:  # host memory comes uninitialised: zeros tell "not copied yet"
        b.zero_()
    xs = [torch.full((4,), float(k + 1), device=device) for k in range(6)]

    def host(p):
        torch.cuda.synchronize() if device == "cuda" else None
        return pool.view_of(p).clone()

    ps = [pool.page_out(x) for x in xs[:2]]
    assert pool.page_outs == 0 and len(pool._deferred) == 2 and pool.in_use() == 2
    assert not host(ps[0]).any()  # nothing copied yet
    ps.append(pool.page_out(xs[2]))  # the group is full: all three queued, in save order
    assert pool.page_outs == 3 and not pool._deferred and [pool._wrote[p.slot] for p in ps] == [0, 1, 2]
    assert all(torch.equal(host(p), x.cpu()) for p, x in zip(ps, xs))
    ps.append(pool.page_out(xs[3]))
    assert pool.page_outs == 3
    assert torch.equal(pool.page_in(ps[0]), xs[0]) and pool.page_outs == 4  # a page-in queues what waits
    ps.append(pool.page_out(xs[4]))
    pool.release_until(pool.released + len(pool._retiring) + 1)  # a release point past the deferred one
    assert pool.page_outs == 5 and not pool._deferred
    ps.append(pool.page_out(xs[5]))
    pool.drain()
    assert pool.page_outs == 6 and not pool._retiring and pool.released == (6 if device == "cuda" else 0)
    # Page-ins due at one point: allocated first, then one wait and the copies (each its event).
    got = pool.page_in_launch_many(ps[1:])
    for (out, ev), x in zip(got, xs[1:]):
        pool.page_wait(ev)
        assert torch.equal(out, x)
    assert pool.in_use() == 0 and (device == "cpu") == all(ev is None for _, ev in got)
    with pytest.raises(RuntimeError, match="page_in"):  # each handle is checked: paged in already
        pool.page_in_launch_many([ps[1]])
    # Cut short with page-outs deferred: nothing queued, every buffer back.
    pool.page_out(xs[0])
    pool.abandon()
    assert pool.page_outs == 6 and not pool._deferred and pool.in_use() == 0


@pytest.mark.parametrize("two_way", [True, False])
def test_a_two_way_page_in_proves_done_only_the_page_outs_up_to_its_buffers(two_way):
    """On one page stream a page-in runs after every page-out queued before it; two-way it
    waited only for the page-out that wrote its buffer (and the page stream runs page-outs in
    order): its mark counts those, so a release there never stalls on a later page-out."""
    pool = sl.HostPool([16, 16, 16], "cpu", two_way=two_way)
    ps = [pool.page_out(torch.full((4,), float(k))) for k in range(3)]
    assert [p.slot for p in ps] == [0, 1, 2] and pool.mark() == 3
    assert pool.mark(ps[1].slot) == (2 if two_way else 3)
    pool.page_in(ps[1])
    p = pool.page_out(torch.zeros(4))  # page-out number 3, into the buffer given back
    assert p.slot == 1 and pool.mark(1) == 4 and pool.mark(0) == (1 if two_way else 4)


def test_the_one_call_page_copy_refuses_bad_arguments_before_any_device_call():
    """`page_copy` (cpp/direct.cc) unpacks every argument before it queues anything: a wrong
    count, a non-tensor, a non-stream or a wait for `after` without its event are errors, a
    tensor subclass answers NotImplemented (the pool then makes the calls from Python)."""
    from sched_lifetime._ops import direct

    a, b = torch.zeros(4), torch.ones(4)
    s = torch.Stream(device="cpu")
    with pytest.raises(TypeError, match="takes 8 arguments"):
        direct.page_copy(a, b, s)
    with pytest.raises(ValueError, match="item 1 is a str"):
        direct.page_copy(a, "b", s, None, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="stream must be a torch.Stream"):
        direct.page_copy(a, b, "s", None, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="needs a created `mark` event"):
        direct.page_copy(a, b, s, s, 0, 0, 0, 0)

    class Sub(torch.Tensor):
        pass

    assert direct.page_copy(a, b.as_subclass(Sub), s, None, 0, 0, 0, 0) is NotImplemented
    assert torch.equal(a, torch.zeros(4))  # nothing copied


def test_queue_copy_takes_one_native_call_once_its_events_exist_and_falls_back_otherwise(monkeypatch):
    """`PageStreams._queue_copy` (CPU, stand-ins for the streams, events and `page_copy`): with
    every event created it makes one `page_copy` call carrying the slot rule's wait and the
    records; an event never recorded (handle 0) or a tensor `page_copy` does not take
    (NotImplemented) takes the calls from Python, and the rule's wait is counted once."""
    from sched_lifetime.paging import SlotOrder, streams

    log = []

    class Ev:
        def __init__(self, handle):
            self.cuda_event = handle

        def record(self, stream):
            log.append(("record", self.cuda_event, stream))
            self.cuda_event = self.cuda_event or 99  # a first record creates it

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", ev.cuda_event, self.name))

    answer = [None]

    def page_copy(dst, src, stream, after, mark, wait, done, slot):
        log.append(("page_copy", stream.name, after.name, mark, wait, done, slot))
        if answer[0] is None:
            dst.copy_(src)
        return answer[0]

    monkeypatch.setattr(streams, "_page_copy", page_copy)
    monkeypatch.setattr(streams, "record", lambda ev, stream: ev.record(stream.name))
    ps = streams.PageStreams("cpu")
    ps.native_copy = True
    ps._mark = Ev(1)
    monkeypatch.setattr(ps, "_after", lambda page, comp: log.append(("after", page.name, comp.name)))
    monkeypatch.setattr(ps, "_on", lambda page: log.append(("on", page.name)))
    monkeypatch.setattr(ps, "_back", lambda prev: log.append(("back",)))
    handles = iter([11, 12])
    order = SlotOrder(2, event=lambda: Ev(next(handles)), capturing=lambda: False)
    out, inn, comp = Stream("out"), Stream("in"), Stream("comp")
    src, dst = torch.arange(4.0), torch.zeros(4)

    ps._spare = [Ev(21)]
    assert ps._queue_copy(out, comp, dst, src, order, 0).cuda_event == 21
    assert log == [("page_copy", "out", "comp", 1, 0, 21, 11)] and torch.equal(dst, src)
    log.clear()
    ps._spare = [Ev(22)]
    ps._queue_copy(inn, comp, dst, src, order, 0)  # slot 0's last copy ran on `out`: the wait rides along
    assert log == [("page_copy", "in", "comp", 1, 11, 22, 11)] and order.waits == 1
    log.clear()
    ps._spare = [Ev(0)]  # a new done event, never recorded: the calls from Python create it
    ps._queue_copy(out, comp, dst, src, order, 1)
    assert [x[0] for x in log] == ["after", "on", "back", "record", "record"] and order.waits == 1
    log.clear()
    answer[0] = NotImplemented  # not a plain tensor: from Python, the wait counted once
    ps._spare = [Ev(23)]
    ps._queue_copy(out, comp, dst, src, order, 0)  # slot 0's last copy ran on `in`
    assert [x[0] for x in log] == ["page_copy", "after", "wait", "on", "back", "record", "record"]
    assert log[2] == ("wait", 11, "out") and order.waits == 2


def test_the_one_call_page_copy_copies_and_lets_a_python_error_inside_the_copy_through():
    """On the CPU `page_copy` with no events is the copy alone; an error a dispatch mode raises
    inside the copy comes back as that error (not a SystemError), and the current stream stays."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sched_lifetime._ops import direct

    a, b = torch.zeros(4), torch.arange(4.0)
    s = torch.Stream(device="cpu")
    assert direct.page_copy(a, b, s, None, 0, 0, 0, 0) is None and torch.equal(a, b)

    class Refuses(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                raise ValueError("no copies here")
            return func(*args, **(kwargs or {}))

    with Refuses(), pytest.raises(ValueError, match="no copies here"):
        direct.page_copy(torch.zeros(4), b, s, None, 0, 0, 0, 0)
    assert direct.page_copy(a, b * 2, s, None, 0, 0, 0, 0) is None and torch.equal(a, b * 2)


def test_a_handle_paged_in_twice_is_refused_even_after_its_buffer_was_taken_again():
    """A stale handle (paged in already) read another page-out's bytes once that page-out took
    its buffer, and gave that buffer back under the live handle; now both cases are refused,
    and the live handle still pages in its own tensor. Groups too."""
    pool = sl.HostPool([4096])
    a, b = torch.arange(1024.0), torch.zeros(1024)
    ha = pool.page_out(a)
    assert torch.equal(pool.page_in(ha), a)
    with pytest.raises(RuntimeError, match=r"page_in: a stale handle: host buffer 0 was given back \(this handle was paged in already\); page each"):
        pool.page_in(ha)
    hb = pool.page_out(b)
    with pytest.raises(RuntimeError, match="a stale handle: host buffer 0 was given back .* and taken by another page-out since"):
        pool.page_in(ha)
    assert torch.equal(pool.page_in(hb), b) and pool.in_use() == 0
    g = pool.page_out_group([torch.ones(512), torch.full((512,), 2.0)])
    back, _ = pool.page_in_group(g)
    assert torch.equal(back[1], torch.full((512,), 2.0))
    with pytest.raises(RuntimeError, match="page_in_group: a stale handle"):
        pool.page_in_group(g)


def test_a_page_in_under_deterministic_algorithms_allocates_without_a_fill():
    """Under `torch.use_deterministic_algorithms(True)` torch fills each new tensor (a kernel per
    page-in on the compute stream); a page-in's tensor is written whole by its copy, so the
    pool allocates it unfilled (`pool.empty_unfilled`: a storage of its extent, viewed; no
    process-wide setting changed), alone and in a group, strides kept. The control: a plain
    allocation in the same mode fills."""
    from sched_lifetime.paging.pool import empty_unfilled

    def fills(fn):  # fills of tensors with elements (a zero-element fill_ runs no kernel)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            out = fn()
        return out, sum(e.name == "aten::fill_" and e.input_shapes and e.input_shapes[0] and all(e.input_shapes[0]) for e in prof.events())

    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert fills(lambda: torch.empty(8))[1] == 1  # the control: torch fills here
        assert fills(lambda: torch.empty_strided((4, 3), (6, 1)))[1] == 1
        pool = sl.HostPool([4 * 24, 4 * 12])
        back, n = fills(lambda: pool.page_in(pool.page_out(x)))
        assert n == 0 and torch.equal(back, x)
        half = x[:, 3:]
        back, n = fills(lambda: pool.page_in(pool.page_out(half)))
        assert n == 0 and torch.equal(back, half) and back.stride() == half.stride()
        ts = [x, half]
        gpool = sl.HostPool([sl.paging.group_plan(ts).nbytes])
        handles = gpool.page_out_group(ts)
        (got, _), n = fills(lambda: gpool.page_in_group(handles))
        assert n == 0 and all(torch.equal(g, t) for g, t in zip(got, ts))
        assert torch.utils.deterministic.fill_uninitialized_memory  # the setting untouched
        e = empty_unfilled((2, 3), (1, 2), torch.int64, "cpu")
        assert e.shape == (2, 3) and e.stride() == (1, 2) and e.untyped_storage().nbytes() == 6 * 8
        assert empty_unfilled((0, 3), (3, 1), torch.float32, "cpu").numel() == 0
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():  # traced (a fake tensor has no storage to set): torch's allocation
            assert empty_unfilled((2, 3), (1, 2), torch.float32, "cpu").stride() == (1, 2)
    finally:
        torch.use_deterministic_algorithms(was)
