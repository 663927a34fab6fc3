"""What the jitted step does with rewards: a reward model's scores of the policy's token ids on the device, the
EOS penalties, and TRL's pairing rule.

What a reward model reads follows TRL 1.16: the prompt and the completion *decoded with
skip_special_tokens=True*, so the completion's EOS is not part of the scored text. With a reward model
that shares the policy tokenizer, jodpo scores the token ids directly on the device (no decode/encode
round trip): EOS and padding become pad slots, and the value is read at the last real token. Rewards computed
on the host (other tokenizers, Python functions) are ``jodpo.program.rewards``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodpo.models.decoder import Model, Params
from jodpo.models.heads import prefixed_reward_scores, reward_scores


def contains_eos(completion_ids: jax.Array, completion_mask: jax.Array, eos_token_ids) -> jax.Array:
    """bool[N]: the completion contains an EOS token (within its mask)."""
    eos = jnp.asarray(tuple(eos_token_ids) or (-1,), jnp.int32)
    return jnp.any(jnp.isin(completion_ids, eos) & (completion_mask > 0), axis=-1)


def apply_eos_penalty(rewards: jax.Array, has_eos: jax.Array, missing_eos_penalty=None,
                      penalty_reward_value=None) -> jax.Array:
    """TRL's ``missing_eos_penalty`` is subtracted from completions without EOS; open-instruct's
    ``penalty_reward_value`` (with ``non_eos_penalty``) replaces their reward instead."""
    if penalty_reward_value is not None:
        rewards = jnp.where(has_eos, rewards, jnp.float32(penalty_reward_value))
    if missing_eos_penalty is not None:
        rewards = jnp.where(has_eos, rewards, rewards - missing_eos_penalty)
    return rewards


def pair_indices(rewards_2B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) row indices, i32[B] each, from block-layout rewards.

    Completion 0 is chosen when ``r0 >= r1`` (ties go to completion 0), exactly TRL's rule, so a NaN
    reward on either side makes completion 1 the chosen one."""
    B = rewards_2B.shape[0] // 2
    first_wins = rewards_2B[:B] >= rewards_2B[B:]
    rows = jnp.arange(B, dtype=jnp.int32)
    chosen = jnp.where(first_wins, rows, rows + B)
    rejected = jnp.where(first_wins, rows + B, rows)
    return chosen, rejected


def reward_suffix_from_tokens(completion_ids, completion_mask, eos_token_ids, pad_token_id: int):
    """The completion as the reward model reads it when it shares the policy tokenizer: the EOS and padding
    turned into pad slots (TRL scores the completion decoded without special tokens)."""
    eos = jnp.asarray(tuple(eos_token_ids) or (-1,), jnp.int32)
    keep = (completion_mask > 0) & ~jnp.isin(completion_ids, eos)
    return jnp.where(keep, completion_ids, pad_token_id), keep


def reward_inputs_from_tokens(prompt_ids, prompt_mask, completion_ids, completion_mask, eos_token_ids,
                              pad_token_id: int):
    """The reward model's input when it shares the policy tokenizer: prompt + completion with the EOS and
    padding turned into pad slots (one prompt row per completion row)."""
    ids, keep = reward_suffix_from_tokens(completion_ids, completion_mask, eos_token_ids, pad_token_id)
    return (jnp.concatenate([prompt_ids, ids], 1),
            jnp.concatenate([prompt_mask, keep.astype(prompt_mask.dtype)], 1))


def score_tokens(rm: Model, rm_params: Params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                 eos_token_ids) -> jax.Array:
    """f32[N]: reward-model scores straight from the policy's token ids (shared tokenizer). Jittable.
    ``prompt_ids`` is ``[N, P]``, or ``[B, P]`` shared by N = n x B completions in block layout (each prompt
    then runs through the reward model once)."""
    pad = rm.pad_token_id if rm.pad_token_id is not None else 0
    if prompt_ids.shape[0] == completion_ids.shape[0]:
        ids, mask = reward_inputs_from_tokens(prompt_ids, prompt_mask, completion_ids, completion_mask, eos_token_ids,
                                              pad)
        return reward_scores(rm, rm_params, ids, mask)
    ids, keep = reward_suffix_from_tokens(completion_ids, completion_mask, eos_token_ids, pad)
    return prefixed_reward_scores(rm, rm_params, prompt_ids, prompt_mask, ids, keep.astype(prompt_mask.dtype))
