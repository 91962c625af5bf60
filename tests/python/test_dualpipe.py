"""deepseek-ai DualPipeV with our `overlapped_forward_backward` (2 GPUs, NCCL): a test in the
shape of DualPipe's own example (a small MLP stage, a full-model reference step, losses
compared with torch.equal and gradients by cosine difference), written here. Needs the
`dualpipe` package on the path (not installable in CI: skipped there)."""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from sched_lifetime.pipelining import NodeStage, describe

HIDDEN, SEQ, MICRO, CHUNKS = 256, 64, 2, 8


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN, bias=False), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN, bias=False))


def _stage(mlp: nn.Sequential) -> NodeStage:
    return NodeStage(mlp, nodes=describe(list(mlp)))


def _criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target).clone()


def _cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()


def _worker(rank: int, world: int, port: int) -> None:
    from dualpipe import DualPipeV, set_p2p_tensor_dtype, set_p2p_tensor_shapes

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    torch.set_default_device(f"cuda:{rank}")
    torch.manual_seed(233)
    torch.use_deterministic_algorithms(True)
    set_p2p_tensor_shapes([(MICRO, SEQ, HIDDEN)])
    set_p2p_tensor_dtype(torch.float32)
    full = nn.Sequential(*[_mlp() for _ in range(2 * world)])  # the plain modules
    x = torch.randn(CHUNKS * MICRO, SEQ, HIDDEN)
    lab = torch.randn(CHUNKS * MICRO, SEQ, HIDDEN)
    # Reference: the full model, microbatch by microbatch.
    losses = []
    for mx, ml in zip(x.chunk(CHUNKS), lab.chunk(CHUNKS)):
        loss = _criterion(full(mx), ml)
        loss.backward()
        losses.append(loss.detach())
    loss_ref = torch.stack(losses)
    mine = (full[rank], full[2 * world - 1 - rank])
    local = nn.Sequential(_stage(copy.deepcopy(mine[0])), _stage(copy.deepcopy(mine[1])))
    for m in local:
        m.zero_grad(set_to_none=True)
    model = DualPipeV(local)
    assert model.overlapped_forward_backward  # DualPipeV found our hook
    loss, outputs = model.step(x if rank == 0 else None, num_chunks=CHUNKS, criterion=_criterion, labels=(lab if rank == 0 else None,), return_outputs=False)
    if rank == 0:
        assert torch.equal(loss, loss_ref)
    else:
        assert loss is None
    for (n, p), q in zip(local.named_parameters(), (q for m in mine for q in m.parameters())):
        assert _cos_diff(p.grad, q.grad) < 1e-13, n
    overlaps = local[0].overlapped + local[1].overlapped
    assert overlaps > 0, "no forward ran inside a backward"
    dist.destroy_process_group()


@pytest.mark.cuda
def test_dualpipev_example_with_our_overlapped_forward_backward():
    pytest.importorskip("dualpipe")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(2, port), nprocs=2, join=True)
