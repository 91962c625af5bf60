"""Shared by the compile-backend test files: train a module for a few SGD steps under a backend
and compare two runs bit for bit (outputs, every gradient of every step, the final weights);
and check one GraphStep step against the same model run eagerly (`assert_matches_eager`)."""

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


def assert_matches_eager(losses, model, ref, microbatches, what="") -> None:
    """A GraphStep step's `losses` and `model`'s accumulated `.grad` against `ref` (a model with
    the same weights) run eagerly, one `loss.backward()` per microbatch: `torch.equal` on every
    loss and every gradient. Then both models' gradients are cleared for the next step."""
    want = []
    for mb in microbatches:
        loss = ref(*mb)
        loss.backward()
        want.append(loss.detach())
    assert len(losses) == len(want) and all(torch.equal(a, b) for a, b in zip(losses, want)), f"{what}: losses differ"
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())), f"{what}: gradients differ"
    for p in [*model.parameters(), *ref.parameters()]:
        p.grad = None
