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


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Everything static about a loss but beta (which may change per step): which loss and its ``options``, how the
    log-probs are computed, and how raw rewards become the scores that order a pair (online DPO)."""

    loss_type: str = "sigmoid"
    options: LossOptions = LossOptions()
    max_length: int | None = None  # prompt + completion, the prompt left-truncated in the loss's forward (TRL)
    logprob_temperature: float | None = None  # log-probs of the logits / T (open-instruct); None: raw logits (TRL)
    missing_eos_penalty: float | None = None  # subtracted from the reward of a completion without EOS (TRL)
    penalty_reward_value: float | None = None  # replaces it instead (open-instruct's non_eos_penalty)
    eos_token_ids: tuple[int, ...] = ()  # the ids that spare a completion the penalties
    judged: bool = False  # the rewards are a judge's verdicts (``jodpo.judges.pair_scores``): never penalised

    def scores(self, rewards: jax.Array, completion_ids: jax.Array, completion_mask: jax.Array):
        """``(scores, has_eos)``: f32 rewards after the EOS penalties (a judge's verdicts as they are), which order
        each pair, and whether each completion contains an EOS."""
        has_eos = contains_eos(completion_ids, completion_mask, self.eos_token_ids)
        scores = rewards.astype(jnp.float32)
        if not self.judged:
            scores = apply_eos_penalty(scores, has_eos, self.missing_eos_penalty, self.penalty_reward_value)
        return scores, has_eos


@flax.struct.dataclass
class OnlineBatch:
    """An online micro-batch: prompts, their two completions each (TRL's block layout) and the completions' rewards,
    with what the loss may be given rather than compute."""

    prompt_ids: jax.Array  # i32[B, P] shared by both completions (each prompt runs once), or i32[2B, P]
    prompt_mask: jax.Array
    completion_ids: jax.Array  # i32[2B, C], padding after the first EOS
    completion_mask: jax.Array
    # f32[2B] raw rewards; with ``LossConfig.judged`` a judge's verdicts (``jodpo.judges.pair_scores``: p for
    # completion 0, 1 - p for completion 1, NaN for none); None where the pairs are given (offline DPO)
    rewards: jax.Array | None = None
    pair_weights: jax.Array | None = None  # f32[B]; None: every pair alike
    ref_logprobs: jax.Array | None = None  # f32[2B, C] the reference's, when already computed
    sample_logprobs: jax.Array | None = None  # f32[2B, C] the sampler's, when it is not the trained policy


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


def batch_logprobs(model: Model, params: Params, batch: OnlineBatch, loss: LossConfig) -> jax.Array:
    """f32[2B, C] ``completion_logprobs`` of a batch's completions, as ``loss`` computes them."""
    return completion_logprobs(model, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                               batch.completion_mask, loss.max_length, loss.logprob_temperature)


def _summed_logprobs(model: Model, params: Params, ref_params: Params, batch: OnlineBatch, loss: LossConfig):
    """Summed completion log-probs under the policy (differentiable) and the frozen reference (None, and the
    reference not run, for a reference-free loss), plainly summed and as the loss reads them (with ``ld_alpha``,
    LD-DPO's weighted sums; else the same arrays)."""
    ref_logprobs, reference = batch.ref_logprobs, needs_reference(loss.loss_type)
    if reference and ref_logprobs is None and ref_params is None:
        raise ValueError(f"loss_type={loss.loss_type!r} compares with a reference: give ref_params (or ref_logprobs); "
                         "only a reference-free loss (REFERENCE_FREE) runs without one")
    logp = batch_logprobs(model, params, batch, loss)
    S, S_ref = logp.sum(-1), None
    if reference:
        if ref_logprobs is None:
            ref_logprobs = batch_logprobs(model, jax.lax.stop_gradient(ref_params), batch, loss)
        ref_logprobs = jax.lax.stop_gradient(ref_logprobs)
        S_ref = ref_logprobs.sum(-1)
    if loss.options.ld_alpha is None:
        return S, S_ref, S, S_ref
    w = ld_weights(batch.completion_mask, loss.options.ld_alpha)
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
    """The online DPO loss of one batch and TRL's metrics; differentiable in ``params``: ``online_batch_loss`` of
    the arrays as an ``OnlineBatch`` (its fields say their shapes; ``rewards`` raw, before any EOS penalty) under the
    keywords but ``beta`` as a ``LossConfig``. ``beta``: the KL strength (a scalar, may be traced). ``ref_params``:
    the frozen reference; None (and never run) with a reference-free ``loss_type`` (``simpo``)."""
    arrays = (jnp.asarray(x) for x in (prompt_ids, prompt_mask, completion_ids, completion_mask, rewards))
    batch = OnlineBatch(*arrays, pair_weights, ref_logprobs, sample_logprobs)
    loss = LossConfig(loss_type, options, max_length, logprob_temperature, missing_eos_penalty, penalty_reward_value,
                      tuple(eos_token_ids), judged)
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
    S, S_ref, S_loss, S_ref_loss = _summed_logprobs(model, params, ref_params, batch, loss)
    scores, has_eos = loss.scores(batch.rewards, batch.completion_ids, batch.completion_mask)
    chosen, rejected = pair_indices(scores)
    length = batch.completion_mask.sum(-1).astype(jnp.float32)
    p_first = scores[:scores.shape[0] // 2]
    weights = jnp.isfinite(p_first).astype(jnp.float32) if loss.judged else None
    if batch.pair_weights is not None:
        weights = batch.pair_weights.astype(jnp.float32) * (1.0 if weights is None else weights)
    value, metrics = preference_loss(S_loss, S_ref_loss, length, chosen, rejected, beta=beta,
                                     loss_type=loss.loss_type, options=loss.options, weights=weights)
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
    batch = OnlineBatch(prompt_ids, prompt_mask, jnp.concatenate([chosen_ids, rejected_ids]),
                        jnp.concatenate([chosen_mask, rejected_mask]))  # rows b and B + b: pair b
    _, _, S, S_ref = _summed_logprobs(model, params, ref_params, batch, LossConfig(loss_type, options, max_length))
    rows = jnp.arange(B, dtype=jnp.int32)
    return preference_loss(S, S_ref, batch.completion_mask.sum(-1).astype(jnp.float32), rows, rows + B, beta=beta,
                           loss_type=loss_type, options=options)
