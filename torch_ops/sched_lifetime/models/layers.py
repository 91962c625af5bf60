"""The layers of the embedded MoE model: norm, attention, experts, routing and the MoE layer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ..ep import Transport
from ..nodes import NodeDef
from .config import SDPA_BACKENDS, MoEConfig
from .layer_nodes import layer_nodes


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, s, d = c.batch, c.seq, c.hidden // c.heads
        q, k, v = self.qkv(h).view(b, s, 3, c.heads, d).permute(2, 0, 3, 1, 4)
        if SDPA_BACKENDS is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            with sdpa_kernel(SDPA_BACKENDS):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b * s, c.hidden))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * g)


class LocalExperts(nn.Module):
    """This rank's share of the routed experts (SwiGLU, no bias: a zero row maps to zero)."""

    def __init__(self, n: int, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, 2 * ffn))
        self.w2 = nn.Parameter(torch.empty(n, ffn, dim))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        a, g = (x @ self.w1[e]).chunk(2, dim=-1)
        return (F.silu(a) * g) @ self.w2[e]


class PermuteRows(torch.autograd.Function):
    """`cat(x, zero_row)[fwd]` where `fwd` and `bwd` are inverse partial permutations (each
    row read at most once; index `len(x)` is the zero row). Its backward is the gather
    `cat(g, zero_row)[bwd]`, not index_select's scatter-add: as fast as the forward and
    deterministic without torch's slow sorting fallback."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: torch.Tensor, bwd: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(bwd)
        return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, fwd)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        (bwd,) = ctx.saved_tensors
        return torch.cat([g, g.new_zeros(1, g.shape[1])]).index_select(0, bwd), None, None


@dataclass
class Routing:
    """Routing of one layer of one microbatch on this rank."""

    send_src: torch.Tensor  # row of the send buffer -> flat (token, k) index (or the zero row)
    back: torch.Tensor  # flat (token, k) index -> row of the returned buffer (or the dump row)
    counts: torch.Tensor  # assignments per global expert
    rows: int  # rows of the send buffer


@dataclass
class Received:
    """What the receiving side needs: per (source rank, local expert) counts (counted mode)."""

    counts: Optional[list[list[int]]]
    send_splits: Optional[list[int]]
    recv_splits: Optional[list[int]]


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, dense: bool, ep_world: int, ep_rank: int) -> None:
        super().__init__()
        self.cfg, self.dense = cfg, dense
        self.ep_world, self.ep_rank = ep_world, ep_rank
        self.norm1, self.attn, self.norm2 = RMSNorm(cfg.hidden), Attention(cfg), RMSNorm(cfg.hidden)
        if dense:
            self.mlp = SwiGLU(cfg.hidden, cfg.dense_ffn)
            return
        if cfg.experts % ep_world:
            raise ValueError(f"{cfg.experts} experts do not shard over {ep_world} EP ranks")
        self.local = cfg.experts // ep_world
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = LocalExperts(self.local, cfg.hidden, cfg.expert_ffn)
        self.shared = SwiGLU(cfg.hidden, cfg.shared_ffn) if cfg.shared_ffn else None
        tokens = cfg.batch * cfg.seq
        self.capacity = (
            None if cfg.capacity_factor is None else max(1, math.ceil(tokens * cfg.topk / cfg.experts * cfg.capacity_factor))
        )

    def forward(self, t: Transport, h: torch.Tensor) -> torch.Tensor:
        """The plain layer (the reference the nodes must match)."""
        if self.dense:
            x, z = self.pre(h)
            return x + self.mlp(z)
        x, z, w, send, r = self.pre(h)
        s = self.shared(z) if self.shared is not None else None
        (recv, rx), _ = self.dispatch(t, send, r)
        eout = self.run_experts(recv, rx)
        (back,), _ = self.combine(t, eout, rx, r)
        return self.post(x, w, back, r, s)

    def sched_nodes(self, inp: str, out: str, prefix: str) -> list[NodeDef]:
        """This layer as schedule nodes (what `pipelining.describe` asks a layer for): where
        its dispatch and combine are, through the model's transport."""
        return layer_nodes(self, self.transport, inp, out, prefix)

    def dropped_assignments(self, r: "Routing") -> int:
        """Assignments beyond capacity in one routing (a host sync: call it outside steps)."""
        return 0 if self.capacity is None else int((r.back == r.rows).sum().item())

    # -- node bodies -------------------------------------------------------------------

    def pre(self, h: torch.Tensor) -> tuple:
        x = h + self.attn(self.norm1(h))
        z = self.norm2(x)
        if self.dense:
            return x, z
        c = self.cfg
        probs = torch.softmax(self.router(z).float(), dim=-1)
        w, eid = torch.topk(probs, c.topk, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(z.dtype)
        flat = eid.reshape(-1)
        n = flat.numel()
        perm = torch.argsort(flat, stable=True)
        inv = torch.argsort(perm)
        # Not bincount: on CUDA it reads the max on the host (a sync; no capture).
        counts = (flat.unsqueeze(1) == torch.arange(c.experts, device=flat.device)).sum(0)
        # Expand, not index with repeats: its backward is a sum over k, deterministic.
        z_rep = z.unsqueeze(1).expand(-1, c.topk, -1).reshape(-1, c.hidden)
        if self.capacity is None:
            send = PermuteRows.apply(z_rep, perm, inv)
            routing = Routing(perm, inv, counts, n)
        else:
            cap = self.capacity
            rows = c.experts * cap
            starts = torch.cumsum(counts, 0) - counts
            slot = torch.arange(cap, device=flat.device)
            q = starts.unsqueeze(1) + slot
            filled = slot < counts.unsqueeze(1)
            # Slot (e, c) takes sorted assignment starts[e] + c, or the zero row past the end.
            src = torch.where(filled, perm.index_select(0, q.clamp(max=n - 1).reshape(-1)).view_as(q), torch.full_like(q, n))
            src = src.reshape(-1)
            # Flat assignment -> its row of the returned buffer, or the dump row (dropped).
            f_sorted = flat.index_select(0, perm)
            pos = torch.arange(n, device=flat.device) - starts.index_select(0, f_sorted)
            dest = torch.where(pos < cap, f_sorted * cap + pos, torch.full_like(pos, rows))
            back = dest.index_select(0, inv)
            send = PermuteRows.apply(z_rep, src, back)
            routing = Routing(src, back, counts, rows)
        return x, z, w, send, routing

    def dispatch(self, t: Transport, send: torch.Tensor, r: Routing, alloc_stream=None) -> tuple:
        if self.capacity is None:
            got = t.exchange_counts(r.counts)
            mine = r.counts.view(self.ep_world, self.local)
            theirs = got.view(self.ep_world, self.local)
            # Eager mode learns the split sizes on the host, as Megatron's a2a dispatcher does.
            send_splits = mine.sum(1).tolist()
            counts = theirs.tolist()
            recv_splits = [sum(row) for row in counts]
            k = getattr(t, "emulated_ranks", None)
            if k is not None and self.ep_world == 1:
                # An emulated EP link of k ranks (`ep_link`): splits per emulated rank's block of
                # experts, so the rows of the other ranks' experts are the ones that cross.
                per = self.local // k
                send_splits = recv_splits = [sum(counts[0][i * per : (i + 1) * per]) for i in range(k)]
            recv = t.all_to_all(send, sum(recv_splits), recv_splits, send_splits, alloc_stream)
            rx = Received(counts, send_splits, recv_splits)
        else:
            recv = t.all_to_all(send, send.shape[0], None, None, alloc_stream)
            rx = Received(None, None, None)
        return (recv, rx), rx

    def run_experts(self, recv: torch.Tensor, rx: Received) -> torch.Tensor:
        c, w, n = self.cfg, self.ep_world, self.local
        if rx.counts is None:
            r = recv.view(w, n, self.capacity, c.hidden)
            outs = [self.experts.expert(e, r[:, e].reshape(-1, c.hidden)) for e in range(n)]
            return torch.stack([o.view(w, self.capacity, c.hidden) for o in outs], 1).reshape(-1, c.hidden)
        sizes = [rx.counts[s][e] for s in range(w) for e in range(n)]
        segs = recv.split(sizes)
        pieces: list[list[torch.Tensor]] = [[None] * n for _ in range(w)]  # type: ignore[list-item]
        for e in range(n):
            xe = torch.cat([segs[s * n + e] for s in range(w)])
            ye = self.experts.expert(e, xe).split([rx.counts[s][e] for s in range(w)])
            for s in range(w):
                pieces[s][e] = ye[s]
        return torch.cat([p for row in pieces for p in row])

    def combine(self, t: Transport, eout: torch.Tensor, rx: Received, r: Routing, alloc_stream=None) -> tuple:
        back = t.all_to_all(eout, r.rows, rx.send_splits, rx.recv_splits, alloc_stream)
        return (back,), rx

    def post(self, x: torch.Tensor, w: torch.Tensor, back: torch.Tensor, r: Routing, s: Optional[torch.Tensor]) -> torch.Tensor:
        c = self.cfg
        # The inverse of the dispatch gather: each row read once, both ways.
        y_flat = PermuteRows.apply(back, r.back, r.send_src)
        y = (y_flat.view(-1, c.topk, c.hidden) * w.unsqueeze(-1)).sum(1)
        out = x + y
        return out + s if s is not None else out
