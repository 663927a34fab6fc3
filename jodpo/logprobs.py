"""The forwards a loss runs: per-token log-probs of completions under the policy or the reference
(``completion_logprobs``; the LM head only at the completion positions, each shared prompt run once), a micro-batch
(``OnlineBatch``) and a loss's settings (``LossConfig``) as those forwards read them, and what a mixture-of-experts
policy's forward adds to its loss (``policy_logprobs``, ``with_moe_terms``): the load-balancing loss
(``router_aux_loss_coef``), routing replay (``moe_routing_replay``) and the route flip rate. ``jodpo.losses`` builds
the losses on these and re-exports the names.

Routing replay (Megatron's and verl's "R3"): the sampler records the experts every completion token took in every
layer (``Samples.experts``); the policy's training forward can take them instead of its own router's choice for those
tokens (``moe.route``: the weights are still its router's probabilities of the replayed experts, so the router keeps
its gradient), so that the log-probs the loss trains are those of the routing that sampled. Whether replayed or not,
``moe/route_flip_rate`` says how often the trainer's own router disagrees with the sampler's. The reference's forward
never replays: it is another model (or the base without adapters), whose log-probs are the same forward every step.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jodpo.models.decoder import Model, Params, hidden_states, prefixed_hidden_states
from jodpo.models.heads import lm_head
from jodpo.models.layers import row_shards
from jodpo.models.moe import load_balancing_loss
from jodpo.pair_losses import LossOptions
from jodpo.scoring import apply_eos_penalty, contains_eos


# the float32 logits one device may hold for one chunk of tokens (token_logprobs), for its share of the rows: 128 MiB,
# a copy of them (a micro-batch's logits, their soft-capping, log-softmax and gradient are each one) under 1% of a
# v5e's HBM
LOGITS_BYTES = 2 ** 27


def token_logprobs(model: Model, params: Params, h_NCD: jax.Array, ids_NC: jax.Array,
                   temperature: float | None = None) -> jax.Array:
    """f32[N, C]: log p(``ids`` [N, C]) from the hidden states that predict them ``[N, C, D]`` (the LM head, the
    logits divided by ``temperature + 1e-7`` where given, the log-softmax at the token). Where the float32 logits of
    all C positions of a device's rows (``[N / shards, C, V]``, the rows split over the mesh's batch axes as the
    forward splits them: ``layers.rows_split``) would pass ``LOGITS_BYTES``, a few positions at a time (a ``lax.map``
    over chunks of them, each chunk's logits recomputed for the backward): a large vocabulary's logits, their
    soft-capping and log-softmax and their gradient are each that size (Gemma 4 E2B, 16 rows a chip x 64 tokens x
    262144: 1 GiB a copy; 8 chunks of 8 tokens). The chunks are the same on 8 chips as on 256 with the same rows a chip;
    each token's value is the same either way."""
    N, C, D = h_NCD.shape

    def chunk(h, ids):
        logits = lm_head(model, params, h)
        if temperature is not None:
            logits = logits / (temperature + 1e-7)
        picked = jnp.take_along_axis(logits, ids[..., None].astype(jnp.int32), -1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1)

    rows = N // row_shards(N, params["embed"])  # (the mesh the embedding's lookup split the rows over)
    size = max(1, LOGITS_BYTES // (4 * rows * model.vocab_size))
    if size >= C:
        return chunk(h_NCD, ids_NC)
    n = -(-C // size)
    h = jnp.pad(h_NCD, ((0, 0), (0, n * size - C), (0, 0))).reshape(N, n, size, D).swapaxes(0, 1)
    ids = jnp.pad(ids_NC, ((0, 0), (0, n * size - C))).reshape(N, n, size).swapaxes(0, 1)
    logp = jax.lax.map(jax.checkpoint(lambda x: chunk(*x)), (h, ids))  # [n, N, size]
    return logp.swapaxes(0, 1).reshape(N, n * size)[:, :C]


def _forward(model: Model, params: Params, prompt_ids, prompt_mask, completion_ids, completion_mask, max_length,
             temperature, with_router: bool = False, routes: jax.Array | None = None):
    """``completion_logprobs``' forward: ``(logp f32[N, C], routing, mask, P)``, with ``with_router`` the
    ``moe.Routing`` of every row ``[layers, N, P + C, ...]`` and the rows' mask of real tokens ``[N, P + C]``, P the
    prompt's length after ``max_length``'s cut (None, None otherwise)."""
    P, C = prompt_ids.shape[1], completion_ids.shape[1]
    if max_length is not None and P + C > max_length:
        cut = min(P + C - max_length, P - 1)
        prompt_ids, prompt_mask, P = prompt_ids[:, cut:], prompt_mask[:, cut:], P - cut
    shared = prompt_ids.shape[0] != completion_ids.shape[0]
    if routes is not None:  # [N, C, M, k] -> the forwards' [M, N, C, k]
        routes = jnp.asarray(routes, jnp.int32).transpose(2, 0, 1, 3)
    if shared:
        out = prefixed_hidden_states(model, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                     with_router=with_router, routes=routes)
        h, routing = out if with_router else (out, None)
    else:
        if routes is not None:  # the prompt's tokens route themselves
            routes = jnp.pad(routes, ((0, 0), (0, 0), (P, 0), (0, 0)), constant_values=-1)
        h, _, *routing = hidden_states(model, params, jnp.concatenate([prompt_ids, completion_ids], 1),
                                       jnp.concatenate([prompt_mask, completion_mask], 1), with_router=with_router,
                                       routes=routes)
        routing = routing[0] if with_router else None
    logp = jnp.where(completion_mask > 0, token_logprobs(model, params, h[:, P - 1: P + C - 1], completion_ids,
                                                          temperature), 0.0)
    if not with_router:
        return logp, None, None, P
    n = completion_ids.shape[0] // prompt_ids.shape[0]
    mask = jnp.concatenate([jnp.concatenate([prompt_mask] * n, 0) if shared else prompt_mask, completion_mask], 1)
    return logp, routing, mask, P


def completion_logprobs(model: Model, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
                        completion_ids: jax.Array, completion_mask: jax.Array,
                        max_length: int | None = None, temperature: float | None = None, with_aux: bool = False,
                        routes: jax.Array | None = None):
    """f32[N, C]: log p(completion token | everything before it) under ``params``; 0 on padding.

    ``prompt_ids`` has a row per completion ``[N, P]``, or ``[B, P]`` shared by N = n x B completions in block
    layout (row r continues prompt ``r % B``): then every prompt runs through the model once, not n times.
    The LM head runs only at the C positions that predict completion tokens (never over the prompt).
    ``max_length`` left-truncates the prompt for this forward only, as TRL does (at least one prompt
    token is kept). ``temperature``: the logits are divided by ``temperature + 1e-7`` first, as open-instruct's
    training forward does (TRL and the default use the raw logits). ``with_aux`` (a MoE model): also the forward's
    load-balancing loss over the real tokens of prompt + completion, as transformers' ``aux_loss`` of those rows.
    ``routes`` (a MoE model; routing replay): i32[N, C, M, k], ``Samples.experts``' layout: the experts each
    completion token takes in every layer instead of its router's choice, where >= 0 (-1: its own choice); the
    prompt's tokens always route themselves.
    """
    if routes is not None and model.moe is None:
        raise ValueError(f"routes replay a mixture of experts' routing, and this {model.family} model has no experts; "
                         "give routes=None")
    logp, routing, mask, _ = _forward(model, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                      max_length, temperature, with_aux, routes)
    return (logp, load_balancing_loss(model.moe, routing.logits, mask)) if with_aux else logp


def route_flip_rate(sampled: jax.Array, trained: jax.Array) -> jax.Array:
    """f32[]: the share of completion tokens whose set of k experts (as a set: the order is not compared) differs
    between the sampler and the trainer's own router, over the tokens the sampler recorded (``sampled`` >= 0) in every
    layer, i.e. averaged over the layers (all of a jodpo MoE model's are MoE layers, and a token is recorded in all or
    none); 0 when none is. ``sampled``, ``trained``: i32[N, C, M, k] (``Samples.experts``' layout)."""
    recorded = sampled[..., 0] >= 0
    flipped = jnp.any(jnp.sort(sampled, -1) != jnp.sort(trained, -1), -1) & recorded
    return jnp.sum(flipped, dtype=jnp.float32) / jnp.maximum(jnp.sum(recorded, dtype=jnp.float32), 1.0)


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
    # a MoE policy's forward takes the sampler's experts for the completion tokens (``OnlineBatch.sample_experts``)
    # instead of its router's choice (routing replay); the reference's never does
    moe_routing_replay: bool = False

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
    # i32[2B, C, M, k] a MoE policy's experts for each completion token as its sampler chose them
    # (``Samples.experts``; -1 where it recorded none): routing replay and ``moe/route_flip_rate``
    sample_experts: jax.Array | None = None


def batch_logprobs(model: Model, params: Params, batch: OnlineBatch, loss: LossConfig) -> jax.Array:
    """f32[2B, C] ``completion_logprobs`` of a batch's completions, as ``loss`` computes them."""
    return completion_logprobs(model, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                               batch.completion_mask, loss.max_length, loss.logprob_temperature)


def policy_logprobs(model: Model, params: Params, batch: OnlineBatch, loss: LossConfig) -> tuple[jax.Array, dict]:
    """``batch_logprobs`` under the trained policy, and the MoE terms of the same forward (``with_moe_terms``; {} for a
    dense policy): ``aux_loss``, its load-balancing loss, where ``loss.router_aux_loss_coef`` is on;
    ``moe/route_flip_rate`` (``route_flip_rate``: the trainer's own router against ``batch.sample_experts``) where
    the batch has the sampler's experts. With ``loss.moe_routing_replay`` the completion tokens take the sampler's
    experts (the flip rate still compares the router's own choice)."""
    experts = batch.sample_experts
    if loss.moe_routing_replay and (model.moe is None or experts is None):
        raise ValueError("moe_routing_replay replays the experts a MoE policy's sampler chose: "
                         + (f"this {model.family} policy has no experts; leave it off" if model.moe is None else
                            "give the batch's sample_experts (Samples.experts), or leave it off"))
    aux = bool(loss.router_aux_loss_coef)
    if model.moe is None or not (aux or experts is not None):
        return batch_logprobs(model, params, batch, loss), {}
    logp, routing, mask, P = _forward(model, params, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                      batch.completion_mask, loss.max_length, loss.logprob_temperature, True,
                                      experts if loss.moe_routing_replay else None)
    terms = {"aux_loss": load_balancing_loss(model.moe, routing.logits, mask)} if aux else {}
    if experts is not None:
        trained = routing.experts[:, :, P:].transpose(1, 2, 0, 3)  # [M, N, P + C, k] -> [N, C, M, k]
        terms["moe/route_flip_rate"] = route_flip_rate(experts, trained)
    return logp, terms


def with_moe_terms(value: jax.Array, metrics: dict, terms: dict, loss: LossConfig):
    """A loss and its metrics with a MoE policy's terms (``policy_logprobs``): its load-balancing loss, where given,
    added (``router_aux_loss_coef`` times it, as transformers adds it to its loss; ``metrics["loss"]`` the sum) and
    logged as ``aux_loss``; ``moe/route_flip_rate`` logged. As they are without (a dense policy)."""
    if not terms:
        return value, metrics
    metrics = metrics | jax.tree.map(jax.lax.stop_gradient, terms)
    if "aux_loss" in terms:
        value = value + loss.router_aux_loss_coef * terms["aux_loss"]
        metrics["loss"] = jax.lax.stop_gradient(value)
    return value, metrics
