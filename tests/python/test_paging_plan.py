"""Rust's paging plan from Python (`paging/plan.py`): the choice is reproducible, the furthest use
goes first, a timed plan places releases and page-ins, and bad budgets and settings are refused."""

import pytest

import sched_lifetime as sl


def test_the_choice_is_reproducible_and_the_furthest_use_goes_first():
    prefix = [
        {"name": "#0", "bytes": 100, "saved_at": 0, "used_at": 5},
        {"name": "#1", "bytes": 300, "saved_at": 1, "used_at": 1},
        {"name": "#2", "bytes": 100, "saved_at": 2, "used_at": 3},
    ]
    a = sl.page_plan(prefix, {"bytes": 150}, min_distance=1)
    assert a["page"] == ["#0", "#2"] and a["bytes_paged"] == 200
    assert sl.page_plan(list(reversed(prefix)), {"bytes": 150}, 1)["page"] == a["page"]
    assert sl.page_plan(prefix, 0.5, 2)["page"] == ["#0", "#2"]  # #1 is read too soon
    with pytest.raises(ValueError, match="0..=1"):
        sl.page_plan(prefix, 1.5)
    with pytest.raises(ValueError, match="budget must be"):
        sl.Pager("half")
    with pytest.raises(ValueError, match="prefetch must be"):
        sl.Pager(0.5, prefetch=-1)
    with pytest.raises(ValueError, match="slack must be"):
        sl.Pager(0.5, slack=0.9)


def test_a_plan_short_of_its_target_says_by_how_much_and_where_to_look():
    from sched_lifetime.paging import explain_plan

    prefix = [
        {"name": "#0", "bytes": 100, "saved_at": 0, "used_at": 5},
        {"name": "#1", "bytes": 300, "saved_at": 1, "used_at": 1},
    ]
    plan = sl.page_plan(prefix, 1.0, min_distance=2)  # #1 is read too soon to page: 300 bytes short
    assert plan["short"] and plan["page"] == ["#0"]
    text = explain_plan(plan)
    assert text.splitlines()[0] == "paging 1 tensors, 100 of 400 bytes (target 400) SHORT of target by 300 bytes (each kept tensor's line says why)", text
    assert any(line.startswith("#1: kept") for line in text.splitlines()[1:]), text
    assert "SHORT" not in explain_plan(sl.page_plan(prefix, 0.25, min_distance=2))


def test_a_timed_plan_through_the_op_places_releases_and_page_ins():
    """The measured timeline through the Python entry: #0's copy (100 bytes at 10 bytes/us)
    ends at 10 us, the save at 10 us releases it; #2's ends at 30 (save 3); #1 is read too soon.
    Page-ins as late as the link allows: #2 (used at unpack 3, 30 us) copies 20-30 (queued at
    unpack 2), #0 (unpack 5, 50 us) 40-50 (unpack 4). A bad timeline is a ValueError."""
    prefix = [
        {"name": "#0", "bytes": 100, "saved_at": 0, "used_at": 5},
        {"name": "#1", "bytes": 300, "saved_at": 1, "used_at": 0},
        {"name": "#2", "bytes": 100, "saved_at": 2, "used_at": 3},
    ]
    timing = {"save_us": [0, 10, 20, 30, 40], "unpack_us": [0, 10, 20, 30, 40, 50], "d2h_bytes_per_us": 10, "h2d_bytes_per_us": 10, "slack": 1}
    p = sl.page_plan(prefix, 1.0, 1, timing)
    assert (p["page"], p["release_at"], p["launch_at"]) == (["#0", "#2"], [1, 3], [4, 2])
    assert sl.page_plan(prefix, 1.0, 1)["release_at"] == []  # untimed: nothing placed
    with pytest.raises(ValueError, match="slack must be >= 1"):
        sl.page_plan(prefix, 1.0, 1, dict(timing, slack=0.5))
    with pytest.raises(ValueError, match="timing is not valid"):
        sl.page_plan(prefix, 1.0, 1, dict(timing, extra=1))
    # Two-way (issue 32): the link's rate both ways at once lets a page-out end in the backward.
    # #3 (200 bytes saved at 30 us) copies 100 bytes by the last save (40 us) and the rest at 5
    # bytes/us (half of 10 both ways) by 60 us: released at unpack 2 (20 us after the forward),
    # point 5 + 2; on one page stream it does not hide and stays.
    late = prefix + [{"name": "#3", "bytes": 200, "saved_at": 3, "used_at": 4}]
    one = sl.page_plan(late, 1.0, 1, timing)
    assert "#3" not in one["page"]
    two = sl.page_plan(late, 1.0, 1, dict(timing, both_bytes_per_us=10))
    assert two["page"] == ["#0", "#2", "#3"] and two["release_at"][-1] == 5 + 2
    assert "#3: released at unpack 2 (after the forward)" in "\n".join(two["explain"])
    with pytest.raises(ValueError, match="both_bytes_per_us must be > 0"):
        sl.page_plan(prefix, 1.0, 1, dict(timing, both_bytes_per_us=0))


def test_the_timed_plan_keeps_what_costs_the_host_more_than_the_link_and_the_cost_is_measured():
    """`page_host_us` in the timing: #2's copy (100 bytes at 10 bytes/us, 10 us) is shorter than
    12 us of host time and stays, said in `explain`; #0 (the same size) too; a 300-byte tensor
    (30 us) is still paged. `page_host_us` measures a real HostPool's round trip (here on CPU):
    a positive, finite number of us; a Pager with `count_host=False` leaves it out."""
    import math

    import torch

    from sched_lifetime.paging.plan import page_host_us

    prefix = [
        {"name": "#0", "bytes": 100, "saved_at": 0, "used_at": 5},
        {"name": "#1", "bytes": 300, "saved_at": 1, "used_at": 4},
        {"name": "#2", "bytes": 100, "saved_at": 2, "used_at": 3},
    ]
    timing = {"save_us": [0, 10, 40, 50, 60], "unpack_us": [0, 10, 20, 30, 40, 50], "d2h_bytes_per_us": 10, "h2d_bytes_per_us": 10, "slack": 1}
    assert sl.page_plan(prefix, 1.0, 1, timing)["page"] == ["#0", "#1", "#2"]
    p = sl.page_plan(prefix, 1.0, 1, dict(timing, page_host_us=12))
    assert p["page"] == ["#1"]
    assert "#2: kept (its copy takes 10.0 us, less than the 12.0 us of host time a page-out and its page-in take)" in p["explain"]
    with pytest.raises(ValueError, match="page_host_us must be finite and >= 0"):
        sl.page_plan(prefix, 1.0, 1, dict(timing, page_host_us=-1))
    us = page_host_us(torch.device("cpu"), reps=8)
    assert math.isfinite(us) and us > 0
    assert sl.Pager(0.5)._calib.count_host and not sl.Pager(0.5, count_host=False)._calib.count_host


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_timed_pagers_calibration_measures_the_host_time_of_a_page_out_on_cuda():
    """On CUDA the timed Pager's plan is made with the measured host time (explain's inputs), and
    a saved tensor whose copy is shorter than it stays on the device."""
    import torch

    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    pager = sl.Pager(1.0, min_bytes=1)
    for _ in range(3):
        with pager.step():
            torch.tanh((x * 2) @ w).sum().backward()  # the matmul saves x * 2: an activation, 16 KiB
    host = pager.calibration["timing"]["page_host_us"]
    assert host > 0
    # 16 KiB copies in well under a microsecond at tens of GB/s: kept for host time, and said.
    kept = [line for line in pager.plan["explain"] if "us of host time" in line]
    assert kept and f"{host:.1f} us of host time" in kept[0], pager.explain()
    # A second Pager in this process plans with the same measurements, not new ones (a graph run
    # per layer calibrates a Pager per run slot); after `forget_measurements` they are new.
    from sched_lifetime.paging import calibrate, forget_measurements

    def twice(*a, **k):
        raise AssertionError("measured again")

    real = calibrate.link_rates, calibrate.page_host_us
    calibrate.link_rates = calibrate.page_host_us = twice
    try:
        again = sl.Pager(1.0, min_bytes=1)
        for _ in range(3):
            with again.step():
                torch.tanh((x * 2) @ w).sum().backward()
        t0, t1 = pager.calibration["timing"], again.calibration["timing"]
        assert (t1["page_host_us"], t1["d2h_bytes_per_us"]) == (t0["page_host_us"], t0["d2h_bytes_per_us"])
    finally:
        calibrate.link_rates, calibrate.page_host_us = real
    forget_measurements()
    fresh = sl.Pager(1.0, min_bytes=1)
    for _ in range(3):
        with fresh.step():
            torch.tanh((x * 2) @ w).sum().backward()
    assert fresh.calibration["timing"]["page_host_us"] > 0


def test_a_machine_measurement_is_made_once_per_device_and_setting_until_forgotten():
    """`calibrate.measured`: the link's rates and the host time are measured once per key (device,
    and the two-way setting for the host time) in a process; `forget_measurements` drops them."""
    import torch

    from sched_lifetime.paging import calibrate, forget_measurements

    forget_measurements()
    calls = []

    def measure(v):
        return lambda: calls.append(v) or v

    assert calibrate.measured(("page_host_us", "cpu", None, False), measure(1.0)) == 1.0
    assert calibrate.measured(("page_host_us", "cpu", None, False), measure(2.0)) == 1.0  # not measured again
    assert calibrate.measured(("page_host_us", "cpu", None, True), measure(3.0)) == 3.0  # another setting
    assert calls == [1.0, 3.0]
    assert calibrate._device_key("cpu") == ("cpu", None) and calibrate._device_key(torch.device("cuda", 1)) == ("cuda", 1)
    forget_measurements()
    assert calibrate.measured(("page_host_us", "cpu", None, False), measure(4.0)) == 4.0 and calls == [1.0, 3.0, 4.0]
    forget_measurements()


@pytest.mark.parametrize("reps", [0, -1, 1.5, True])
def test_the_link_and_host_measurements_refuse_a_count_of_rounds_that_is_not_a_positive_int(reps):
    """`link_rates` and `page_host_us` keep the fastest of `reps` rounds: none would divide by
    nothing (or time nothing), so they say so before touching a device."""
    import torch

    from sched_lifetime.paging.plan import link_rates, page_host_us

    for measure in (link_rates, page_host_us):
        with pytest.raises(ValueError, match="reps must be an int >= 1"):
            measure(torch.device("cpu"), reps=reps)
