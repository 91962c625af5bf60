"""A small DeepSeek-style MoE transformer, described as schedule nodes.

Per layer: RMSNorm + causal attention (+ residual), RMSNorm, a top-k softmax router, routed
SwiGLU experts sharded over the EP ranks, a shared expert beside them; the first
`dense_layers` layers have a dense MLP instead. Embedding in front, RMSNorm + LM head +
cross-entropy behind. Tokens are synthetic.

Node split of a MoE layer (what `MoEModel.nodes` describes; each is a `NodeDef`):
  attn      h -> x (after attention), z (normed), w (top-k weights), send (permuted tokens), meta
  shared    z -> s                                  (the shared expert; hides a dispatch)
  dispatch  send, meta -> recv, rmeta               (all-to-all on the EP stream)
  experts   recv, rmeta -> eout                     (the local experts)
  combine   eout, rmeta, meta -> back               (all-to-all back)
  post      x, w, back, meta, s -> h'               (un-permute, weight, add)
Dense layer: attn (h -> x, z), mlp (x, z -> h').

Two dispatch modes: counted (eager, lossless: counts exchanged first, a host sync, as
Megatron-LM's all-to-all dispatcher does) and fixed capacity (`capacity_factor`: no host
sync, so a step can be captured in a CUDA graph; assignments beyond capacity are dropped
and counted by `dropped_assignments`). Every gather reads distinct rows (a zero or dump row
aside), so the numerics are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..ep import AllToAll, Transport
from ..nodes import Chunk, NodeDef


@dataclass(frozen=True)
class MoEConfig:
    """Model and batch shape."""

    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    dense_layers: int = 0
    experts: int = 4
    topk: int = 2
    expert_ffn: int = 64
    shared_ffn: int = 64
    dense_ffn: int = 128
    seq: int = 16
    batch: int = 2
    dtype: str = "float32"
    #: None: counted (lossless, host sync); a number: fixed capacity per expert and source
    #: rank of ceil(tokens * topk / experts * factor) (no host sync; overflow dropped).
    capacity_factor: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)


CONFIGS = {
    # Runs on CPU in seconds (CI, parity tests).
    "tiny": MoEConfig(),
    "tiny_dense": MoEConfig(dense_layers=1, layers=3),
    # Two H200s: bf16, hidden 4096, 8 experts of ffn 1024 top-4, 8192 tokens per microbatch per
    # rank; with NCCL held to one channel (`train --nccl-channels 1`, an inter-node-like link)
    # the all-to-all takes about as long as the expert compute.
    "h200": MoEConfig(
        vocab=8192, hidden=4096, heads=32, layers=4, dense_layers=0, experts=8, topk=4,
        expert_ffn=1024, shared_ffn=1024, dense_ffn=8192, seq=2048, batch=4, dtype="bfloat16",
        capacity_factor=1.25,
    ),
}


#: Attention backends to use (None: torch's choice). The main job sets a deterministic one
#: on GPU (`deterministic_sdpa`), so arms compare bit-exact.
SDPA_BACKENDS: Optional[list] = None


def deterministic_sdpa(device: torch.device, dtype: torch.dtype) -> Optional[list]:
    """The first attention backend whose backward gives the same bits twice here (probed on a
    small causal problem), set as the model's backend; None if torch's default already does."""
    global SDPA_BACKENDS
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=g).to(device, dtype).requires_grad_() for _ in range(3))

    def grads(backends: Optional[list]) -> Optional[list]:
        try:
            ctx = sdpa_kernel(backends) if backends else torch.enable_grad()
            with ctx:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return list(torch.autograd.grad(o.square().sum(), (q, k, v)))
        except RuntimeError:
            return None

    for backends in (None, [SDPBackend.FLASH_ATTENTION], [SDPBackend.EFFICIENT_ATTENTION], [SDPBackend.MATH]):
        runs = [grads(backends) for _ in range(3)]
        if runs[0] is not None and all(r is not None and all(torch.equal(a, b) for a, b in zip(r, runs[0])) for r in runs[1:]):
            SDPA_BACKENDS = backends
            return backends
    raise RuntimeError("no deterministic attention backend found")


def _dtype(cfg: MoEConfig) -> torch.dtype:
    return getattr(torch, cfg.dtype)


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


class MoEModel(nn.Module):
    """Embedding, layers, head; `nodes()` describes it as schedule nodes."""

    def __init__(self, cfg: MoEConfig, transport: Optional[Transport] = None, seed: int = 0, device: Any = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.transport: Transport = transport if transport is not None else AllToAll()
        world, rank = self.transport.world, self.transport.rank
        check = getattr(self.transport, "check", None)  # a transport bound to an expert count
        if check is not None and cfg.layers > cfg.dense_layers:
            check(cfg.experts)
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(MoELayer(cfg, i < cfg.dense_layers, world, rank) for i in range(cfg.layers))
        for layer in self.layers:
            layer.transport = self.transport  # what `sched_nodes` dispatches and combines through
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self._init(seed, world, rank)
        self.to(device=device, dtype=_dtype(cfg))

    def _init(self, seed: int, world: int, rank: int) -> None:
        # Same values on every rank and every arm; each rank keeps its slice of the experts.
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                continue
            if ".experts." in name:
                full = torch.randn((p.shape[0] * world, *p.shape[1:]), generator=g) / math.sqrt(p.shape[-2])
                p.data.copy_(full[rank * p.shape[0] : (rank + 1) * p.shape[0]])
            else:
                p.data.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters sharded over EP (their gradients need no data-parallel reduction)."""
        return [p for n, p in self.named_parameters() if ".experts." in n]

    def dense_parameters(self) -> list[nn.Parameter]:
        ids = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in ids]

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Plain eager forward (no nodes), the reference the node path must match."""
        t = self.transport
        h = self.embed(tokens.reshape(-1))
        for layer in self.layers:
            h = layer.forward(t, h)
        return F.cross_entropy(self.head(self.norm(h)).float(), labels.reshape(-1))

    def nodes(self) -> list[NodeDef]:
        t = self.transport
        nodes = [embed_node(self.embed, "tokens", "h0")]
        for i, layer in enumerate(self.layers):
            nodes += layer_nodes(layer, t, f"h{i}", f"h{i + 1}", f"L{i}")
        last = f"h{len(self.layers)}"
        nodes.append(
            NodeDef(
                "head", "compute", [last, "labels"], ["loss"],
                lambda h_, lab: F.cross_entropy(self.head(self.norm(h_)).float(), lab.reshape(-1)),
                list(self.norm.parameters()) + list(self.head.parameters()), [last], ["loss"],
            )
        )
        return nodes

    def chunk(self, device: Any = None, dw_nodes: bool = True) -> Chunk:
        dev = torch.device(device) if device is not None else next(self.parameters()).device
        return Chunk(self.nodes(), ["tokens", "labels"], "loss", dev, dw_nodes=dw_nodes)

    def batch(self, step: int, microbatch: int, device: Any = None) -> dict[str, torch.Tensor]:
        """Synthetic tokens and labels, the same on every arm (different per rank)."""
        c = self.cfg
        g = torch.Generator().manual_seed(1_000_003 * step + 1009 * microbatch + 7 * self.transport.rank + 1)
        tok = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
        lab = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
        dev = device if device is not None else next(self.parameters()).device
        return {"tokens": tok.to(dev), "labels": lab.to(dev)}


class MoEStage(nn.Module):
    """Layers `[start, stop)` of a model as one pipeline stage (it takes those modules over):
    the first stage embeds tokens, the last ends with the final norm and the head (logits; the
    pipeline schedule's `loss_fn` takes them). `nodes()` is its description for the node API;
    `forward` is the plain module the no-handler reference runs."""

    def __init__(self, model: MoEModel, start: int, stop: int) -> None:
        super().__init__()
        if not 0 <= start < stop <= len(model.layers):
            raise ValueError(f"stage layers [{start}, {stop}) outside the model's {len(model.layers)} layers")
        self.transport = model.transport
        self.first, self.last = start == 0, stop == len(model.layers)
        self.embed = model.embed if self.first else None
        self.layers = nn.ModuleList(model.layers[start:stop])
        self.norm = model.norm if self.last else None
        self.head = model.head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(-1)) if self.embed is not None else x
        t = self.transport
        for layer in self.layers:
            h = layer.forward(t, h)
        if self.head is not None:
            h = self.head(self.norm(h)).float()
        return h

    def nodes(self) -> list[NodeDef]:
        """Input `x`, output `out`."""
        nodes = [embed_node(self.embed, "x", "h0")] if self.embed is not None else []
        first = "h0" if self.embed is not None else "x"
        names = [first] + [f"h{i + 1}" for i in range(len(self.layers))]
        if self.head is None:
            names[-1] = "out"
        for i, layer in enumerate(self.layers):
            nodes += layer_nodes(layer, self.transport, names[i], names[i + 1], f"L{i}")
        if self.head is not None:
            last = names[-1]
            nodes.append(NodeDef("head", "compute", [last], ["out"], lambda h_: self.head(self.norm(h_)).float(),
                                 list(self.norm.parameters()) + list(self.head.parameters()), [last], ["out"]))
        return nodes


def stage_io(cfg: MoEConfig, k: int, n_stages: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of pipeline stage `k` of `n_stages` (one microbatch): what
    `PipelineStage(input_args=, output_args=)` takes, so no shape inference runs."""
    rows, dt = cfg.batch * cfg.seq, _dtype(cfg)
    inp = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long, device=device) if k == 0 else torch.zeros(rows, cfg.hidden, dtype=dt, device=device)
    out = torch.zeros(rows, cfg.vocab, device=device) if k == n_stages - 1 else torch.zeros(rows, cfg.hidden, dtype=dt, device=device)
    return inp, out


def embed_node(embed: nn.Embedding, tokens: str, out: str) -> NodeDef:
    """The token embedding as a node (tokens of any shape -> rows)."""
    return NodeDef("embed", "compute", [tokens], [out], lambda tok: embed(tok.reshape(-1)), list(embed.parameters()), (), [out])


def layer_nodes(layer: "MoELayer", t: Transport, h: str, nxt: str, p: str) -> list[NodeDef]:
    """One layer as schedule nodes, reading `h` and writing `nxt`, names prefixed `p`: a dense
    layer is attention then MLP; an MoE layer is attention/router (pre-dispatch), shared
    expert, dispatch, experts, combine, post-combine."""
    nodes: list[NodeDef] = []
    own = [q for n, q in layer.named_parameters() if n.split(".")[0] in ("norm1", "attn", "norm2", "router")]
    if layer.dense:
        nodes.append(NodeDef(f"{p}.attn", "compute", [h], [f"{p}.x", f"{p}.z"], layer.pre, own, [h], [f"{p}.x", f"{p}.z"]))
        nodes.append(
            NodeDef(f"{p}.mlp", "compute", [f"{p}.x", f"{p}.z"], [nxt], lambda x, z, L=layer: x + L.mlp(z), list(layer.mlp.parameters()), [f"{p}.x", f"{p}.z"], [nxt])
        )
        return nodes
    x, z, w, send, meta, s = (f"{p}.{k}" for k in ("x", "z", "w", "send", "meta", "s"))
    recv, rmeta, eout, back = (f"{p}.{k}" for k in ("recv", "rmeta", "eout", "back"))
    nodes.append(NodeDef(f"{p}.attn", "compute", [h], [x, z, w, send, meta], layer.pre, own, [h], [x, z, w, send]))
    if layer.shared is not None:
        nodes.append(NodeDef(f"{p}.shared", "compute", [z], [s], layer.shared, list(layer.shared.parameters()), [z], [s]))
    nodes.append(
        NodeDef(
            f"{p}.dispatch", "comm", [send, meta], [recv, rmeta],
            lambda send_, r, alloc_stream=None, L=layer: L.dispatch(t, send_, r, alloc_stream),
            grad_inputs=[send], grad_outputs=[recv], consumer_alloc=[recv],
            transpose=lambda rx, g, alloc_stream=None, L=layer: (
                t.all_to_all(g, sum(rx.send_splits) if rx.send_splits else g.shape[0], rx.send_splits, rx.recv_splits, alloc_stream),
            ),
        )
    )
    nodes.append(
        NodeDef(f"{p}.experts", "compute", [recv, rmeta], [eout], layer.run_experts, list(layer.experts.parameters()), [recv], [eout])
    )
    nodes.append(
        NodeDef(
            f"{p}.combine", "comm", [eout, rmeta, meta], [back],
            lambda e, rx, r, alloc_stream=None, L=layer: L.combine(t, e, rx, r, alloc_stream),
            grad_inputs=[eout], grad_outputs=[back], consumer_alloc=[back],
            transpose=lambda rx, g, alloc_stream=None: (
                t.all_to_all(g, sum(rx.recv_splits) if rx.recv_splits else g.shape[0], rx.recv_splits, rx.send_splits, alloc_stream),
            ),
        )
    )
    post_in = [x, w, back, meta] + ([s] if layer.shared is not None else [])
    post_fn = (lambda x_, w_, b_, r_, s_, L=layer: L.post(x_, w_, b_, r_, s_)) if layer.shared is not None else (
        lambda x_, w_, b_, r_, L=layer: L.post(x_, w_, b_, r_, None)
    )
    grads = [x, w, back] + ([s] if layer.shared is not None else [])
    nodes.append(NodeDef(f"{p}.post", "compute", post_in, [nxt], post_fn, (), grads, [nxt]))
    return nodes


def with_overrides(cfg: MoEConfig, **kw: Any) -> MoEConfig:
    """A config with some fields replaced."""
    return replace(cfg, **kw)
