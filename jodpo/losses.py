"""Per-token log-probs, the DPO-family losses, and the online DPO loss with TRL's metrics.

Rows are in TRL's *block layout*: for B prompts, rows [0, B) hold completion 0 of every prompt and rows
[B, 2B) completion 1. Every loss is its own pure function of a ``Pair`` of log-ratios, chosen from
``LOSSES`` by name (formulas as in TRL's ``trl/trainer/dpo_trainer.py``; ``simpo`` as TRL's CPOTrainer). A
reference-free loss (``REFERENCE_FREE``: ``simpo``) gets no reference at all: its ``Pair`` holds the policy's
average per-token log-probs, and the reference model is neither read nor run.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jodpo.models.decoder import Model, Params, hidden_states, prefixed_hidden_states
from jodpo.models.heads import lm_head
from jodpo.scoring import apply_eos_penalty, contains_eos, pair_indices


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
    """Summed log-ratios log pi - log pi_ref of the chosen and rejected completions, and their lengths (for a
    reference-free loss: the policy's average per-token log-probs)."""

    chosen: jax.Array  # f32[B]
    rejected: jax.Array  # f32[B]
    chosen_len: jax.Array  # f32[B], completion tokens (EOS included)
    rejected_len: jax.Array


@dataclasses.dataclass(frozen=True)
class LossOptions:
    label_smoothing: float = 0.0  # cDPO (sigmoid), robust, exo_pair: the assumed label-flip rate
    discopop_tau: float = 0.05
    ipo_length_normalized: bool = False  # TRL's online trainer sums; its offline DPO normalises
    simpo_gamma: float = 0.5  # SimPO's target reward margin gamma (TRL CPOConfig's simpo_gamma)
    rdpo_alpha: float = 0.0  # R-DPO's length coefficient alpha (Park et al. 2024); not TRL's rpo_alpha (an NLL term)
    ld_alpha: float | None = None  # LD-DPO (TRL DPOConfig): weight of the log-probs past the shorter completion


def _delta(p: Pair):
    return p.chosen - p.rejected


def _smoothed(z, e):
    """-log sigmoid(z); with a label-flip rate e, cDPO's -(1 - e) log sigmoid(z) - e log sigmoid(-z)."""
    return -(1 - e) * jax.nn.log_sigmoid(z) - e * jax.nn.log_sigmoid(-z)


def sigmoid_loss(p: Pair, beta, o: LossOptions):
    """DPO; with label smoothing, cDPO."""
    return _smoothed(beta * _delta(p), o.label_smoothing)


def simpo_loss(p: Pair, beta, o: LossOptions):
    """SimPO (Meng et al. 2024), as TRL's CPOTrainer computes it (``loss_type="simpo"``): the Pair holds average
    per-token log-probs (no reference), ``-log sigmoid(beta * (c - r) - gamma)``; with label smoothing as CPO's."""
    return _smoothed(beta * (_delta(p) - o.simpo_gamma / beta), o.label_smoothing)


def rdpo_loss(p: Pair, beta, o: LossOptions):
    """R-DPO (Park et al. 2024, "Disentangling Length from Quality in DPO", eq. 9): DPO with the length term
    ``alpha * (|y_c| - |y_r|)`` added to the margin inside the log-sigmoid, so a pair whose chosen completion is the
    longer one pushes less on the policy (the length share of the preference is explained away)."""
    return _smoothed(beta * _delta(p) + o.rdpo_alpha * (p.chosen_len - p.rejected_len), o.label_smoothing)


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
    "simpo": simpo_loss, "rdpo": rdpo_loss,
}
# Losses without a reference model: their Pair holds the policy's average log-probs (TRL CPOTrainer's
# average_log_prob for simpo), their implicit rewards are beta times those averages, and no reference is read or run.
REFERENCE_FREE = frozenset({"simpo"})


def needs_reference(loss_type: str) -> bool:
    """Whether ``loss_type`` compares the policy with a frozen reference (every loss but ``REFERENCE_FREE``'s)."""
    return loss_type not in REFERENCE_FREE


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
    if o.rdpo_alpha and loss_type != "rdpo":
        raise ValueError(f"rdpo_alpha is R-DPO's length term and loss_type is {loss_type!r}: set loss_type='rdpo' "
                         "or rdpo_alpha=0")
    if o.ld_alpha is not None and not 0 <= o.ld_alpha <= 1:
        raise ValueError(f"ld_alpha must be in [0, 1] (1: plain log-probs, 0: the verbose part masked), got "
                         f"{o.ld_alpha}")
    if o.ld_alpha is not None and not needs_reference(loss_type):
        raise ValueError(f"ld_alpha weights DPO's log-ratios (TRL's DPOTrainer); loss_type={loss_type!r} has no "
                         "reference and already averages over the length: unset ld_alpha")


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


def _summed_logprobs(model, params, ref_params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                     max_length, ref_logprobs, temperature=None, *, loss_type="sigmoid",
                     options: LossOptions = LossOptions()):
    """Summed completion log-probs under the policy (differentiable) and the frozen reference (None, and the
    reference not run, for a reference-free ``loss_type``), plainly summed and as the loss reads them (with
    ``ld_alpha``, LD-DPO's weighted sums; else the same arrays)."""
    reference = needs_reference(loss_type)
    if reference and ref_logprobs is None and ref_params is None:
        raise ValueError(f"loss_type={loss_type!r} compares with a reference: give ref_params (or ref_logprobs); "
                         "only a reference-free loss (REFERENCE_FREE) runs without one")
    logp = completion_logprobs(model, params, prompt_ids, prompt_mask, completion_ids, completion_mask, max_length,
                               temperature)
    S, S_ref = logp.sum(-1), None
    if reference:
        if ref_logprobs is None:
            ref_logprobs = completion_logprobs(model, jax.lax.stop_gradient(ref_params), prompt_ids, prompt_mask,
                                               completion_ids, completion_mask, max_length, temperature)
        ref_logprobs = jax.lax.stop_gradient(ref_logprobs)
        S_ref = ref_logprobs.sum(-1)
    if options.ld_alpha is None:
        return S, S_ref, S, S_ref
    w = ld_weights(completion_mask, options.ld_alpha)
    return S, S_ref, (logp * w).sum(-1), None if S_ref is None else (ref_logprobs * w).sum(-1)


# --------------------------------------------------------------------------------------------------
# Online DPO
# --------------------------------------------------------------------------------------------------


def online_dpo_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array,
                    prompt_mask: jax.Array, completion_ids: jax.Array, completion_mask: jax.Array,
                    rewards: jax.Array, *, beta, loss_type: str = "sigmoid", missing_eos_penalty=None,
                    eos_token_ids=(), penalty_reward_value=None, max_length: int | None = None,
                    options: LossOptions = LossOptions(), ref_logprobs: jax.Array | None = None,
                    judged: bool = False, logprob_temperature: float | None = None,
                    sample_logprobs: jax.Array | None = None, pair_weights: jax.Array | None = None):
    """The online DPO loss of one batch and TRL's metrics; differentiable in ``params``.

    Args:
      ref_params: the frozen reference; None (and never run) with a reference-free ``loss_type`` (``simpo``).
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
      pair_weights: f32[B] the pairs' weights in the loss and the ``rewards/*``, ``logps/*`` metrics (0: a prompt
        without a pair, ``jodpo.pairing``); None: every pair alike. With ``judged``, multiplied by the verdicts'.
      options: the losses' options (``LossOptions``); with ``ld_alpha``, LD-DPO's weighted log-probs feed the loss,
        ``rewards/*`` and ``logps/*`` (as TRL's DPOTrainer), the plain sums the KL and entropy.
    Returns:
      ``(loss, metrics)`` with TRL's metric names; KL and entropy are masked to the completion. Without a
      reference, ``objective/kl``, ``objective/non_score_reward`` and ``objective/rlhf_reward`` are not logged and
      ``rewards/*``, ``logps/*`` are TRL CPOTrainer's (beta x the average log-prob; the average log-prob).
    """
    prompt_ids, prompt_mask, completion_ids, completion_mask, rewards = (
        jnp.asarray(x) for x in (prompt_ids, prompt_mask, completion_ids, completion_mask, rewards))
    S, S_ref, S_loss, S_ref_loss = _summed_logprobs(
        model, params, ref_params, prompt_ids, prompt_mask, completion_ids, completion_mask, max_length, ref_logprobs,
        logprob_temperature, loss_type=loss_type, options=options)
    has_eos = contains_eos(completion_ids, completion_mask, eos_token_ids)
    scores = rewards.astype(jnp.float32)
    if not judged:
        scores = apply_eos_penalty(scores, has_eos, missing_eos_penalty, penalty_reward_value)
    chosen, rejected = pair_indices(scores)
    length = completion_mask.sum(-1).astype(jnp.float32)
    p_first = scores[:scores.shape[0] // 2]
    weights = jnp.isfinite(p_first).astype(jnp.float32) if judged else None
    if pair_weights is not None:
        weights = pair_weights.astype(jnp.float32) * (1.0 if weights is None else weights)
    loss, metrics = preference_loss(S_loss, S_ref_loss, length, chosen, rejected, beta=beta, loss_type=loss_type,
                                    options=options, weights=weights)
    S = jax.lax.stop_gradient(S)
    if sample_logprobs is not None:
        metrics["objective/off_policy_kl"] = (jnp.where(completion_mask > 0, sample_logprobs, 0.0).sum(-1) - S).mean()
    metrics |= {"objective/entropy": -S.mean(), "val/contain_eos_token": has_eos.astype(jnp.float32).mean()}
    kl = None if S_ref is None else S - S_ref  # per sequence, masked to the completion (TRL 1.16 also sums padding)
    if kl is not None:  # the KL metrics need the reference: a reference-free loss logs none of them
        metrics |= {"objective/kl": kl.mean(), "objective/non_score_reward": (-beta * kl).mean()}
    if judged:
        confidence = jnp.maximum(p_first, 1.0 - p_first)
        return loss, metrics | {"objective/judge_confidence": _mean(jnp.nan_to_num(confidence), weights),
                                "objective/judge_abstained": 1.0 - weights.mean()}
    metrics |= {"objective/scores": scores.mean(),
                "objective/scores_margin": (scores[chosen] - scores[rejected]).mean()}
    if kl is not None:
        metrics["objective/rlhf_reward"] = (scores - beta * kl).mean()
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# Offline DPO
# --------------------------------------------------------------------------------------------------


def dpo_loss(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
             chosen_ids: jax.Array, chosen_mask: jax.Array, rejected_ids: jax.Array, rejected_mask: jax.Array, *,
             beta, loss_type: str = "sigmoid", max_length: int | None = None,
             options: LossOptions = LossOptions()):
    """Offline DPO (TRL's DPOTrainer) on preference data: the same losses, the pairs given by the data
    (``simpo``: TRL's CPOTrainer, ``ref_params`` None).

    Args:
      prompt_ids, prompt_mask: i32[B, P], left-padded.
      chosen_ids, chosen_mask, rejected_ids, rejected_mask: i32[B, C], right-padded responses (EOS included).
    Returns:
      ``(loss, metrics)`` with ``rewards/*``, ``logps/*``, ``beta`` and ``loss``.
    """
    B = prompt_ids.shape[0]
    completions, cmask = jnp.concatenate([chosen_ids, rejected_ids]), jnp.concatenate([chosen_mask, rejected_mask])
    _, _, S, S_ref = _summed_logprobs(model, params, ref_params, prompt_ids, prompt_mask, completions, cmask,
                                      max_length, None, loss_type=loss_type, options=options)
    rows = jnp.arange(B, dtype=jnp.int32)
    return preference_loss(S, S_ref, cmask.sum(-1).astype(jnp.float32), rows, rows + B, beta=beta,
                           loss_type=loss_type, options=options)
