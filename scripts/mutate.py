#!/usr/bin/env python3
"""Mutation testing of the Python package for the developer loop (issue 35); not run in CI.

Each mutant is one small deliberate bug in one file: an arithmetic operator swapped (`+`/`-`,
`*`/`/`, also in `+=`...), a comparison flipped (`==`/`!=`, `<`/`<=`, `in`/`not in`,
`is`/`is not`), `and`/`or` swapped, `True`/`False` swapped, a small integer moved by one, a
`not` dropped, an `if` condition negated, or a simple statement (a call, an assignment, a
`return` value, an assignment to an attribute or an item) dropped. The mutated file is written into a scratch copy of the package and
its tests, the file's focused tests run there (`pytest -x`), and the mutant is

  killed    a test failed (or the package no longer imports),
  timeout   the tests ran past the time limit (counted as killed, listed apart),
  survived  every test passed: a missing test, or a mutant the CPU cannot see.

Each survivor is then probed: the mutated expression (or statement) is replaced by
`os._exit(97)`, which no `except` can catch. If the tests still pass, the CPU tests never
reach that code (GPU-only branches, paths only a GPU run takes): the mutant is `unreached`,
not CPU-visible. The kill rate is reported over every mutant and over the CPU-visible ones
(killed + timeout + reached survivors).

    PYTHONPATH=torch_ops nice python scripts/mutate.py --sample 50 --seed 1
    python scripts/mutate.py --list --files torch_ops/sched_lifetime/executor.py
    python scripts/mutate.py --only executor.py:123:3 --keep    # one mutant, scratch kept

Needs the built library in the package (`make build`, or `_C.so` copied in), and nothing
beyond the test requirements. Runs one mutant at a time (the tests themselves spawn ranks).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "torch_ops/sched_lifetime"
T = "tests/python/"

#: The packages and modules mutated by default, and the focused CPU tests each one runs
#: (fast ones first: `-x` stops at the first failure, so a killed mutant costs little).
_DIST = T + "test_train_dist.py::test_every_arm_bit_exact_against_sequential_over_two_gloo_ranks[tiny-0.0]"
_RUN = T + "test_nodes_run.py::"
TARGETS: dict[str, list[str]] = {
    f"{PKG}/nodes/": [
        T + "test_nodes_graph.py", T + "test_nodes_grads.py",
        _RUN + "test_backward_without_a_forward_is_an_error", _RUN + "test_train_step_rejects_bad_orders_and_empty_steps", _RUN + "test_paired_ends_errors",
        _RUN + "test_b_then_f_issues_every_backward_node_before_every_forward_node",
        _RUN + "test_node_path_equals_plain_backward[1.0-tiny]", _RUN + "test_node_path_equals_plain_backward[None-odd]",
        _RUN + "test_paired_ends_are_bit_exact_against_sequential[3-odd]",
        T + "test_executor.py::test_rule3_each_value_of_the_embedded_model_retires_with_the_scheduled_action",
        T + "test_paging_nodes.py::test_page_nodes_on_the_node_path_are_scheduled_and_bit_exact", _DIST,
    ],
    f"{PKG}/executor.py": [
        T + "test_executor.py", _RUN + "test_b_then_f_issues_every_backward_node_before_every_forward_node",
        _RUN + "test_node_path_equals_plain_backward[1.0-tiny]", T + "test_paging_nodes.py::test_page_nodes_on_the_node_path_are_scheduled_and_bit_exact",
    ],
    f"{PKG}/train/": [
        T + "test_train_arms.py", T + "test_train_figures.py", T + "test_train_reference.py", _DIST,
        T + "test_train_dist.py::test_main_job_loop_over_two_gloo_ranks_prints_the_table_and_writes_its_files",
    ],
    # File order (some tests rely on what an earlier one set up); the 2-rank EP test, 65 s, left out.
    f"{PKG}/compile/graph_step.py": [
        T + "test_calibrate.py::test_graph_step_calibrated_order_follows_measured_costs_and_stays_bit_exact",
        T + "test_ep_link.py::test_graph_step_on_the_link_bit_exact_against_eager_microbatch_by_microbatch",
        T + "test_compile.py -k 'graph_step or GraphStep or multiplex'",
    ],
    f"{PKG}/compile/": [T + "test_compile.py -k 'not moe_model_with_ep'"],
    f"{PKG}/paging/": [
        T + "test_paging_plan.py", T + "test_paging_pool.py", T + "test_paging_slot_order.py", T + "test_paging_groups.py",
        T + "test_paging_pager.py",
    ],
    f"{PKG}/calibrate.py": [T + "test_calibrate.py"],
}

_SWAP_BIN = {ast.Add: (ast.Sub, "+", "-"), ast.Sub: (ast.Add, "-", "+"), ast.Mult: (ast.Div, "*", "/"), ast.Div: (ast.Mult, "/", "*"),
             ast.FloorDiv: (ast.Mult, "//", "*"), ast.Mod: (ast.FloorDiv, "%", "//")}
_SWAP_CMP = {ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="),
             ast.GtE: (">=", ">"), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}


@dataclass
class Mutant:
    """One mutation: replace source bytes [start, end) of `file` (offsets into its UTF-8 bytes)
    with `new`; `probe` is the span that `os._exit(97)` replaces to see if the tests reach it."""

    file: str
    line: int
    col: int
    what: str
    start: int
    end: int
    new: str
    probe: tuple[int, int, bool]  # (start, end, is_statement)

    @property
    def id(self) -> str:
        return f"{os.path.relpath(self.file, os.path.join(ROOT, PKG))}:{self.line}:{self.col}"


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str, src: bytes) -> None:
        self.path, self.src = path, src
        self.lines = src.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.out: list[Mutant] = []
        self.stmt: Optional[ast.stmt] = None

    def off(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, n: ast.AST) -> tuple[int, int]:
        return self.off(n.lineno, n.col_offset), self.off(n.end_lineno, n.end_col_offset)

    def add(self, n: ast.AST, what: str, start: int, end: int, new: str, probe: Optional[ast.AST] = None) -> None:
        if b"no mutate" in self.lines[n.lineno - 1]:
            return
        p = probe if probe is not None else n
        ps, pe = self.span(p)
        self.out.append(Mutant(self.path, n.lineno, n.col_offset, what, start, end, new, (ps, pe, isinstance(p, ast.stmt))))

    def op_between(self, a: ast.AST, b: ast.AST, sym: str) -> Optional[tuple[int, int]]:
        """The byte span of operator `sym` between the end of `a` and the start of `b`."""
        s, e = self.off(a.end_lineno, a.end_col_offset), self.off(b.lineno, b.col_offset)
        i = self.src.find(sym.encode(), s, e)
        return None if i < 0 else (i, i + len(sym))

    # Code that never runs, or runs at import only, is not mutated.
    def visit_JoinedStr(self, n: ast.JoinedStr) -> None:
        return

    def visit_AnnAssign(self, n: ast.AnnAssign) -> None:
        self._stmt(n)
        if n.value is not None:
            self.visit(n.value)

    def visit_FunctionDef(self, n: ast.FunctionDef) -> None:
        for stmt in n.body:
            self.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, n: ast.ClassDef) -> None:
        for stmt in n.body:
            self.visit(stmt)

    def visit_Module(self, n: ast.Module) -> None:
        for stmt in n.body:  # module level: functions, classes and data tables (not imports, not registrations)
            if isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                self.visit(stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and not (
                isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)
            ):
                self.visit(stmt.value)

    def visit_If(self, n: ast.If) -> None:
        if isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING":
            return
        s, e = self.span(n.test)
        self.add(n.test, "negate if", s, e, "not (" + self.src[s:e].decode() + ")")
        self.generic_visit(n)

    def _stmt(self, n: ast.stmt) -> None:
        """Drop a one-line simple statement (not a docstring, not the only one of its block)."""
        if n.lineno != n.end_lineno:
            return
        if isinstance(n, ast.Expr) and not isinstance(n.value, ast.Call):
            return
        local = lambda t: isinstance(t, ast.Name) or (isinstance(t, ast.Tuple) and all(map(local, t.elts)))  # noqa: E731
        if isinstance(n, ast.Assign) and all(map(local, n.targets)):
            return  # a local name dropped only fails on its next read: no information
        s, e = self.span(n)
        if isinstance(n, ast.Return):
            if n.value is None or (isinstance(n.value, ast.Constant) and n.value.value is None):
                return
            self.add(n, "return None", s, e, "return None")
        else:
            self.add(n, "drop statement", s, e, "pass")

    def visit_Expr(self, n: ast.Expr) -> None:
        self._stmt(n)
        self.generic_visit(n)

    def visit_Assign(self, n: ast.Assign) -> None:
        if not (len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "__all__"):
            self._stmt(n)
            self.generic_visit(n)

    def visit_Return(self, n: ast.Return) -> None:
        self._stmt(n)
        self.generic_visit(n)

    def visit_AugAssign(self, n: ast.AugAssign) -> None:
        self._stmt(n)
        sw = _SWAP_BIN.get(type(n.op))
        if sw is not None:
            span = self.op_between(n.target, n.value, sw[1] + "=")
            if span:
                self.add(n, f"{sw[1]}= -> {sw[2]}=", *span, sw[2] + "=")
        self.generic_visit(n)

    def visit_BinOp(self, n: ast.BinOp) -> None:
        sw = _SWAP_BIN.get(type(n.op))
        if sw is not None:
            span = self.op_between(n.left, n.right, sw[1])
            if span:
                self.add(n, f"{sw[1]} -> {sw[2]}", *span, sw[2])
        self.generic_visit(n)

    def visit_Compare(self, n: ast.Compare) -> None:
        sw = _SWAP_CMP.get(type(n.ops[0]))
        if sw is not None:
            s, e = self.off(n.left.end_lineno, n.left.end_col_offset), self.off(n.comparators[0].lineno, n.comparators[0].col_offset)
            seg = self.src[s:e].decode()
            old = sw[0]
            if old in ("not in", "is not"):
                i = seg.find(old.split()[0])
                j = seg.find(old.split()[1], i + len(old.split()[0])) + len(old.split()[1])
            else:
                i = seg.find(old)
                j = i + len(old)
            if i >= 0:
                self.add(n, f"{old} -> {sw[1]}", s + len(seg[:i].encode()), s + len(seg[:j].encode()), sw[1])
        self.generic_visit(n)

    def visit_BoolOp(self, n: ast.BoolOp) -> None:
        old, new = ("and", "or") if isinstance(n.op, ast.And) else ("or", "and")
        span = self.op_between(n.values[0], n.values[1], old)
        if span:
            self.add(n, f"{old} -> {new}", *span, new)
        self.generic_visit(n)

    def visit_UnaryOp(self, n: ast.UnaryOp) -> None:
        if isinstance(n.op, ast.Not):
            s, e = self.span(n)
            os_, oe = self.span(n.operand)
            self.add(n, "drop not", s, e, "(" + self.src[os_:oe].decode() + ")")
        self.generic_visit(n)

    def visit_Constant(self, n: ast.Constant) -> None:
        s, e = self.span(n)
        if n.value is True or n.value is False:
            self.add(n, f"{n.value} -> {not n.value}", s, e, str(not n.value))
        elif type(n.value) is int and 0 <= n.value <= 16:
            self.add(n, f"{n.value} -> {n.value + 1}", s, e, str(n.value + 1))

    def visit_arguments(self, n: ast.arguments) -> None:
        return  # defaults are evaluated at import, annotations never (postponed)

    def visit_arg(self, n: ast.arg) -> None:
        return


def find_mutants(path: str) -> list[Mutant]:
    with open(path, "rb") as f:
        src = f.read()
    finder = _Finder(path, src)
    finder.visit(ast.parse(src))
    return finder.out


def tests_for(path: str) -> list[str]:
    rel = os.path.relpath(path, ROOT)
    for prefix, tests in TARGETS.items():
        if rel.startswith(prefix):
            return tests
    raise SystemExit(f"no tests are mapped to {rel}: add it to TARGETS or pass --tests")


def scratch() -> str:
    """A copy of the package (with its built library) and of the tests: mutants are written
    there, never into the checkout."""
    d = tempfile.mkdtemp(prefix="sl-mutate-")
    shutil.copytree(os.path.join(ROOT, "torch_ops"), os.path.join(d, "torch_ops"), ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "tests", "python"), os.path.join(d, "tests", "python"), ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("README.md", "pyproject.toml"):  # read by tests (the arm table, the entry point)
        shutil.copy(os.path.join(ROOT, f), d)
    shutil.copytree(os.path.join(ROOT, "benches", "data"), os.path.join(d, "benches", "data"))  # measured node times
    shutil.copytree(os.path.join(ROOT, "docs"), os.path.join(d, "docs"))  # the generated arm table, the guides' examples
    return d


def run_tests(d: str, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout', seconds, last output line) of `tests` in scratch `d`."""
    env = dict(os.environ, PYTHONPATH=os.path.join(d, "torch_ops"), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"] + [x for t in tests for x in shlex.split(t)]
    t0 = time.monotonic()
    # Its own process group: on a timeout the spawned ranks go too, not only pytest.
    p = subprocess.Popen(cmd, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return "timeout", time.monotonic() - t0, f"over {timeout:.0f} s"
    tail = (out.strip().splitlines() or [""])[-1]
    return ("passed" if p.returncode == 0 else "failed"), time.monotonic() - t0, tail


def apply(src: bytes, start: int, end: int, new: str) -> bytes:
    return src[:start] + new.encode() + src[end:]


def probe_text(src: bytes, m: Mutant) -> bytes:
    s, e, stmt = m.probe
    return apply(src, s, e, "__import__('os')._exit(97)" if stmt else "(__import__('os')._exit(97))")


def main() -> int:
    ap = argparse.ArgumentParser(description="mutation testing of sched_lifetime's Python package (developer loop, not CI)")
    ap.add_argument("--files", nargs="*", help="files to mutate (default: every file under TARGETS)")
    ap.add_argument("--sample", type=int, default=50, help="mutants to run, drawn at random (0: all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tests", default=None, help="pytest arguments to run for every mutant (default: the file's focused tests in TARGETS)")
    ap.add_argument("--timeout", type=float, default=0, help="seconds per mutant (default: 3x the clean run of its tests + 60)")
    ap.add_argument("--start", type=int, default=0, help="skip the first N mutants of the sample (a run cut short, resumed)")
    ap.add_argument("--no-clean", action="store_true", help="skip the unmutated run of each test set (you ran them; give --timeout)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--lines", default=None, help="only mutants on these lines of the files, e.g. 40-75")
    ap.add_argument("--only", default=None, help="run the one mutant with this id (file:line:col, as --list prints)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    ap.add_argument("--json", default=None, help="write every result here")
    a = ap.parse_args()
    files = [os.path.abspath(f) for f in a.files] if a.files else sorted(
        os.path.join(dp, f)
        for prefix in TARGETS
        for dp, _, fs in os.walk(os.path.join(ROOT, prefix)) if os.path.isdir(os.path.join(ROOT, prefix))
        for f in fs if f.endswith(".py")
    ) + [os.path.join(ROOT, p) for p in TARGETS if p.endswith(".py")]
    mutants = [m for f in files for m in find_mutants(f)]
    if a.lines:
        lo, _, hi = a.lines.partition("-")
        mutants = [m for m in mutants if int(lo) <= m.line <= int(hi or lo)]
    if a.only:
        mutants = [m for m in mutants if m.id == a.only or m.id.endswith("/" + a.only)]
        if not mutants:
            raise SystemExit(f"no mutant {a.only!r} (see --list)")
    if a.list:
        for m in mutants:
            print(f"{m.id}  {m.what}")
        print(f"{len(mutants)} mutants in {len(files)} files")
        return 0
    if a.sample and len(mutants) > a.sample and not a.only:
        mutants = random.Random(a.seed).sample(mutants, a.sample)  # in random order: a run cut short is still a random sample
    mutants = mutants[a.start :]
    d = scratch()
    print(f"{len(mutants)} mutants; scratch copy {d}", flush=True)
    clean: dict[str, float] = {}
    results = []
    try:
        for i, m in enumerate(mutants):
            tests = [a.tests] if a.tests else tests_for(m.file)
            key = " ".join(tests)
            if key not in clean and a.no_clean:
                clean[key] = (a.timeout or 600) / 3
            if key not in clean:  # the unmutated tests must pass first; their time sets the limit
                status, secs, tail = run_tests(d, tests, 3600)
                if status != "passed":
                    raise SystemExit(f"the unmutated tests do not pass ({tail}): {key}")
                clean[key] = secs
                print(f"clean run of {key}: {secs:.0f} s", flush=True)
            limit = a.timeout or 3 * clean[key] + 60
            dst = os.path.join(d, os.path.relpath(m.file, ROOT))
            with open(m.file, "rb") as f:
                src = f.read()
            try:
                with open(dst, "wb") as f:
                    f.write(apply(src, m.start, m.end, m.new))
                status, secs, tail = run_tests(d, tests, limit)
                verdict = {"failed": "killed", "timeout": "timeout", "passed": "survived"}[status]
                if verdict == "survived":
                    with open(dst, "wb") as f:
                        f.write(probe_text(src, m))
                    reached, _, _ = run_tests(d, tests, limit)
                    verdict = "survived" if reached != "passed" else "unreached"
            finally:
                with open(dst, "wb") as f:
                    f.write(src)
            line = src.splitlines()[m.line - 1].decode().strip()
            results.append({**asdict(m), "id": m.id, "verdict": verdict, "seconds": round(secs, 1), "source": line})
            if a.json:  # as it goes: a run cut short keeps what it found
                with open(a.json, "w") as f:
                    json.dump(results, f, indent=1)
            print(f"[{i + 1}/{len(mutants)}] {verdict:<9} {m.id:<28} {m.what:<16} {secs:5.0f} s  {line[:90]}", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    count = {v: sum(r["verdict"] == v for r in results) for v in ("killed", "timeout", "survived", "unreached")}
    visible = count["killed"] + count["timeout"] + count["survived"]
    dead = count["killed"] + count["timeout"]
    print(f"\n{len(results)} mutants: {count['killed']} killed, {count['timeout']} timed out, {count['survived']} survived, "
          f"{count['unreached']} unreached by the CPU tests")
    if results:
        print(f"kill rate: {dead}/{len(results)} = {dead / len(results):.0%} of all; "
              f"{dead}/{visible} = {dead / max(visible, 1):.0%} of the CPU-visible (reached) mutants")
    for r in results:
        if r["verdict"] in ("survived", "unreached"):
            print(f"  {r['verdict']:<9} {r['id']:<28} {r['what']:<16} {r['source'][:100]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
