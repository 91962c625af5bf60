"""benches/trace_stalls.py: a step's GPU idle time split into host-late and stalled, on a
synthetic Chrome trace whose answer is known."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benches", "trace_stalls.py")
_spec = importlib.util.spec_from_file_location("trace_stalls", _PATH)
trace_stalls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_stalls)


def kernel(ts, dur, corr, stream=7, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": corr}}


def launch(ts, dur, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_gaps_split_by_when_the_next_kernel_was_launched():
    events = [
        kernel(0, 10, 1), launch(-5, 1, 1),
        kernel(20, 10, 2), launch(25, 1, 2),  # launched after the gap began: 10 us host late
        kernel(60, 10, 3), launch(5, 1, 3),  # queued long before: 30 us stalled
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 40, "dur": 10, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 42, "dur": 6, "args": {"stream": 10}},  # both ways at once: counted once
        kernel(0, 100, 4, stream=8), launch(0, 1, 4),  # another stream: not the compute stream
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 4, "args": {}},
    ]
    r = trace_stalls.analyse(events)
    assert r["stream"] == 7 and r["kernels"] == 3
    assert r["busy_ms"] == pytest.approx(0.030) and r["span_ms"] == pytest.approx(0.070)
    assert r["host_late_ms"] == pytest.approx(0.010)
    assert r["stalled_ms"] == pytest.approx(0.030)
    assert r["stalled_under_copy_ms"] == pytest.approx(0.010)  # the copy ran 40..50, inside the stall 30..60
    assert r["copy_ms"] == pytest.approx(0.010)
    assert r["top_cpu_ops"] == [("aten::mm", pytest.approx(0.004), 1)]


def test_no_kernels_is_empty():
    assert trace_stalls.analyse([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 4, "args": {}}]) == {}


def test_the_command_prints_a_row_per_trace(tmp_path, capsys, monkeypatch):
    """`python benches/trace_stalls.py TRACE...`: a row per trace and its longest stalls."""
    import gzip
    import json

    events = [kernel(0, 10, 1, name="gemm"), launch(-5, 1, 1), kernel(100, 10, 2), launch(1, 1, 2)]  # a 90 us stall after gemm
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    monkeypatch.setattr("sys.argv", ["trace_stalls.py", str(path)])
    trace_stalls.main()
    out = capsys.readouterr().out
    assert "step.json.gz" in out and "stalled 0.09 ms after gemm" in out, out


def op(ts, dur, name="aten::mul", tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}


def test_host_speed_compares_self_times_per_bin_and_marks_the_copies():
    """`--host-speed`: an operator's self time is its time minus what it called (a runtime call
    inside it is not the host running slower); per 10 ms, the median ratio to the reference's
    median self time of that operator, the bins under a device -> host copy starred."""
    ref = [op(i * 100, 10) for i in range(30)]  # aten::mul: 10 us each
    slow = [op(i * 500, 20) for i in range(20)]  # 0..10 ms: twice as slow
    inside = [op(12_000 + i * 500, 25) for i in range(20)]  # 12..22 ms: 25 us, of which a 15 us launch
    inside += [{**launch(12_000 + i * 500 + 5, 15, i), "tid": 1} for i in range(20)]
    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 8000, "args": {}}
    back = {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MulBackward0", "ts": 20_000, "dur": 1, "tid": 1, "args": {}}
    bins, fwd_end = trace_stalls.host_speed(ref, slow + inside + [copy, back])
    assert fwd_end == pytest.approx(20.0)
    assert bins[0] == (0.0, pytest.approx(2.0), pytest.approx(0.8))
    assert bins[1][0] == 10.0 and bins[1][1] == pytest.approx(1.0) and bins[1][2] == 0.0  # 25 - 15 = 10 us: not slower
    assert trace_stalls.host_speed(ref[:10], slow)[0][0][1] is None  # seen < 20 times in REF: no ratio


def test_kernels_vs_splits_extra_busy_time_by_copies_and_names_new_kernels():
    """`--kernels-vs`: each kernel against the same name's same occurrence in REF; under a copy
    when a copy ran under half of it or more; names run more or less often than in REF counted
    apart (their time less REF's)."""
    ref = [kernel(i * 100, 10, i, name="fill") for i in range(3)] + [kernel(400, 20, 9, name="gemm"), kernel(450, 6, 10, name="gone")]
    events = [
        kernel(0, 14, 1, name="fill"),  # under the copy (0..10 of 14 us): +4
        kernel(100, 10, 2, name="fill"),  # no copy: +0
        kernel(200, 13, 3, name="fill"),  # copy covers 2 of 13 us: not under, +3
        kernel(400, 20, 4, name="gemm"),
        kernel(500, 5, 5, name="copy_strided"),  # REF lacks it
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 10, "args": {}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 211, "dur": 2, "args": {}},
    ]
    r = trace_stalls.kernels_vs(ref, events)
    assert r["kernels_ref"] == 5 and r["kernels"] == 5
    assert r["busy_ref_ms"] == pytest.approx(0.056) and r["busy_ms"] == pytest.approx(0.062)
    assert r["extra_under_copy_ms"] == pytest.approx(0.004) and r["kernels_under_copy"] == 1
    assert r["extra_no_copy_ms"] == pytest.approx(0.003) and r["kernels_no_copy"] == 3
    assert r["count_changed_ms"] == pytest.approx(0.005 - 0.006)  # copy_strided added, gone dropped
    assert r["rows"][0] == ("fill", 3, pytest.approx(0.030), 3, pytest.approx(0.037))  # the largest difference first
    assert ("copy_strided", 0, 0.0, 1, pytest.approx(0.005)) in r["rows"]
