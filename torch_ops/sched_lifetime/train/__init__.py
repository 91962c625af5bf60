"""The main job, `python -m sched_lifetime train`: train the embedded MoE model for a few steps
under several arms, side by side in one process per rank, and print one table.

Arms (same initial weights, same tokens) are the rows of `arms.ARM_TABLE`: by default
`sequential` (F then B per microbatch, each comm waited at once: the reference), `b_then_f`
(F(i+1) and B(i) multiplexed as every B node then every F node), `ours` (the scheduler's order)
and `ours+record` (`ours` with `record_stream` instead of the lifetime manager); the others are
for A/Bs (`--help` lists them all). Columns: loss and gradient parity against `sequential`
(torch.equal on every loss, gradient and updated weight), the same against `reference.Reference`
(the model trained by plain autograd, sharing no step code with the arms), step time (median of interleaved
steps), exposed communication (profiler kernel intervals: NCCL time with no compute kernel
running), max allocated, max reserved, pending-free peak (allocator snapshot).

Launch: with 2+ GPUs it spawns 2 ranks over NCCL itself (or run it under
`torchrun --standalone --nproc-per-node 2 -m sched_lifetime train`); on CPU it spawns 2 gloo
ranks (real numerics; memory figures simulated by the Rust model and labelled so); with one
GPU it runs one process on the emulated EP link (`--ep-link host[:K]`, `ep_link.py`: EP=K,
default 8, its traffic through pinned host memory; "comm" is then the link's copies, and the
table says the link is emulated). `--ep-link nccl` on one GPU runs EP=1 (a local copy).

Modules, one job each: `arms` (the arm table, `Arm`), `reference` (the plain-autograd
reference and the comparison every parity suite uses), `capture` (whole-step CUDA graphs and
their pools), `loop` (the ranks' loop), `figures` (measures, plots, the table), `cli` (options
and launch). Every name is re-exported here.
"""

from .arms import (
    ARM_TABLE,
    ARMS,
    EXTRA_ARMS,
    GRAPH_ARMS,
    PAGED,
    PAIRED_ENDS,
    REDUCE_AFTER,
    SPECS,
    Arm,
    ArmSpec,
    arms_help,
    check_arms,
    default_arms,
    markdown_table,
    same_grads,
    with_markdown_table,
)
from .capture import _capture, _capture_start, _large_pool_reserved, eager_step_growth, eager_step_pool, pool_segments
from .cli import _free_port, main, parser
from .figures import (
    _exposed_us,
    _is_kernel,
    _is_nccl,
    _is_page_copy,
    allocator_timeline,
    exposed_comm_us,
    exposed_page_us,
    format_table,
    median_exposed,
    plot_allocator,
    simulate_memory,
    top_kernels,
    union,
)
from .loop import build_arms, run, worker

__all__ = [
    "ARM_TABLE",
    "ARMS",
    "Arm",
    "ArmSpec",
    "EXTRA_ARMS",
    "GRAPH_ARMS",
    "PAGED",
    "PAIRED_ENDS",
    "REDUCE_AFTER",
    "SPECS",
    "allocator_timeline",
    "arms_help",
    "build_arms",
    "check_arms",
    "default_arms",
    "eager_step_growth",
    "eager_step_pool",
    "exposed_comm_us",
    "exposed_page_us",
    "median_exposed",
    "format_table",
    "main",
    "markdown_table",
    "parser",
    "plot_allocator",
    "pool_segments",
    "run",
    "same_grads",
    "simulate_memory",
    "top_kernels",
    "union",
    "with_markdown_table",
    "worker",
]
