"""A node's saved tensors as one group (`paging/groups.py`, `HostPool.page_out_group` /
`page_in_group`): each storage paged once, every tensor back with its strides and aliasing."""

import pytest
import torch

import sched_lifetime as sl


def test_a_group_pages_each_storage_once_and_comes_back_with_its_strides_and_aliasing():
    """`page_out_group` / `page_in_group` (a page node's saved activations together), laid out
    by `group_plan`: one tensor saved twice and q, k, v of one projection move once (the bytes
    their storage spans), a lone chunk with gaps on its own (packed), a transposed tensor as
    its bytes; every segment 512-byte aligned; every tensor back equal with its dtype and
    strides, and tensors that shared memory share it again; the buffer free again; tensors
    of different groups are not one group; an expanded tensor is refused."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    qkv = torch.randn(5, 3 * 8)
    q, k, v = qkv.split(8, dim=-1)
    dup = torch.randn(3, 5)
    ts = [dup, q, torch.arange(12, dtype=torch.int64).reshape(3, 4).t(), k, x.chunk(2, dim=-1)[1], dup, v, torch.randn(7).to(torch.bfloat16)]
    plan = sl.paging.group_plan(ts)
    kinds = [(kind, i) for kind, i, *_ in plan.segments]
    assert kinds == [("span", 0), ("span", 1), ("span", 2), ("view", 4), ("span", 7)], kinds
    assert [n for *_, n, _ in plan.segments] == [60, 4 * 5 * 24, 96, 48, 14]
    assert all(off % sl.paging.GROUP_ALIGN == 0 for *_, off in plan.segments)
    assert plan.places[0][0] == plan.places[5][0] and [p[1] for p in plan.places] == [False] * 4 + [True] + [False] * 3
    pool = sl.HostPool([plan.nbytes] * 2, "cpu")
    ps = pool.page_out_group(ts)
    assert pool.in_use() == 1 and pool.mark() == 1 and len({p.slot for p in ps}) == 1
    other = pool.page_out_group(ts)
    with pytest.raises(ValueError, match="not paged out as one group"):
        pool.page_in_group([ps[0], other[1]])
    back, ev = pool.page_in_group(ps)
    assert ev is None and pool.in_use() == 1
    for b, t in zip(back, ts):
        assert b.dtype == t.dtype and b.stride() == t.stride() and torch.equal(b, t)
    # One device block holds them all but the packed one; the same tensor twice is one tensor's
    # memory again, and k sits 8 floats after q, as in qkv.
    blocks = [b.untyped_storage().data_ptr() for b in back]
    assert len(set(blocks[:4] + blocks[5:])) == 1 and blocks[4] != blocks[0]
    assert back[0].data_ptr() == back[5].data_ptr() and back[3].data_ptr() - back[1].data_ptr() == 8 * 4
    assert [torch.equal(b, t) for b, t in zip(pool.page_in_group(other)[0], ts)] == [True] * len(ts)
    assert pool.in_use() == 0
    lone = sl.paging.group_plan([q, k[:, :4], q])  # a view with gaps saved twice, beside another
    assert [kind for kind, *_ in lone.segments] == ["view", "view"] and lone.places == [(0, True), (512, True), (0, True)]
    with pytest.raises(ValueError, match="elements sharing memory"):
        pool.page_out_group([torch.ones(3, 1).expand(3, 4)])


@pytest.mark.cuda
def test_a_group_on_the_gpu_holds_each_storage_once_and_comes_back_as_one_block():
    """On the GPU: two saved views of one storage (q and k of one projection) are one storage
    to the lifetime manager (held and released once, not refused as aliases), a group of dense
    tensors comes back as views of one device block (one copy) with their strides, one with
    gaps as its own tensor; bit-exact; the device storage is released after its copy."""
    dev = torch.device("cuda")
    qkv = torch.randn(64, 3 * 256, device=dev)
    q, k, _ = qkv.split(256, dim=-1)
    dense = [torch.randn(128, 64, device=dev).t(), torch.arange(1000, device=dev), torch.randn(33, device=dev).to(torch.bfloat16)]
    for ts in (dense, [q, k, *dense]):
        want = [t.clone() for t in ts]
        pool = sl.HostPool([sl.paging.group_plan(ts).nbytes], dev)
        ps = pool.page_out_group(ts)
        assert pool.page_outs == 1  # one page-out (its storage released once its copy is done)
        back, ev = pool.page_in_group(ps)
        pool.page_wait(ev)
        bases = {b.untyped_storage().data_ptr() for b in back}
        assert (len(bases) == 1) == (ts is dense)  # one block only when every layout is dense
        for b, t, w in zip(back, ts, want):
            assert b.stride() == t.stride() and torch.equal(b, w)
        pool.drain()
        assert pool.released == 1 and not pool._retiring


@pytest.mark.cuda
def test_page_in_group_of_packed_tensors_keeps_its_block_off_the_compute_stream_until_copied():
    """Every tensor of the group has gaps, so each comes back packed into its own tensor and no
    output keeps the device block alive. The block must not go back to the compute stream's pool
    while the page stream still copies into and scatters out of it: a compute-stream allocation
    of the same size right after the page-in is poisoned while the page stream is held back by
    a sleep kernel; it must keep its bytes, and the paged-in tensors must be bit-exact (issue 35)."""
    dev = torch.device("cuda")
    base = torch.randn(256, 1024, device=dev)
    ts = [base[:, ::2], base[:, 1::4]]  # views with gaps: both packed
    want = [t.clone() for t in ts]
    plan = sl.paging.group_plan(ts)
    assert all(kind == "view" for kind, *_ in plan.segments)
    pool = sl.HostPool([plan.nbytes], dev)
    ps = pool.page_out_group(ts)
    del ts
    torch.cuda.synchronize()
    with torch.cuda.stream(pool.page_in_stream):
        torch.cuda._sleep(200_000_000)  # hold the page-in stream back (~0.1 s)
    back, ev = pool.page_in_group(ps)
    poison = torch.empty(pool._bufs[ps[0].slot].numel(), dtype=torch.uint8, device=dev)
    poison.fill_(0xFF)  # gets the block back if page_in_group freed it to the compute stream
    pool.page_wait(ev)
    torch.cuda.synchronize()
    for b, w in zip(back, want):
        assert torch.equal(b, w)
    # The compute stream's own tensor is intact: had it been handed the block, the page stream's
    # copy (queued behind the sleep) would have overwritten it with the host buffer.
    assert bool((poison == 0xFF).all()), "page_in_group's block was reused by the compute stream while the page stream wrote it"
