"""Per-token log-probs, the DPO-family losses, and the online DPO loss with TRL's metrics.

Rows are in TRL's *block layout*: for B prompts, rows [0, B) hold completion 0 of every prompt and rows
[B, 2B) completion 1. Every loss is its own pure function of a ``Pair`` of log-ratios, chosen from
``LOSSES`` by name (formulas as in TRL's ``trl/trainer/dpo_trainer.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jodpo.models.core import Model, Params, hidden_states, prefixed_hidden_states
from jodpo.models.heads import lm_head
from jodpo.rewards import apply_eos_penalty, contains_eos, pair_indices


def completion_logprobs(model: Model, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
                        completion_ids: jax.Array, completion_mask: jax.Array,
                        max_length: int | None = None, temperature: float | None = None) -> jax.Array:
    """f32[N, C]: log p(completion token | everything before it) under ``params``; 0 on padding.

    ``prompt_ids`` has a row per completion ``[N, P]``, or ``[B, P]`` shared by N = n x B completions in block
    layout (row r continues prompt ``r % B``): then every prompt runs through the model once, not n times.
    The LM head runs only at the C positions that predict completion tokens (never over the prompt).
    ``max_length`` left-truncates the prompt for this forward only, as TRL does (at least one prompt
    token is kept). ``temperature``: the logits are divided by ``temperature + 1e-7`` first, as open-instruct's
    training forward does (TRL and the default use the raw logits).
    """
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    if max_length is not None and P + C > max_length:
        cut = min(P + C - max_length, P - 1)
        prompt_ids, prompt_mask, P = prompt_ids[:, cut:], prompt_mask[:, cut:], P - cut
    if prompt_ids.shape[0] == completion_ids.shape[0]:
        h, _ = hidden_states(model, params, jnp.concatenate([prompt_ids, completion_ids], 1),
                             jnp.concatenate([prompt_mask, completion_mask], 1))
    else:
        h = prefixed_hidden_states(model, params, prompt_ids, prompt_mask, completion_ids, completion_mask)
    logits_BCV = lm_head(model, params, h[:, P - 1: P + C - 1])
    if temperature is not None:
        logits_BCV = logits_BCV / (temperature + 1e-7)
    picked = jnp.take_along_axis(logits_BCV, completion_ids[..., None].astype(jnp.int32), -1)[..., 0]
    logp = picked - jax.nn.logsumexp(logits_BCV, axis=-1)
    return jnp.where(completion_mask > 0, logp, 0.0)


# --------------------------------------------------------------------------------------------------
# The losses
# --------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class Pair:
    """Summed log-ratios log pi - log pi_ref of the chosen and rejected completions, and their lengths."""

    chosen: jax.Array  # f32[B]
    rejected: jax.Array  # f32[B]
    chosen_len: jax.Array  # f32[B], completion tokens (EOS included)
    rejected_len: jax.Array


@dataclasses.dataclass(frozen=True)
class LossOptions:
    label_smoothing: float = 0.0  # cDPO (sigmoid), robust, exo_pair: the assumed label-flip rate
    discopop_tau: float = 0.05
    ipo_length_normalized: bool = False  # TRL's online trainer sums; its offline DPO normalises


def _delta(p: Pair):
    return p.chosen - p.rejected


def sigmoid_loss(p: Pair, beta, o: LossOptions):
    """DPO; with label smoothing, cDPO."""
    z = beta * _delta(p)
    return -(1 - o.label_smoothing) * jax.nn.log_sigmoid(z) - o.label_smoothing * jax.nn.log_sigmoid(-z)


def ipo_loss(p: Pair, beta, o: LossOptions):
    if o.ipo_length_normalized:
        d = p.chosen / jnp.maximum(p.chosen_len, 1.0) - p.rejected / jnp.maximum(p.rejected_len, 1.0)
    else:
        d = _delta(p)
    return (d - 1 / (2 * beta)) ** 2


def hinge_loss(p: Pair, beta, o: LossOptions):
    return jax.nn.relu(1 - beta * _delta(p))


def robust_loss(p: Pair, beta, o: LossOptions):
    z, e = beta * _delta(p), o.label_smoothing
    return (-(1 - e) * jax.nn.log_sigmoid(z) + e * jax.nn.log_sigmoid(-z)) / (1 - 2 * e)


def exo_pair_loss(p: Pair, beta, o: LossOptions):
    z, e = beta * _delta(p), o.label_smoothing
    return (jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - jnp.log1p(-e))
            + jax.nn.sigmoid(-z) * (jax.nn.log_sigmoid(-z) - jnp.log(e)))


def nca_pair_loss(p: Pair, beta, o: LossOptions):
    c, r = beta * p.chosen, beta * p.rejected
    return -jax.nn.log_sigmoid(c) - 0.5 * jax.nn.log_sigmoid(-c) - 0.5 * jax.nn.log_sigmoid(-r)


def sppo_hard_loss(p: Pair, beta, o: LossOptions):
    return (p.chosen - 0.5 / beta) ** 2 + (p.rejected + 0.5 / beta) ** 2


def apo_zero_loss(p: Pair, beta, o: LossOptions):
    return 1 - jax.nn.sigmoid(beta * p.chosen) + jax.nn.sigmoid(beta * p.rejected)


def apo_down_loss(p: Pair, beta, o: LossOptions):
    return jax.nn.sigmoid(beta * p.chosen) + 1 - jax.nn.sigmoid(beta * _delta(p))


def discopop_loss(p: Pair, beta, o: LossOptions):
    z = beta * _delta(p)
    w = jax.nn.sigmoid(z / o.discopop_tau)
    return -jax.nn.log_sigmoid(z) * (1 - w) + jnp.exp(-z) * w


LOSSES: dict[str, Callable[[Pair, jax.Array, LossOptions], jax.Array]] = {
    "sigmoid": sigmoid_loss, "ipo": ipo_loss, "hinge": hinge_loss, "robust": robust_loss,
    "exo_pair": exo_pair_loss, "nca_pair": nca_pair_loss, "sppo_hard": sppo_hard_loss,
    "apo_zero": apo_zero_loss, "apo_down": apo_down_loss, "discopop": discopop_loss,
}


def get_loss(loss_type: str):
    """The per-sequence loss function of ``loss_type``; unknown names get the list of known ones."""
    try:
        return LOSSES[loss_type]
    except KeyError:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {sorted(LOSSES)}") from None


def check_loss_options(loss_type: str, o: LossOptions) -> None:
    get_loss(loss_type)
    if loss_type == "robust" and not 0 <= o.label_smoothing < 0.5:
        raise ValueError("loss_type='robust' needs 0 <= label_smoothing < 0.5")
    if loss_type == "exo_pair" and not 0 < o.label_smoothing < 1:
        raise ValueError("loss_type='exo_pair' needs 0 < label_smoothing < 1 (TRL suggests 1e-3)")


def _mean(x: jax.Array, weights: jax.Array | None) -> jax.Array:
    """The mean of ``x``, or its ``weights``-weighted mean (0 when every weight is 0)."""
    if weights is None:
        return x.mean()
    return (x * weights).sum() / jnp.maximum(weights.sum(), 1e-30)


def preference_loss(S: jax.Array, S_ref: jax.Array, lengths: jax.Array, chosen: jax.Array, rejected: jax.Array, *,
                    beta, loss_type: str = "sigmoid", options: LossOptions = LossOptions(),
                    weights: jax.Array | None = None):
    """The pairwise loss and its metrics from summed log-probs of N sequences and (chosen, rejected) rows.

    Args:
      S, S_ref: f32[N] summed completion log-probs under the policy and the reference.
      lengths: f32[N] completion lengths (for length-normalised losses).
      chosen, rejected: i32[B] row indices of each pair.
      weights: f32[B] per-pair weights (a judge's pairs without a verdict weigh 0), or None: every pair alike.
    Returns:
      ``(loss, metrics)``: the (weighted) mean per-pair loss; ``rewards/*`` and ``logps/*`` as TRL logs them.
    """
    pair = Pair(chosen=S[chosen] - S_ref[chosen], rejected=S[rejected] - S_ref[rejected],
                chosen_len=lengths[chosen], rejected_len=lengths[rejected])
    loss = _mean(get_loss(loss_type)(pair, beta, options), weights)
    chosen_rewards, rejected_rewards = beta * pair.chosen, beta * pair.rejected
    margins = chosen_rewards - rejected_rewards
    metrics = {
        "loss": loss,
        "rewards/chosen": _mean(chosen_rewards, weights),
        "rewards/rejected": _mean(rejected_rewards, weights),
        "rewards/margins": _mean(margins, weights),
        "rewards/accuracies": _mean((margins > 0).astype(jnp.float32), weights),
        "logps/chosen": _mean(S[chosen], weights),
        "logps/rejected": _mean(S[rejected], weights),
        "beta": jnp.asarray(beta, jnp.float32),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _summed_logprobs(model, params, ref_params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                     max_length, ref_logprobs, temperature=None):
    """Summed completion log-probs under the policy (differentiable) and the frozen reference."""
    logp = completion_logprobs(model, params, prompt_ids, prompt_mask, completion_ids, completion_mask, max_length,
                               temperature)
    if ref_logprobs is None:
        ref_logprobs = completion_logprobs(model, jax.lax.stop_gradient(ref_params), prompt_ids, prompt_mask,
                                           completion_ids, completion_mask, max_length, temperature)
    return logp.sum(-1), jax.lax.stop_gradient(ref_logprobs).sum(-1)


# --------------------------------------------------------------------------------------------------
# Online DPO
# --------------------------------------------------------------------------------------------------


def online_dpo_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array,
                    prompt_mask: jax.Array, completion_ids: jax.Array, completion_mask: jax.Array,
                    rewards: jax.Array, *, beta, loss_type: str = "sigmoid", missing_eos_penalty=None,
                    eos_token_ids=(), penalty_reward_value=None, max_length: int | None = None,
                    options: LossOptions = LossOptions(), ref_logprobs: jax.Array | None = None,
                    judged: bool = False, logprob_temperature: float | None = None,
                    sample_logprobs: jax.Array | None = None):
    """The online DPO loss of one batch and TRL's metrics; differentiable in ``params``.

    Args:
      prompt_ids, prompt_mask: i32[B, P], shared by both completions (each prompt's forward runs once), or
        i32[2B, P] in block layout.
      completion_ids, completion_mask: i32[2B, C], block layout, padding after the first EOS.
      rewards: f32[2B], raw (before any EOS penalty); with ``judged``, a judge's verdicts instead
        (``jodpo.judges.pair_scores``: p for completion 0, 1 - p for completion 1, NaN for no verdict).
      beta: the KL strength (a scalar, may be traced).
      missing_eos_penalty: subtracted from the reward of completions without EOS (TRL).
      penalty_reward_value: if given, *replaces* the reward of completions without EOS (open-instruct's
        ``non_eos_penalty``).
      ref_logprobs: f32[2B, C] reference log-probs when already computed (else from ``ref_params``).
      judged: the pairs come from a judge (TRL's ``judge``): no EOS penalty, pairs without a verdict weigh 0, and
        the metrics of scores (``objective/scores``, ``scores_margin``, ``rlhf_reward``) give way to
        ``objective/judge_confidence`` and ``objective/judge_abstained``.
      logprob_temperature: log-probs (policy and reference) from the logits divided by this temperature, as
        open-instruct computes them (the sampling temperature there); None: the raw logits, as TRL.
      sample_logprobs: f32[2B, C] the sampling policy's log-probs of the completion tokens, when it is not the
        trained one (open-instruct's async_mode): then ``objective/off_policy_kl`` is logged, the mean over
        completions of their summed log-probs under the sampler minus under the trained policy (a sample estimate
        of KL(sampler || policy)).
    Returns:
      ``(loss, metrics)`` with TRL's metric names; KL and entropy are masked to the completion.
    """
    prompt_ids, prompt_mask, completion_ids, completion_mask, rewards = (
        jnp.asarray(x) for x in (prompt_ids, prompt_mask, completion_ids, completion_mask, rewards))
    S, S_ref = _summed_logprobs(model, params, ref_params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                max_length, ref_logprobs, logprob_temperature)
    has_eos = contains_eos(completion_ids, completion_mask, eos_token_ids)
    scores = rewards.astype(jnp.float32)
    if not judged:
        scores = apply_eos_penalty(scores, has_eos, missing_eos_penalty, penalty_reward_value)
    chosen, rejected = pair_indices(scores)
    length = completion_mask.sum(-1).astype(jnp.float32)
    p_first = scores[:scores.shape[0] // 2]
    weights = jnp.isfinite(p_first).astype(jnp.float32) if judged else None
    loss, metrics = preference_loss(S, S_ref, length, chosen, rejected, beta=beta, loss_type=loss_type,
                                    options=options, weights=weights)
    kl = jax.lax.stop_gradient(S - S_ref)  # per sequence, masked to the completion (TRL 1.16 also sums padding)
    S = jax.lax.stop_gradient(S)
    if sample_logprobs is not None:
        metrics["objective/off_policy_kl"] = (jnp.where(completion_mask > 0, sample_logprobs, 0.0).sum(-1) - S).mean()
    metrics |= {
        "objective/kl": kl.mean(),
        "objective/entropy": -S.mean(),
        "objective/non_score_reward": (-beta * kl).mean(),
        "val/contain_eos_token": has_eos.astype(jnp.float32).mean(),
    }
    if judged:
        confidence = jnp.maximum(p_first, 1.0 - p_first)
        return loss, metrics | {"objective/judge_confidence": _mean(jnp.nan_to_num(confidence), weights),
                                "objective/judge_abstained": 1.0 - weights.mean()}
    return loss, metrics | {
        "objective/rlhf_reward": (scores - beta * kl).mean(),
        "objective/scores": scores.mean(),
        "objective/scores_margin": (scores[chosen] - scores[rejected]).mean(),
    }


# --------------------------------------------------------------------------------------------------
# Offline DPO
# --------------------------------------------------------------------------------------------------


def dpo_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
             chosen_ids: jax.Array, chosen_mask: jax.Array, rejected_ids: jax.Array, rejected_mask: jax.Array, *,
             beta, loss_type: str = "sigmoid", max_length: int | None = None,
             options: LossOptions = LossOptions()):
    """Offline DPO (TRL's DPOTrainer) on preference data: the same losses, the pairs given by the data.

    Args:
      prompt_ids, prompt_mask: i32[B, P], left-padded.
      chosen_ids, chosen_mask, rejected_ids, rejected_mask: i32[B, C], right-padded responses (EOS included).
    Returns:
      ``(loss, metrics)`` with ``rewards/*``, ``logps/*``, ``beta`` and ``loss``.
    """
    B = prompt_ids.shape[0]
    completions, cmask = jnp.concatenate([chosen_ids, rejected_ids]), jnp.concatenate([chosen_mask, rejected_mask])
    S, S_ref = _summed_logprobs(model, params, ref_params, prompt_ids, prompt_mask, completions, cmask, max_length,
                                None)
    rows = jnp.arange(B, dtype=jnp.int32)
    return preference_loss(S, S_ref, cmask.sum(-1).astype(jnp.float32), rows, rows + B, beta=beta,
                           loss_type=loss_type, options=options)
