"""The global-attention mixer kind: softmax attention of a shape of its own (Gemma 4's ``full_attention`` layers:
``global_head_dim``, ``num_global_key_value_heads``, values that are the keys with ``attention_k_eq_v``, and the
"proportional" RoPE, whose zero frequencies leave the head's unrotated dims as they are). ``Model.global_attention``
is its ``Attention`` description; everything every attention layer shares (norms, scale, soft-capping, the cache
layout) is the softmax-attention kind's (``jodpo.models.attention_mixer``), run with this kind's description and RoPE
tables of its own (``context``, from the positions the decoder passes every mixer)."""
from __future__ import annotations

from jodpo.models import attention_mixer
from jodpo.models.layers import Context, rope_tables
from jodpo.models.model import Model

KIND = "global_attention"
WEIGHTS = attention_mixer.WEIGHTS


def context(model: Model, ctx: Context) -> Context:
    """``ctx`` with this kind's RoPE tables at each group's positions."""
    rope = model.attention_of(KIND).rope
    return ctx._replace(rope=tuple(rope_tables(rope, pos) for pos in ctx.positions))


def specs(model: Model, n: int, reads: bool = False) -> dict:
    return attention_mixer.specs(model, n, reads, kind=KIND)


def empty_kv(model: Model, batch: int, length: int, dtype) -> tuple:
    return attention_mixer.empty_kv(model, batch, length, dtype, kind=KIND)


def init_state(model: Model, batch: int, length: int, dtype) -> dict:
    return attention_mixer.init_state(model, batch, length, dtype, kind=KIND)


def full(model: Model, p, x, ctx: Context, site, kv=None, reads: bool = False):
    return attention_mixer.full(model, p, x, context(model, ctx), site, kv, reads, kind=KIND)


def prefixed(model: Model, p, xs, ctx: Context, site, kv=None, reads: bool = False):
    return attention_mixer.prefixed(model, p, xs, context(model, ctx), site, kv, reads, kind=KIND)


def cached(model: Model, p, x, state, j, ctx: Context, site, reads: bool = False):
    return attention_mixer.cached(model, p, x, state, j, context(model, ctx), site, reads, kind=KIND)
