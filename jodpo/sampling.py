"""Sampling: one prefill over the prompt, then decoding over a KV cache in ``lax.scan`` chunks; from the policy
(``sample``), or from two models at once (``sample_pair``: TRL's online family, a reference's or a geometric
mixture's completions beside the policy's).

The decode loop is a ``while_loop`` over chunks of ``SamplingConfig.chunk`` steps, each a ``lax.scan`` of
branch-free steps (run the model on the last token, choose the next); between chunks it stops as soon as every row
has produced an EOS (TL;DR completions often end early) or the budget is spent. Everything after a row's first EOS
is padding. With ``SamplingConfig.slots`` below the call's prompts, the prompts are a queue: between chunks, the
rows whose completions have ended take the next prompts (refill), so a row does not idle until the longest of a
fixed batch ends. Each completion draws from keys of its own (prompt, sample) pair, so it is the same token for token
whatever the slots, the row it ran in and when.

The settings and one step's filters and draw are ``jodpo.filtering``'s (``SamplingConfig``, ``choose``).
"""
from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jodpo.filtering import SamplingConfig, choose, process_logits  # noqa: F401 (re-exported)
from jodpo.models.decoder import Cache, Model, Params, hidden_states, init_cache, split_cache
from jodpo.models.params import compute_params, decode_params, split_layers
from jodpo.models.heads import lm_head


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
    # i32[B]: the decode steps of the loop that sampled the row, each over all its rows in flight (the same for every
    # row of a call; per row so that the rows can be reordered, split and sharded as the others): ``slot_utilization``
    decode_steps: jax.Array | None = None


def slot_utilization(samples: Samples, rows_in_flight: int) -> jax.Array:
    """f32[]: the real tokens the decode steps of one sampler call produced (``samples``, of any leading shape) over
    the row-steps they ran (``rows_in_flight`` rows each: ``num_samples`` times ``SamplingConfig.slots``, or times the
    prompts): 1 when no row ever idles. Token 0 of each completion comes from its prefill, not a decode step."""
    made = jnp.sum(samples.mask) - jnp.sum(samples.mask[..., 0])
    return made / jnp.maximum(jnp.max(samples.decode_steps) * rows_in_flight, 1)


# --------------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------------


def completion_keys(rng: jax.Array, prompts_S: jax.Array, samples: int) -> jax.Array:
    """Each row's key, in block layout over ``samples`` blocks of the prompts ``prompts_S`` (indices into the call's
    prompts): completion j of prompt i draws from ``fold_in(fold_in(rng, i), j)``, whatever row it runs in and
    whenever (``SamplingConfig.slots``), and its token t from ``fold_in`` of that with t (``token_keys``)."""
    of_prompt = jax.vmap(jax.random.fold_in, (None, 0))(rng, prompts_S)
    return jnp.concatenate([jax.vmap(jax.random.fold_in, (0, None))(of_prompt, j) for j in range(samples)])


def token_keys(keys_N: jax.Array, t_N: jax.Array) -> jax.Array:
    """The keys of token ``t_N[r]`` of each row's completion (``completion_keys``)."""
    return jax.vmap(jax.random.fold_in)(keys_N, t_N)


@flax.struct.dataclass
class _State:
    """The decode loop's rows: ``SamplingConfig.slots`` prompts in flight (all the call's by default), each with its
    n completions, in block layout (row j * S + s: completion j of the prompt in slot s)."""

    step: jax.Array  # i32[]: decode steps run
    pos: jax.Array  # i32[N]: tokens each row has chosen of its completion (the next one chosen is token ``pos``)
    keys: jax.Array  # each row's completion's key (``completion_keys``)
    token: jax.Array  # i32[N]: the last token chosen, which the next decode step runs the models on
    alive: jax.Array  # bool[N]: whether that token is a real one (its row had not ended before it)
    caches: tuple[Cache, ...]  # one per model that decodes (``_Decoder``), over its rows
    seen: jax.Array | None  # bool[N, V] tokens seen (repetition penalty only)
    done: jax.Array  # bool[N]: row has produced an EOS or its ``max_new_tokens``
    rows: Samples  # the rows' completions so far, [N, T]
    item: jax.Array | None = None  # i32[S] (refill): the prompt in each slot, -1 for none
    next: jax.Array | None = None  # i32[] (refill): the next prompt of the queue
    out: Samples | None = None  # (refill) the finished completions, [nB, T], block layout over the call's prompts
    stash: tuple | None = None  # (refill) per model, the next S prompts' prefill: (cache of P slots, first logits)
    stash_first: jax.Array | None = None  # i32[] (refill): the first of them


def _choose_next(cfg: SamplingConfig, logits_NV: jax.Array, seen, done, keys, pos):
    """Token ``pos`` of each row from its logits: the token (pad where the row had ended), its raw log-prob (0 there),
    whether it is real, and the rows' ``done`` and ``seen`` after it."""
    token, logp = choose(logits_NV, seen, token_keys(keys, pos), cfg)
    alive = ~done
    token = jnp.where(alive, token, cfg.pad_token_id)
    ended = jnp.isin(token, jnp.asarray(cfg.eos_token_ids or (-1,), jnp.int32)) | (pos + 1 >= cfg.max_new_tokens)
    if seen is not None:
        seen = seen | (jax.nn.one_hot(token, seen.shape[-1], dtype=bool) & alive[:, None])
    return token, jnp.where(alive, logp, 0.0), alive, done | (ended & alive), seen


def _record(rows: Samples, at_N: jax.Array, pos_N: jax.Array, token, logp, alive) -> Samples:
    """``rows`` with each real token at its row ``at_N`` and column ``pos_N`` (the others: nothing written)."""
    col = jnp.where(alive, pos_N, rows.tokens.shape[1])  # out of range: dropped
    put = lambda buf, v: buf.at[at_N, col].set(v.astype(buf.dtype), mode="drop")  # noqa: E731
    return rows.replace(tokens=put(rows.tokens, token), mask=put(rows.mask, alive), logprobs=put(rows.logprobs, logp))


def _emit(cfg: SamplingConfig, state: _State, logits_NV: jax.Array) -> _State:
    """Choose and record every row's next token from its logits."""
    token, logp, alive, done, seen = _choose_next(cfg, logits_NV, state.seen, state.done, state.keys, state.pos)
    rows = _record(state.rows, jnp.arange(token.shape[0]), state.pos, token, logp, alive)
    return state.replace(pos=state.pos + 1, token=token, alive=alive, seen=seen, done=done, rows=rows)


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
    """One model of a decode loop: its parameters (``params`` as the prefill reads them, ``decode`` as the decode
    steps do) and the rows it runs on, whole blocks of the rows (``first`` to ``end``, in units of the prompts in
    flight: block j is completion j of every one)."""

    params: Params
    decode: Params
    first: int
    end: int


def _decode_step(model: Model, decoders: tuple[_Decoder, ...], combine, cfg: SamplingConfig, state: _State) -> _State:
    """One decode step, straight-line (no branch: on a GPU every ``lax.cond`` waits for its predicate to reach the
    host, and the kernels behind it then start only after it): run each model on the last token of its rows (a row
    that has ended runs on padding, unseen by any real token), combine their logits into each row's, choose the
    next. A MoE policy (the first model) records the experts it chose for that token (``Samples.experts``)."""
    S = state.token.shape[0] // max(d.end for d in decoders)
    logits, caches, rows = [], [], state.rows
    for i, (d, cache) in enumerate(zip(decoders, state.caches)):
        block = slice(d.first * S, d.end * S)
        with_experts = i == 0 and rows.experts is not None
        out = decode_step(model, d.decode, cache, state.token[block], state.alive[block], with_experts)
        if with_experts:  # for each row's token pos - 1 (the one just run)
            at = jnp.arange(d.first * S, d.end * S)
            col = jnp.where(state.alive[block], state.pos[block] - 1, rows.experts.shape[1])
            rows = rows.replace(experts=rows.experts.at[at, col].set(out[2], mode="drop"))
        logits.append(out[0])
        caches.append(out[1])
    return _emit(cfg, state.replace(step=state.step + 1, caches=tuple(caches), rows=rows), combine(*logits))


def _prefill(model: Model, d: _Decoder, prompt_ids: jax.Array, prompt_mask: jax.Array, length: int):
    """One model's prefill over prompts, through the decoder's scans over its layers (one compiled body per repeating
    period of layers, whatever the depth), its cache of ``length`` slots then split per layer for the unrolled decode
    steps (which slice no weights and no cache state, step after step), and the logits of token 0."""
    h, cache = hidden_states(model, d.params, prompt_ids, prompt_mask, init_cache(model, prompt_ids.shape[0], length),
                             empty_cache=True)
    return split_cache(model, cache), lm_head(model, d.params, h[:, -1])


def _tiled(d: _Decoder, cache: Cache, logits: jax.Array):
    """A prefill's cache and logits copied for the model's blocks of rows (one prefill a prompt, not a completion)."""
    if d.end - d.first == 1:
        return cache, logits
    tile = lambda x: jnp.concatenate([x] * (d.end - d.first), 0)  # noqa: E731
    return {"state": jax.tree.map(tile, cache["state"]), "mask": tile(cache["mask"]), "index": cache["index"]}, \
        tile(logits)


def _empty_rows(model: Model, N: int, T: int) -> Samples:
    experts = None if model.moe is None else jnp.full((N, T, len(model.layers_with("moe")), model.moe.top_k), -1,
                                                      jnp.int32)
    zeros = lambda dt: jnp.zeros((N, T), dt)  # noqa: E731
    return Samples(tokens=zeros(jnp.int32), mask=zeros(jnp.int32), logprobs=zeros(jnp.float32), experts=experts)


def _seen(model: Model, prompt_ids, prompt_mask, n: int):
    hit = jax.nn.one_hot(prompt_ids, model.vocab_size, dtype=bool) & prompt_mask.astype(bool)[..., None]
    return jnp.concatenate([jnp.any(hit, axis=1)] * n, 0)


def _refill(model: Model, decoders, combine, cfg: SamplingConfig, rng, first_prompt, B: int, prompt_ids, prompt_mask,
            n: int, state: _State) -> _State:
    """Between decode chunks: the slots whose completions have all ended hand them out (``state.out``, at their
    prompt's rows), then every free slot takes the next prompt of the queue: its cache and first logits from the
    stash (the prompts prefilled S at a time, as a fixed batch of S prompts is: ``_restash``) into the slot's rows,
    which start again at slot P (the caches' index is per row), their state reset, token 0 chosen. ``prompt_ids``,
    ``prompt_mask``: the queue of B prompts in whole batches of S (``_restash``)."""
    P = prompt_ids.shape[1]
    S, T = state.item.shape[0], cfg.max_new_tokens
    ended = jnp.all(state.done.reshape(n, S), 0) & (state.item >= 0)
    at = jnp.concatenate([jnp.where(ended, j * B + state.item, n * B) for j in range(n)])  # out of range: dropped
    out = jax.tree.map(lambda out, rows: out.at[at].set(rows, mode="drop"), state.out, state.rows)
    item = jnp.where(ended, -1, state.item)
    free = item < 0
    take = free & (state.next + jnp.cumsum(free) - 1 < B)
    count = jnp.sum(take, dtype=jnp.int32)
    order = jnp.argsort(~take, stable=True)  # the slots that take a prompt, first, in order
    fresh = _empty_rows(model, n, T)

    def fill(i, st):
        slot, prompt = order[i], st.next + i
        st = jax.lax.cond(prompt >= st.stash_first + S, functools.partial(_restash, model, decoders, prompt_ids,
                                                                          prompt_mask, prompt), lambda st: st, st)
        e, rows = prompt - st.stash_first, jnp.arange(n) * S + slot
        caches, logits = [], []
        for d, big, (cache, first) in zip(decoders, st.caches, st.stash):
            mine = jnp.arange(d.end - d.first) * S + slot  # the slot's rows in this model's cache (its blocks')

            def put(whole, part, mine=mine):  # the prompt's P slots first in its rows' P + T (the rest masked)
                row = part[e]
                row = jnp.pad(row, [(0, w - r) for w, r in zip(whole.shape[1:], row.shape)])
                return whole.at[mine].set(row.astype(whole.dtype))

            caches.append({"state": jax.tree.map(put, big["state"], cache["state"]), "mask": put(big["mask"],
                                                                                              cache["mask"]),
                           "index": big["index"].at[mine].set(P)})
            logits.append(jnp.repeat(first[e][None], d.end - d.first, 0))
        keys = completion_keys(rng, first_prompt + prompt[None], n)
        seen = None
        if st.seen is not None:
            seen = _seen(model, jax.lax.dynamic_slice_in_dim(prompt_ids, prompt, 1),
                         jax.lax.dynamic_slice_in_dim(prompt_mask, prompt, 1), n)
        zero = jnp.zeros((n,), jnp.int32)
        token, logp, alive, done, seen = _choose_next(cfg, combine(*logits), seen, jnp.zeros((n,), bool), keys, zero)
        all_rows = jax.tree.map(lambda b, f: b.at[rows].set(f), st.rows, fresh)
        return st.replace(caches=tuple(caches), rows=_record(all_rows, rows, zero, token, logp, alive),
                          keys=st.keys.at[rows].set(keys), pos=st.pos.at[rows].set(1),
                          token=st.token.at[rows].set(token), alive=st.alive.at[rows].set(alive),
                          done=st.done.at[rows].set(done), seen=None if seen is None else st.seen.at[rows].set(seen))

    state = state.replace(out=out, item=jnp.where(take, state.next + jnp.cumsum(take) - 1, item))
    state = jax.lax.fori_loop(0, count, fill, state)
    return state.replace(next=state.next + count)


def _restash(model: Model, decoders, prompt_ids, prompt_mask, first, state: _State) -> _State:
    """The stash: prompts ``first`` to ``first + S`` (S the slots) prefilled together through each model, their caches
    of P slots and their first logits, ready for the slots that free. ``prompt_ids`` holds whole batches of S (the
    queue's last rows repeated: ``_sample``), so the prompts go through the model in the batches, and so with the
    rounding, a fixed-batch sampler of S prompts has."""
    S, P = state.item.shape[0], prompt_ids.shape[1]
    ids, mask = (jax.lax.dynamic_slice_in_dim(x, first, S) for x in (prompt_ids, prompt_mask))
    return state.replace(stash=tuple(_prefill(model, d, ids, mask, P) for d in decoders), stash_first=first)


def _sample(model: Model, sources: tuple[tuple[Params, int, int], ...], combine, prompt_ids: jax.Array,
            prompt_mask: jax.Array, rng: jax.Array, config: SamplingConfig, first_prompt=0) -> Samples:
    """The decode loop behind ``sample`` and ``sample_pair``: ``sources`` are ``(params, first, end)``, a model and
    the blocks of rows it runs on (``_Decoder``); ``combine(*logits)`` makes the rows' logits f32[nS, V] out of the
    models' (in the order of ``sources``), n = the largest ``end``, S the prompts in flight; the prompts draw as
    those from ``first_prompt`` on of a longer queue (``completion_keys``)."""
    B, P = prompt_ids.shape
    T, n = config.max_new_tokens, max(end for _, _, end in sources)
    S = min(config.slots or B, B)
    decoders = tuple(_Decoder(params, sampler_params(model, params), first, end) for params, first, end in sources)
    first_ids, first_mask = prompt_ids[:S], prompt_mask[:S]
    caches, first_logits = zip(*(_tiled(d, *_prefill(model, d, first_ids, first_mask, P + T)) for d in decoders))
    seen = None if config.repetition_penalty == 1.0 else _seen(model, first_ids, first_mask, n)
    state = _State(step=jnp.zeros((), jnp.int32), pos=jnp.zeros((n * S,), jnp.int32),
                   keys=completion_keys(rng, first_prompt + jnp.arange(S), n), token=jnp.zeros((n * S,), jnp.int32),
                   alive=jnp.zeros((n * S,), bool), caches=tuple(caches), seen=seen, done=jnp.zeros((n * S,), bool),
                   rows=_empty_rows(model, n * S, T))
    state = _emit(config, state, combine(*first_logits))  # token 0, from the prefills' logits

    def chunk(state):
        return jax.lax.scan(lambda s, _: (_decode_step(model, decoders, combine, config, s), None), state, None,
                            length=config.chunk, unroll=config.unroll)[0]

    # Tokens 1 .. T-1, ``chunk`` decode steps at a time, until every row has ended. Only this loop's predicate is
    # read between chunks; a scan's trip count is known, so its steps run without a check. A row that ends inside a
    # chunk runs on padding to its end: it records nothing more.
    if S == B:
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), chunk, state)
        rows = state.rows
    else:  # S prompts in flight; between chunks, the slots whose completions have ended take the next prompts
        whole = -B % S  # the queue in whole batches of S (its last prompt repeated), as the stash prefills it
        queue = [jnp.concatenate([x, jnp.repeat(x[-1:], whole, 0)]) for x in (prompt_ids, prompt_mask)]
        refill = functools.partial(_refill, model, decoders, combine, config, rng, first_prompt, B, *queue, n)
        per_row = tuple({**c, "index": jnp.full((c["mask"].shape[0],), c["index"], jnp.int32)} for c in state.caches)
        state = state.replace(item=jnp.arange(S, dtype=jnp.int32), next=jnp.int32(S),
                              out=_empty_rows(model, n * B, T), caches=per_row)
        state = _restash(model, decoders, queue[0], queue[1], S, state)
        state = jax.lax.while_loop(lambda s: ~jnp.all(s.done) | (s.next < B), lambda s: refill(chunk(s)),
                                   refill(state))
        rows = state.out
    pad = jnp.int32(config.pad_token_id)
    experts = rows.experts
    if experts is not None:  # a token's experts where the next token is real: those the loss's log-probs read
        follows = jnp.pad(rows.mask[:, 1:], ((0, 0), (0, 1))) > 0
        experts = jnp.where(follows[:, :, None, None], experts, -1)
    return Samples(tokens=jnp.where(rows.mask > 0, rows.tokens, pad), mask=rows.mask, logprobs=rows.logprobs,
                   experts=experts, decode_steps=jnp.full(rows.mask.shape[:1], state.step))


def sample(model: Model, params: Params, prompt_ids: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
           config: SamplingConfig, num_samples: int = 1, first_prompt=0) -> Samples:
    """Sample ``config.max_new_tokens`` tokens after left-padded prompts.

    Args:
      model, params: a causal LM from ``jodpo.load_model``.
      prompt_ids, prompt_mask: i32[B, P], left-padded (every row ends with a real token).
      rng: a PRNG key; completion j of prompt i draws its token t from ``fold_in(fold_in(fold_in(rng, i), j), t)``
        (``completion_keys``, ``token_keys``), so a result is reproducible and does not depend on ``config.slots``.
      config: a ``SamplingConfig`` (static).
      num_samples: completions per prompt (static). The prompts are run through the model once and their
        cache copied (one prefill instead of n); rows come in block layout: every prompt for sample 0, then every
        prompt for sample 1, ... (row j * B + i: completion j of prompt i, drawn from its keys).
      first_prompt: the index of the first prompt in a longer queue these prompts are part of (an int or a traced
        scalar): they then draw as they would there, so a queue sampled in several calls gives what one call gives.
    Returns:
      ``Samples`` with ``tokens``, ``mask`` and ``logprobs`` of shape [num_samples * B, max_new_tokens]; a MoE
      model's also with ``experts`` [num_samples * B, max_new_tokens, layers, k]; ``decode_steps``.
    Jittable (``model`` and ``config`` static); works on sharded params and batches.
    """
    return _sample(model, ((params, 0, num_samples),), lambda logits: logits, prompt_ids, prompt_mask, rng, config,
                   first_prompt)


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
    if mixture_coef is None:
        sources, combine = ((params, 0, 1), (ref_params, 1, 2)), lambda pol, ref: jnp.concatenate([pol, ref])
    else:
        sources = ((params, 0, 2), (ref_params, 1, 2))

        def combine(pol, ref):  # pol: both blocks' rows, ref: block 1's (the rows in flight, or one slot's)
            b = ref.shape[0]
            return jnp.concatenate([pol[:b], geometric_mixture(pol[b:], ref, mixture_coef)])
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
