"""The host pool (`paging/pool.py`, `slots.py`, `release.py`): the FIFO freelist that never allocates
in a step, page-out/page-in with the strides kept, the freelist's order on the page stream
(against a control that corrupts), and releases of exactly the page-outs queued before a page-in."""

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
SLEEP = 20_000_000  # ~10 ms of GPU sleep on the page stream before the page-in


def _freelist_poison(ordered: bool) -> int:
    """A page-in delayed on the page stream, then at once a new page-out into the same (only)
    host buffer. `ordered`: the page-out goes through the pool (queued on the page stream);
    control: the same buffer is rewritten by a copy on another stream, skipping that order.
    Returns how many of the iterations reloaded a corrupt tensor."""
    n = 1 << 20
    pool = sl.HostPool([4 * n], "cuda")
    other = torch.cuda.Stream()
    bad = 0
    for it in range(POISON_ITERS):
        want = torch.full((n,), float(it), device="cuda")
        poison = torch.full((n,), -1.0, device="cuda")
        other.wait_stream(torch.cuda.current_stream())  # the control's copy may read `poison`
        p = pool.page_out(want)
        with torch.cuda.stream(pool.page_stream):
            torch.cuda._sleep(SLEEP)
        # A prefetched page-in: queued behind the sleep, the compute stream has not waited on it
        # yet, and the buffer is already back on the freelist.
        got, ev = pool.page_in_launch(p)
        if ordered:
            q = pool.page_out(poison)
            slot = q.slot
        else:
            slot = pool.take(4 * n)
            with torch.cuda.stream(other):
                pool.view(slot, (n,), torch.float32).copy_(poison, non_blocking=True)
        pool.page_wait(ev)
        torch.cuda.synchronize()
        bad += int(not torch.equal(got, want))
        pool.give(slot)
        pool.drain()
    return bad


@pytest.mark.cuda
def test_freelist_reuse_is_ordered_on_the_page_stream_and_the_control_corrupts():
    assert _freelist_poison(ordered=True) == 0
    corrupt = _freelist_poison(ordered=False)
    assert corrupt > POISON_ITERS // 2, f"control corrupted only {corrupt}/{POISON_ITERS}: the test has no teeth here"


def test_a_page_in_releases_exactly_the_page_outs_queued_before_it():
    """`release_queued_before(mark)`: the page-outs numbered below a page-in's mark ran before
    it on the page stream, so they (and no later one) give their device storage back, oldest
    first, each by its owner's acquire and finalize (no event query: capture-safe)."""
    pool = sl.HostPool([16], "cpu")
    calls = []

    class Manager:
        def __init__(self, k):
            self.k = k

        def acquire(self, owner):
            calls.append(("acquire", self.k, owner))

        def finalize(self):
            calls.append(("finalize", self.k))

        def close(self):
            pass

    for k in range(4):
        pool._retiring.append((Manager(k), f"ev{k}", f"owner{k}", k))
    pool.page_outs = 4
    pool.release_queued_before(2)
    assert calls == [("acquire", 0, "owner0"), ("finalize", 0), ("acquire", 1, "owner1"), ("finalize", 1)]
    assert [e[3] for e in pool._retiring] == [2, 3] and pool.released == 2
    assert pool._spare == ["ev0", "ev1"]  # their copy-done events are recycled
    pool.release_queued_before(2)  # nothing below the mark is left
    assert len(calls) == 4
    assert pool.mark() == 4
    pool.release_queued_before(pool.mark())
    assert not pool._retiring and pool.released == 4
