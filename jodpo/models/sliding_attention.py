"""The sliding-window attention mixer kind (``Model.sliding_window``: Gemma 2-4's local layers, Mistral, Qwen2 and 3 and
SmolLM3 with windows, OLMo 3's sliding layers): softmax attention over the last ``window`` slots (padding included, as
transformers counts them), rotated with the local RoPE tables where the model has them; its ``Attention`` description
is the ``Model``'s with the window (``Model.attention_of``). Its parameters and cache-free forwards are the
softmax-attention kind's (``jodpo.models.attention_mixer``, with this kind's description; the parameters stacked
with that kind's, ``params["layers"]["attn"]``); its cache is a ring of ``min(window, length)`` slots
``[B, kv_heads, ring, head_dim]``: slot s of the sequence lives at ``s % ring``, so a decode step writes one slot in
place and reads the window's slots only, however long the sequence.

Several new tokens at once (a prefill; a prompt longer than the window) attend among themselves with the forwards'
kernel and, after a non-empty cache, to the ring's slots still within their window; then the last ``ring`` of them are
written in their slots. In a model whose KV-sharing layers read this kind's (Gemma 4), which attend to all of them and
to the ring as it was, their keys and values wait beside the ring instead (``open_state``) until every layer has run
(``close_state``). Which slots hold a real token comes from the cache's mask (``ctx.mask[1]``: every slot of the
sequence, a byte each).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodpo.models import attention_mixer
from jodpo.models.attention_mixer import _output, _queries
from jodpo.models.layers import (Context, Site, attention, cache_attention, causal_attention, keys_values, layer_rope,
                                 within)
from jodpo.models.model import READS, Model, Params

KIND = "sliding_attention"
WEIGHTS = attention_mixer.WEIGHTS


def specs(model: Model, n: int, reads: bool = False) -> dict:
    return attention_mixer.specs(model, n, reads, kind=KIND)


def empty_kv(model: Model, batch: int, length: int, dtype) -> tuple:
    return attention_mixer.empty_kv(model, batch, length, dtype, kind=KIND)


def full(model: Model, p: Params, x, ctx: Context, site: Site, kv=None, reads: bool = False):
    return attention_mixer.full(model, p, x, ctx, site, kv, reads, kind=KIND)


def prefixed(model: Model, p: Params, xs, ctx: Context, site: Site, kv=None, reads: bool = False):
    return attention_mixer.prefixed(model, p, xs, ctx, site, kv, reads, kind=KIND)


def init_state(model: Model, batch: int, length: int, dtype) -> dict:
    """The ring: the window's slots, or the sequence's where it is shorter."""
    window = model.attention_of(KIND).window
    return attention_mixer.init_state(model, batch, min(window, length), dtype, kind=KIND)


def _read(model: Model) -> bool:
    """Whether layers of another kind read this kind's keys and values (KV sharing)."""
    return any(READS.get(k) == KIND for k in model.kinds)


def open_state(model: Model, state: dict, length: int) -> dict:
    """``state`` with room for the keys and values of ``length`` new tokens, token-major ``[..., B, L, K, Dh]``, where
    KV-sharing layers read them (else as it is)."""
    if not _read(model):
        return state

    def room(ring):
        *lead, B, K, _, Dh = ring.shape
        return jnp.zeros((*lead, B, length, K, Dh), ring.dtype)

    return {**state, "new_k": room(state["k"]), "new_v": room(state["v"])}


def close_state(model: Model, state: dict, ctx: Context) -> dict:
    """The ring with the last of the new tokens' keys and values in their slots (``ctx.start`` is the first's), the
    room gone."""
    if "new_k" not in state:
        return state
    size, L = state["k"].shape[-2], state["new_k"].shape[-3]
    n = min(L, size)
    slots = (ctx.start + jnp.arange(L - n, L, dtype=jnp.int32)) % size  # distinct: n <= size

    def put(ring, new):
        return ring.at[..., slots, :].set(jnp.swapaxes(new[..., L - n:, :, :], -3, -2).astype(ring.dtype))

    return {"k": put(state["k"], state["new_k"]), "v": put(state["v"], state["new_v"])}


def _written(ring, new, start, j):
    """One layer's ``ring`` (the ``j``-th of a stack) with the last of the new tokens' keys or values ``new`` ``[B, L, K,
    Dh]`` in their slots (``start`` is the first's)."""
    size, L = ring.shape[-2], new.shape[1]
    n = min(L, size)
    slots = (start + jnp.arange(L - n, L, dtype=jnp.int32)) % size  # distinct: n <= size
    new = new[:, L - n:].transpose(0, 2, 1, 3).astype(ring.dtype)
    if j is None:
        return ring.at[:, :, slots, :].set(new)
    return jax.lax.dynamic_update_index_in_dim(ring, ring[j].at[:, :, slots, :].set(new), j, 0)


def _held(last, size: int):
    """The sequence slot each ring position holds when the latest written is slot ``last`` (negative: none yet);
    ``last`` i32[] or, a slot per row, i32[B] (then ``[B, size]``)."""
    last = jnp.asarray(last)[..., None]
    return last - (last - jnp.arange(size, dtype=jnp.int32)) % size


def _real(ctx: Context, slots):
    """bool ``[B, n]``: which of these sequence slots (``[n]``, or ``[B, n]`` a row's own) hold a real token (the
    cache's mask; a slot past the mask's end, in the sampler's last chunk's overhang, reads its last)."""
    mask = ctx.mask[1]
    at = jnp.clip(slots, 0, mask.shape[1] - 1)
    if slots.ndim == 2:
        return (slots >= 0) & jnp.take_along_axis(mask, at, axis=1)
    return (slots >= 0)[None] & jnp.take(mask, at, axis=1)


def cached(model: Model, p: Params, x, state: dict, j, ctx: Context, site: Site,
           reads: bool = False) -> tuple[jax.Array, dict]:
    """One new token (a decode step): its keys and values written in its ring slot (in place), then attention over the
    ring, every slot of which is within its window. Several: attended among themselves (with the forwards' kernel when
    ``ctx.empty`` promises an empty cache) and to the ring's slots within their window, then the last of them written
    in the ring, or kept in the room beside it (``open_state``). ``reads``: ``state`` is another layer's (KV
    sharing), already written, its new tokens' in the room."""
    attn = model.attention_of(KIND)
    W, size, L = attn.window, state["k"].shape[-2], x.shape[1]
    rope = layer_rope(attn, ctx.rope[0], site)
    q, gate = _queries(model, attn, p, x, rope)
    mine = (lambda a: a) if j is None else (lambda a: a[j])  # noqa: E731
    if L == 1:
        if not reads:
            k, v = keys_values(model, attn, p, x, *rope)
            at = (0, 0, ctx.start % size, 0) if j is None else (j, 0, 0, ctx.start % size, 0)

            def write(ring, new):  # [B, 1, K, Dh] -> the ring's head-major layout, at the token's slot
                if jnp.ndim(ctx.start) == 1:  # a slot per row
                    return attention_mixer.write_slot(ring, new[:, 0], ctx.start % size)
                new = new.transpose(0, 2, 1, 3).astype(ring.dtype)
                return jax.lax.dynamic_update_slice(ring, new if j is None else new[None], at)

            state = {"k": write(state["k"], k), "v": write(state["v"], v)}
        attend = _real(ctx, _held(ctx.start, size))[:, None, :]
        a = cache_attention(model, q, state["k"], state["v"], attend, j)
        return _output(model, p, a, gate, x.dtype), state
    if reads:
        k, v = mine(state["new_k"]), mine(state["new_v"])
    else:
        k, v = keys_values(model, attn, p, x, *rope)
        if "new_k" in state:  # KV-sharing layers read them: kept in the room until every layer has run
            keep = (lambda room, new: new.astype(room.dtype)) if j is None else (  # noqa: E731
                lambda room, new: jax.lax.dynamic_update_index_in_dim(room, new.astype(room.dtype), j, 0))
            state = {**state, "new_k": keep(state["new_k"], k), "new_v": keep(state["new_v"], v)}
    if ctx.empty:
        a = causal_attention(model, q, k, v, ctx.mask[0], 0, W)
    else:
        among = ctx.mask[0][:, None, :] & within(W, ctx.dist[0])[None]
        held = _held(ctx.start - 1, size)  # the ring before these tokens
        dist = (ctx.start + jnp.arange(L, dtype=jnp.int32))[:, None] - held[None, :]
        before = _real(ctx, held)[:, None, :] & (dist < W)[None]
        ks, vs = (jnp.concatenate([mine(state[n]), new.transpose(0, 2, 1, 3).astype(state[n].dtype)], -2)
                  for n, new in (("k", k), ("v", v)))
        a = attention(model, q, ks, vs, jnp.concatenate([before, among], -1))
    if not reads and "new_k" not in state:
        state = {"k": _written(state["k"], k, ctx.start, j), "v": _written(state["v"], v, ctx.start, j)}
    return _output(model, p, a, gate, x.dtype), state
