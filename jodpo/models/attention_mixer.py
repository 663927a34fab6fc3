"""The softmax-attention mixer kind: its parameters, its three forwards and its cache state.

Every mixer kind (this one, ``jodpo.models.sliding_attention``, ``deltanet``, ``global_attention``, ``shared_kv``)
offers the decoder the same functions:
  specs(model, n)                   its parameters' ``(shape, logical_axes)`` for n layers, stacked on a ``layers`` axis
  full(model, p, x, ctx, site, kv)  a group of tokens without a cache (training, scoring)
  prefixed(model, p, xs, ctx, site, kv)   the shared-prompt layout: a prefix group and the suffixes that continue it
  cached(model, p, x, state, j, ctx, site)   new tokens after a cache state (the prefill, the decode steps)
  init_state(model, batch, length, dtype)    one layer's empty cache state (None: it keeps none)
  open_state(model, state, length), close_state(model, state, ctx)   optional: the state made ready for ``length``
                                    new tokens before a cached call over several, and put in order after every layer
                                    ran (the sliding kind keeps them beside its ring until its KV-sharing readers
                                    have read them)
``p`` is one layer's parameters of this kind (``params["layers"]["attn"]`` sliced), ``x`` its normed input
``[B, L, D]``; each returns the mixer's output ``[B, L, D]`` (after its output projection). ``ctx``
(``layers.Context``) carries what the decoder computes once for every layer: token masks, RoPE tables, the attention
masks before windows, the cache slot the new tokens go to. ``site`` (``layers.Site``) says whether the layer rotates.
``state`` is the layer's state, or the kind's states stacked over its layers with ``j`` the layer's index among them
(the stacked cache; None for a layer's own state). ``kv`` is KV sharing's slot in the cache-free forwards
(None in a model without it): the keys and values of the last layer of this kind so far, ``(k, v)`` (``full``) or
``((prefix's), (suffix's))`` (``prefixed``), which a layer of this kind replaces with its own and a layer of a kind
that reads this one's (``model.READS``) attends to; ``full`` and ``prefixed`` return it with their output.

This kind: keys and values of every token in a cache ``[B, kv_heads, slots, head_dim]`` (head-major, as the decode
steps read them), RoPE, q/k norms, biases, grouped kv heads, soft-capping, an output gate, a value norm, values that
are the keys. Its functions compute with the ``Attention`` description of ``kind`` (``Model.attention_of``: heads,
RoPE, options, window), this kind's by default: the other softmax-attention kinds run them with theirs (the sliding
kind's ``full`` and ``prefixed``, with its window; the global kind's, another shape and RoPE). ``reads=True`` runs a
layer that projects no keys or values of its own but attends to another layer's (``jodpo.models.shared_kv``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodpo.models.layers import (Context, Site, cache_attention, causal_attention, keys_values, layer_rope, queries,
                                 within)
from jodpo.models.model import Attention, Model, Params, einsum

KIND = "attention"
WEIGHTS = ("q", "k", "v", "o", "o_gate")  # the projections LoRA can adapt (jodpo.models.lora)


def specs(model: Model, n: int, reads: bool = False, kind: str = KIND) -> dict:
    """The parameters; ``reads``: a layer that reuses another's keys and values has no k or v projection (nor norm)."""
    a = model.attention_of(kind)
    D, H, K, Dh = model.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim
    out = {
        "q": ((n, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "o": ((n, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
    }
    o = a.options
    kv = [] if reads else ["k"] + ([] if o.k_eq_v else ["v"])
    for name in kv:
        out[name] = ((n, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"))
    if o.output_gate:
        out["o_gate"] = ((n, D, H, Dh), ("layers", "embed", "heads", "head_dim"))
    if o.qk_norm == "whole":  # a scale per channel of the whole projection (OLMo 2)
        out["q_norm"] = {"scale": ((n, H, Dh), ("layers", "heads", "head_dim"))}
        if not reads:
            out["k_norm"] = {"scale": ((n, K, Dh), ("layers", "kv_heads", "head_dim"))}
    elif o.qk_norm == "head":  # one scale per head dim, shared by the heads (never split)
        out["q_norm"] = {"scale": ((n, Dh), ("layers", "head_dim"))}
        if not reads:
            out["k_norm"] = {"scale": ((n, Dh), ("layers", "head_dim"))}
    if model.qkv_bias:
        out["q_bias"] = ((n, H, Dh), ("layers", "heads", "head_dim"))
        if o.output_gate:
            out["o_gate_bias"] = ((n, H, Dh), ("layers", "heads", "head_dim"))
        for name in kv:
            out[f"{name}_bias"] = ((n, K, Dh), ("layers", "kv_heads", "head_dim"))
    if model.out_bias:
        out["o_bias"] = ((n, D), ("layers", "embed"))
    return out


def empty_kv(model: Model, batch: int, length: int, dtype, kind: str = KIND) -> tuple:
    """KV sharing's slot before any layer of this kind filled it: keys and values ``[B, L, K, Dh]``."""
    a = model.attention_of(kind)
    shape = (batch, length, a.num_kv_heads, a.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def _queries(model: Model, attn: Attention, p: Params, x, rope):
    """Rotated queries of the new tokens, and the output gate's pre-activation (None without one)."""
    q = queries(model, attn, p, x, *rope)
    gate = None
    if attn.options.output_gate:
        gate = einsum(model, "bld,dhk->blhk", x, p["o_gate"].astype(x.dtype))
        if model.qkv_bias:
            gate = gate + p["o_gate_bias"].astype(x.dtype)
    return q, gate


def _output(model: Model, p: Params, a_BLHD, gate, dtype) -> jax.Array:
    """The attended values through the output gate (sigmoid, in the compute dtype as transformers) and projection."""
    if gate is not None:
        a_BLHD = a_BLHD * jax.nn.sigmoid(gate)
    out = einsum(model, "blhk,hkd->bld", a_BLHD, p["o"].astype(dtype))
    if model.out_bias:
        out = out + p["o_bias"].astype(dtype)
    return out


def _cached_keys(ctx: Context):
    """Which cache slots the new tokens attend to, ``[B, L, S]``: the real ones up to each token's own (the
    distances are per row where the cache's index is, ``decoder.hidden_states``)."""
    dist = ctx.dist[1]
    return ctx.mask[1][:, None, :] & within(0, dist if dist.ndim == 3 else dist[None])


def write_slot(slab, new_BKD, slot_B):
    """``slab`` ``[B, K, S, Dh]`` with row b's ``new_BKD[b]`` at its slot ``slot_B[b]`` (past the end: dropped)."""
    return slab.at[jnp.arange(slab.shape[0]), :, slot_B, :].set(new_BKD.astype(slab.dtype), mode="drop")


def full(model: Model, p: Params, x, ctx: Context, site: Site, kv=None, reads: bool = False, kind: str = KIND):
    """A windowed kind's layers (``jodpo.models.sliding_attention``) attend within ``Attention.window`` and rotate
    with the local RoPE tables where the rope has them."""
    attn = model.attention_of(kind)
    rope = layer_rope(attn, ctx.rope[0], site)
    q, gate = _queries(model, attn, p, x, rope)
    k, v = kv if reads else keys_values(model, attn, p, x, *rope)
    a = causal_attention(model, q, k, v, ctx.mask[0], 0, attn.window)
    return _output(model, p, a, gate, x.dtype), (kv if reads or kv is None else (k, v))


def prefixed(model: Model, p: Params, xs, ctx: Context, site: Site, kv=None, reads: bool = False, kind: str = KIND):
    """The prefix's tokens attend among themselves; the suffix rows (block layout: row r continues prefix r % B)
    attend to their prefix's keys and values (shared: their gradients add up) and to their own."""
    attn = model.attention_of(kind)
    (xp, xs_), (rope_p, rope_s) = xs, (layer_rope(attn, r, site) for r in ctx.rope)
    (qp, gp), (qs, gs) = _queries(model, attn, p, xp, rope_p), _queries(model, attn, p, xs_, rope_s)
    if reads:
        (kp, vp), (ks, vs) = kv
    else:
        (kp, vp), (ks, vs) = keys_values(model, attn, p, xp, *rope_p), keys_values(model, attn, p, xs_, *rope_s)
    n = xs_.shape[0] // xp.shape[0]
    tile = lambda a: jnp.concatenate([a] * n, 0)  # noqa: E731
    prefix_mask, suffix_keys = ctx.mask[0], ctx.mask[1]  # [B, P]; [N, P + C] (the tiled prefix's, then its own)
    ap = causal_attention(model, qp, kp, vp, prefix_mask, 0, attn.window)
    a_s = causal_attention(model, qs, jnp.concatenate([tile(kp), ks], 1), jnp.concatenate([tile(vp), vs], 1),
                           suffix_keys, xp.shape[1], attn.window)  # the suffix's slots follow the prefix's P
    out = _output(model, p, ap, gp, xp.dtype), _output(model, p, a_s, gs, xs_.dtype)
    return out, (kv if reads or kv is None else ((kp, vp), (ks, vs)))


def init_state(model: Model, batch: int, length: int, dtype, kind: str = KIND) -> dict:
    a = model.attention_of(kind)
    shape = (batch, a.num_kv_heads, length, a.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cached(model: Model, p: Params, x, state: dict, j, ctx: Context, site: Site, reads: bool = False,
           kind: str = KIND) -> tuple[jax.Array, dict]:
    """The new tokens' keys and values are written at slot ``ctx.start`` (only those slots: the cache is updated in
    place, never copied); they attend to every earlier real slot, or, when ``ctx.empty`` promises an empty cache (a
    prefill), among themselves with the forwards' kernel (``Model.attention``). ``reads``: ``state`` is another layer's
    (KV sharing), which already holds these tokens' keys and values: read, never written."""
    attn = model.attention_of(kind)
    rope = layer_rope(attn, ctx.rope[0], site)
    q, gate = _queries(model, attn, p, x, rope)
    if not reads:
        k, v = keys_values(model, attn, p, x, *rope)
        at = (0, 0, ctx.start, 0) if j is None else (j, 0, 0, ctx.start, 0)

        def write(slab, new):  # [B, L, K, Dh] -> the slab's head-major layout, at the new tokens' slots
            if jnp.ndim(ctx.start) == 1:  # a slot per row
                return write_slot(slab, new[:, 0], ctx.start)
            new = new.transpose(0, 2, 1, 3).astype(slab.dtype)
            return jax.lax.dynamic_update_slice(slab, new if j is None else new[None], at)

        state = {"k": write(state["k"], k), "v": write(state["v"], v)}
        if ctx.empty:
            a = causal_attention(model, q, k, v, ctx.mask[0])
            return _output(model, p, a, gate, x.dtype), state
    a = cache_attention(model, q, state["k"], state["v"], _cached_keys(ctx), j)
    return _output(model, p, a, gate, x.dtype), state
