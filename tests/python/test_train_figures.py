"""The main job's figures (`sched_lifetime.train.figures`) on synthetic inputs: exposed
communication and page-copy time from profiler kernel intervals, the allocator's timeline and
its plot, and the printed table."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from sched_lifetime.train.figures import (
    allocator_timeline,
    exposed_comm_us,
    exposed_page_us,
    format_table,
    median_exposed,
    plot_allocator,
    top_kernels,
    union,
)


def _event(name: str, start: float, end: float, cuda: bool = True, annotation: bool = False, id: int = 0, thread: int = 1) -> SimpleNamespace:
    dev = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name, device_type=dev, is_user_annotation=annotation, time_range=SimpleNamespace(start=start, end=end), id=id, thread=thread
    )


class _Profile:
    def __init__(self, events: list) -> None:
        self._events = events

    def events(self) -> list:
        return self._events


def test_union_merges_overlapping_and_touching_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 10)]) == [[0, 4], [5, 7], [9, 10]]
    assert union([]) == []
    assert union([(2, 3), (0, 10)]) == [[0, 10]]  # a contained interval keeps the outer end
    assert union([(0, 10), (2, 3), (5, 12), (12.5, 13)]) == [[0, 12], [12.5, 13]]


def test_exposed_comm_over_several_transfers_with_compute_between_and_after():
    """Four transfers, compute before, between, across two of them and after the last
    compute: each transfer's covered part counted once, none missed by the sweep."""
    comm = [(10, 20), (40, 50), (70, 80), (120, 130)]
    comp = [(0, 5), (15, 45), (20, 30), (60, 65), (78, 90)]  # (20, 30) inside (15, 45)
    prof = _Profile([_event("ncclDevKernel_AllToAll", s, t) for s, t in comm] + [_event("gemm", s, t) for s, t in comp])
    # Covered: 15-20 of the first, 40-45 of the second, 78-80 of the third, none of the last.
    assert exposed_comm_us(prof) == (40 - 5 - 5 - 2, 40)
    assert exposed_comm_us(_Profile([_event("ncclDevKernel_AllToAll", 0, 10)])) == (10, 10)  # no compute at all
    assert exposed_comm_us(_Profile([_event("gemm", 0, 10)])) == (0, 0)  # no communication
    # An event without the `is_user_annotation` attribute (older profilers) is a kernel.
    bare = SimpleNamespace(name="gemm", device_type=torch.autograd.DeviceType.CUDA, time_range=SimpleNamespace(start=0, end=10))
    assert exposed_comm_us(_Profile([_event("ncclDevKernel_AllToAll", 0, 10), bare])) == (0, 10)


def test_exposed_comm_is_nccl_time_no_compute_kernel_covers():
    prof = _Profile([
        _event("ncclDevKernel_AllToAll", 0, 100),  # 0-100, with compute on 20-50 and 40-60: 60 exposed
        _event("ncclDevKernel_AllToAll", 90, 120),  # overlaps the first: the union is 0-120
        _event("gemm", 20, 50),
        _event("gemm", 40, 60),
        _event("elementwise", 110, 130),  # covers 110-120
        _event("nccl:all_to_all", 0, 120, annotation=True),  # a user range on the GPU timeline: not a kernel
        _event("ncclKernel_cpu_side", 0, 1000, cuda=False),  # a CPU event: ignored
    ])
    exposed, total = exposed_comm_us(prof)
    assert (exposed, total) == (120 - 40 - 10, 120)


def test_exposed_page_copy_is_not_covered_by_nccl_kernels():
    prof = _Profile([
        _event("Memcpy DtoH (Device -> Pinned)", 0, 50),
        _event("Memcpy HtoD (Pinned -> Device)", 100, 150),
        _event("Memcpy DtoD (Device -> Device)", 0, 500),  # not a page copy: compute-like, covers all
        _event("ncclDevKernel_AllToAll", 0, 200),
    ])
    assert exposed_page_us(prof) == (0, 100)
    prof = _Profile([_event("Memcpy DtoH (Device -> Pinned)", 0, 50), _event("ncclDevKernel_AllToAll", 0, 200), _event("gemm", 0, 10)])
    assert exposed_page_us(prof) == (40, 50)  # an all-to-all alone leaves the copy exposed


def _link_profile() -> _Profile:
    """An emulated-link step with page nodes: the link's copies (runtime calls 7, 8 inside its
    range on thread 1), a page copy (call 9, outside it), a loss's copy to pageable memory."""
    from sched_lifetime.ep_link import LINK_RANGE

    return _Profile([
        _event(LINK_RANGE, 0, 10, cuda=False),
        _event("cudaMemcpyAsync", 1, 2, cuda=False, id=7),
        _event("cudaMemcpyAsync", 3, 4, cuda=False, id=8),
        _event("cudaMemcpyAsync", 12, 13, cuda=False, id=9),  # after the range: a page copy
        _event("cudaMemcpyAsync", 3, 4, cuda=False, id=10, thread=2),  # in the range's time, another thread
        _event("Memcpy DtoH (Device -> Pinned)", 0, 100, id=7),  # link out: 0-100
        _event("Memcpy HtoD (Pinned -> Device)", 50, 150, id=8),  # link back: 50-150
        _event("Memcpy DtoH (Device -> Pinned)", 200, 260, id=9),  # page out
        _event("Memcpy HtoD (Pinned -> Device)", 300, 310, id=10),  # page in
        _event("Memcpy DtoH (Device -> Pageable)", 400, 500, id=11),  # loss.cpu(): neither, compute-like
        _event("gemm", 120, 220),
    ])


def test_link_copies_are_the_runtime_calls_inside_its_range_on_its_thread():
    from sched_lifetime.train.figures import link_copy_ids

    assert link_copy_ids(_link_profile()) == {7, 8}


def test_exposed_comm_on_the_emulated_link_is_its_pinned_copies_time():
    """Without page nodes every pinned copy is the link's (a graph replay has no ranges); with
    them, the link's copies are those of its range and page copies are neither comm nor compute."""
    prof, link = _link_profile(), object()
    # No page nodes: all pinned copies are the link's: 0-150, 200-260, 300-310; the gemm covers
    # 120-150 and 200-220, the pageable copy nothing of them.
    assert exposed_comm_us(prof, link) == (150 + 60 + 10 - 30 - 20, 220)
    # Page nodes: the link's 0-150 (gemm covers 120-150); the page copies ignored.
    assert exposed_comm_us(prof, link, paged=True) == (120, 150)
    # Page copies 200-260 and 300-310, the gemm covering 200-220; the link's copies are not compute.
    assert exposed_page_us(prof, link) == (50, 70)
    assert exposed_comm_us(prof) == (0, 0)  # the NCCL default sees no comm here


def test_top_kernels_sums_by_name_in_ms():
    prof = _Profile([_event("gemm", 0, 3000), _event("gemm", 5000, 6000), _event("softmax", 0, 500), _event("range", 0, 9000, annotation=True)])
    assert top_kernels(prof, 1) == [("gemm", 4.0)]
    assert top_kernels(prof) == [("gemm", 4.0), ("softmax", 0.5)]


def test_allocator_timeline_and_plot_from_a_snapshot(tmp_path):
    """The GPU memory plot's parsing, on a synthetic allocator history: allocations, a free
    that waits (record_stream) and one that completes at once."""
    ev = [
        {"action": "segment_alloc", "size": 1 << 30, "time_us": 5},
        {"action": "alloc", "size": 100, "time_us": 10},
        {"action": "alloc", "size": 50, "time_us": 20},
        {"action": "free_requested", "size": 100, "time_us": 30},
        {"action": "free_requested", "size": 50, "time_us": 35},
        {"action": "free_completed", "size": 50, "time_us": 35},
        {"action": "free_completed", "size": 100, "time_us": 90},
    ]
    tl = allocator_timeline({"device_traces": [ev]}, torch.device("cuda", 0))
    assert [(round(t * 1e3), a, p) for t, a, p in tl] == [(0, 100, 0), (10, 150, 0), (20, 50, 100), (25, 0, 150), (25, 0, 100), (80, 0, 0)]
    assert allocator_timeline({"device_traces": [ev]}, torch.device("cuda", 1)) == []  # no history for that device
    out = tmp_path / "m.png"
    plot_allocator({"ours": tl, "ours+record": tl}, str(out))
    assert out.stat().st_size > 1000


def test_format_table_on_cpu_rows():
    args = argparse.Namespace(nccl_channels=0, config="tiny", microbatches=4, steps=3)
    cfg = SimpleNamespace()
    rows = {
        "sequential": {"parity": True, "ref": "exact", "step_ms": 20.0},
        "ours": {"parity": True, "ref": "3e-07", "step_ms": 10.0},
        "ours+record": {"parity": False, "ref": "DIFFER", "step_ms": 16.0},
        "ours+graph": {"parity": False, "step_ms": float("nan"), "failed": "RuntimeError: boom"},
    }
    lines = format_table(rows, cfg, args, use_cuda=False, world=2).splitlines()
    assert lines[0] == "MEASURED (CPU, EP=2, config tiny, 4 microbatches, 3 timed steps)"
    assert lines[1].split() == ["arm", "parity", "vs", "ref", "step", "ms", "vs", "seq", "exposed", "comm", "ms", "comm", "ms", "max", "alloc", "MiB", "max", "resv", "MiB", "pending", "MiB"]
    assert lines[2].split()[:5] == ["sequential", "base", "exact", "20.00", "1.000"] and "(GPU only)" in lines[2]  # the others' parity base
    assert lines[3].split()[:5] == ["ours", "equal", "3e-07", "10.00", "2.000"]
    assert lines[4].split()[:5] == ["ours+record", "DIFFER", "DIFFER", "16.00", "1.250"]
    assert lines[5] == "ours+graph     FAILED: RuntimeError: boom"
    assert lines[6].startswith("parity: torch.equal with the first arm, sequential (base") and "vs ref: the same against plain autograd" in lines[6]
    assert lines[7].startswith("CPU: step times are host times")


def test_format_table_says_the_link_is_emulated():
    args = argparse.Namespace(nccl_channels=2, config="h200", microbatches=8, steps=3, profile_steps=5)
    rows = {
        "sequential": {"parity": True, "step_ms": 20.0, "exposed_comm_us": 8000.0, "comm_us": 10000.0, "link_bytes_each_way": 1 << 30,
                       "max_allocated": 1 << 30, "max_reserved": 2 << 30, "pending_free_peak": 0},
    }
    link = "emulated link: EP=8 over pinned host memory (copy engines), full duplex, up to 8 chunks of >= 1024 KiB"
    lines = format_table(rows, SimpleNamespace(), args, use_cuda=True, world=1, link=link).splitlines()
    assert lines[0] == f"MEASURED (CUDA, {link}, config h200, 8 microbatches, 3 timed steps)"  # no NCCL channels: no NCCL
    assert "sequential: the link moved 1024 MiB each way in one step, 107.4 GB/s over its copy time" in lines
    assert "exposed comm: the median of 5 profiled steps (each profiled alone); comm ms: that step's" in lines
    assert any(line.startswith("EMULATED EP: one process") for line in lines) and not any("One GPU: EP=1" in line for line in lines)


def test_median_exposed_takes_the_median_step_and_keeps_every_step():
    steps = [(30.0, 100.0), (10.0, 90.0), (50.0, 120.0), (20.0, 95.0), (40.0, 110.0)]
    m = median_exposed(steps, "comm")
    assert (m["exposed_comm_us"], m["comm_us"]) == (30.0, 100.0)  # one step's pair, not a mix of medians
    assert m["exposed_comm_steps"] == [list(p) for p in steps]
    assert median_exposed(steps[:4], "page")["exposed_page_us"] == 20.0  # even count: the lower middle step
    assert median_exposed([(7.0, 9.0)], "comm")["comm_us"] == 9.0
    with pytest.raises(ValueError, match="no profiled step"):
        median_exposed([], "comm")
