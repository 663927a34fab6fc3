"""Pairwise judges: for each prompt, which of its two completions is better (TRL's ``judge``, in place of rewards).

Two kinds, both giving ``preferences(prompts, first, second) -> f32[B]``, the probability that the *first*
completion is the better one (NaN: no verdict):

- a **callable judge**, TRL's ``BasePairwiseJudge.judge(prompts, completions_pairs) -> list[int]`` shape: 0 means
  the first completion is better, 1 the second, -1 or None no verdict. Imported from a ``module:function`` or
  ``module:Class`` path (a class is instantiated without arguments and its ``judge`` method called).
- an **LLM judge**: any causal LM jodpo loads, asked with a prompt (TRL's default pairwise prompt unless
  configured) and read from the logits of its two answer tokens at the position after the prompt: one batched
  forward, no sampling, jitted, its parameters sharded like the reward model's. Position bias: with
  ``both_orders`` each pair is also read with its completions swapped and the two probabilities are averaged.

Chat prompts reach a judge as plain text ("User: ...", "Assistant: ..."), as TRL renders them, so the judge never
sees the policy's chat-template tokens.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from jodpo import collective_order
from jodpo.errors import JudgeError
from jodpo.models.decoder import Model, Params, hidden_states
from jodpo.models.heads import lm_head
from jodpo.models.layers import to_host

# TRL's DEFAULT_PAIRWISE_SYSTEM_PROMPT (trl/trainer/judges.py), sent as the user's message.
DEFAULT_PAIRWISE_PROMPT = '''I require a leaderboard for various large language models. I'll provide you with prompts given to these models and their corresponding outputs. Your task is to assess these responses, and select the model that produces the best output from a human perspective.

## Instruction

{{
    "instruction": """{prompt}""",
}}

## Model Outputs

Here are the unordered outputs from the models. Each output is associated with a specific model, identified by a unique model identifier.

{{
    {{
        "model_identifier": "0",
        "output": """{response0}"""
    }},
    {{
        "model_identifier": "1",
        "output": """{response1}"""
    }}
}}

## Task

Evaluate the models on the basis of the quality and relevance of their results, and select the model that generated the best result. Reply with the identifier of the best model. Our evaluation will only take into account the first character of your answer, so make sure it contains only one of the identifiers and nothing else (no quotation marks, no spaces, no new lines, ...).
'''  # noqa: E501


def plain_text(x) -> str:
    """A prompt or completion as a judge reads it: text as is; chat messages rendered as TRL's
    ``SIMPLE_CHAT_TEMPLATE`` does ("Role: content" and a blank line per message)."""
    if isinstance(x, str):
        return x
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in x)


# --------------------------------------------------------------------------------------------------
# The LLM judge's device function
# --------------------------------------------------------------------------------------------------


def answer_probabilities(model: Model, params: Params, input_ids: jax.Array, attention_mask: jax.Array,
                         answer_ids: jax.Array) -> jax.Array:
    """f32[N]: P(answer 0) / (P(answer 0) + P(answer 1)) for the next token after each left-padded row.

    ``answer_ids`` i32[2] are the judge's two answer tokens; the LM head runs at the last position only. Jittable.
    """
    h_NLD, _ = hidden_states(model, params, input_ids, attention_mask)
    logits_NV = lm_head(model, params, h_NLD[:, -1])
    return jax.nn.softmax(logits_NV[:, answer_ids], axis=-1)[:, 0]


_jit_answer_probabilities = collective_order.jit(answer_probabilities, static_argnums=0)



class LLMJudge:
    """A causal LM as a pairwise judge. ``template`` holds ``{prompt}``, ``{response0}`` and ``{response1}``; it
    goes through the judge tokenizer's chat template as the user's message when the tokenizer has one."""

    def __init__(self, model: Model, params: Params, tokenizer, template: str = DEFAULT_PAIRWISE_PROMPT,
                 answers: Sequence[str] = ("0", "1"), both_orders: bool = True, pad_to_multiple: int = 64):
        if model.task != "causal_lm":
            raise JudgeError(f"the LLM judge must be a causal LM; this model was loaded with task={model.task!r}")
        for key in ("{prompt}", "{response0}", "{response1}"):
            if key not in template:
                raise JudgeError(f"judge_prompt has no {key} placeholder; it needs {{prompt}}, {{response0}} and "
                                 "{response1} (and {{ }} for literal braces)")
        if len(answers) != 2 or answers[0] == answers[1]:
            raise JudgeError(f"judge_answer_tokens must be two different strings, got {tuple(answers)!r}")
        ids = []
        for a in answers:
            enc = tokenizer(a, add_special_tokens=False)["input_ids"]
            if len(enc) != 1:
                raise JudgeError(f"judge_answer_tokens: {a!r} is {len(enc)} tokens for the judge's tokenizer; give "
                                 "answers that are one token each (and say them in judge_prompt)")
            ids.append(enc[0])
        self.model, self.params, self.tokenizer, self.template = model, params, tokenizer, template
        self.answer_ids = np.asarray(ids, np.int32)
        self.both_orders, self.pad_to_multiple = both_orders, pad_to_multiple
        self.chat = getattr(tokenizer, "chat_template", None) is not None

    def text(self, prompt, response0: str, response1: str) -> str:
        """The judge's whole input for one ordered pair, chat template included."""
        content = self.template.format(prompt=plain_text(prompt), response0=plain_text(response0),
                                       response1=plain_text(response1))
        if not self.chat:
            return content
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)

    def batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded i32 ids and mask; the length rounded up to ``pad_to_multiple`` so that few shapes compile."""
        enc = self.tokenizer(list(texts), add_special_tokens=not self.chat)["input_ids"]
        L = -(-max(map(len, enc)) // self.pad_to_multiple) * self.pad_to_multiple
        pad = self.model.pad_token_id if self.model.pad_token_id is not None else (self.tokenizer.pad_token_id or 0)
        ids, mask = np.full((len(enc), L), pad, np.int32), np.zeros((len(enc), L), np.int32)
        for i, row in enumerate(enc):
            ids[i, L - len(row):], mask[i, L - len(row):] = row, 1
        return ids, mask

    def preferences(self, prompts: Sequence, first: Sequence, second: Sequence) -> np.ndarray:
        """f32[B]: the probability that ``first[b]`` is better than ``second[b]`` for ``prompts[b]``."""
        texts = [self.text(p, a, b) for p, a, b in zip(prompts, first, second)]
        if self.both_orders:
            texts += [self.text(p, b, a) for p, a, b in zip(prompts, first, second)]
        ids, mask = self.batch(texts)
        p = to_host(_jit_answer_probabilities(self.model, self.params, ids, mask, self.answer_ids)).astype(np.float32)
        if not self.both_orders:
            return p
        B = len(prompts)
        return (p[:B] + (1.0 - p[B:])) / 2


# --------------------------------------------------------------------------------------------------
# Callable judges
# --------------------------------------------------------------------------------------------------


class CallableJudge:
    """TRL's pairwise-judge interface: ``fn(prompts, [(first, second), ...]) -> [0 | 1 | -1 | None, ...]``."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name

    def preferences(self, prompts: Sequence, first: Sequence, second: Sequence) -> np.ndarray:
        texts = [plain_text(p) for p in prompts]
        verdicts = list(self.fn(texts, [(plain_text(a), plain_text(b)) for a, b in zip(first, second)]))
        if len(verdicts) != len(texts):
            raise JudgeError(f"judge {self.name!r} returned {len(verdicts)} verdicts for {len(texts)} pairs")
        out = np.empty(len(verdicts), np.float32)
        for i, v in enumerate(verdicts):
            if v is None or v == -1:
                out[i] = math.nan
            elif v in (0, 1):
                out[i] = 1.0 - float(v)
            else:
                raise JudgeError(f"judge {self.name!r} returned {v!r} for pair {i}; a pairwise judge answers 0 (the "
                                 "first completion is better), 1 (the second), or -1 / None (no verdict)")
        return out


def read_template(value: str | None) -> str:
    """``judge_prompt``: None for TRL's default, the template's text, or a path to a file holding it."""
    if value is None:
        return DEFAULT_PAIRWISE_PROMPT
    if "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    return value


# --------------------------------------------------------------------------------------------------
# What a step and an evaluation need from a judge
# --------------------------------------------------------------------------------------------------


def pair_scores(p_first: np.ndarray) -> np.ndarray:
    """f32[2B] block-layout scores from f32[B] preferences: ``p`` for completion 0 and ``1 - p`` for completion 1,
    so that the reward pairing rule (completion 0 chosen when its score is >= the other's) follows the judge; NaN
    (no verdict) stays NaN on both sides, and the loss leaves the pair out."""
    p = np.asarray(p_first, np.float32)
    return np.concatenate([p, 1.0 - p])


def win_rate(p_reference_better: np.ndarray) -> float:
    """Share of judged pairs the policy wins against the reference completion (a tie counts a half)."""
    p = np.asarray(p_reference_better, np.float64)
    p = p[np.isfinite(p)]
    if not p.size:
        return math.nan
    return float(np.mean(np.where(p < 0.5, 1.0, np.where(p == 0.5, 0.5, 0.0))))
