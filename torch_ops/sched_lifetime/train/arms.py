"""The main job's arms: one declarative table, and what is built from it.

Each row of `ARM_TABLE` names an arm, the order string and lifetime policy its steps run under,
its options (whole-step CUDA graph, page nodes, paired warm-up/cool-down, all-reduce after the
step), whether `--arms` runs it by default, and what it shows. The loop builds each `Arm` from
its row; the CLI's `--arms` help (`arms_help`) and the arm table of docs/main-job.md
(`markdown_table`) are rendered from the same rows, so adding an arm is one row here, then
regenerating that table (tests/python/test_train_arms.py says how when it differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ArmSpec:
    """One arm of the main job: how its steps run and what it is for."""

    #: The name `--arms` takes and the table prints.
    name: str
    #: One line: what runs (markdown; the CLI help drops the backticks).
    summary: str
    #: The order string `train_step` gets: a baseline (`sequential`, `b_then_f`) or
    #: `ours[:rule][:key=value...]` (scheduler rule and budgets).
    order: str = "ours"
    #: `scheduled` (the lifetime manager) or `record_stream`.
    lifetime: str = "scheduled"
    #: In the default `--arms` list.
    default: bool = False
    #: The whole step captured in one CUDA graph at step 1, replayed after (GPU, fixed-capacity
    #: dispatch only); its gradients are reduced after the replay.
    captured: bool = False
    #: Page nodes (`chunk.enable_paging` with `--page-*`): the table adds its page-copy time.
    paged: bool = False
    #: Warm-up and cool-down multiplexed too (`train_step(..., paired_ends=True)`).
    paired_ends: bool = False
    #: The data-parallel gradient all-reduce after the step, at once, instead of in it.
    reduce_after: bool = False
    #: Needs `--costs` (node costs in us) for its order.
    needs_costs: bool = False
    #: Docs only (docs/main-job.md's arm table): why the arm exists, what it costs, what it was
    #: measured against.
    notes: str = ""

    def options(self) -> list[str]:
        """The options this arm turns on, by field name (the arm table's column)."""
        return [k for k in ("captured", "paged", "paired_ends", "reduce_after", "needs_costs") if getattr(self, k)]


# Defaults first, in the order the table prints them (the default `--arms` keeps this order).
ARM_TABLE: tuple[ArmSpec, ...] = (
    ArmSpec("sequential", "F then B of each microbatch, each all-to-all waited at once (the serial reference)", order="sequential", default=True),
    ArmSpec("b_then_f", "steady state F(i+1) + B(i) in one graph, every B node then every F node", order="b_then_f", default=True),
    ArmSpec("ours", "the same graphs in the scheduler's order (EP stream, late waits, lifetime manager)", default=True),
    ArmSpec(
        "calibrated",
        "`ours` re-planned with measured costs: the first `--calibrate-steps` steps time every node, then rule `search` "
        "picks the order the simulator rates shortest with them (agreed across the ranks)",
        order="calibrated",
        default=True,
        notes="the table says from which step's costs; `ours` is the timing-free order",
    ),
    ArmSpec("ours+record", "`ours` with `Tensor.record_stream` instead of the lifetime manager", lifetime="record_stream", default=True),
    ArmSpec("ours+graph", "`ours` with the whole step captured in one CUDA graph (GPU, fixed-capacity dispatch)", captured=True),
    ArmSpec(
        "ours+graph+record",
        "`ours+graph` with `record_stream`",
        lifetime="record_stream",
        captured=True,
        notes="its frees on other streams wait for the capture's end",
    ),
    ArmSpec("ours+classic", "`ours` under the `classic` scheduler rules", order="ours:classic", notes="the default before `ready_first`"),
    ArmSpec(
        "ours+ep2",
        "`ours` with two EP launches in flight",
        order="ours:ep_budget=2",
        notes="the default before budget 1: on 2 x H200, h200 config, 8 microbatches, budget 1 ran 1054 ms against 1147 ms",
    ),
    ArmSpec(
        "ours+search",
        "`ours` under rule `search`: the order the simulator rates shortest with the node costs of `--costs`",
        order="ours:search",
        needs_costs=True,
        notes="e.g. a previous run's `durations.json`",
    ),
    ArmSpec(
        "ours+first",
        "`ours` under rule `launch_first`: each EP launch moved up to just after its inputs and the previous launch, "
        "the wait that frees the budget with it",
        order="ours:launch_first",
        notes="a launch waits for all compute issued before it (the transport's wait_stream); timing-free",
    ),
    ArmSpec(
        "ours+ends",
        "`ours` with the warm-up and cool-down multiplexed too, F(0) with F(1) and B(n-2) with B(n-1)",
        paired_ends=True,
        notes="one more microbatch's activations live",
    ),
    ArmSpec(
        "ours+page",
        "`ours` with page nodes: saved activations of the chosen nodes go to pinned host memory and come back before their backward",
        order="ours:page_budget=8",
        paged=True,
        notes="`chunk.enable_paging(budget=--page-budget or nodes=--page-nodes, prefetch=--page-prefetch, "
        "release=--page-release)`; page launch budget 8: with the default 2, budget 0.12 / prefetch 6 on 2 x H200 cost 1.357x "
        "instead of 1.076x; the table adds its page-copy time and how much of it ran with no compute kernel; "
        "trace `trace_ours_page.json`",
    ),
    ArmSpec(
        "ours+reduce_after",
        "`ours` with the data-parallel gradient all-reduce after the step, at once",
        reduce_after=True,
        notes="how every arm reduced before `Chunk.enable_grad_reduce`, which `ours` uses to start each node's reduce in the last backward",
    ),
)

#: Every arm by name, in table order.
SPECS: dict[str, ArmSpec] = {s.name: s for s in ARM_TABLE}
#: The default arms: name -> (order, lifetime).
ARMS = {s.name: (s.order, s.lifetime) for s in ARM_TABLE if s.default}
#: Arms that capture the whole step in one CUDA graph: name -> (order, lifetime).
GRAPH_ARMS = {s.name: (s.order, s.lifetime) for s in ARM_TABLE if s.captured}
#: Arms neither in the default list nor captured, for A/Bs: name -> (order, lifetime).
EXTRA_ARMS = {s.name: (s.order, s.lifetime) for s in ARM_TABLE if not s.default and not s.captured}
#: Arms whose data-parallel gradient all-reduce runs after the step.
REDUCE_AFTER = {s.name for s in ARM_TABLE if s.reduce_after}
#: Arms whose warm-up and cool-down are multiplexed too.
PAIRED_ENDS = {s.name for s in ARM_TABLE if s.paired_ends}
#: Arms with page nodes.
PAGED = {s.name for s in ARM_TABLE if s.paged}


def default_arms() -> str:
    """The default `--arms` value: the default arms in table order, comma-separated."""
    return ",".join(s.name for s in ARM_TABLE if s.default)


def check_arms(names: list[str], use_cuda: bool, have_costs: bool) -> None:
    """Raise `SystemExit` naming the first arm that is unknown or cannot run here."""
    for a in names:
        spec = SPECS.get(a)
        if spec is None:
            raise SystemExit(f"unknown arm {a!r}; expected some of {list(SPECS)}")
        if spec.captured and not use_cuda:
            raise SystemExit(f"arm {a!r} captures a CUDA graph: it needs a GPU")
        if spec.needs_costs and not have_costs:
            raise SystemExit(f"arm {a!r} needs --costs (node costs in us, e.g. a previous run's durations.json)")


def arms_help() -> str:
    """The `--arms` help: the default list, then one line per arm (name: summary)."""
    lines = [f"comma-separated arms (default {default_arms()}); every arm:"]
    lines += [f"{s.name}: {s.summary.replace('`', '')}" for s in ARM_TABLE]
    return "\n".join(lines).replace("%", "%%")  # argparse formats help with %


def markdown_table() -> str:
    """The arm table of docs/main-job.md (markdown), one row per arm in table order."""
    rows = ["| arm | what runs | order | lifetime | options | default |", "|---|---|---|---|---|---|"]
    for s in ARM_TABLE:
        what = s.summary + (f" ({s.notes})" if s.notes else "")
        opts = ", ".join(f"`{o}`" for o in s.options())
        rows.append(f"| `{s.name}` | {what} | `{s.order}` | `{s.lifetime}` | {opts} | {'yes' if s.default else ''} |")
    return "\n".join(rows) + "\n"


def with_markdown_table(readme: str) -> str:
    """`readme` (a Markdown document: docs/main-job.md) with its arm table (the lines from
    `| arm | what runs |` to the first line not starting with `|`) replaced by
    `markdown_table()`."""
    lines = readme.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.startswith("| arm | what runs |")), None)
    if start is None:
        raise ValueError("no arm table (a line starting '| arm | what runs |') in the document")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "".join(lines[:start]) + markdown_table() + "".join(lines[end:])


class Arm:
    """One arm's model, optimizer and results, built from its row of `ARM_TABLE`."""

    def __init__(self, name: str, cfg: Any, transport: Any, device: torch.device, lr: float, calibration: Any = None) -> None:
        from ..models import MoEModel
        from ..nodes import GradReduce

        self.name = name
        self.spec = SPECS[name]
        self.order, self.lifetime = self.spec.order, self.spec.lifetime
        self.captured = self.spec.captured
        self.graph: Any = None
        self.graph_pool = 0
        self.graph_pool_large = 0
        self.static: list = []
        self.static_losses: list = []
        self.model = MoEModel(cfg, transport, seed=0, device=device)
        self.chunk = self.model.chunk(device)
        if calibration is not None:
            self.chunk.calibration = calibration
        # Data parallel over the EP ranks for everything but the experts: in train_step, or
        # after the step (the captured arms: after the replay; `ours+reduce_after`).
        self.reduce_after: Any = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.captured or self.spec.reduce_after:
                self.reduce_after = GradReduce(self.model.dense_parameters())
            else:
                self.chunk.enable_grad_reduce(self.model.dense_parameters())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []

    def step(self, step: int, microbatches: int, on_run: Any = None) -> None:
        """One optimizer step over `microbatches` microbatches (a replay once captured)."""
        from ..nodes import train_step

        m = self.model
        batches = [m.batch(step, i) for i in range(microbatches)]
        if self.captured and step > 0:
            losses = self._replay(batches)
        else:
            self.opt.zero_grad(set_to_none=True)
            losses = train_step(self.chunk, batches, self.order, self.lifetime, on_run, paired_ends=self.spec.paired_ends)
        if self.reduce_after is not None:  # every gradient at once, after the step
            self.reduce_after.launch(m.dense_parameters())
            self.reduce_after.finish()
        self.opt.step()
        self.losses.append(torch.stack([x.float() for x in losses]).detach().cpu())

    def _replay(self, batches: list) -> list:
        from .capture import _capture

        if self.graph is None:
            _capture(self, batches)
        for s, b in zip(self.static, batches):
            for k in s:
                s[k].copy_(b[k])
        self.graph.replay()
        return [x.clone() for x in self.static_losses]


def same_grads(arm: Arm, ref: Arm, exact: bool = True) -> bool:
    """Every gradient of `arm` equals `ref`'s after the same step, compared in place: no copy
    is kept, so the memory figures carry no history of earlier steps. `exact=False` (the
    arms' sums in another order: an all-reduce over more than two ranks, `reference.compare`):
    within tolerance."""
    mine = {k: p.grad for k, p in arm.model.named_parameters() if p.grad is not None}
    theirs = {k: p.grad for k, p in ref.model.named_parameters() if p.grad is not None}
    if not exact:
        from .reference import compare

        return bool(compare(mine, theirs, exact=False))
    return set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
