"""The global-attention mixer kind: softmax attention of a shape of its own (Gemma 4's ``full_attention`` layers:
``global_head_dim``, ``num_global_key_value_heads``, values that are the keys with ``attention_k_eq_v``, and the
"proportional" RoPE, whose zero frequencies leave the head's unrotated dims as they are). ``Model.global_attention``
describes what differs; everything else (norms, scale, soft-capping, the cache layout) is the softmax-attention
kind's (``jodpo.models.attention_mixer``), run on the ``Model`` as these layers see it (``view``) with RoPE tables of
their own (``context``, from the positions the decoder passes every mixer)."""
from __future__ import annotations

import dataclasses

from jodpo.models import attention_mixer
from jodpo.models.layers import Context, rope_tables
from jodpo.models.model import Model

WEIGHTS = attention_mixer.WEIGHTS


def view(model: Model) -> Model:
    g = model.global_attention
    return model.replace(num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, rope=g.rope,
                         attn_options=dataclasses.replace(model.attn_options, k_eq_v=g.k_eq_v))


def context(model: Model, ctx: Context) -> Context:
    """``ctx`` with the RoPE tables of ``model`` (this kind's view) at each group's positions."""
    return ctx._replace(rope=tuple(rope_tables(model, pos) for pos in ctx.positions))


def specs(model: Model, n: int, reads: bool = False) -> dict:
    return attention_mixer.specs(view(model), n, reads)


def empty_kv(model: Model, batch: int, length: int, dtype) -> tuple:
    return attention_mixer.empty_kv(view(model), batch, length, dtype)


def init_state(model: Model, batch: int, length: int, dtype) -> dict:
    return attention_mixer.init_state(view(model), batch, length, dtype)


def full(model: Model, p, x, ctx: Context, site, kv=None, reads: bool = False):
    m = view(model)
    return attention_mixer.full(m, p, x, context(m, ctx), site, kv, reads)


def prefixed(model: Model, p, xs, ctx: Context, site, kv=None, reads: bool = False):
    m = view(model)
    return attention_mixer.prefixed(m, p, xs, context(m, ctx), site, kv, reads)


def cached(model: Model, p, x, state, j, ctx: Context, site, reads: bool = False):
    m = view(model)
    return attention_mixer.cached(m, p, x, state, j, context(m, ctx), site, reads)
