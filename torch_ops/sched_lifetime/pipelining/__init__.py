"""Pipelines (wiring only): an OVERLAP_F_B handler for `torch.distributed.pipelining` and an
`overlapped_forward_backward` for deepseek-ai's DualPipe/DualPipeV, both running the forward
of one stage and the backward of another as one multiplexed schedule (the scheduler's order,
streams and lifetime points, all from Rust) in one thread.

Graph stages: `GraphStage(module, example_inputs)` runs the stage as compiled forward and
backward graphs (AOTAutograd, no Inductor) in Rust's order, and an OVERLAP_F_B pair of graph
stages as the one module `compile.multiplex` builds for that pair.

An eager stage module takes part by being a `NodeStage`: its module described as nodes (`NodeDef`s;
`describe` makes them from a list of layers, where a layer that knows its dispatch and combine
gives its own nodes). `NodeStage.forward` runs those nodes and joins autograd through one
function whose backward runs the nodes' backward, so the runtime's ordinary forward and
backward calls (and any schedule without OVERLAP_F_B) work unchanged, with the same ops.

The overlap itself: the handler does the F and B sub-actions' bookkeeping as the runtime's
default path does (recv waits, loss, backward counters, same-rank hand-off), but arms the
forward stage and its inputs before it starts the backward. When the backward reaches the
backward stage's nodes, they run multiplexed with the armed forward's nodes (`run_pair`); the
forward call that follows finds its result ready and returns it. If the backward never reaches
a `NodeStage` (a plain stage), the forward runs on its own afterwards: same results, no overlap
(`NodeStage.overlapped` counts the overlaps that happened).

Modules: `arming` (a forward armed for the next backward), `node_stage` (`NodeStage`,
`describe`), `graph_stage` (`GraphStage`), `schedule_hook` (`enable_overlap`: the OVERLAP_F_B
handler).
"""

from .arming import _ARMED, _Armed, _DualPipeHook, _armed, _take_armed, _take_ready, overlapped
from .graph_stage import GraphStage, _GraphChain
from .node_stage import NodeStage, _Chain, _module_device, _refuse_reentrant_checkpoint, describe
from .schedule_hook import _overlap_f_b, _split_dw_on_input_backward, enable_overlap

__all__ = ["GraphStage", "NodeStage", "describe", "enable_overlap", "overlapped"]
