"""TRL's online trainers as a training step runs them (``StepConfig.method``): how a step samples its completions,
which loss trains on them, and how the program prepares and scores them. One registry, ``METHODS``; the step and the
program read a method's entries, never its name.

- ``online_dpo``: TRL 1.16's ``OnlineDPOTrainer``: k completions per prompt from the policy, one pair each, DPO.
- ``nash_md``: TRL 1.12's ``NashMDTrainer`` (Munos et al. 2023): a completion from the policy and one from the
  geometric mixture of policy and reference (``mixture_coef``), Nash-MD's REINFORCE loss.
- ``xpo``: TRL 1.12's ``XPOTrainer`` (Xie et al. 2024): a completion from the policy and one from the reference, the
  DPO loss on that pair plus ``alpha`` times the policy's log-prob of the reference's completion.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from jodpo.losses import ONLINE_LOSSES, Coefficients
from jodpo.models.decoder import Model, Params
from jodpo.sampling import Samples, SamplingConfig, sample, sample_pair


@dataclasses.dataclass(frozen=True)
class Method:
    """One online trainer of TRL's family."""

    trainer: str  # TRL's class, for messages
    # (model, policy params, reference params, prompt_ids i32[B, P], prompt_mask, key, SamplingConfig, k, Coefficients)
    # -> Samples [kB, T] in block layout: a step's completions
    sample: Callable[..., Samples]
    loss: Callable  # ``losses.ONLINE_LOSSES``' signature
    # two completions per prompt, policy's first, trained as sampled: no k > 2, pairing, rollout passes or lagging
    # sampler (open-instruct's shapes, online DPO's alone)
    fixed_pair: bool = False
    uses_loss_type: bool = True  # the loss is ``loss_type``'s (Nash-MD's is its own)
    # TRL 1.12's trainers score the policy's token ids with the reward model (``get_reward``): the completion's EOS is
    # read unless it is the pad token; TRL 1.16's online DPO scores the text decoded without special tokens
    reward_reads_eos: bool = False
    # TRL 1.12's trainers tokenize a prompt with ``tokenize_row``, which puts the tokenizer's BOS first when missing
    prompt_bos: bool = False


def _from_policy(model: Model, params: Params, ref_params: Params | None, prompt_ids, prompt_mask, key: jax.Array,
                 config: SamplingConfig, k: int, coefs: Coefficients) -> Samples:
    return sample(model, params, prompt_ids, prompt_mask, key, config, num_samples=k)


def _beside_reference(model: Model, params: Params, ref_params: Params, prompt_ids, prompt_mask, key: jax.Array,
                      config: SamplingConfig, k: int, coefs: Coefficients) -> Samples:
    return sample_pair(model, params, ref_params, prompt_ids, prompt_mask, key, config)


def _beside_mixture(model: Model, params: Params, ref_params: Params, prompt_ids, prompt_mask, key: jax.Array,
                    config: SamplingConfig, k: int, coefs: Coefficients) -> Samples:
    return sample_pair(model, params, ref_params, prompt_ids, prompt_mask, key, config, coefs.mixture_coef)


METHODS: dict[str, Method] = {
    "online_dpo": Method("OnlineDPOTrainer", _from_policy, ONLINE_LOSSES["online_dpo"]),
    "nash_md": Method("NashMDTrainer", _beside_mixture, ONLINE_LOSSES["nash_md"], fixed_pair=True,
                      uses_loss_type=False, reward_reads_eos=True, prompt_bos=True),
    "xpo": Method("XPOTrainer", _beside_reference, ONLINE_LOSSES["xpo"], fixed_pair=True, reward_reads_eos=True,
                  prompt_bos=True),
}


def get_method(name: str) -> Method:
    """The method called ``name``; an unknown name gets the list of known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}") from None
