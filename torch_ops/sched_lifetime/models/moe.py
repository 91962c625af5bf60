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
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ep import AllToAll, Transport
from ..nodes import Chunk, NodeDef
from .config import CONFIGS, SDPA_BACKENDS, MoEConfig, _dtype, deterministic_sdpa, with_overrides  # noqa: F401 (re-exported)
from .layer_nodes import embed_node, layer_nodes
from .layers import MoELayer, RMSNorm


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
    # Activations carry requires_grad as they do at run time: torch >= 2.15 takes it from
    # these examples (a stage whose input does not require grad sends no input gradient, and
    # its previous stage then backpropagates from None); torch 2.11 ignores it.
    inp = torch.zeros(cfg.batch, cfg.seq, dtype=torch.long, device=device) if k == 0 else torch.zeros(rows, cfg.hidden, dtype=dt, device=device, requires_grad=True)
    out = torch.zeros(rows, cfg.vocab, device=device, requires_grad=True) if k == n_stages - 1 else torch.zeros(rows, cfg.hidden, dtype=dt, device=device, requires_grad=True)
    return inp, out
