"""The freelist's rule across the two page streams (`paging/slot_order.py`), on the CPU: a host
buffer is rewritten or read only after its last copy has finished. Stand-in streams and events
log what `SlotOrder` queues; an independent happens-before check over that log (stream order
plus event waits, nothing of `SlotOrder`'s own state) finds every pair of copies of one buffer
that the GPU could run out of order. A control with the wait left out must be caught. The same
rule on the GPU, with a delayed copy and a poisoned buffer: test_paging_pool.py."""

import collections
import random

import pytest

from sched_lifetime.paging import SlotOrder


class Log:
    """The GPU as the stand-ins see it: per operation, the operations it waits for directly
    (the one before it on its stream, and for a wait, the last operation before the event's
    record)."""

    def __init__(self) -> None:
        self.deps: list[list[int]] = []
        self.copies: list[tuple[int, int, str]] = []  # (operation, slot, "out" | "in"), in issue order
        self.waits: list[tuple[str, str, int]] = []  # (waiting stream, event, the operation it waits for)

    def ordered(self, a: int, b: int) -> bool:
        """Whether operation `a` finishes before `b` starts (`b` reaches `a` through its deps)."""
        seen, todo = set(), [b]
        while todo:
            n = todo.pop()
            for d in self.deps[n]:
                if d == a:
                    return True
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return False

    def races(self) -> list[tuple]:
        """Consecutive copies of one buffer the GPU may run out of order (each later copy must
        come after the one before it: then all of them are in order)."""
        last: dict[int, tuple[int, str]] = {}
        out = []
        for op, slot, kind in self.copies:
            if slot in last and not self.ordered(last[slot][0], op):
                out.append((slot, last[slot][1], kind))
            last[slot] = (op, kind)
        return out


class Stream:
    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name, self.last = log, name, None

    def _op(self, extra: list[int]) -> int:
        self.log.deps.append(([self.last] if self.last is not None else []) + extra)
        self.last = len(self.log.deps) - 1
        return self.last

    def wait_event(self, ev: "Event") -> None:
        self.log.waits.append((self.name, ev.name, ev.rec))
        self._op([ev.rec] if ev.rec is not None else [])

    def copy(self, slot: int, kind: str) -> None:
        self.log.copies.append((self._op([]), slot, kind))


class Event:
    def __init__(self, name: str) -> None:
        self.name, self.rec = name, None

    def record(self, stream: Stream) -> None:
        self.rec = stream.last  # a wait on it waits for everything queued on `stream` so far


def order_with(slots: int, capturing=lambda: False, cls=SlotOrder) -> SlotOrder:
    names = iter(range(slots))
    return cls(slots, event=lambda: Event(f"ev{next(names)}"), capturing=capturing)


def copy(order: SlotOrder, stream: Stream, slot: int, kind: str, one_call: bool = False) -> None:
    """A copy as `HostPool` queues it: `before`, the copy, `after`; `one_call`: as its one native
    call (`page_copy`) queues it, the rule asked with `wait_for` and the slot's event recorded
    by the caller (`recorded`)."""
    if one_call:
        ev = order.wait_for(slot, stream)
        if ev is not None:
            stream.wait_event(ev)
        stream.copy(slot, kind)
        order.event(slot).record(stream)
        order.recorded(slot, stream)
        return
    order.before(slot, stream)
    stream.copy(slot, kind)
    order.after(slot, stream)


def test_each_copy_waits_for_its_buffers_last_copy_on_the_other_stream_only():
    log = Log()
    out, inn = Stream(log, "out"), Stream(log, "in")
    order = order_with(2)
    copy(order, out, 0, "out")  # the buffer's first copy: nothing to wait for
    assert log.waits == []
    copy(order, inn, 0, "in")  # reads what the page-out wrote: waits for it
    assert log.waits == [("in", "ev0", 0)]
    copy(order, out, 1, "out")  # another buffer: no wait
    copy(order, out, 0, "out")  # rewrites what the page-in read: waits for the page-in (operation 2)
    assert log.waits == [("in", "ev0", 0), ("out", "ev0", 2)]
    copy(order, out, 1, "out")  # a page-out never paged in, its buffer reclaimed: the stream orders it
    assert len(log.waits) == 2 and order.waits == 2
    assert log.races() == []


def test_one_page_stream_needs_no_wait():
    log = Log()
    page = Stream(log, "page")
    order = order_with(1)
    for k in range(4):
        copy(order, page, 0, "out" if k % 2 == 0 else "in")
    assert log.waits == [] and order.waits == 0 and log.races() == []


class LeavesTheWaitOut(SlotOrder):
    """The control: the rule broken (every copy queued without its wait, either way of queueing)."""

    def wait_for(self, slot, stream):
        return None


def pool_like(rng: random.Random, cls=SlotOrder, two_way: bool = True, ops: int = 60, one_call: bool = False) -> Log:
    """A pool's use of its buffers, at random: page-outs take the buffer given back longest ago
    (FIFO), page-ins come back in any order (prefetch) and give it back at once, and now and then
    a step is cut short (its page-outs never paged in, their buffers reclaimed)."""
    log = Log()
    out = Stream(log, "out")
    inn = Stream(log, "in") if two_way else out
    slots = rng.randint(1, 4)
    order = order_with(slots, cls=cls)
    free, paged = collections.deque(range(slots)), []
    for _ in range(ops):
        r = rng.random()
        if r < 0.05:
            free.extend(paged)
            paged.clear()
        elif free and (r < 0.55 or not paged):
            slot = free.popleft()
            copy(order, out, slot, "out", one_call)
            paged.append(slot)
        elif paged:
            slot = paged.pop(rng.randrange(len(paged)))
            copy(order, inn, slot, "in", one_call)
            free.append(slot)
    return log


@pytest.mark.parametrize("one_call", [False, True])
def test_random_pool_use_never_lets_a_buffer_be_reused_early_and_the_control_races(one_call):
    rng = random.Random(32)
    for _ in range(300):
        assert pool_like(rng, one_call=one_call).races() == []
        assert pool_like(rng, two_way=False, one_call=one_call).races() == []  # one stream: its order suffices
    # The checker sees what a missing wait does: without the rule most runs race.
    raced = sum(bool(pool_like(rng, LeavesTheWaitOut, one_call=one_call).races()) for _ in range(100))
    assert raced > 50, raced


def test_asking_the_rule_and_queueing_it_leave_the_same_log():
    """`wait_for` + `recorded` (the one-call copy) and `before` + `after` queue the same waits."""
    logs = []
    for one_call in (False, True):
        rng = random.Random(7)
        logs.append([(pool_like(rng, one_call=one_call).waits) for _ in range(50)])
    assert logs[0] == logs[1] and any(logs[0])


def test_no_wait_crosses_a_capture_edge():
    """An event recorded before a capture is not waited on inside it, one recorded in a capture
    not after it; inside one capture the rule holds as outside."""
    log = Log()
    out, inn = Stream(log, "out"), Stream(log, "in")
    capturing = [False]
    order = order_with(2, capturing=lambda: capturing[0])
    copy(order, out, 0, "out")  # eager
    capturing[0] = True
    copy(order, inn, 0, "in")  # captured: the eager page-out's record is not waited on
    assert log.waits == []
    copy(order, out, 0, "out")  # captured: waits for the captured page-in
    assert log.waits == [("out", "ev0", 1)]
    capturing[0] = False
    copy(order, inn, 0, "in")  # eager again: the captured record is not waited on
    copy(order, out, 0, "out")  # eager: waits for the eager page-in
    assert log.waits == [("out", "ev0", 1), ("out", "ev0", 4)]


@pytest.mark.parametrize("two_way", [True, False])
def test_a_pool_on_cpu_keeps_its_copies_in_order_without_streams(two_way):
    """On the CPU a copy is done when queued: the pool has no `SlotOrder`, and a buffer reused at
    once holds what was paged out last."""
    import torch

    import sched_lifetime as sl

    pool = sl.HostPool([16], "cpu", two_way=two_way)
    assert pool.slot_order is None and pool.page_stream is None and pool.page_in_stream is None
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    pa = pool.page_out(a)
    back, ev = pool.page_in_launch(pa)
    pb = pool.page_out(b)
    assert pb.slot == pa.slot and ev is None
    assert torch.equal(back, a) and torch.equal(pool.page_in(pb), b)


def test_the_page_copies_event_calls_fall_back_to_the_events_methods_without_cuda_events():
    """A CPU-only torch build puts a placeholder class at `torch._C._CudaEventBase`: the paging
    modules still load, and their event calls use the events' own methods (the pool makes no
    CUDA event there); with CUDA events they are the C methods, (event, stream) arguments."""
    import torch

    from sched_lifetime.paging import streams

    class Placeholder:  # what torch.cuda installs without CUDA: no methods
        pass

    calls = []

    class Ev:
        def record(self, stream):
            calls.append(("record", stream))

        def wait(self, stream):
            calls.append(("wait", stream))

        def query(self):
            return True

    record, wait, query = streams._event_calls(Placeholder)
    ev = Ev()
    record(ev, "s1")
    wait(ev, "s2")
    assert query(ev) and calls == [("record", "s1"), ("wait", "s2")]
    # The package loads with the placeholder in place (a fresh process: the modules bind the
    # calls at import).
    import os
    import subprocess
    import sys

    import sched_lifetime

    code = (
        "import torch\nclass Placeholder: pass\ntorch._C._CudaEventBase = Placeholder\n"
        "import sched_lifetime\nfrom sched_lifetime.paging import streams\nassert streams.record.__name__ == '<lambda>'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(sched_lifetime.__file__)), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    base = getattr(torch._C, "_CudaEventBase", None)
    if base is not None and hasattr(base, "record"):
        assert streams.record is base.record and streams.wait is base.wait
