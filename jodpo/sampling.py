"""Sampling: one prefill over the prompt, then decoding over a KV cache in ``lax.scan`` chunks; from the policy
(``sample``), or from two models at once (``sample_pair``: TRL's online family, a reference's or a geometric
mixture's completions beside the policy's).

The decode loop is a ``while_loop`` over chunks of ``SamplingConfig.chunk`` steps, each a ``lax.scan`` of
branch-free steps (run the model on the last token, choose the next); between chunks it stops as soon as every row
has produced an EOS (TL;DR completions often end early) or the budget is spent. Everything after a row's first EOS
is padding.

Filtering follows transformers exactly, in its order: repetition penalty, then temperature, top-k, top-p
(nucleus, keeping the token that crosses p), min-p (relative to the top token's probability).
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models.decoder import Cache, Model, Params, hidden_states, init_cache, split_cache
from jodpo.models.params import compute_params, decode_params, split_layers
from jodpo.models.heads import lm_head


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings (hashable: pass as a static argument of ``jax.jit``).

    ``temperature=0`` is greedy decoding. ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch those filters off.
    """

    max_new_tokens: int = 64
    temperature: float = 0.9
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    chunk: int = 8  # decode steps between checks for "every row has ended"
    unroll: int = 1  # decode steps per iteration of the compiled loop (lax.scan's unroll); results do not depend on it

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0 or self.chunk < 1 or self.unroll < 1 or self.repetition_penalty <= 0:
            raise ValueError("top_k must be >= 0, chunk and unroll >= 1, and repetition_penalty > 0")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))


@flax.struct.dataclass
class Samples:
    tokens: jax.Array  # i32[B, T]: sampled tokens, pad after the first EOS (the EOS itself kept)
    mask: jax.Array  # i32[B, T]: 1 up to and including the first EOS
    logprobs: jax.Array  # f32[B, T]: log p(token) under the raw model (temperature 1, no filters); 0 on pad
    # i32[B, T, M, k] (a MoE policy; None otherwise): the experts each of its M layers with experts (Model.layers_with)
    # chose for token t when the sampler ran it (to choose token t + 1), where token t + 1 is a real token, which the
    # loss's log-prob of it depends on; -1 elsewhere (the last real token, padding, rows the policy did not sample).
    # Routing replay
    experts: jax.Array | None = None


# --------------------------------------------------------------------------------------------------
# Filtering (pure, on one step's logits)
# --------------------------------------------------------------------------------------------------


def process_logits(logits_BV: jax.Array, seen_BV: jax.Array | None, cfg: SamplingConfig) -> jax.Array:
    """The filtered, tempered logits that a token is sampled from (-inf where filtered out)."""
    x = logits_BV.astype(jnp.float32)
    if cfg.repetition_penalty != 1.0:
        penalised = jnp.where(x < 0, x * cfg.repetition_penalty, x / cfg.repetition_penalty)
        x = jnp.where(seen_BV, penalised, x)
    if cfg.temperature == 0:
        return x
    if cfg.temperature != 1.0:
        x = x / cfg.temperature
    neg_inf = jnp.float32(-jnp.inf)
    if cfg.top_k > 0 and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][:, -1:]
        x = jnp.where(x < kth, neg_inf, x)
    if cfg.top_p < 1.0:
        # Ascending sort; drop tokens whose cumulative probability stays <= 1 - p (always keep the top one).
        s = jnp.sort(x, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(s, axis=-1), axis=-1)
        keep = (cum > 1.0 - cfg.top_p).at[:, -1].set(True)
        threshold = jnp.min(jnp.where(keep, s, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, neg_inf, x)
    if cfg.min_p > 0:
        p = jax.nn.softmax(x, axis=-1)
        x = jnp.where(p < cfg.min_p * jnp.max(p, -1, keepdims=True), neg_inf, x)
    return x


def choose(logits_BV: jax.Array, seen_BV, rng: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """One decoding step: the next token of every row and its raw log-probability."""
    x = process_logits(logits_BV, seen_BV, cfg)
    if cfg.temperature == 0:
        token = jnp.argmax(x, axis=-1).astype(jnp.int32)
    else:
        token = _inverse_cdf(x, rng)
    logits = logits_BV.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, token[:, None], -1)[:, 0]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    return token, logp


def _inverse_cdf(x_BV: jax.Array, rng: jax.Array, block: int = 128) -> jax.Array:
    """An exact categorical draw with one uniform per row, by searching the cumulative probabilities,
    instead of a Gumbel variate for every vocabulary entry (which dominates a decode step on a CPU with a
    50k vocabulary). Two levels: the cumulative sum of per-block totals finds the block where the uniform
    falls, then the cumulative sum inside that block alone finds the token (a flat cumulative sum over the
    vocabulary took 3 ms of a 25 ms decode step at batch 16; this takes 0.5 ms)."""
    B, V = x_BV.shape
    n = -(-V // block)
    p = jnp.exp(x_BV - jnp.max(x_BV, -1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, n * block - V))).reshape(B, n, block)
    block_p = jnp.sum(p, -1)
    block_cdf = jnp.cumsum(block_p, -1)
    u = jax.random.uniform(rng, (B, 1), jnp.float32) * block_cdf[:, -1:]
    # Rounding can put u at a total (of the row or of the chosen block): then take the last block, and the last
    # token in its block, of nonzero probability, never a filtered token or the padding.
    last_block = jnp.max(jnp.where(block_p > 0, jnp.arange(n), 0), -1)
    b = jnp.minimum(jnp.sum(block_cdf <= u, -1), last_block)[:, None]  # the first block whose cdf exceeds u
    inner = jnp.take_along_axis(p, b[:, :, None], 1)[:, 0]  # [B, block]; its total is > 0
    u_in = jnp.maximum(u - (jnp.take_along_axis(block_cdf, b, -1) - jnp.take_along_axis(block_p, b, -1)), 0.0)
    i = jnp.sum(jnp.cumsum(inner, -1) <= u_in, -1)
    last = jnp.max(jnp.where(inner > 0, jnp.arange(block), 0), -1)
    return (b[:, 0] * block + jnp.minimum(i, last)).astype(jnp.int32)


# --------------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class _State:
    step: jax.Array  # i32[]: tokens chosen so far (the next one chosen is token ``step``)
    token: jax.Array  # i32[N]: the last token chosen, which the next decode step runs the models on
    alive: jax.Array  # bool[N]: whether that token is a real one (its row had not ended before it)
    caches: tuple[Cache, ...]  # one per model that decodes (``_Decoder``), over its rows
    seen: jax.Array | None  # bool[N, V] tokens seen (repetition penalty only)
    done: jax.Array  # bool[N]: row has produced an EOS
    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    experts: jax.Array | None  # i32[N, T, M, k] (a MoE policy): ``Samples.experts``, filled as the steps run


def _emit(cfg: SamplingConfig, rng: jax.Array, state: _State, logits_BV: jax.Array) -> _State:
    """Choose token ``state.step`` of every row from its logits and record it. A step past ``max_new_tokens`` (the
    last chunk's overhang) records nothing: its token is never part of the result."""
    t = state.step
    token, logp = choose(logits_BV, state.seen, jax.random.fold_in(rng, t), cfg)
    alive = ~state.done
    token = jnp.where(alive, token, cfg.pad_token_id)
    done = state.done | (jnp.isin(token, jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)) & alive)
    seen = state.seen
    if seen is not None:
        seen = seen | (jax.nn.one_hot(token, seen.shape[-1], dtype=bool) & alive[:, None])
    keep = t < cfg.max_new_tokens
    upd = lambda buf, v: jnp.where(  # noqa: E731
        keep, jax.lax.dynamic_update_slice(buf, v[:, None].astype(buf.dtype), (0, t)), buf)
    return state.replace(step=t + 1, token=token, alive=alive, seen=seen, done=done,
                         tokens=upd(state.tokens, token), mask=upd(state.mask, alive),
                         logprobs=upd(state.logprobs, jnp.where(alive, logp, 0.0)))


def sampler_params(model: Model, params: Params) -> Params:
    """``params`` as the decode steps read them: split per layer (a decode step then slices no weights), any LoRA
    adapters merged, in the compute dtype (float32 master weights of a bf16 run converted once, not on every step),
    each mixer's weights as its decode step reads them (``params.decode_params``). They go with a per-layer cache
    (``decoder.split_cache``)."""
    if "lora" in params["layers"]:  # adapters merged a layer at a time (compute_params), then prepared
        return decode_params(model, compute_params(model, split_layers(model, params)))
    return compute_params(model, split_layers(model, decode_params(model, params)))


def decode_step(model: Model, params: Params, cache: Cache, token_B: jax.Array, alive_B: jax.Array,
                with_experts: bool = False):
    """The model's part of one step of the sampler's decode loop: ``token_B`` i32[B] (``alive_B`` bool[B]: a real
    token; a row that has ended runs on padding, unseen by any real token) after ``cache``; returns the next token's
    logits f32[B, V] and the cache with it written. ``params`` from ``sampler_params``, ``cache`` per layer. What
    ``bench.py traffic`` compiles to count the bytes a decode step moves. ``with_experts`` (a MoE model): a third
    output, the experts each layer with experts chose for the token, i32[B, M, k]."""
    h, cache, *routing = hidden_states(model, params, token_B[:, None], alive_B[:, None].astype(jnp.int32), cache,
                                       with_router=with_experts)
    logits = lm_head(model, params, h[:, -1])
    return (logits, cache, routing[0].experts[:, :, 0].transpose(1, 0, 2)) if with_experts else (logits, cache)


@dataclasses.dataclass(frozen=True)
class _Decoder:
    """One model of a decode loop: its parameters and the rows it runs on, whole blocks of the B prompts' rows
    (``first`` to ``end``, in units of B: block s is completion s of every prompt)."""

    params: Params
    first: int
    end: int


def _decode_step(model: Model, decoders: tuple[_Decoder, ...], combine, cfg: SamplingConfig, rng: jax.Array,
                 state: _State) -> _State:
    """One decode step, straight-line (no branch: on a GPU every ``lax.cond`` waits for its predicate to reach the
    host, and the kernels behind it then start only after it): run each model on the last token of its rows (a row
    that has ended runs on padding, unseen by any real token), combine their logits into each row's, choose the
    next. A MoE policy (the first model) records the experts it chose for that token (``Samples.experts``)."""
    B = state.token.shape[0] // max(d.end for d in decoders)
    logits, caches, experts = [], [], state.experts
    for i, (d, cache) in enumerate(zip(decoders, state.caches)):
        rows = slice(d.first * B, d.end * B)
        out = decode_step(model, d.params, cache, state.token[rows], state.alive[rows], i == 0 and experts is not None)
        if i == 0 and experts is not None:  # token step - 1's; a step past the budget writes the last slot, which
            # ``_sample`` clears (no token follows it)
            t = jnp.minimum(state.step - 1, experts.shape[1] - 1)
            experts = jax.lax.dynamic_update_slice(experts, out[2][:, None], (d.first * B, t, 0, 0))
        logits.append(out[0])
        caches.append(out[1])
    return _emit(cfg, rng, state.replace(caches=tuple(caches), experts=experts), combine(*logits))


def _prefill(model: Model, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array, length: int, copies: int):
    """One model's prefill over the B prompts, through the decoder's scans over its layers (one compiled body per
    repeating period of layers, whatever the depth), its cache then split per layer for the unrolled decode steps
    (which slice no weights and no cache state, step after step): the decode steps' parameters, the cache of
    ``length`` slots copied for ``copies`` blocks of rows, and the logits of token 0 likewise."""
    B, P = prompt_ids.shape
    h, cache = hidden_states(model, params, prompt_ids, prompt_mask, init_cache(model, B, length), empty_cache=True)
    logits = lm_head(model, params, h[:, -1])
    cache = split_cache(model, cache)
    if copies > 1:  # the prompt's cache (and first logits) for every block: one prefill, not ``copies``
        tile = lambda x: jnp.concatenate([x] * copies, 0)  # noqa: E731
        cache = {"state": jax.tree.map(tile, cache["state"]), "mask": tile(cache["mask"]), "index": cache["index"]}
        logits = tile(logits)
    return sampler_params(model, params), cache, logits  # the weights as the decode steps read them, once a call


def _sample(model: Model, sources: tuple[tuple[Params, int, int], ...], combine, prompt_ids: jax.Array,
            prompt_mask: jax.Array, rng: jax.Array, config: SamplingConfig) -> Samples:
    """The decode loop behind ``sample`` and ``sample_pair``: ``sources`` are ``(params, first, end)``, a model and
    the blocks of rows it runs on (``_Decoder``); ``combine(*logits)`` makes the rows' logits f32[nB, V] out of the
    models' (in the order of ``sources``), n = the largest ``end``."""
    B, P = prompt_ids.shape
    T, n = config.max_new_tokens, max(end for _, _, end in sources)
    decoders, caches, first_logits = [], [], []
    for params, first, end in sources:
        params, cache, logits = _prefill(model, params, prompt_ids, prompt_mask, P + T, end - first)
        decoders.append(_Decoder(params, first, end))
        caches.append(cache)
        first_logits.append(logits)
    decoders = tuple(decoders)
    seen = None
    if config.repetition_penalty != 1.0:
        hit = jax.nn.one_hot(prompt_ids, model.vocab_size, dtype=bool) & prompt_mask.astype(bool)[..., None]
        seen = jnp.concatenate([jnp.any(hit, axis=1)] * n, 0)
    zeros = lambda dt: jnp.zeros((n * B, T), dt)  # noqa: E731
    experts = None if model.moe is None else jnp.full((n * B, T, len(model.layers_with("moe")), model.moe.top_k), -1,
                                                      jnp.int32)
    state = _State(step=jnp.zeros((), jnp.int32), token=jnp.zeros((n * B,), jnp.int32),
                   alive=jnp.zeros((n * B,), bool), caches=tuple(caches), seen=seen, done=jnp.zeros((n * B,), bool),
                   tokens=zeros(jnp.int32), mask=zeros(jnp.int32), logprobs=zeros(jnp.float32), experts=experts)
    state = _emit(config, rng, state, combine(*first_logits))  # token 0, from the prefills' logits

    def chunk(state):
        return jax.lax.scan(lambda s, _: (_decode_step(model, decoders, combine, config, rng, s), None), state, None,
                            length=config.chunk, unroll=config.unroll)[0]

    # Tokens 1 .. T-1, ``chunk`` decode steps at a time, until every row has ended. Only this loop's predicate is
    # read between chunks; a scan's trip count is known, so its steps run without a check. The last chunk may run
    # past T - 1: those steps record nothing (their cache writes land in the last slot, which nothing reads after).
    state = jax.lax.while_loop(lambda s: (s.step < T) & ~jnp.all(s.done), chunk, state)
    pad = jnp.int32(config.pad_token_id)
    if experts is not None:  # a token's experts where the next token is real: those the loss's log-probs read
        follows = jnp.pad(state.mask[:, 1:], ((0, 0), (0, 1))) > 0
        experts = jnp.where(follows[:, :, None, None], state.experts, -1)
    return Samples(tokens=jnp.where(state.mask > 0, state.tokens, pad), mask=state.mask, logprobs=state.logprobs,
                   experts=experts)


def sample(model: Model, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
           config: SamplingConfig, num_samples: int = 1) -> Samples:
    """Sample ``config.max_new_tokens`` tokens after left-padded prompts.

    Args:
      model, params: a causal LM from ``jodpo.load_model``.
      prompt_ids, prompt_mask: i32[B, P], left-padded (every row ends with a real token).
      rng: a PRNG key; step ``t`` uses ``fold_in(rng, t)``, so a result is reproducible.
      config: a ``SamplingConfig`` (static).
      num_samples: completions per prompt (static). The prompts are run through the model once and their
        cache copied; rows come in block layout: every prompt for sample 0, then every prompt for sample 1, ...
        (the same as sampling ``concatenate([prompt_ids] * num_samples)``, with one prefill instead of n).
    Returns:
      ``Samples`` with ``tokens``, ``mask`` and ``logprobs`` of shape [num_samples * B, max_new_tokens]; a MoE
      model's also with ``experts`` [num_samples * B, max_new_tokens, layers, k].
    Jittable (``model`` and ``config`` static); works on sharded params and batches.
    """
    return _sample(model, ((params, 0, num_samples),), lambda logits: logits, prompt_ids, prompt_mask, rng, config)


def geometric_mixture(policy_logits: jax.Array, ref_logits: jax.Array, mixture_coef) -> jax.Array:
    """TRL 1.12's ``GeometricMixtureWrapper``: the log-probabilities ``log_softmax(c * ref + (1 - c) * policy)`` of
    the raw logits, c = ``mixture_coef`` (a number or a traced scalar). The sampler then tempers and filters them as
    any model's logits (so, as in TRL, the temperature applies to the mixture, and a repetition penalty to its
    log-probabilities)."""
    c = jnp.asarray(mixture_coef, jnp.float32)
    return jax.nn.log_softmax(c * ref_logits.astype(jnp.float32) + (1 - c) * policy_logits.astype(jnp.float32), -1)


def sample_pair(model: Model, params: Params, ref_params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array,
                rng: jax.Array, config: SamplingConfig, mixture_coef=None) -> Samples:
    """Two completions per prompt from two models in one decode loop over two caches (TRL's online family): rows
    [0, B) from the policy ``params``; rows [B, 2B) from the reference ``ref_params`` (``mixture_coef`` None: XPO's
    reference completions), or from the geometric mixture of the two (Nash-MD: ``geometric_mixture`` with
    ``mixture_coef``, a number or a traced scalar). Each model runs on the rows that need it: the policy on both blocks
    for Nash-MD, on block 0 for XPO; the reference on block 1. On an accelerator a decode step reads each model's
    weights once whatever its rows, so one loop over both costs less than a loop per completion.

    ``Samples.logprobs`` are each row's own distribution's (the policy's, the reference's, the mixture's), raw.
    ``Samples.experts`` (a MoE model) are the policy's on the rows it runs on (Nash-MD's mixture rows too), -1 on
    XPO's reference rows.
    ``ref_params`` may be the policy's base with ``params`` its LoRA adapters attached: the reference is the policy
    with its adapters off. Jittable as ``sample``."""
    B = prompt_ids.shape[0]
    if mixture_coef is None:
        sources, combine = ((params, 0, 1), (ref_params, 1, 2)), lambda pol, ref: jnp.concatenate([pol, ref])
    else:
        sources = ((params, 0, 2), (ref_params, 1, 2))

        def combine(pol, ref):
            return jnp.concatenate([pol[:B], geometric_mixture(pol[B:], ref, mixture_coef)])
    return _sample(model, sources, combine, prompt_ids, prompt_mask, rng, config)


# --------------------------------------------------------------------------------------------------
# Prompt-length buckets (host side): a fixed set of shapes, so steady-state training never recompiles
# --------------------------------------------------------------------------------------------------


def bucket_length(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``n`` tokens."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"prompt of {n} tokens is longer than the largest bucket {max(buckets)}; "
                     "raise max_prompt_length or add a bucket")


def pad_to_bucket(ids: np.ndarray, mask: np.ndarray, buckets: tuple[int, ...], pad_id: int):
    """Left-pad a left-padded batch to its bucket length (drops all-pad leading columns first)."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    n = int(mask.sum(-1).max())
    L = bucket_length(max(n, 1), buckets)
    out_ids = np.full((ids.shape[0], L), pad_id, np.int32)
    out_mask = np.zeros((ids.shape[0], L), np.int32)
    k = min(L, ids.shape[1])
    out_ids[:, L - k:], out_mask[:, L - k:] = ids[:, ids.shape[1] - k:], mask[:, ids.shape[1] - k:]
    return out_ids, out_mask
