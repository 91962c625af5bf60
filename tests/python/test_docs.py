"""The documentation cannot rot (CPU, in CI): every ```python block of README.md and docs/
runs; every relative link and #anchor resolves; the README stays short and keeps the two
commands; every entry of `sched_lifetime.__all__` has a docstring whose example runs; every
command-line option has a help line and the main job's options are in its guide; the
troubleshooting page covers the errors the tests expect; scripts/figures.py draws what its
inputs allow and says what it skips.

Blocks: a page's ```python blocks run in order in one fresh namespace (in this process, in a
temporary working directory). The line before a block may mark it: `<!-- cuda -->` runs only
where CUDA is available (the GPU pass), `<!-- skip: reason -->` never (several processes).
"""

from __future__ import annotations

import argparse
import ast
import doctest
import glob
import inspect
import io
import json
import os
import re
import sys
import warnings
from contextlib import redirect_stdout

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
TROUBLESHOOTING = os.path.join(ROOT, "docs", "troubleshooting.md")

#: `pytest.raises(match=...)` patterns of errors a test injects on purpose (not met in use).
INJECTED = {"a rank was started", "node 'F.mlp': injected", "(?s)injected.*in node 'F.mlp'", "boom", "boom in the backward", "bad batch", "panic in sched_lifetime.*deliberate 7"}


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def python_blocks(path: str) -> list[tuple[int, str, str]]:
    """(line of the fence, marker, code) of each ```python block; the marker is the HTML
    comment on the nearest non-blank line above the fence ("" when none)."""
    lines = open(path).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = above if above.startswith("<!--") else ""
            out.append((i + 1, marker, "\n".join(lines[i + 1 : j])))
            i = j
        i += 1
    return out


def _cleanup() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _leave_no_trace():
    """The examples compile graphs in this process: `sched_lifetime.compile.history` (kept to
    its last 64) is put back as it was, so a later test reading the entries it adds still finds
    them (test_ep_link counts from `len(history)`)."""
    from sched_lifetime import compile as slc

    before = list(slc.history)
    yield
    slc.history[:] = before


@pytest.mark.parametrize("page", [_rel(p) for p in PAGES])
def test_python_blocks_run(page, tmp_path, monkeypatch):
    blocks = python_blocks(os.path.join(ROOT, page))
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()  # as a fresh process: an earlier test's compile of the same module code at other sizes would make these recompile dynamic
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    try:
        for line, marker, code in blocks:
            if marker.startswith("<!-- skip"):
                continue
            if marker.startswith("<!-- cuda") and not torch.cuda.is_available():
                continue
            assert marker in ("", "<!-- cuda -->"), f"{page}:{line}: unknown marker {marker!r}"
            try:
                with redirect_stdout(io.StringIO()), warnings.catch_warnings():
                    # An example that selects nothing (the library warns so) shows nothing.
                    warnings.filterwarnings("error", message=".*(nothing to page|pages nothing|paired_ends pairs two)")
                    exec(compile(code, f"{page}:{line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{page}:{line}: the block raised {type(e).__name__}: {e}") from e
            ran += 1
    finally:
        _cleanup()
    if not blocks:
        pytest.skip(f"{page} has no python blocks")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in open(path).read().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        s = _slug(line.lstrip("#"))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_relative_links_and_anchors_resolve():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", open(page).read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            dest = page if not file else os.path.normpath(os.path.join(os.path.dirname(page), file))
            if not os.path.exists(dest):
                bad.append(f"{_rel(page)}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                bad.append(f"{_rel(page)}: {target} (no heading with that anchor)")
    assert not bad, "\n".join(bad)


def test_readme_is_short_and_keeps_the_two_commands():
    text = open(README).read()
    assert len(text.splitlines()) <= 250
    for job in ("demo", "test"):
        assert f"\nscripts/setup.sh {job}   #" in text, job
    setup = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    assert "demo|test) ;;" in setup
    assert "exec bash scripts/setup.sh test" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_headline_results_link_to_the_results_page():
    text = open(README).read()
    table = text[text.index("## Headline results") : text.index("## Compatibility")]
    rows = [r for r in table.splitlines() if r.startswith("| [")]
    assert 1 <= len(rows) <= 10
    assert all("(docs/results.md#" in r for r in rows)


def test_every_public_name_has_a_docstring_whose_example_runs():
    import sched_lifetime as sl

    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    parser = doctest.DocTestParser()
    for name in sl.__all__:
        doc = inspect.getdoc(getattr(sl, name))
        assert doc and ">>>" in doc, f"sched_lifetime.{name}: no docstring with an example"
        test = parser.get_doctest(doc, {"__name__": "__doctest__"}, f"sched_lifetime.{name}", None, 0)
        with redirect_stdout(io.StringIO()) as out:
            res = runner.run(test, out=out.write)
        assert res.failed == 0, f"sched_lifetime.{name}: its example fails\n{out.getvalue()}"
    _cleanup()


def test_readme_names_every_public_entry():
    import sched_lifetime as sl

    text = open(README).read()
    section = text[text.index("## The public API") : text.index("## Documentation")]
    assert not [n for n in sl.__all__ if f"`{n}`" not in section]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser of the command line: "" (top level), each subcommand, and `train`'s own."""
    from sched_lifetime.__main__ import parser
    from sched_lifetime.train.cli import parser as train_parser

    top = parser()
    seen: dict[str, argparse.ArgumentParser] = {"": top, "train": train_parser()}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen.update({name: sub for name, sub in action.choices.items() if name != "train"})
    return seen


def test_every_option_has_a_help_line_and_the_main_jobs_are_documented():
    parsers = _parsers()
    assert {"", "train", "ab", "demo", "simulate", "simulate-schedule"} <= set(parsers)
    for name, p in parsers.items():
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help and a.help != argparse.SUPPRESS, f"`{name}` option {a.option_strings or a.dest} has no help"
    guide = open(os.path.join(ROOT, "docs", "main-job.md")).read()
    for a in parsers["train"]._actions:
        for opt in a.option_strings:
            if opt.startswith("--") and opt != "--help":
                assert f"`{opt}`" in guide, f"docs/main-job.md does not document train {opt}"


def _expected_errors() -> list[tuple[str, str]]:
    """(test file, pattern) of every constant `pytest.raises(..., match=...)` in tests/python,
    and the message fragments of test_hardening's bad-input matrix."""
    out = []
    for f in sorted(glob.glob(os.path.join(ROOT, "tests", "python", "test_*.py"))):
        tree = ast.parse(open(f).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "raises":
                for kw in node.keywords:
                    if kw.arg == "match" and isinstance(kw.value, ast.Constant) and kw.value.value not in INJECTED:
                        out.append((os.path.basename(f), kw.value.value))
    sys.path.insert(0, os.path.dirname(__file__))
    import sched_lifetime as sl
    from test_hardening import _bad_inputs

    m = sl.LifetimeManager("docs")
    out += [("test_hardening.py", re.escape(frag)) for _, _, _, frag in _bad_inputs(m, torch.ones(8))]
    m.close()
    return out


def test_troubleshooting_covers_the_errors_the_tests_expect():
    page = open(TROUBLESHOOTING).read()
    missing = [f"{f}: {p}" for f, p in _expected_errors() if not re.search(p, page)]
    assert not missing, "docs/troubleshooting.md has no entry matching:\n" + "\n".join(missing)


def test_figures_script_draws_what_it_can_and_says_what_it_skips(tmp_path):
    """With no measured JSON the simulated pictures are drawn and the measured ones skipped;
    with a main-job run's files imported (synthetic here), the measured ones are drawn too."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "memory_over_time.json").write_text(json.dumps({"ours": [[0.0, 0, 0], [1.0, 1 << 20, 0]], "ours+record": [[0.0, 0, 0], [1.0, 1 << 20, 1 << 19]]}))
    kernel = lambda name, ts, stream, cat="kernel": {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 5.0, "args": {"stream": stream}}  # noqa: E731
    trace = {"traceEvents": [kernel("gemm", 10.0, 7), kernel("ncclDevKernel_AllToAll", 12.0, 20), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 1.0}]}
    for arm in ("sequential", "ours"):
        (run_dir / f"trace_{arm}.json").write_text(json.dumps(trace))
    (run_dir / "train.json").write_text(json.dumps({"config": {}, "world": 2, "rows": {"ours": {"comm_us": 5.0, "exposed_comm_us": 3.0, "step_ms": 1.0}}}))
    data, out = tmp_path / "data", tmp_path / "figs"
    figures = _figures_module()

    def run(*argv: str) -> str:
        with redirect_stdout(io.StringIO()) as text:
            assert figures.main(list(argv)) == 0
        return text.getvalue()

    first = run("--data", str(data), "--out", str(out))
    assert "skipped memory_over_time_h200.png" in first and "skipped step_timeline_h200.png" in first
    run("import-run", str(run_dir), "--data", str(data), "--label", "test")
    timeline = json.loads((data / "h200_step_timeline.json").read_text())
    assert timeline["arms"]["ours"]["events"] == [["compute", 7, 0.0, 5.0], ["nccl", 20, 2.0, 5.0]]
    # The pair picture reads the repository's measured node times.
    (data / "h200_main_job_durations.json").write_text(open(os.path.join(ROOT, "benches", "data", "h200_main_job_durations.json")).read())
    second = run("--data", str(data), "--out", str(out))
    assert "skipped" not in second, second
    for name in ("memory_over_time_h200.png", "step_timeline_h200.png", "pair_timeline_simulated.png", "megatron_hero_memory_simulated.png"):
        assert (out / name).stat().st_size > 1000, name


def _figures_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_figures", os.path.join(ROOT, "scripts", "figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
