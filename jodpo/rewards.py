"""Rewards: reward-model scoring, callable rewards, EOS penalties, and pairing.

What a reward model reads follows TRL 1.16: the prompt and the completion *decoded with
skip_special_tokens=True*, so the completion's EOS is not part of the scored text. With a reward model
that shares the policy tokenizer, jodpo scores the token ids directly on the device (no decode/encode
round trip): EOS and padding become pad slots, and the value is read at the last real token.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.data import assistant_messages
from jodpo.models.core import Model, Params
from jodpo.models.heads import prefixed_reward_scores, reward_scores

RewardFn = Callable[..., Sequence[float | None]]


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


def check_shared_vocab(policy: Model, rm: Model) -> None:
    """The reward model scores the policy's token ids directly (they share a tokenizer), so its embedding
    must have a row for every id the policy can sample."""
    if rm.vocab_size < policy.vocab_size:
        raise ValueError(f"the policy and the reward model share a tokenizer, but the reward model's embedding has "
                         f"only {rm.vocab_size} rows and the policy can sample ids up to {policy.vocab_size - 1}; "
                         f"use a reward model with vocab_size >= {policy.vocab_size} (resize_token_embeddings and "
                         "save it), or the reward model trained for this policy")


def text_batch(rm: Model, rm_tokenizer, prompts: Sequence, completions: Sequence[str],
               pad_to_multiple: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """i32[N, L] ids and mask of prompt + completion texts in the reward model's own tokenizer (its chat template
    for chat prompts), right-padded as TRL does. Lengths are padded to a multiple of ``pad_to_multiple`` so that
    the jitted scorer sees few shapes."""
    if prompts and isinstance(prompts[0], list):  # chat: messages + the assistant's reply
        texts = [rm_tokenizer.apply_chat_template(p + [{"role": "assistant", "content": c}], tokenize=False)
                 for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    enc = rm_tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False, return_tensors="np")
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)
    L = -(-ids.shape[1] // pad_to_multiple) * pad_to_multiple
    pad = rm.pad_token_id if rm.pad_token_id is not None else rm_tokenizer.pad_token_id
    ids = np.pad(ids, ((0, 0), (0, L - ids.shape[1])), constant_values=pad)
    return ids, np.pad(mask, ((0, 0), (0, L - mask.shape[1])))


def score_texts(rm: Model, rm_params: Params, rm_tokenizer, prompts: Sequence, completions: Sequence[str],
                pad_to_multiple: int = 64) -> np.ndarray:
    """Scores of decoded completions re-tokenized with the reward model's own tokenizer (``text_batch``)."""
    ids, mask = text_batch(rm, rm_tokenizer, prompts, completions, pad_to_multiple)
    return np.asarray(jit_reward_scores(rm, rm_params, ids, mask))


jit_reward_scores = jax.jit(reward_scores, static_argnums=0)  # what score_texts calls (evaluation compiles it ahead)


class RewardError(ValueError):
    """A reward function that raised or returned something other than a number (or None) per completion."""


def function_name(fn) -> str:
    """``module:function``, as ``reward_funcs`` names it."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{getattr(fn, '__module__', None) or '?'}:{name}"


def _is_number(r) -> bool:
    return hasattr(type(r), "__float__") and not isinstance(r, (str, bytes))


def function_rewards(fn: RewardFn, prompts, completions, completion_ids, **columns) -> np.ndarray:
    """f32[N]: one reward function's values (NaN for None). A function that raises, or returns anything other than
    a number or None per completion, is a ``RewardError`` naming it."""
    try:
        out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as e:  # noqa: BLE001 - the user's function: reported with its name (--debug: traceback)
        raise RewardError(f"reward function {function_name(fn)} raised {type(e).__name__}: {e}") from e
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise RewardError(f"reward function {function_name(fn)} returned {type(out).__name__}, not a list of "
                          f"{len(completions)} numbers (or None) per completion")
    if len(out) != len(completions):
        raise RewardError(f"reward function {function_name(fn)} returned {len(out)} values for {len(completions)} "
                          "completions")
    bad = [(j, r) for j, r in enumerate(out) if r is not None and not _is_number(r)]
    if bad:
        raise RewardError(f"reward function {function_name(fn)} returned {bad[0][1]!r} ({type(bad[0][1]).__name__}) "
                          f"for completion {bad[0][0]}; it must return a number or None per completion")
    return np.asarray([math.nan if r is None else float(r) for r in out], np.float32)


def call_reward_functions(fns: Sequence[RewardFn], prompts, completions, completion_ids, weights=None,
                          **columns) -> np.ndarray:
    """TRL's callable rewards: ``f(prompts=, completions=, completion_ids=, **columns)`` returning a float
    or None per completion; combined as a weighted sum that ignores None and NaN (nansum)."""
    w = np.ones(len(fns), np.float32) if weights is None else np.asarray(weights, np.float32)
    if w.shape != (len(fns),):
        raise ValueError(f"reward_weights has {w.size} entries for {len(fns)} reward functions")
    per_fn = np.stack([function_rewards(fn, prompts, completions, completion_ids, **columns) for fn in fns], 1)
    return np.nansum(per_fn * w[None], axis=1)


# --------------------------------------------------------------------------------------------------
# The rewards of a run (host side): a reward model and/or Python functions, combined with weights
# --------------------------------------------------------------------------------------------------


def import_object(spec: str, what: str = "reward function"):
    """``'package.module:name'`` -> the object (a reward function, a judge)."""
    import importlib

    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r}: write it as 'module.path:name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r} cannot be imported: {e}") from e


def import_reward_function(spec: str) -> RewardFn:
    """``'package.module:function'`` -> the function (TRL's callable reward)."""
    return import_object(spec, "reward function")


class RewardSet:
    """Every reward of a run. ``on_device`` when the only reward is a model sharing the policy tokenizer on
    text prompts: then the jitted step scores token ids itself and this class only serves evaluation."""

    def __init__(self, model: Model | None, params: Params | None, tokenizer, functions: Sequence[RewardFn],
                 weights: Sequence[float] | None, shared_tokenizer: bool, chat: bool):
        n = (model is not None) + len(functions)
        if n == 0:
            raise ValueError("no reward: set reward_model_path and/or reward_funcs")
        if weights is not None and len(weights) != n:
            raise ValueError(f"reward_weights has {len(weights)} entries for {n} rewards (model first, then functions)")
        self.model, self.params, self.tokenizer, self.functions = model, params, tokenizer, list(functions)
        self.weights = None if weights is None else np.asarray(weights, np.float32)
        self.on_device = model is not None and not functions and shared_tokenizer and not chat and (
            self.weights is None or float(self.weights[0]) == 1.0)
        self.chat = chat
        self.warned_unscored = False

    def score(self, prompts: Sequence, completions: Sequence[str], completion_ids, columns: dict,
              model_scores: np.ndarray | None = None) -> np.ndarray:
        """f32[N]: the weighted nansum of every reward of the texts. ``model_scores`` (already computed on the
        device from token ids) replaces the reward model's text scoring."""
        per: list[np.ndarray] = []
        if self.model is not None:
            per.append(model_scores if model_scores is not None
                       else score_texts(self.model, self.params, self.tokenizer, prompts, completions))
        if self.functions:
            outs = assistant_messages(completions) if self.chat else completions
            for fn in self.functions:
                per.append(function_rewards(fn, prompts, outs, completion_ids, **columns))
        stack = np.stack(per, 1).astype(np.float32)
        none = int(np.all(np.isnan(stack), axis=1).sum())
        if none and not self.warned_unscored:  # scored 0 by the nansum: a pair of them teaches nothing
            self.warned_unscored = True
            warnings.warn(f"{none} of {len(stack)} completions got no reward (every reward returned None or NaN) and "
                          "are scored 0; check the reward functions (warned once per run)", stacklevel=2)
        w = np.ones(stack.shape[1], np.float32) if self.weights is None else self.weights
        return np.nansum(stack * w[None], axis=1)
