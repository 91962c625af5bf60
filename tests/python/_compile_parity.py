"""Shared by the compile-backend test files: train a module for a few SGD steps under a backend
and compare two runs bit for bit (outputs, every gradient of every step, the final weights)."""

import torch

STEPS = 3


def steps(model, make_batch, backend, options=None, steps=STEPS, dynamic=None):
    """(outputs, gradients per step, final weights) of `steps` SGD steps of `model` compiled with
    `backend` (None: eager) on `make_batch(step)`'s positional inputs."""
    torch._dynamo.reset()
    run = model if backend is None else torch.compile(model, backend=backend, options=options, dynamic=dynamic)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, grads = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + step)  # the same RNG draws in every arm
        out = run(*make_batch(step))
        out.sum().backward() if out.dim() else out.backward()
        outs.append(out.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return outs, grads, [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    """Two `steps` results equal bit for bit (`torch.equal` on every tensor)."""
    (oa, ga, pa), (ob, gb, pb) = a, b
    return (
        all(torch.equal(x, y) for x, y in zip(oa, ob))
        and all(torch.equal(x, y) for gx, gy in zip(ga, gb) for x, y in zip(gx, gy))
        and all(torch.equal(x, y) for x, y in zip(pa, pb))
    )
