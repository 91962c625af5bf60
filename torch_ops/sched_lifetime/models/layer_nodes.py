"""A MoE layer and the embedding as schedule nodes (`NodeDef`s): the split the docstring of `moe` draws."""

from __future__ import annotations


from torch import nn

from ..ep import Transport
from ..nodes import NodeDef


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
