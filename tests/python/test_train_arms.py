"""The main job's arm table (`sched_lifetime.train.arms`): the arm table of docs/main-job.md
and the `--arms` help are generated from it, the lookups the loop uses are derived from it, and
each `Arm` runs under its row's order, lifetime and options."""

import os

import pytest
import torch

from sched_lifetime.train import arms as arms_mod
from sched_lifetime.train.arms import ARM_TABLE, SPECS, Arm, check_arms, default_arms, markdown_table, with_markdown_table
from sched_lifetime.train.cli import parser

#: Where the arm table lives (the main job's guide; the README links to it).
MAIN_JOB_DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "main-job.md")


def test_main_job_doc_arm_table_is_the_generated_one():
    with open(MAIN_JOB_DOC) as f:
        text = f.read()
    assert markdown_table() in text, (
        "docs/main-job.md's arm table differs from sched_lifetime.train.arms.ARM_TABLE; regenerate it with\n"
        "PYTHONPATH=torch_ops python -c \"from sched_lifetime.train import with_markdown_table as w; "
        "p = 'docs/main-job.md'; t = open(p).read(); open(p, 'w').write(w(t))\""
    )
    assert with_markdown_table(text) == text


def test_markdown_table_has_one_row_per_arm_and_replaces_only_the_table():
    rows = markdown_table().splitlines()
    assert rows[0].startswith("| arm | what runs |") and len(rows) == 2 + len(ARM_TABLE)
    assert [r.split(" | ")[0] for r in rows[2:]] == [f"| `{s.name}`" for s in ARM_TABLE]
    page = next(r for r in rows if r.startswith("| `ours+page`"))
    assert "`ours:page_budget=8`" in page and "`paged`" in page and not page.endswith("| yes |")
    doc = "intro\n\n| arm | what runs |\n|---|---|\n| `old` | gone |\n\nafter\n"
    assert with_markdown_table(doc) == "intro\n\n" + markdown_table() + "\nafter\n"
    with pytest.raises(ValueError, match="no arm table"):
        with_markdown_table("no table here\n")


def test_lookups_are_derived_from_the_table():
    assert default_arms() == "sequential,b_then_f,ours,calibrated,ours+record"
    assert parser().parse_args([]).arms == default_arms()
    assert arms_mod.ARMS == {"sequential": ("sequential", "scheduled"), "b_then_f": ("b_then_f", "scheduled"), "ours": ("ours", "scheduled"), "calibrated": ("calibrated", "scheduled"), "ours+record": ("ours", "record_stream")}
    assert arms_mod.GRAPH_ARMS == {"ours+graph": ("ours", "scheduled"), "ours+graph+record": ("ours", "record_stream")}
    assert list(arms_mod.EXTRA_ARMS) == ["ours+classic", "ours+ep2", "ours+search", "ours+first", "ours+ends", "ours+page", "ours+reduce_after"]
    assert arms_mod.EXTRA_ARMS["ours+first"] == ("ours:launch_first", "scheduled")
    assert arms_mod.EXTRA_ARMS["ours+page"] == ("ours:page_budget=8", "scheduled")
    assert (arms_mod.PAGED, arms_mod.PAIRED_ENDS, arms_mod.REDUCE_AFTER) == ({"ours+page"}, {"ours+ends"}, {"ours+reduce_after"})
    assert len(SPECS) == len(ARM_TABLE)  # names are unique
    assert all(s.lifetime in ("scheduled", "record_stream") for s in ARM_TABLE)


def test_arms_help_lists_every_arm_with_its_summary(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping (argparse breaks lines at hyphens)
    text = parser().format_help()
    assert "every arm:\n" in text  # one arm a line
    for s in ARM_TABLE:
        assert f"{s.name}: {s.summary.replace('`', '')}\n" in text, s.name


def test_check_arms_names_the_arm_that_cannot_run():
    check_arms(default_arms().split(","), use_cuda=False, have_costs=False)
    with pytest.raises(SystemExit, match="unknown arm 'nope'"):
        check_arms(["ours", "nope"], use_cuda=True, have_costs=True)
    with pytest.raises(SystemExit, match="arm 'ours\\+graph' captures a CUDA graph: it needs a GPU"):
        check_arms(["ours+graph"], use_cuda=False, have_costs=True)
    with pytest.raises(SystemExit, match="arm 'ours\\+search' needs --costs"):
        check_arms(["ours+search"], use_cuda=True, have_costs=False)
    check_arms(["ours+graph", "ours+search"], use_cuda=True, have_costs=True)


def test_each_arm_runs_under_its_row(monkeypatch):
    """An `Arm` hands `train_step` its row's order, lifetime and paired ends (one process,
    no EP: no gradient reduce), and reduces after the step only where its row says so."""
    from sched_lifetime import ep
    from sched_lifetime.models import CONFIGS
    from sched_lifetime import nodes

    calls = []

    def fake_train_step(chunk, batches, order, lifetime, on_run=None, paired_ends=False):
        calls.append((order, lifetime, paired_ends, len(batches)))
        return [torch.zeros(())]

    monkeypatch.setattr(nodes, "train_step", fake_train_step)
    t = ep.AllToAll(None)
    for s in ARM_TABLE:
        if s.captured:
            continue  # captured arms replay a CUDA graph after step 0 (tests/python/test_train_cuda.py)
        arm = Arm(s.name, CONFIGS["tiny"], t, torch.device("cpu"), lr=0.1)
        arm.step(0, 2)
        assert calls[-1] == (s.order, s.lifetime, s.paired_ends, 2), s.name
        assert (arm.order, arm.lifetime, arm.captured, arm.reduce_after) == (s.order, s.lifetime, False, None)
        assert len(arm.losses) == 1
