"""The dense feed-forward kind (``Model.mlp``, an ``MLP``): its parameters and its forward, which is also its decode
step (it keeps no state).

``down(act(gate(x)) * up(x))`` where ``MLP.gated`` (SwiGLU, GeGLU), ``down(act(up(x)))`` otherwise (GPT-NeoX), with
biases where ``MLP.bias``. Parameters, stacked over the layers: ``params["layers"]["mlp"]``, ``up`` ``[D, F]``,
``gate`` ``[D, F]``, ``down`` ``[F, D]``, the biases ``up_bias``, ``gate_bias`` ``[F]``, ``down_bias`` ``[D]``; where
some layers' MLPs are twice as wide (``MLP.wide_kinds``: Gemma 4's KV-sharing layers), theirs are
``params["layers"]["mlp_wide"]``, stacked over those layers (``jodpo.models.layout.subtree_layers``).
"""
from __future__ import annotations

import jax

from jodpo.models.layers import ACTIVATIONS, recomputed
from jodpo.models.model import MLP, Model, Params, einsum


def specs(m: MLP, D: int, n: int, width: int) -> dict:
    """The parameters of ``n`` layers' MLPs of ``width``, ``(shape, logical_axes)`` stacked on a ``layers`` axis."""
    out = {"up": ((n, D, width), ("layers", "embed", "mlp")), "down": ((n, width, D), ("layers", "mlp", "embed"))}
    if m.gated:
        out["gate"] = ((n, D, width), ("layers", "embed", "mlp"))
    if m.bias:
        out["up_bias"] = ((n, width), ("layers", "mlp"))
        out["down_bias"] = ((n, D), ("layers", "embed"))
        if m.gated:
            out["gate_bias"] = ((n, width), ("layers", "mlp"))
    return out


def key(model: Model, kind: str) -> str:
    """Where a layer of this mixer kind finds its MLP in ``params["layers"]``."""
    return "mlp_wide" if kind in model.wide_kinds else "mlp"


def forward(model: Model, m: MLP, p: Params, x_BLD: jax.Array) -> jax.Array:
    """The MLP ``m`` on normed hidden states ``[B, L, D]`` (any number of tokens: a decode step's too)."""
    dt = x_BLD.dtype
    act = ACTIVATIONS[m.activation]
    up = einsum(model, "bld,df->blf", x_BLD, p["up"].astype(dt))
    if m.bias:
        up = up + p["up_bias"].astype(dt)
    gate = None
    if m.gated:
        gate = einsum(model, "bld,df->blf", x_BLD, p["gate"].astype(dt))
        if m.bias:
            gate = gate + p["gate_bias"].astype(dt)

    def down(gate, up, w):  # the backward keeps only the projections' outputs and recomputes the activation
        h = act(gate) * up if m.gated else act(up)
        return einsum(model, "blf,fd->bld", h, w)

    out = recomputed(down)(gate, up, p["down"].astype(dt))
    if m.bias:
        out = out + p["down_bias"].astype(dt)
    return out
