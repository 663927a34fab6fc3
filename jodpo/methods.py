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

from jodpo.losses import ONLINE_LOSSES, Coefficients, LossOptions, needs_reference
from jodpo.models.decoder import Model, Params
from jodpo.pairing import resolve_pairing
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


# a method's own settings: the method that reads each, and its default (TRL's; the config and StepConfig take theirs
# from here; a setting is per epoch: a number or a list of them)
OWN_SETTINGS = {"mixture_coef": ("nash_md", 0.5), "alpha": ("xpo", 1e-5)}
# the run's shape a fixed pair takes (``Method.fixed_pair``)
FIXED_PAIR_SHAPE = {"num_generations": 2, "pairing": "auto", "async_mode": False, "sync_steps": 1, "num_epochs": 1,
                    "num_mini_batches": 1, "sampler_devices": 0}


def per_epoch(name: str, value) -> tuple[float, ...]:
    """A setting indexed by epoch (a number or a non-empty list of them) as a tuple of floats."""
    values = (value,) if isinstance(value, (int, float)) else tuple(value)
    if not values:
        raise ValueError(f"{name} must be a number or a non-empty list of them, got {value}")
    return tuple(float(v) for v in values)


def check_method(name: str, *, mixture_coef, alpha, loss_type: str, loss_options: LossOptions,
                 **shape) -> None:
    """Refuse settings that do not fit the method called ``name``: its own settings (``OWN_SETTINGS``) at their defaults
    for every other method, ``mixture_coef`` in [0, 1], a fixed pair in ``FIXED_PAIR_SHAPE`` (``shape``: any of its
    keys, as the caller has them), a reference to compare with, and Nash-MD's own loss. ValueError names what to
    change (``jodpo.program.config`` and ``StepConfig`` both call this)."""
    method = get_method(name)
    for setting, value in (("mixture_coef", mixture_coef), ("alpha", alpha)):
        owner, default = OWN_SETTINGS[setting]
        if name != owner and per_epoch(setting, value) != per_epoch(setting, default):
            raise ValueError(f"{setting} is {owner}'s setting and method is {name!r}: set method={owner!r} or "
                             f"leave {setting} at its default")
    if any(not 0 <= m <= 1 for m in per_epoch("mixture_coef", mixture_coef)):
        raise ValueError(f"mixture_coef weighs the reference in the mixture: each must be in [0, 1], got "
                         f"{mixture_coef}")
    if method.fixed_pair:
        def fits(key, value):  # ``pairing`` also fits as what ``auto`` means for a pair
            return value == FIXED_PAIR_SHAPE[key] or (key == "pairing" and resolve_pairing(value, 2) == "random")

        changed = [k for k, v in shape.items() if not fits(k, v)]
        if changed:
            raise ValueError(f"method={name!r} ({method.trainer}) samples one completion from the policy and one "
                             "beside it per prompt and trains on that pair once, on-policy, on the training devices; "
                             f"{', '.join(f'{k}={shape[k]!r}' for k in changed)} asks otherwise: leave "
                             f"{', '.join(changed)} at the default")
        if not needs_reference(loss_type):
            raise ValueError(f"method={name!r} ({method.trainer}) compares the policy with its reference; "
                             f"loss_type={loss_type!r} has none: use sigmoid or ipo (TRL's)")
    if not method.uses_loss_type and (loss_type != "sigmoid" or loss_options != LossOptions()):
        raise ValueError(f"method={name!r} ({method.trainer}) trains with its own loss (REINFORCE of the preference "
                         "plus a KL term): leave loss_type and its options (label_smoothing, ipo_length_normalized, "
                         "discopop_tau, simpo_gamma, rdpo_alpha, ld_alpha) at their defaults")
