"""Eager node API (DESIGN.md §6), in the shape of Megatron-LM's schedule nodes.

A model chunk is a list of `NodeDef`s: compute nodes (a forward function and the parameters
it uses) and comm nodes (an EP dispatch/combine with an explicit transpose for its backward).
From that list, `Chunk` derives two graph tables for the scheduler: the forward source and the
backward source, whose nodes are the backward of each forward node, split into dI (`B.<node>`)
and dW (`B.<node>.dw`, weight-gradient work the scheduler may defer). Each compute node's
backward runs through autograd on its own detached inputs, so one microbatch's backward is
split per node and can be interleaved with another microbatch's forward.

`Chunk.run(...)` runs a forward of one microbatch, a backward of another, or both multiplexed
(`combined_step`) through the executor, in the scheduler's order or a baseline's; `train_step`
runs a whole step of n microbatches (warm-up F, combined F(i+1)+B(i), cool-down B) with
gradient accumulation. The order, streams, syncs and lifetime points all come from Rust.

One module a noun, each importing only those above it here:
  graph.py       the graph of a chunk: `NodeDef`, `ChunkGraph`'s tables, pairings (pure)
  state.py       what a microbatch keeps between its forward and its backward
  grads.py       the dI/dW split, accumulation into `.grad`, the in-step `GradReduce`
  page_hooks.py  paging's tensor side: saved-tensor hooks, page-out/in callables, calibration
  callables.py   what each graph node runs
  run.py         the executor hand-off: `run_pair`, `run_two`, `combined_step`, `train_step`
  chunk.py       `Chunk`: the graph composed with the above
"""

from .chunk import Chunk
from .grads import GradReduce, accumulate_grads, grad_reduce_for
from .graph import ORDERS, ChunkGraph, NodeDef, two_schedule
from .page_hooks import PageHooks
from .run import combined_step, run_pair, run_two, train_step
from .state import MicrobatchState

# The private names of the single module `nodes` was, still here for tests and benches.
from .grads import _WeightSplit
from .graph import _grad_name, _order_schedule, _pair_graph, _renamed, _two_graph
from .run import _compute_stream, _executor, _feed_backward, _feed_forward, _loss_grad, _twin
from .state import _Ctx

__all__ = [
    "ORDERS",
    "Chunk",
    "ChunkGraph",
    "GradReduce",
    "MicrobatchState",
    "NodeDef",
    "PageHooks",
    "accumulate_grads",
    "combined_step",
    "grad_reduce_for",
    "run_pair",
    "run_two",
    "train_step",
    "two_schedule",
]
