"""The online training step of TRL's online trainers (``StepConfig.method``: online DPO, Nash-MD, XPO; and the
offline DPO step), as pure functions of ``(state, batch)``.

One optimizer step covers an accumulation window of A micro-batches of B prompts, arrays shaped [A, B, ...]:
  1. ``sample_completions``: k = ``num_generations`` completions per prompt (two, as TRL, by default) from the
     policy, rows in TRL's block layout (Nash-MD, XPO: the policy's beside the mixture's or the reference's,
     ``jodpo.methods``);
  2. ``score_completions``: a reward model that shares the policy tokenizer scores the token ids on the
     device; any other reward (another tokenizer, Python functions) or a pairwise judge (``jodpo.judges``) is
     computed on the host between ``sample_completions`` and ``online_update`` (the *split* path);
  3. ``online_update``: one pair per prompt (``choose_pairs``: as sampled for k = 2, else best-vs-worst or random,
     ``jodpo.pairing``), then ``update``: per micro-batch loss and gradient (``lax.scan``), averaged over the
     window (the method's loss), then clip-by-global-norm + AdamW + the learning-rate schedule, in one optax
     chain.
``online_step`` is 1-3 fused in one jitted call (no host round trip). ``offline_step`` is DPO on preference
data: the pairs come from the dataset. Unless ``async_mode`` or ``sync_steps`` > 1 ask for a lagging sampler, the
policy is never sampled or updated with stale parameters: within one window the parameters do not change, so
sampling every micro-batch first is the same as interleaving.

Randomness: step ``t`` samples its whole window with ``fold_in(state.rng, t)``, so a resumed run draws exactly the
numbers an uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jodpo import collective_order
from jodpo.losses import Coefficients, OnlineBatch, batch_logprobs, dpo_loss
from jodpo.losses import LossOptions, completion_logprobs, online_dpo_loss  # noqa: F401 (re-exported)
from jodpo.models.decoder import Model, Params
from jodpo.models.lora import attach
from jodpo.models.params import buffers, frozen_params
from jodpo.optim import SCHEDULES, OptimizerConfig, learning_rate_schedule, make_optimizer  # noqa: F401 (re-exported)
from jodpo.pairing import group_metrics, pair_rows, resolve_pairing, take_rows
from jodpo.scoring import score_tokens
from jodpo.sampling import Samples, SamplingConfig, sample, slot_utilization  # noqa: F401 (SamplingConfig: re-exported)
from jodpo.step_state import PreferenceBatch, StepConfig, TrainState  # noqa: F401 (PreferenceBatch: re-exported)

def init_state(cfg: StepConfig, params: Params, rng: jax.Array) -> TrainState:
    """A fresh state. The policy is a copy of ``params`` (made once), so ``params`` can stay the frozen
    reference: the jitted steps donate the state's buffers, never the reference's.

    Laid out as a step returns it, so the second step reuses the first one's program: the copies and the optimizer's
    moments keep their parameter's placement, and where ``params`` sit on a mesh the rest (the step, the optimizer's
    counts, the key) is put on that mesh whole. Left on one device, those scalars would come back from the first
    step placed on the mesh, a new argument layout that compiles the step again."""
    params = jax.tree.map(jnp.copy, params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                       opt_state=make_optimizer(cfg.optimizer, buffers(cfg.model)).init(params), rng=rng,
                       sampler_params=sampler_weights(cfg, params) if cfg.lagging else None)
    return _on_mesh_of(params, state)


def _on_mesh_of(params: Params, state: TrainState) -> TrainState:
    """``state`` with every concrete array that is not already on the mesh of ``params`` replicated over it (as it is
    without a mesh: under ``jit`` or ``eval_shape``, or for parameters on one device)."""
    meshes = {s.mesh for x in jax.tree.leaves(params)
              if isinstance(x, jax.Array) and isinstance(s := getattr(x, "sharding", None), jax.sharding.NamedSharding)}
    if len(meshes) != 1:
        return state
    whole = jax.sharding.NamedSharding(meshes.pop(), jax.sharding.PartitionSpec())

    def put(x):  # from the host value every process holds, as jodpo.parallel.sharding.put (a key: by its data)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, whole, lambda index: host[index])

    def place(x):
        on_mesh = isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == whole.mesh
        return x if on_mesh else put(x)

    return jax.tree.map(lambda x: place(x) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else x,
                        state)


def _sampled(cfg: StepConfig, old: TrainState, new: TrainState) -> TrainState:
    """The sampler's parameters after the updates from ``old`` to ``new``, in the form it samples with (a bf16 run's
    lagging copy holds half the bytes of the float32 policy; the same numbers). ``sync_steps`` = s refreshes them
    only at multiples of s optimizer steps: with the new policy when ``new.step`` is one; with ``async_mode`` (one
    rollout behind, what a sampler running beside the trainer would have) with the policy from before the updates
    when ``old.step`` is one. s = 1 with async_mode: always the policy from before the updates."""
    if not cfg.lagging:
        return new
    source, step = (old.params, old.step) if cfg.async_mode else (new.params, new.step)
    fresh = sampler_weights(cfg, source)
    if cfg.sync_steps == 1:
        return new.replace(sampler_params=fresh)
    refresh = step % cfg.sync_steps == 0
    return new.replace(sampler_params=jax.tree.map(lambda f, o: jnp.where(refresh, f, o), fresh, old.sampler_params))


def policy_params(cfg: StepConfig, params: Params, base: Params) -> Params:
    """The policy's parameters for a forward. With LoRA (``cfg.model.lora_rank > 0``) the trained ``params`` are
    only the adapters, and they ride on ``base``, the frozen reference: the reference is the policy with its adapters
    off, and no second copy of the model exists."""
    return attach(base, params) if cfg.model.lora_rank else params


def scheduled(cfg: StepConfig, values: tuple[float, ...], step: jax.Array) -> jax.Array:
    """``values[min(int(epoch), len - 1)]`` with epoch = steps done / steps per epoch: TRL's per-epoch lists (its
    trainers index them with the float epoch, which fails for any list of two or more)."""
    epoch = jnp.asarray(step, jnp.int32) // cfg.updates_per_epoch
    return jnp.asarray(values, jnp.float32)[jnp.minimum(epoch, len(values) - 1)]


def current_beta(cfg: StepConfig, step: jax.Array) -> jax.Array:
    """``beta`` at optimizer step ``step`` (``scheduled``)."""
    return scheduled(cfg, cfg.beta, step)


def coefficients(cfg: StepConfig, step: jax.Array) -> Coefficients:
    """The scheduled settings at optimizer step ``step``: beta, XPO's alpha, Nash-MD's mixture_coef."""
    return Coefficients(beta=current_beta(cfg, step), alpha=scheduled(cfg, cfg.alpha, step),
                        mixture_coef=scheduled(cfg, cfg.mixture_coef, step))


def sample_completions(cfg: StepConfig, state: TrainState, prompt_ids: jax.Array, prompt_mask: jax.Array,
                       num_samples: int | None = None, ref_params: Params | None = None) -> Samples:
    """A step's completions (``num_samples`` None: the method's, ``cfg.num_generations`` per prompt: from the policy
    for online DPO, the policy's beside the mixture's for Nash-MD or the reference's for XPO), or ``num_samples``
    completions per prompt from the policy alone (evaluation: one): ``Samples`` of shape [A, k * B, T], block layout
    within each micro-batch. ``ref_params`` (the reference; with LoRA the base model, where the state holds only the
    adapters) is needed with LoRA and by the methods that sample beside it. With ``cfg.lagging`` the state's
    ``sampler_params`` sample."""
    sampler = state.sampler_params if cfg.lagging else state.params
    return sample_with(cfg, sampler, state.rng, state.step, prompt_ids, prompt_mask, num_samples, ref_params)


def sample_with(cfg: StepConfig, params: Params, rng: jax.Array, step: jax.Array, prompt_ids: jax.Array,
                prompt_mask: jax.Array, num_samples: int | None = None, ref_params: Params | None = None) -> Samples:
    """``sample_completions`` from its parts: the sampling ``params`` (or ``sampler_weights`` of them), the run's key
    and the step whose draw this is, so a sampler on devices of its own (``jodpo.parallel.split_sampler``) draws exactly
    what the state would.

    The A micro-batches of a window are sampled in one call (the parameters do not change within a window): one
    decode loop of 2AB rows instead of A loops of 2B rows, which on an accelerator, where a decode step's time
    hardly depends on its rows, is A times fewer steps. Prompts go in prompt-major order (row b * A + a), so a
    batch split over devices along B stays split the same way."""
    A, B, P = prompt_ids.shape
    n = cfg.num_generations if num_samples is None else num_samples
    key = jax.random.fold_in(rng, step)
    flat = lambda x: x.transpose(1, 0, 2).reshape(B * A, P)  # noqa: E731
    method = cfg.online_method
    if ref_params is None and (cfg.model.lora_rank or (num_samples is None and method.fixed_pair)):
        raise ValueError("sample_completions needs ref_params: with LoRA adapters the base model they ride on, and "
                         f"{method.trainer}'s steps sample beside the reference")
    policy = policy_params(cfg, params, ref_params)
    if num_samples is None:  # a step's: the method's
        out = method.sample(cfg.model, policy, ref_params, flat(prompt_ids), flat(prompt_mask), key, cfg.sampling, n,
                            coefficients(cfg, step))
    else:
        out = sample(cfg.model, policy, flat(prompt_ids), flat(prompt_mask), key, cfg.sampling, num_samples=n)
    # rows s * AB + b * A + a -> [a, s * B + b]
    return jax.tree.map(lambda x: jnp.moveaxis(x.reshape(n, B, A, *x.shape[1:]), 2, 0).reshape(A, n * B, *x.shape[1:]),
                        out)


def sampler_weights(cfg: StepConfig, params: Params) -> Params:
    """What a sampler elsewhere (or ``async_mode``'s lagging copy) needs of the trained ``params``: ``frozen_params``
    of them, i.e. with LoRA the adapters as they are (the base is sent once), else the weights in the compute dtype
    where that is narrower, as ``sample`` would cast them (half the bytes in a bf16 run; the same numbers). Always
    new arrays, never the state's own, so the state can be donated at once."""
    return jax.tree.map(jnp.copy, frozen_params(cfg.model, params))


def score_completions(cfg: StepConfig, rm_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
                      samples: Samples) -> jax.Array:
    """f32[A, nB] raw reward-model scores of ``[A, nB, T]`` samples from token ids (the reward model shares the
    policy tokenizer), read as the method's trainer reads them (``StepConfig.reward_eos_ids``)."""
    eos = cfg.reward_eos_ids

    def one(x):
        ids_BP, mask_BP, tokens, mask = x
        return score_tokens(cfg.reward_model, rm_params, ids_BP, mask_BP, tokens, mask, eos)  # prompts shared

    return jax.lax.map(one, (prompt_ids, prompt_mask, samples.tokens, samples.mask))


def pair_choice(cfg: StepConfig, state: TrainState, scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``pair_rows`` of every micro-batch of a window: i32[A, 2B] rows into the [A, kB] completions and f32[A, B]
    pair weights, from scores f32[A, kB] (rewards after any EOS penalty, or a judge's win scores). ``random`` draws from the state's key and step,
    so a resumed run picks the same pairs."""
    key = jax.random.fold_in(jax.random.fold_in(state.rng, 0x9A1E), state.step)
    keys = jax.random.split(key, scores.shape[0])
    pairing = resolve_pairing(cfg.pairing, cfg.num_generations)
    return jax.vmap(lambda s, k: pair_rows(s, cfg.num_generations, pairing, k))(scores, keys)


def choose_pairs(cfg: StepConfig, state: TrainState, samples: Samples, rewards: jax.Array, rows: jax.Array | None = None):
    """One pair per prompt out of its k completions, for a window: ``(samples, rewards, pair_weights, metrics)``
    with ``Samples`` [A, 2B, T] and raw rewards f32[A, 2B] in TRL's block layout, f32[A, B] pair weights (None:
    every pair counts) and the metrics of the k scores (``group_metrics``). The pairs are chosen by the rewards after
    the EOS penalties, as the loss pairs them. k = 2 with ``random`` returns its arguments: TRL's step. Given
    ``rows`` (a judge's choice, made on the host: ``jodpo.program.loop.judge_samples``), those rows of ``samples`` are the
    pairs and ``rewards`` are already the judge's verdicts of them."""
    if rows is not None:
        return take_rows(samples, rows), rewards, None, {}
    if cfg.pairs_as_sampled:
        return samples, rewards, None, {}
    scores, _ = cfg.loss.scores(rewards, samples.tokens, samples.mask)
    rows, weights = pair_choice(cfg, state, scores)
    metrics = jax.tree.map(lambda m: m.mean(0), jax.vmap(lambda s: group_metrics(s, cfg.num_generations))(scores))
    return take_rows(samples, rows), take_rows(rewards, rows), weights, metrics


def _accumulate(model: Model, loss_fn, params: Params, batches):
    """Mean gradient and mean metrics of ``loss_fn(params, micro_batch)`` over the leading axis of ``batches``.

    With several micro-batches and weights wider than the compute dtype (float32 master weights, bf16 compute), each
    micro-batch is differentiated with respect to the weights as its forward reads them (``frozen_params``: cast to
    bf16 once per step, as the forward casts them anyway; the embedding table stays float32, its gradient being a
    scatter-add of every occurrence) and its bf16 gradient is added into the float32 sum. The layers' backward then
    stacks bf16 gradients, and the step holds 3 GiB less at the Pythia-1B shape (docs/performance.md). The same
    numbers but for one rounding: the two bf16 products of a weight the forward uses twice (the shared prompt's two
    groups of tokens) are summed in bf16, not float32, as torch autocast sums them. One micro-batch keeps the float32
    path, which costs no more there."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    A = jax.tree.leaves(batches)[0].shape[0]
    work = frozen_params(model, params) if A > 1 else params
    if work is not params:
        work = {**work, "embed": params["embed"]}

    def body(grad_sum, batch):
        (_, metrics), grads = grad_fn(work, batch)
        return jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads), metrics

    grad_sum, metrics_A = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), batches)
    # Averaged over micro-batches (TRL sums them, so its gradient grows with the accumulation steps).
    return jax.tree.map(lambda g: g / A, grad_sum), jax.tree.map(lambda m: m.mean(0), metrics_A)


def apply_gradients(cfg: StepConfig, state: TrainState, grads: Params, metrics: dict) -> tuple[TrainState, dict]:
    """One optax update. A non-finite loss or gradient norm skips it (parameters and moments unchanged)."""
    tx = make_optimizer(cfg.optimizer, buffers(cfg.model))
    grad_norm = optax.global_norm(grads)  # logged before clipping, as transformers does
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])

    def apply(_):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    params, opt_state = jax.lax.cond(finite, apply, lambda _: (state.params, state.opt_state), None)
    metrics = metrics | {"grad_norm": grad_norm, "skipped_update": (~finite).astype(jnp.float32),
                         # the rate this update used, as transformers (>= 4.50, TRL 1.16's) logs it: read before the
                         # scheduler's step, so 0 at the first step of a linear warm-up
                         "learning_rate": learning_rate_schedule(cfg.optimizer)(state.step)}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def update(cfg: StepConfig, state: TrainState, ref_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
           samples: Samples, rewards: jax.Array, ref_logprobs: jax.Array | None = None,
           pair_weights: jax.Array | None = None) -> tuple[TrainState, dict]:
    """The optimizer step from pairs of sampled completions and their raw rewards f32[A, 2B] (or, with
    ``cfg.judged``, a judge's verdicts in the same layout). ``ref_logprobs`` f32[A, 2B, C]: the reference's log-probs
    when they are already known, else the loss computes them. ``pair_weights`` f32[A, B]: the pairs' weights in the
    loss (``choose_pairs``). ``ref_params``: the frozen reference, None with a reference-free loss
    (``cfg.reference_free``) unless LoRA needs the base; the same for every step below."""
    return _update(cfg, state, ref_params, _online_batch(cfg, prompt_ids, prompt_mask, samples, rewards, pair_weights,
                                                         ref_logprobs))


def _online_batch(cfg: StepConfig, prompt_ids, prompt_mask, samples: Samples, rewards, pair_weights,
                  ref_logprobs=None) -> OnlineBatch:
    """A window's ``OnlineBatch`` [A, ...]; the sampler's log-probs only where the sampler lags (``cfg.lagging``),
    a MoE policy's experts as sampled (routing replay, ``moe/route_flip_rate``)."""
    return OnlineBatch(prompt_ids, prompt_mask, samples.tokens, samples.mask, rewards.astype(jnp.float32),
                       pair_weights, ref_logprobs, samples.logprobs if cfg.lagging else None, samples.experts)


def _update(cfg: StepConfig, state: TrainState, ref_params: Params, batch: OnlineBatch) -> tuple[TrainState, dict]:
    """``update`` of a window's ``OnlineBatch`` (arrays [A, ...]): the loss of each micro-batch (``_accumulate``)."""
    coefs, loss, batch_loss = coefficients(cfg, state.step), cfg.loss, cfg.online_method.loss

    def loss_fn(params, mb: OnlineBatch):
        return batch_loss(cfg.model, policy_params(cfg, params, ref_params), ref_params, mb, coefs, loss)

    grads, metrics = _accumulate(cfg.model, loss_fn, state.params, batch)
    return apply_gradients(cfg, state, grads, metrics)


def rollout_metrics(cfg: StepConfig, prompt_ids: jax.Array, samples: Samples) -> dict:
    """The sampler's share of a window (``samples`` [A, kB, T] of ``prompt_ids`` [A, B, P], from one call):
    ``rollout/slot_utilization`` (``sampling.slot_utilization``: real decoded tokens over the row-steps run) and
    ``rollout/generated_tokens``, the completions' real tokens (the program logs them per second:
    ``rollout/generated_tok_s``). None of them for samples made elsewhere (no ``decode_steps``)."""
    if samples.decode_steps is None:
        return {}
    A, B = prompt_ids.shape[:2]
    rows = samples.tokens.shape[1] // B * min(cfg.sampling.slots or A * B, A * B)
    return {"rollout/slot_utilization": slot_utilization(samples, rows),
            "rollout/generated_tokens": jnp.sum(samples.mask).astype(jnp.float32)}


def online_update(cfg: StepConfig, state: TrainState, ref_params: Params, prompt_ids: jax.Array,
                  prompt_mask: jax.Array, samples: Samples, rewards: jax.Array,
                  rows: jax.Array | None = None) -> tuple[TrainState, dict]:
    """A step's update from its k completions per prompt (``samples`` [A, kB, T], ``rewards`` f32[A, kB]): one pair
    per prompt (``choose_pairs``; ``rows``: a judge's), ``update``, and the sampler's parameters for the next
    step (``_sampled``)."""
    pairs, rewards, weights, chosen = choose_pairs(cfg, state, samples, rewards, rows)
    new, metrics = update(cfg, state, ref_params, prompt_ids, prompt_mask, pairs, rewards, pair_weights=weights)
    return _sampled(cfg, state, new), metrics | chosen | rollout_metrics(cfg, prompt_ids, samples)


def rollout_update(cfg: StepConfig, state: TrainState, ref_params: Params, prompt_ids: jax.Array,
                   prompt_mask: jax.Array, samples: Samples, rewards: jax.Array, num_epochs: int = 1,
                   num_mini_batches: int = 1, rows: jax.Array | None = None) -> tuple[TrainState, dict]:
    """open-instruct's several passes over one rollout batch: ``num_epochs`` passes, each a fresh shuffle of the
    rollout's pairs cut into ``num_mini_batches`` optimizer steps (``update``, with the accumulation of its
    micro-batches). The reference's log-probs are computed once per rollout; the policy's come from the updated
    policy at every pass, as in open-instruct.

    Arrays hold the rollout's R = num_mini_batches x A micro-batches: ``prompt_ids`` i32[R, B, P], ``samples``
    [R, kB, T] in block layout, ``rewards`` f32[R, kB] (``rows``: as ``online_update``). Each prompt's pair is chosen
    first; a pair (a prompt, its two completions, their rewards and weight) stays together. The shuffle draws from
    the state's key and the rollout's first step, so a resumed run draws the same. Returns the state after the
    ``num_epochs x num_mini_batches`` updates and their mean metrics (``skipped_update``: the fraction skipped)."""
    R, B = prompt_ids.shape[:2]
    M = num_mini_batches
    if R % M:
        raise ValueError(f"a rollout of {R} micro-batches does not split into {M} mini-batches")
    A = R // M
    rollout = rollout_metrics(cfg, prompt_ids, samples)
    samples, rewards, weights, chosen = choose_pairs(cfg, state, samples, rewards, rows)
    batch = _online_batch(cfg, prompt_ids, prompt_mask, samples, rewards, weights)
    if not cfg.reference_free:  # the reference's log-probs, once per rollout
        ref = jax.lax.map(lambda b: batch_logprobs(cfg.model, ref_params, b, cfg.loss), batch)
        batch = batch.replace(ref_logprobs=ref)

    def to_pairs(x):  # [R, kB, ...] -> [R * B, k, ...]: prompt b (k = 1) or its completions b, B + b (k = 2)
        return x.reshape(R, -1, B, *x.shape[2:]).swapaxes(1, 2).reshape(R * B, -1, *x.shape[2:])

    def from_pairs(x):  # [A * B, k, ...] -> [A, kB, ...]
        return x.reshape(A, B, *x.shape[1:]).swapaxes(1, 2).reshape(A, -1, *x.shape[2:])

    pairs = jax.tree.map(to_pairs, batch)
    key = jax.random.fold_in(jax.random.fold_in(state.rng, 0x5EED), state.step)

    def one_update(state, i):
        epoch, m = i // M, i % M
        order = jax.random.permutation(jax.random.fold_in(key, epoch), R * B)
        take = jax.lax.dynamic_slice_in_dim(order, m * A * B, A * B)
        return _update(cfg, state, ref_params, jax.tree.map(lambda x: from_pairs(x[take]), pairs))

    new, metrics = jax.lax.scan(one_update, state, jnp.arange(num_epochs * M))
    # means over the updates; the learning rate after the last, as a single update reports it
    metrics = jax.tree.map(lambda m: m.mean(0), metrics) | {"learning_rate": metrics["learning_rate"][-1]}
    return _sampled(cfg, state, new), metrics | chosen | rollout


def online_step(cfg: StepConfig, state: TrainState, ref_params: Params, rm_params: Params, prompt_ids: jax.Array,
                prompt_mask: jax.Array) -> tuple[TrainState, dict, Samples, jax.Array]:
    """Sample, score on device, update: one fused step. Returns the new state, the metrics (means over the
    window), and the samples and raw rewards (for completion tables)."""
    if cfg.reward_model is None:
        raise ValueError("online_step scores on device and needs StepConfig.reward_model; with host rewards "
                         "call sample_completions, then update")
    samples = sample_completions(cfg, state, prompt_ids, prompt_mask, None, ref_params)
    rewards = score_completions(cfg, rm_params, prompt_ids, prompt_mask, samples)
    state, metrics = online_update(cfg, state, ref_params, prompt_ids, prompt_mask, samples, rewards)
    return state, metrics, samples, rewards


def offline_step(cfg: StepConfig, state: TrainState, ref_params: Params,
                 batch: PreferenceBatch) -> tuple[TrainState, dict]:
    """Offline DPO (TRL's DPOTrainer): the same losses and update; chosen/rejected come from the data."""
    beta = current_beta(cfg, state.step)

    def loss_fn(params, mb: PreferenceBatch):
        return dpo_loss(cfg.model, policy_params(cfg, params, ref_params), ref_params, mb.prompt_ids, mb.prompt_mask,
                        mb.chosen_ids, mb.chosen_mask, mb.rejected_ids, mb.rejected_mask, beta=beta,
                        loss_type=cfg.loss_type, max_length=cfg.max_length, options=cfg.loss_options,
                        router_aux_loss_coef=cfg.router_aux_loss_coef)

    grads, metrics = _accumulate(cfg.model, loss_fn, state.params, batch)
    return apply_gradients(cfg, state, grads, metrics)


@dataclasses.dataclass(frozen=True)
class JittedSteps:
    """The jitted entry points: the config is static, the state is donated (updated in place), the reference
    parameters are an argument (never copied per step)."""

    sample_completions: Callable
    score_completions: Callable
    update: Callable
    online_update: Callable
    rollout_update: Callable
    pair_choice: Callable
    online_step: Callable
    offline_step: Callable


def jit_steps(state_sharding=None, metrics_sharding=None) -> JittedSteps:
    """Jitted steps. With ``state_sharding`` (a tree of shardings like the ``TrainState``) the new state keeps
    exactly that layout, step after step, and the metrics come back with ``metrics_sharding`` (replicated);
    everything else follows the shardings of the arguments."""
    def out(*rest):
        return None if state_sharding is None else (state_sharding, metrics_sharding, *rest)

    step = dict(static_argnums=0, donate_argnums=1)
    jit = collective_order.jit  # collectives in program order, whatever the job (jodpo.collective_order)
    return JittedSteps(
        sample_completions=jit(sample_completions, static_argnums=(0, 4)),
        score_completions=jit(score_completions, static_argnums=0),
        update=jit(update, **step, out_shardings=out()),
        online_update=jit(online_update, **step, out_shardings=out()),
        rollout_update=jit(rollout_update, static_argnums=(0, 7, 8), donate_argnums=1, out_shardings=out()),
        pair_choice=jit(pair_choice, static_argnums=0),
        online_step=jit(online_step, **step, out_shardings=out(None, None)),
        offline_step=jit(offline_step, **step, out_shardings=out()))


_single = jit_steps()
jit_sample_completions = _single.sample_completions
jit_score_completions = _single.score_completions
jit_update = _single.update
jit_online_update = _single.online_update
jit_rollout_update = _single.rollout_update
jit_pair_choice = _single.pair_choice
jit_online_step = _single.online_step
jit_offline_step = _single.offline_step
