"""The losses of batches with TRL's metrics: online DPO, TRL's online family (Nash-MD, XPO; ``ONLINE_LOSSES``),
offline DPO.

Rows are in TRL's *block layout*: for B prompts, rows [0, B) hold completion 0 of every prompt and rows
[B, 2B) completion 1. The forwards that give the losses their log-probs, ``OnlineBatch`` and ``LossConfig`` are
``jodpo.logprobs``'s (re-exported here). The pairwise losses (``jodpo.pair_losses``, re-exported here) are each a
pure function of a ``Pair`` of log-ratios, chosen from ``LOSSES`` by name. A reference-free loss
(``REFERENCE_FREE``: ``simpo``) gets no reference at all: its ``Pair`` holds the policy's average per-token
log-probs, and the reference model is neither read nor run.
"""
from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jodpo.logprobs import (LossConfig, OnlineBatch, batch_logprobs, completion_logprobs,  # noqa: F401 (re-exported)
                            policy_logprobs, with_moe_terms)
from jodpo.models.decoder import Model, Params
from jodpo.pair_losses import (LOSSES, REFERENCE_FREE, LossOptions, Pair, check_loss_options,  # noqa: F401 (re-exported)
                               get_loss, needs_reference)
from jodpo.scoring import pair_indices


# --------------------------------------------------------------------------------------------------
# The losses
# --------------------------------------------------------------------------------------------------


def ld_weights(completion_mask: jax.Array, ld_alpha: float) -> jax.Array:
    """f32[2B, C] LD-DPO's token weights, as TRL's DPOTrainer applies ``ld_alpha`` (Liu et al. 2024, length
    desensitisation): 1 on a completion's tokens up to the length of the shorter completion of its pair (the public
    part), ``ld_alpha`` on the tokens past it (the verbose part), 0 on padding. Block layout: rows b and B + b are a
    pair, so the weights do not depend on which of the two is chosen."""
    m = completion_mask > 0
    n = m.sum(-1)
    half = n.shape[0] // 2
    shared = jnp.tile(jnp.minimum(n[:half], n[half:]), 2)
    position = jnp.cumsum(m, -1)
    return jnp.where(m, jnp.where(position <= shared[:, None], 1.0, ld_alpha), 0.0)


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
      S, S_ref: f32[N] summed completion log-probs under the policy and the reference; ``S_ref`` None for a
        reference-free loss, whose Pair, rewards and ``logps/*`` are then the per-token averages ``S / lengths``
        (TRL's CPOTrainer: ``rewards/chosen`` = beta x the average log-prob).
      lengths: f32[N] completion lengths (for length-normalised losses).
      chosen, rejected: i32[B] row indices of each pair.
      weights: f32[B] per-pair weights (a judge's pairs without a verdict weigh 0), or None: every pair alike.
    Returns:
      ``(loss, metrics)``: the (weighted) mean per-pair loss; ``rewards/*`` and ``logps/*`` as TRL logs them.
    """
    if S_ref is None:  # reference-free: average log-probs (TRL's get_batch_logps(average_log_prob=True))
        S = S / jnp.maximum(lengths, 1.0)
        S_ref = jnp.zeros_like(S)
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


def _summed_logprobs(model: Model, params: Params, ref_params: Params, batch: OnlineBatch, loss: LossConfig):
    """Summed completion log-probs under the policy (differentiable) and the frozen reference (None, and the
    reference not run, for a reference-free loss), plainly summed and as the loss reads them (with ``ld_alpha``,
    LD-DPO's weighted sums; else the same arrays); and the policy's MoE terms (``policy_logprobs``)."""
    ref_logprobs, reference = batch.ref_logprobs, needs_reference(loss.loss_type)
    if reference and ref_logprobs is None and ref_params is None:
        raise ValueError(f"loss_type={loss.loss_type!r} compares with a reference: give ref_params (or ref_logprobs); "
                         "only a reference-free loss (REFERENCE_FREE) runs without one")
    logp, moe = policy_logprobs(model, params, batch, loss)
    S, S_ref = logp.sum(-1), None
    if reference:
        if ref_logprobs is None:
            ref_logprobs = batch_logprobs(model, jax.lax.stop_gradient(ref_params), batch, loss)
        ref_logprobs = jax.lax.stop_gradient(ref_logprobs)
        S_ref = ref_logprobs.sum(-1)
    if loss.options.ld_alpha is None:
        return S, S_ref, S, S_ref, moe
    w = ld_weights(batch.completion_mask, loss.options.ld_alpha)
    return S, S_ref, (logp * w).sum(-1), None if S_ref is None else (ref_logprobs * w).sum(-1), moe


# --------------------------------------------------------------------------------------------------
# Online DPO
# --------------------------------------------------------------------------------------------------


def online_dpo_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array,
                    prompt_mask: jax.Array, completion_ids: jax.Array, completion_mask: jax.Array,
                    rewards: jax.Array, *, beta, loss_type: str = "sigmoid", missing_eos_penalty=None,
                    eos_token_ids=(), penalty_reward_value=None, max_length: int | None = None,
                    options: LossOptions = LossOptions(), ref_logprobs: jax.Array | None = None,
                    judged: bool = False, logprob_temperature: float | None = None,
                    sample_logprobs: jax.Array | None = None, pair_weights: jax.Array | None = None,
                    sample_experts: jax.Array | None = None, moe_routing_replay: bool = False):
    """The online DPO loss of one batch and TRL's metrics; differentiable in ``params``: ``online_batch_loss`` of
    the arrays as an ``OnlineBatch`` (its fields say their shapes; ``rewards`` raw, before any EOS penalty) under the
    keywords but ``beta`` as a ``LossConfig``. ``beta``: the KL strength (a scalar, may be traced). ``ref_params``:
    the frozen reference; None (and never run) with a reference-free ``loss_type`` (``simpo``). ``sample_experts``
    (a MoE policy: ``Samples.experts``) logs ``moe/route_flip_rate`` and, with ``moe_routing_replay``, is replayed."""
    arrays = (jnp.asarray(x) for x in (prompt_ids, prompt_mask, completion_ids, completion_mask, rewards))
    batch = OnlineBatch(*arrays, pair_weights, ref_logprobs, sample_logprobs, sample_experts)
    loss = LossConfig(loss_type, options, max_length, logprob_temperature, missing_eos_penalty, penalty_reward_value,
                      tuple(eos_token_ids), judged, moe_routing_replay=moe_routing_replay)
    return online_batch_loss(model, params, ref_params, batch, beta, loss)


def online_batch_loss(model: Model, params: Params, ref_params: Params, batch: OnlineBatch, beta, loss: LossConfig):
    """``online_dpo_loss`` of an ``OnlineBatch`` under a ``LossConfig`` (the training step's form).

    With ``loss.judged`` (TRL's ``judge``) the rewards are not penalised, pairs without a verdict weigh 0, and the
    metrics of scores (``objective/scores``, ``scores_margin``, ``rlhf_reward``) give way to
    ``objective/judge_confidence`` and ``objective/judge_abstained``. ``batch.pair_weights`` (0: a prompt without a
    pair, ``jodpo.pairing``) weigh the loss and the ``rewards/*``, ``logps/*`` metrics, times the verdicts' weights.
    With ``batch.sample_logprobs`` (a sampler that is not the trained policy: open-instruct's async_mode),
    ``objective/off_policy_kl`` is logged: the mean over completions of their summed log-probs under the sampler
    minus under the policy (a sample estimate of KL(sampler || policy)). With ``ld_alpha``, LD-DPO's weighted
    log-probs feed the loss, ``rewards/*`` and ``logps/*`` (as TRL's DPOTrainer), the plain sums the KL and entropy.

    Returns:
      ``(loss, metrics)`` with TRL's metric names; KL and entropy are masked to the completion. Without a
      reference, ``objective/kl``, ``objective/non_score_reward`` and ``objective/rlhf_reward`` are not logged and
      ``rewards/*``, ``logps/*`` are TRL CPOTrainer's (beta x the average log-prob; the average log-prob).
    """
    S, S_ref, S_loss, S_ref_loss, moe = _summed_logprobs(model, params, ref_params, batch, loss)
    scores, has_eos = loss.scores(batch.rewards, batch.completion_ids, batch.completion_mask)
    chosen, rejected = pair_indices(scores)
    length = batch.completion_mask.sum(-1).astype(jnp.float32)
    p_first = scores[:scores.shape[0] // 2]
    weights = jnp.isfinite(p_first).astype(jnp.float32) if loss.judged else None
    if batch.pair_weights is not None:
        weights = batch.pair_weights.astype(jnp.float32) * (1.0 if weights is None else weights)
    value, metrics = with_moe_terms(*preference_loss(S_loss, S_ref_loss, length, chosen, rejected, beta=beta,
                                                    loss_type=loss.loss_type, options=loss.options, weights=weights),
                                    moe, loss)
    S = jax.lax.stop_gradient(S)
    if batch.sample_logprobs is not None:
        sampled = jnp.where(batch.completion_mask > 0, batch.sample_logprobs, 0.0).sum(-1)
        metrics["objective/off_policy_kl"] = (sampled - S).mean()
    metrics |= {"objective/entropy": -S.mean(), "val/contain_eos_token": has_eos.astype(jnp.float32).mean()}
    kl = None if S_ref is None else S - S_ref  # per sequence, masked to the completion (TRL 1.16 also sums padding)
    if kl is not None:  # the KL metrics need the reference: a reference-free loss logs none of them
        metrics |= {"objective/kl": kl.mean(), "objective/non_score_reward": (-beta * kl).mean()}
    if loss.judged:
        confidence = jnp.maximum(p_first, 1.0 - p_first)
        return value, metrics | {"objective/judge_confidence": _mean(jnp.nan_to_num(confidence), weights),
                                 "objective/judge_abstained": 1.0 - weights.mean()}
    metrics |= {"objective/scores": scores.mean(),
                "objective/scores_margin": (scores[chosen] - scores[rejected]).mean()}
    if kl is not None:
        metrics["objective/rlhf_reward"] = (scores - beta * kl).mean()
    return value, metrics


# --------------------------------------------------------------------------------------------------
# TRL's online family: Nash-MD and XPO (trl.experimental.nash_md / xpo, as in TRL 1.12, their last release)
# --------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class Coefficients:
    """A step's values of the settings TRL schedules per epoch (a list: ``values[min(int(epoch), len - 1)]``), as
    the trainers' properties of the same names read them; scalars, traced in the jitted step."""

    beta: jax.Array
    alpha: jax.Array | float = 1e-5  # XPO's weight of the exploration term
    mixture_coef: jax.Array | float = 0.5  # Nash-MD's weight of the reference in the sampled mixture


def _verdict_weights(loss: LossConfig, scores: jax.Array, batch: OnlineBatch) -> jax.Array | None:
    """f32[B] weights of a batch's pairs: a judge's pairs without a verdict weigh 0, and ``batch.pair_weights``
    multiply in; None when every pair counts alike."""
    weights = jnp.isfinite(scores[:scores.shape[0] // 2]).astype(jnp.float32) if loss.judged else None
    if batch.pair_weights is not None:
        weights = batch.pair_weights.astype(jnp.float32) * (1.0 if weights is None else weights)
    return weights


def nash_md_batch_loss(model: Model, params: Params, ref_params: Params, batch: OnlineBatch, coefs: Coefficients,
                       loss: LossConfig):
    """TRL 1.12's ``NashMDTrainer`` loss of a batch in block layout: rows [0, B) the policy's completions, rows
    [B, 2B) the geometric mixture's (``sampling.sample_pair``); raw rewards (or, judged, the judge's probability that
    the policy's completion is the better one: ``judges.pair_scores``).

    With S = the policy's summed log-probs of its own completions and p = sigmoid(r_policy - r_mixture) (rewards
    after the EOS penalties; judged: the judge's probability), per prompt:
    ``beta * sum_t sg(logpi - logpi_ref) * logpi  -  (p - 0.5) * S`` (REINFORCE of the preference, 0.5 its control
    variate; the KL's REINFORCE estimate), averaged. Only the policy's completions are read by the models.
    Metrics, TRL's names: ``loss/score``, ``loss/kl`` (mean summed log-ratio), ``logps/chosen|rejected`` (the policy's
    and the reference's log-probs of the policy's completions), ``rewards/chosen|rejected`` (the two completions'
    scores; not with a judge), ``rewards/probabilities``, ``rewards/margins`` and ``rewards/accuracies`` (of the
    log-ratio), ``objective/entropy``, ``val/model_contain_eos_token``, ``val/ref_contain_eos_token``, ``beta``,
    ``mixture_coef``."""
    B = batch.completion_ids.shape[0] // 2
    own = OnlineBatch(batch.prompt_ids[:B], batch.prompt_mask[:B], batch.completion_ids[:B],  # prompt rows [:B]
                      batch.completion_mask[:B],  # whether shared ([B, P]) or per row ([2B, P])
                      sample_experts=None if batch.sample_experts is None else batch.sample_experts[:B])
    logp, moe = policy_logprobs(model, params, own, loss)
    ref = batch.ref_logprobs[:B] if batch.ref_logprobs is not None else batch_logprobs(
        model, jax.lax.stop_gradient(ref_params), own, loss)
    ref = jax.lax.stop_gradient(ref)
    scores, has_eos = loss.scores(batch.rewards, batch.completion_ids, batch.completion_mask)
    weights = _verdict_weights(loss, scores, batch)
    p = jnp.nan_to_num(scores[:B]) if loss.judged else jax.nn.sigmoid(scores[:B] - scores[B:])
    S = logp.sum(-1)
    score = (p - 0.5) * S  # the preference's REINFORCE term, 0.5 its control variate
    log_ratio = jax.lax.stop_gradient(logp - ref)
    value = _mean(coefs.beta * (log_ratio * logp).sum(-1) - score, weights)
    S, S_ref = jax.lax.stop_gradient(S), ref.sum(-1)
    margin = S - S_ref
    metrics = {"loss": value, "loss/score": _mean(score, weights), "loss/kl": _mean(log_ratio.sum(-1), weights),
               "logps/chosen": _mean(S, weights), "logps/rejected": _mean(S_ref, weights),
               "rewards/probabilities": _mean(p, weights), "objective/entropy": _mean(-S, weights),
               "rewards/margins": _mean(margin, weights),
               "rewards/accuracies": _mean((margin > 0).astype(jnp.float32), weights),
               "val/model_contain_eos_token": has_eos[:B].astype(jnp.float32).mean(),
               "val/ref_contain_eos_token": has_eos[B:].astype(jnp.float32).mean(),
               "beta": jnp.asarray(coefs.beta, jnp.float32),
               "mixture_coef": jnp.asarray(coefs.mixture_coef, jnp.float32)}
    if loss.judged:
        metrics["objective/judge_abstained"] = 1.0 - weights.mean()
    else:
        metrics |= {"rewards/chosen": scores[:B].mean(), "rewards/rejected": scores[B:].mean()}
    return with_moe_terms(value, jax.tree.map(jax.lax.stop_gradient, metrics), moe, loss)


def xpo_batch_loss(model: Model, params: Params, ref_params: Params, batch: OnlineBatch, coefs: Coefficients,
                   loss: LossConfig):
    """TRL 1.12's ``XPOTrainer`` loss of a batch in block layout: rows [0, B) the policy's completions, rows
    [B, 2B) the reference's (``sampling.sample_pair``); raw rewards (or a judge's verdicts).

    The pair of each prompt is (policy's, reference's), chosen by the scores as online DPO chooses (the policy's
    completion when its score is >= the other's); its loss is ``loss.loss_type``'s (TRL: sigmoid or ipo; jodpo any of
    ``LOSSES`` that has a reference) plus ``alpha`` times the policy's summed log-prob of the reference's completion
    (XPO's exploration term), averaged. Metrics, TRL's names: ``loss/dpo``, ``loss/xpo``, ``objective/model_scores``,
    ``objective/ref_scores``, ``objective/scores_margin`` (not with a judge), ``objective/kl`` and
    ``objective/entropy`` (over both completions), ``rewards/*``, ``logps/chosen|rejected`` (as TRL logs them: the
    policy's mean summed log-prob of the chosen (rejected) completions plus the reference's),
    ``val/model_contain_eos_token``, ``val/ref_contain_eos_token``, ``alpha``, ``beta``."""
    B = batch.completion_ids.shape[0] // 2
    S, S_ref, S_loss, S_ref_loss, moe = _summed_logprobs(model, params, ref_params, batch, loss)
    scores, has_eos = loss.scores(batch.rewards, batch.completion_ids, batch.completion_mask)
    chosen, rejected = pair_indices(scores)
    weights = _verdict_weights(loss, scores, batch)
    length = batch.completion_mask.sum(-1).astype(jnp.float32)
    dpo, metrics = preference_loss(S_loss, S_ref_loss, length, chosen, rejected, beta=coefs.beta,
                                   loss_type=loss.loss_type, options=loss.options, weights=weights)
    xpo = _mean(coefs.alpha * S[B:], weights)  # the policy's log-prob of the reference's completions
    S = jax.lax.stop_gradient(S)
    metrics |= {
        "loss": dpo + xpo, "loss/dpo": dpo, "loss/xpo": jax.lax.stop_gradient(xpo),
        "logps/chosen": metrics["logps/chosen"] + _mean(S_ref_loss[chosen], weights),
        "logps/rejected": metrics["logps/rejected"] + _mean(S_ref_loss[rejected], weights),
        "objective/kl": (S - S_ref).mean(), "objective/entropy": -S.mean(),
        "val/model_contain_eos_token": has_eos[:B].astype(jnp.float32).mean(),
        "val/ref_contain_eos_token": has_eos[B:].astype(jnp.float32).mean(),
        "alpha": jnp.asarray(coefs.alpha, jnp.float32)}
    if loss.judged:
        metrics["objective/judge_abstained"] = 1.0 - weights.mean()
    else:
        metrics |= {"objective/model_scores": scores[:B].mean(), "objective/ref_scores": scores[B:].mean(),
                    "objective/scores_margin": (scores[:B] - scores[B:]).mean()}
    return with_moe_terms(dpo + xpo, jax.tree.map(jax.lax.stop_gradient, metrics), moe, loss)


def _online_dpo_batch_loss(model, params, ref_params, batch: OnlineBatch, coefs: Coefficients, loss: LossConfig):
    return online_batch_loss(model, params, ref_params, batch, coefs.beta, loss)


# The batch loss of each online method (``jodpo.methods``), one signature:
# (model, params, ref_params, OnlineBatch, Coefficients, LossConfig) -> (loss, metrics)
ONLINE_LOSSES: dict[str, Callable] = {"online_dpo": _online_dpo_batch_loss, "nash_md": nash_md_batch_loss,
                                      "xpo": xpo_batch_loss}


def _family_batch(prompt_ids, prompt_mask, completion_ids, completion_mask, rewards, settings: dict):
    """An ``OnlineBatch`` and ``LossConfig`` from ``nash_md_loss``'s or ``xpo_loss``'s arrays and keywords."""
    arrays = (jnp.asarray(x) for x in (prompt_ids, prompt_mask, completion_ids, completion_mask, rewards))
    ref_logprobs, experts = settings.pop("ref_logprobs", None), settings.pop("sample_experts", None)
    if "eos_token_ids" in settings:
        settings["eos_token_ids"] = tuple(settings["eos_token_ids"])
    return OnlineBatch(*arrays, ref_logprobs=ref_logprobs, sample_experts=experts), LossConfig(**settings)


def nash_md_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
                 completion_ids: jax.Array, completion_mask: jax.Array, rewards: jax.Array, *, beta,
                 mixture_coef=0.5, **settings):
    """``nash_md_batch_loss`` of arrays (``OnlineBatch``'s fields; ``rewards`` raw): Nash-MD's loss and TRL's
    metrics, differentiable in ``params``. ``settings``: ``LossConfig``'s fields (``missing_eos_penalty``,
    ``eos_token_ids``, ``judged``, ``max_length``, ...), ``ref_logprobs`` and ``sample_experts``."""
    batch, loss = _family_batch(prompt_ids, prompt_mask, completion_ids, completion_mask, rewards, settings)
    return nash_md_batch_loss(model, params, ref_params, batch, Coefficients(beta, mixture_coef=mixture_coef), loss)


def xpo_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
             completion_ids: jax.Array, completion_mask: jax.Array, rewards: jax.Array, *, beta, alpha=1e-5,
             **settings):
    """``xpo_batch_loss`` of arrays (``OnlineBatch``'s fields; ``rewards`` raw): XPO's loss and TRL's metrics,
    differentiable in ``params``. ``settings``: ``LossConfig``'s fields (``loss_type``, ``missing_eos_penalty``,
    ``eos_token_ids``, ``judged``, ...), ``ref_logprobs`` and ``sample_experts``."""
    batch, loss = _family_batch(prompt_ids, prompt_mask, completion_ids, completion_mask, rewards, settings)
    return xpo_batch_loss(model, params, ref_params, batch, Coefficients(beta, alpha=alpha), loss)


# --------------------------------------------------------------------------------------------------
# Offline DPO
# --------------------------------------------------------------------------------------------------


def dpo_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
             chosen_ids: jax.Array, chosen_mask: jax.Array, rejected_ids: jax.Array, rejected_mask: jax.Array, *,
             beta, loss_type: str = "sigmoid", max_length: int | None = None,
             options: LossOptions = LossOptions(), router_aux_loss_coef: float = 0.0):
    """Offline DPO (TRL's DPOTrainer) on preference data: the same losses, the pairs given by the data
    (``simpo``: TRL's CPOTrainer, ``ref_params`` None). ``router_aux_loss_coef`` (a MoE policy): its load-balancing
    loss of the chosen and rejected rows' forward, times this, added and logged as ``aux_loss`` (TRL's DPOTrainer).

    Args:
      prompt_ids, prompt_mask: i32[B, P], left-padded.
      chosen_ids, chosen_mask, rejected_ids, rejected_mask: i32[B, C], right-padded responses (EOS included).
    Returns:
      ``(loss, metrics)`` with ``rewards/*``, ``logps/*``, ``beta`` and ``loss``.
    """
    B = prompt_ids.shape[0]
    batch = OnlineBatch(prompt_ids, prompt_mask, jnp.concatenate([chosen_ids, rejected_ids]),
                        jnp.concatenate([chosen_mask, rejected_mask]))  # rows b and B + b: pair b
    loss = LossConfig(loss_type, options, max_length, router_aux_loss_coef=router_aux_loss_coef)
    _, _, S, S_ref, moe = _summed_logprobs(model, params, ref_params, batch, loss)
    rows = jnp.arange(B, dtype=jnp.int32)
    return with_moe_terms(*preference_loss(S, S_ref, batch.completion_mask.sum(-1).astype(jnp.float32), rows,
                                           rows + B, beta=beta, loss_type=loss_type, options=options), moe, loss)
