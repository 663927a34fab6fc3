"""The heads on top of the decoder's hidden states: the LM head (logits) and the reward head (a
``*ForSequenceClassification`` value at the last non-pad token), for plain and prompt-sharing forwards."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodpo.models.decoder import Model, Params, einsum, hidden_states, prefixed_hidden_states


def lm_head(model: Model, params: Params, h_BXD: jax.Array) -> jax.Array:
    """Float32 logits of hidden states of any leading shape ``[..., D] -> [..., V]``, soft-capped as
    ``cap * tanh(logits / cap)`` where the model does (Gemma 2's final_logit_softcapping): every logit of jodpo (the
    losses, the sampler's prefill and decode steps, the LLM judge) comes from here."""
    w_VD = params["embed"] if model.tie_embeddings else params["lm_head"]
    logits = einsum(model, "...d,vd->...v", h_BXD, w_VD.astype(h_BXD.dtype), preferred_element_type=jnp.float32)
    if model.final_softcap:
        logits = jnp.tanh(logits / model.final_softcap) * model.final_softcap
    return logits


def logits(model: Model, params: Params, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """f32[B, L, V] next-token logits of a causal LM, as ``transformers`` computes them."""
    if model.task != "causal_lm":
        raise ValueError(f"logits() needs a causal LM; this model was loaded with task={model.task!r}")
    h, _ = hidden_states(model, params, input_ids, attention_mask)
    return lm_head(model, params, h)


def last_token_index(model: Model, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Where a sequence classifier reads its value, exactly as transformers does: the rightmost token
    that is not ``pad_token_id`` (so with pad == EOS a trailing EOS is skipped, as in HF). Without a pad
    id in the config, the rightmost real token by the attention mask."""
    L = input_ids.shape[1]
    idx = jnp.arange(L, dtype=jnp.int32)
    keep = attention_mask.astype(bool) if model.pad_token_id is None else input_ids != model.pad_token_id
    return jnp.argmax(idx * keep.astype(jnp.int32), axis=-1)


def _value_at_last(model: Model, params: Params, h_BLD, input_ids, attention_mask) -> jax.Array:
    last = last_token_index(model, input_ids, attention_mask)
    h_BD = jnp.take_along_axis(h_BLD, last[:, None, None], axis=1)[:, 0]
    return einsum(model, "bd,dk->bk", h_BD, params["score"].astype(h_BD.dtype),
                      preferred_element_type=jnp.float32)[:, 0]


def _check_reward(model: Model) -> None:
    if model.task != "reward":
        raise ValueError(f"reward scores need a reward model; this model was loaded with task={model.task!r}")


def reward_scores(model: Model, params: Params, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """f32[B]: a ``*ForSequenceClassification`` (num_labels=1) value at the last non-pad token."""
    _check_reward(model)
    h, _ = hidden_states(model, params, input_ids, attention_mask)
    return _value_at_last(model, params, h, input_ids, attention_mask)


def prefixed_reward_scores(model: Model, params: Params, prefix_ids_BP: jax.Array, prefix_mask_BP: jax.Array,
                           suffix_ids_NC: jax.Array, suffix_mask_NC: jax.Array) -> jax.Array:
    """f32[N]: ``reward_scores`` of ``concatenate([tile(prefix), suffix], 1)`` with every prefix computed once
    (block layout, as ``prefixed_hidden_states``)."""
    _check_reward(model)
    n = suffix_ids_NC.shape[0] // prefix_ids_BP.shape[0]
    ids = jnp.concatenate([jnp.concatenate([prefix_ids_BP] * n, 0), suffix_ids_NC], 1)
    mask = jnp.concatenate([jnp.concatenate([prefix_mask_BP] * n, 0), suffix_mask_NC], 1)
    h = prefixed_hidden_states(model, params, prefix_ids_BP, prefix_mask_BP, suffix_ids_NC, suffix_mask_NC)
    return _value_at_last(model, params, h, ids, mask)
