"""The forwards a loss runs: per-token log-probs of completions under the policy or the reference
(``completion_logprobs``; the LM head only at the completion positions, each shared prompt run once), a micro-batch
(``OnlineBatch``) and a loss's settings (``LossConfig``) as those forwards read them, and what a mixture-of-experts
policy's forward adds to its loss: the load-balancing loss (``router_aux_loss_coef``). ``jodpo.losses`` builds the
losses on these and re-exports the names.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jodpo.models.decoder import Model, Params, hidden_states, prefixed_hidden_states
from jodpo.models.heads import lm_head
from jodpo.models.moe import load_balancing_loss
from jodpo.pair_losses import LossOptions
from jodpo.scoring import apply_eos_penalty, contains_eos


def completion_logprobs(model: Model, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
                        completion_ids: jax.Array, completion_mask: jax.Array,
                        max_length: int | None = None, temperature: float | None = None, with_aux: bool = False):
    """f32[N, C]: log p(completion token | everything before it) under ``params``; 0 on padding.

    ``prompt_ids`` has a row per completion ``[N, P]``, or ``[B, P]`` shared by N = n x B completions in block
    layout (row r continues prompt ``r % B``): then every prompt runs through the model once, not n times.
    The LM head runs only at the C positions that predict completion tokens (never over the prompt).
    ``max_length`` left-truncates the prompt for this forward only, as TRL does (at least one prompt
    token is kept). ``temperature``: the logits are divided by ``temperature + 1e-7`` first, as open-instruct's
    training forward does (TRL and the default use the raw logits). ``with_aux`` (a MoE model): also the forward's
    load-balancing loss over the real tokens of prompt + completion, as transformers' ``aux_loss`` of those rows.
    """
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    if max_length is not None and P + C > max_length:
        cut = min(P + C - max_length, P - 1)
        prompt_ids, prompt_mask, P = prompt_ids[:, cut:], prompt_mask[:, cut:], P - cut
    shared = prompt_ids.shape[0] != completion_ids.shape[0]
    if shared:
        out = prefixed_hidden_states(model, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                     with_router=with_aux)
        h, router = out if with_aux else (out, None)
    else:
        h, _, *router = hidden_states(model, params, jnp.concatenate([prompt_ids, completion_ids], 1),
                                      jnp.concatenate([prompt_mask, completion_mask], 1), with_router=with_aux)
        router = router[0] if with_aux else None
    logits_BCV = lm_head(model, params, h[:, P - 1: P + C - 1])
    if temperature is not None:
        logits_BCV = logits_BCV / (temperature + 1e-7)
    picked = jnp.take_along_axis(logits_BCV, completion_ids[..., None].astype(jnp.int32), -1)[..., 0]
    logp = jnp.where(completion_mask > 0, picked - jax.nn.logsumexp(logits_BCV, axis=-1), 0.0)
    if not with_aux:
        return logp
    n = completion_ids.shape[0] // prompt_ids.shape[0]
    mask = jnp.concatenate([jnp.concatenate([prompt_mask] * n, 0) if shared else prompt_mask, completion_mask], 1)
    return logp, load_balancing_loss(model.moe, router, mask)


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
    # a MoE policy's load-balancing loss (transformers' aux_loss of its forward) times this is added to the loss and
    # logged as ``aux_loss`` (TRL's name); 0: off, as TRL's online trainers (they add none)
    router_aux_loss_coef: float = 0.0

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


def batch_logprobs(model: Model, params: Params, batch: OnlineBatch, loss: LossConfig) -> jax.Array:
    """f32[2B, C] ``completion_logprobs`` of a batch's completions, as ``loss`` computes them."""
    return completion_logprobs(model, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                               batch.completion_mask, loss.max_length, loss.logprob_temperature)


def policy_logprobs(model: Model, params: Params, batch: OnlineBatch, loss: LossConfig):
    """``batch_logprobs`` under the trained policy and, where ``loss.router_aux_loss_coef`` is on (a MoE policy), the
    load-balancing loss of the same forward (None otherwise)."""
    if not (loss.router_aux_loss_coef and model.moe is not None):
        return batch_logprobs(model, params, batch, loss), None
    return completion_logprobs(model, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                               batch.completion_mask, loss.max_length, loss.logprob_temperature, with_aux=True)


def with_aux_loss(value: jax.Array, metrics: dict, aux: jax.Array | None, loss: LossConfig):
    """A loss and its metrics with the policy's load-balancing loss added (``router_aux_loss_coef`` times it, as
    transformers adds it to its loss; ``metrics["loss"]`` the sum) and logged as ``aux_loss``; as they are without."""
    if aux is None:
        return value, metrics
    value = value + loss.router_aux_loss_coef * aux
    return value, metrics | {"loss": jax.lax.stop_gradient(value), "aux_loss": jax.lax.stop_gradient(aux)}
