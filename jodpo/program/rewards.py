"""The rewards of a run on the host: a reward model reading texts in its own tokenizer (its chat template for chat
prompts, right-padded as TRL pads), TRL's callable reward functions, and ``RewardSet``, every reward of a run
combined with its weights. Scoring the policy's token ids on the device is ``jodpo.scoring``."""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np

from jodpo import collective_order
from jodpo.errors import RewardError
from jodpo.program.data import assistant_messages
from jodpo.program.user_code import RewardFn
from jodpo.models.decoder import Model, Params
from jodpo.models.heads import reward_scores
from jodpo.parallel import sharding as S



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
    return S.to_host(jit_reward_scores(rm, rm_params, ids, mask))  # (split by rows over a job's processes)


# what score_texts calls (evaluation compiles it ahead)
jit_reward_scores = collective_order.jit(reward_scores, static_argnums=0)



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
              model_scores: np.ndarray | None = None, need_signal: bool = False) -> np.ndarray:
        """f32[N]: the weighted nansum of every reward of the texts. ``model_scores`` (already computed on the
        device from token ids) replaces the reward model's text scoring. ``need_signal`` (a training step): no
        completion with a reward at all is a ``RewardError``, since every pair would tie at 0 and the run would train
        to its end on nothing (a reward function reading a column the data lacks, say)."""
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
        if need_signal and none == len(stack):
            raise RewardError(f"every reward returned None or NaN for all {none} completions of the step: no signal "
                              "to train on (the run stops rather than train on ties at 0)")
        if none and not self.warned_unscored:  # scored 0 by the nansum: a pair of them teaches nothing
            self.warned_unscored = True
            warnings.warn(f"{none} of {len(stack)} completions got no reward (every reward returned None or NaN) and "
                          "are scored 0; check the reward functions (warned once per run)", stacklevel=2)
        w = np.ones(stack.shape[1], np.float32) if self.weights is None else self.weights
        return np.nansum(stack * w[None], axis=1)
