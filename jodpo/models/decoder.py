"""The decoder every family shares, as pure functions of ``(model, params, ...)``.

``Model`` (``jodpo.models.model``) is the static architecture; ``params`` is a plain nested dict of arrays. A layer is
a *mixer* (``Model.kinds``: softmax attention, ``jodpo.models.attention_mixer``, or over a sliding window,
``sliding_attention``; Gated DeltaNet, ``jodpo.models.deltanet``; attention of another shape, ``global_attention``;
attention over another layer's keys and values, ``shared_kv``) plus a feed-forward (``Model.ffns``: the dense MLP,
``jodpo.models.mlp``; a mixture of experts, ``jodpo.models.moe``; or both side by side), with norms around both.
``params["layers"]`` holds what every layer has (norms) stacked on a leading axis over all layers, and each mixer or
feed-forward kind's parameters (``"attn"``, ``"deltanet"``, ``"mlp"``, ``"moe"``, ...) stacked over the layers that
have them (``jodpo.models.layout``). The layers run as ``lax.scan``s over ``layer_runs``: a run repeats a period of
layer kinds (one layer for a uniform model; Qwen3.5's three DeltaNet layers and one attention layer), so one compiled
body serves any depth; what differs per
layer without changing shapes (whether it rotates, Gemma 4's per-layer inputs) is scanned with it.

Where families differ inside a mixer or the MLP, a field of ``Model`` says so (``jodpo.models.layers`` reads them):
  GPT-NeoX  LayerNorm with bias, parallel residual, partial rotary, GELU MLP with biases;
  Llama     RMSNorm, sequential residual, full rotary, SwiGLU, grouped-query attention;
  Qwen2     Llama with q/k/v biases;
  Qwen3     Llama with an RMSNorm on each head's queries and keys;
  Gemma 2   (1 + w) RMSNorms in float32, four a layer (Norms.sites), scaled embeddings, GeGLU, query_pre_attn_scalar,
            local (sliding-window) and global layers, soft-capped attention scores and logits;
  Gemma 3   Gemma 2 with q/k norms instead of soft-capping, and the local layers' own RoPE base;
  Qwen3.5   (1 + w) RMSNorms; Gated DeltaNet layers and gated attention (an output gate, partial RoPE), 3 : 1;
  SmolLM3   Llama with no RoPE on every 4th layer (NoPE);
  OLMo 2    norms after the attention and the MLP (none before), q/k norms over the whole projections;
  OLMo 3    OLMo 2 with three sliding layers to a global one, their own RoPE beside the global layers' YaRN;
  Gemma 4   x * w RMSNorms, four a layer, q/k and value norms, scale 1; sliding and global layers of two shapes (mixer
            kinds), values that are the keys, proportional RoPE; per-layer embeddings; KV sharing; layer scalars.

The cache is a dict pytree passed in and returned (never a mutable collection):
  state  each layer's mixer state: per kind, stacked over that kind's layers ({"attention": {"k", "v"}, ...}), or,
         with ``per_layer=True`` (the sampler's), a tuple of per-layer states (attention: keys/values by slot
         ``[B, kv_heads, S, head_dim]``; sliding attention: the same over a ring of the window's slots, slot s at
         s % window; DeltaNet: its convolution window and recurrent state); a KV-sharing layer has none (None): it
         reads its source layer's where it is (``_source``)
  mask   bool[B, S]   which slots hold a real (non-pad) token
  index  i32[]        the next slot to write; or i32[B], each row's own (one token a call, per-layer states: the
                      sampler's refill, whose rows hold completions begun at different steps)
Positions always come from the masks (count of real tokens before), so left padding shifts nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models import mlp, moe
from jodpo.models.layers import Context, Site, embed, norm, per_layer_block, per_layer_inputs, rope_tables
from jodpo.models.layout import (KEYS, KINDS_OF_KEY, MIXERS, SUBTREES, Run, groups,  # noqa: F401 - re-exported
                                 layer_key, layer_params, layer_runs, merge_adapters, period_params, run_params)
from jodpo.models.model import (ATTENTIONS, MLP, PRECISIONS, READS, Cache, Model, Norms,  # noqa: F401 - re-exported
                                Params, Rope, einsum)


def _positions(mask_BL: jax.Array, n_before_B: jax.Array) -> jax.Array:
    """Rotary positions: the count of real tokens before each one (padding repeats its neighbour's)."""
    return n_before_B[:, None] + jnp.maximum(jnp.cumsum(mask_BL, -1, dtype=jnp.int32) - 1, 0)


def sites(model: Model) -> Site:
    """Each layer's ``Site`` as int32 arrays ``[N]``: whether it rotates (1) or not (0, ``Rope.nope_layers``)."""
    rope = np.ones(model.num_layers, np.int32)
    rope[list(model.rope.nope_layers)] = 0
    return Site(rope)


def _each_state(model: Model, states, name: str, *args):
    """``MIXERS[kind].<name>(model, state, *args)`` on the cache states (stacked by kind, or per layer) of the kinds
    that define it (``open_state``, ``close_state``: the sliding kind's room for several new tokens)."""
    def one(kind, state):
        hook = getattr(MIXERS[kind], name, None)
        return state if state is None or hook is None else hook(model, state, *args)

    if isinstance(states, (tuple, list)):
        return tuple(one(k, s) for k, s in zip(model.kinds, states))
    return {k: one(k, s) for k, s in states.items()}


def _source(model: Model, kind: str, j):
    """Whose cache state a layer of ``kind`` (at ``j`` among its kind's layers) reads and writes: its own, or (KV
    sharing) the state of the last layer of the kind it reads (``READS``), at that layer's place among its kind's."""
    if kind not in READS:
        return kind, j
    return READS[kind], len(model.layers_of(READS[kind])) - 1


def _layer(model: Model, kind: str, ffn: str, p: Params, xs: tuple, site: Site, mix, state=None, j=None, extra=None,
           routes=None):
    """One decoder layer over groups of tokens ``xs`` (a tuple of ``[B_i, L_i, D]``): norm, the mixer of ``kind``
    (``mix(kind, p, normed, site, state, j)`` returns its outputs, one per group, and its updated cache state, in
    the caller's mode), residual, the feed-forward of ``ffn`` (``routes``: each group's forced experts
    ``[B_i, L_i, k]`` or None, routing replay in a MoE layer); then Gemma 4's per-layer block (``extra``: each group's
    per-layer inputs) and its layer scalar. Returns the groups, the state and, in a layer with experts, each group's
    ``moe.Routing`` (None otherwise). LoRA adapters are folded into the layer's weights here, one layer at a time
    (inside the scan and its rematerialisation: no merged copy of the model)."""
    p = merge_adapters(model, p)
    pre = (lambda name, x: norm(model, p[name], x)) if model.norms.pre else (lambda name, x: x)  # noqa: E731
    outs, state = mix(kind, p, tuple(pre("ln1", x) for x in xs), site, state, j)
    new, routers = [], []
    for g, (x, a) in enumerate(zip(xs, outs)):
        forced = None if routes is None else routes[g]
        if model.norms.post:  # Gemma, OLMo 2: the mixer's output is normed before the residual
            a = norm(model, p["post_attn"], a)
        if model.parallel_residual:
            out, router = _feed_forward(model, kind, ffn, p, x, forced)
            x = x + a + out
        else:
            x = x + a
            out, router = _feed_forward(model, kind, ffn, p, x, forced)
            x = x + (norm(model, p["post_mlp"], out) if model.norms.post else out)
        routers.append(router)
        if model.per_layer_embeddings is not None:
            x = per_layer_block(model, p, x, extra[g])
        if model.layer_scalar:  # a buffer in transformers: never trained (params.buffers)
            x = x * jax.lax.stop_gradient(p["scalar"]).astype(x.dtype)
        new.append(x)
    return tuple(new), state, (None if ffn == "mlp" else tuple(routers))


def _feed_forward(model: Model, kind: str, ffn: str, p: Params, x_BLD: jax.Array, forced: jax.Array | None = None):
    """A layer's feed-forward (``ffn``, a ``FFN_KINDS``) on its residual stream ``x`` (normed here, where the norms are
    before): the dense MLP (``Model.mlp``: a KV-sharing layer's double-wide one in Gemma 4; no routing), the MoE block
    (``Model.moe``: its output and its ``moe.Routing``; ``forced``: experts replayed, ``moe.block``), or both side by
    side (Gemma 4 26B-A4B, ``moe.beside_mlp``)."""
    h = norm(model, p["ln2"], x_BLD) if model.norms.pre else x_BLD
    if ffn == "mlp":
        return mlp.forward(model, model.mlp, p[mlp.key(model, kind)], h), None
    if ffn == "moe":
        return moe.block(model, p["moe"], h, forced=forced)
    return moe.beside_mlp(model, p["moe"], p[mlp.key(model, kind)], x_BLD, h, forced=forced)


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_POLICIES = ("none",) + tuple(_REMAT_POLICIES)


def _stack(model: Model, params: Params, xs: tuple, mix, states=None, remat: bool = False, extra=None, routes=None):
    """``xs`` (a tuple of token groups) through every layer, one ``lax.scan`` per run of ``layer_runs`` (a repeating
    period of layer kinds: mixer and feed-forward, ``layer_key``), and inside a period one scan per group of
    consecutive layers of one kind (``groups``).
    ``states``: what the mixers read and write, by kind: the cache's states (each kind's stacked over its layers: a
    layer's at its index among them), or in the cache-free forwards KV sharing's slots (``attention_mixer``); the scans
    carry them (updated in place). ``extra``: each group's per-layer inputs ``[N, ...]`` (Gemma 4), scanned with the
    layers. ``remat``: each layer rematerialised as ``model.remat`` says (the forwards that are differentiated).
    ``routes`` (a MoE model, routing replay): each group's forced experts ``[M, B_i, L_i, k]`` over the M layers with
    experts (-1: the token's own choice), or None for a group (or all) that routes itself; scanned with the layers.
    Returns the token groups, the states and, in a MoE model, the ``moe.Routing`` of every layer with experts, per
    group (a tuple of them, ``[M, B_i, L_i, ...]``; None otherwise)."""
    all_sites = sites(model)
    mixers, variants = _scan_kinds(model) if states is None else (model.kinds, {})
    variant = np.array([variants[k].index(own) if k in variants else 0 for k, own in zip(mixers, model.kinds)],
                       np.int32)
    kinds = tuple(layer_key(model, i, k) for i, k in enumerate(mixers))
    experts_at = model.layers_with("moe")
    routers = []
    for run in layer_runs(kinds):
        period, n = run.period, len(run.period)
        lo = {k: len([i for i in model.layers_of(k) if i < run.start]) for k, _ in set(period)}
        per_run = lambda a, run=run, n=n: jnp.asarray(a[run.start:run.end].reshape(run.reps, n, *a.shape[1:]))  # noqa
        # the routes of the layers with experts: those before this run, and in one period of it
        m0, m = sum(i < run.start for i in experts_at), sum(run.start <= i < run.start + n for i in experts_at)
        per_experts = lambda a, m0=m0, m=m, run=run: a[m0:m0 + run.reps * m].reshape(run.reps, m, *a.shape[1:])  # noqa
        scanned = (run_params(model, params["layers"], run), Site(*map(per_run, all_sites)),
                   jnp.arange(run.reps, dtype=jnp.int32), None if extra is None else tuple(map(per_run, extra)),
                   jax.tree.map(per_experts, routes), per_run(variant))

        def body(carry, scanned, run=run, lo=lo):
            x, states = carry
            p_run, site_run, rep, extra_run, routes_run, variant_run = scanned
            period, ys = run.period, []
            kinds_of = tuple(k for k, _ in period)
            for q, (kind, ffn), count in groups(period):
                src, j = _source(model, kind, lo[kind] + rep * kinds_of.count(kind) + kinds_of[:q].count(kind))
                at = sum(f != "mlp" for _, f in period[:q])  # among the period's layers with experts (routes)

                def one(carry, layer, kind=kind, ffn=ffn, src=src):
                    (x, states), (p, site, extra, routes, j, v) = carry, layer
                    if kind in variants:  # a cache-free forward (no states): this layer's own kind's
                        branches = [lambda p, x, site, extra, routes, own=own: _layer(
                            model, own, ffn, p, x, site, mix, None, None, extra, routes) for own in variants[kind]]
                        x, _, router = jax.lax.switch(v, branches, p, x, site, extra, routes)
                        return (x, states), router
                    mine = None if states is None else states.get(src)
                    x, mine, router = _layer(model, kind, ffn, p, x, site, mix, mine, j, extra, routes)
                    return (x, states if states is None or src not in states else {**states, src: mine}), router

                if remat and model.remat != "none":
                    # A scan's body is rematerialised as is; a layer beside others in straight-line code needs its
                    # recomputation kept apart (prevent_cse), or XLA merges it with the forward and saves nothing
                    alone = count == 1 and len(groups(period)) > 1
                    one = jax.checkpoint(one, policy=_REMAT_POLICIES[model.remat], prevent_cse=alone)
                p = period_params(model, p_run, run, q, count)
                forced = None if ffn == "mlp" else jax.tree.map(lambda a, at=at: a[at:at + count], routes_run)
                if count == 1:
                    layer = (p, Site(*(a[q] for a in site_run)),
                             None if extra_run is None else tuple(e[q] for e in extra_run),
                             jax.tree.map(lambda a: a[0], forced), j, variant_run[q])
                    (x, states), y = one((x, states), layer)
                    ys.append(jax.tree.map(lambda a: a[None], y))
                    continue
                # a KV-sharing group's layers all read the one state of their source (_source)
                js = j + (jnp.arange(count, dtype=jnp.int32) if src == kind else jnp.zeros(count, jnp.int32))
                layers = slice(q, q + count)
                layer = (p, Site(*(a[layers] for a in site_run)),
                         None if extra_run is None else tuple(e[layers] for e in extra_run), forced, js,
                         variant_run[layers])
                (x, states), y = jax.lax.scan(one, (x, states), layer)
                ys.append(y)
            ys = [y for y in ys if y is not None]  # the layers with experts' routing
            return (x, states), (jax.tree.map(lambda *a: jnp.concatenate(a), *ys) if ys else None)

        if remat and model.remat != "none" and len(groups(period)) > 1 and run.reps > 1:
            # A period of several groups is rematerialised whole too: the scan over its repetitions then keeps each
            # one's input, not every layer's and what the groups' scans keep, at the cost of its forward once more in
            # the backward. XLA's temporaries of the gradient (8 prompts of 128 tokens, 2 x 64 completions, bf16):
            # Qwen3.5-0.8B 4.3 -> 3.1 GB; Gemma 4 E2B 12.2 -> 5.6 GB
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[model.remat])
        (xs, states), ys = jax.lax.scan(body, (xs, states), scanned)
        if ys is not None:
            routers.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), ys))  # [reps, period, ...] -> layers
    return xs, states, (jax.tree.map(lambda *a: jnp.concatenate(a), *routers) if routers else None)


def _scan_kinds(model: Model) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """The layers' kinds as the cache-free forwards scan them: kinds with the same parameters (``KEYS``: the full and
    the sliding attention) and no other layer's state to read go as one, the first of them (the returned kinds), each
    layer's own forward chosen per layer (the returned variants: representative kind -> its kinds, in order). Gemma 3
    1B's (sliding x 5, full) x 4 + sliding x 2 is then one scan of 26 layers: two scans' weight gradients stitched
    back into one stack held one more copy of them (XLA's temporaries of the gradient 6.5 -> 3.6 GB)."""
    rep, variants = {}, {}
    for kind in dict.fromkeys(model.kinds):
        first = rep.setdefault(KEYS[kind] if kind not in READS and kind not in model.wide_kinds else kind, kind)
        variants[first] = variants.get(first, ()) + (kind,)
    kinds = tuple(rep[KEYS[k] if k not in READS and k not in model.wide_kinds else k] for k in model.kinds)
    return kinds, {k: v for k, v in variants.items() if len(v) > 1}


def _shared_slots(model: Model, xs: tuple):
    """KV sharing's slots for the cache-free forwards over token groups ``xs``: for each kind another kind reads, its
    last layer's keys and values so far, per group (None: a model without KV sharing)."""
    sources = dict.fromkeys(READS[k] for k in model.kinds if k in READS)
    if not sources:
        return None
    slots = {s: tuple(MIXERS[s].empty_kv(model, x.shape[0], x.shape[1], x.dtype) for x in xs) for s in sources}
    return {s: v[0] if len(xs) == 1 else v for s, v in slots.items()}


def _embed(model: Model, params: Params, tokens_BL: jax.Array):
    """The tokens' embeddings and, for Gemma 4, their per-layer inputs (None otherwise)."""
    x = embed(model, params, tokens_BL)
    return x, (None if model.per_layer_embeddings is None else per_layer_inputs(model, params, tokens_BL, x))


# --------------------------------------------------------------------------------------------------
# The forward passes
# --------------------------------------------------------------------------------------------------


def init_cache(model: Model, batch: int, length: int, dtype=None, per_layer: bool = False) -> Cache:
    """An empty cache of ``length`` slots for ``batch`` rows (``per_layer``: a tuple of per-layer states, to go with
    ``split_layers`` params). Attention layers' keys and values in ``dtype`` (the compute dtype by default); a
    DeltaNet layer's convolution window in it too, its recurrent state in float32. A layer that reads another's keys
    and values (KV sharing) keeps no state of its own (None)."""
    dtype = jnp.dtype(dtype or model.dtype)
    if per_layer:
        state = tuple(MIXERS[k].init_state(model, batch, length, dtype) for k in model.kinds)
    else:
        state = {k: jax.tree.map(lambda a, n=len(model.layers_of(k)): jnp.zeros((n, *a.shape), a.dtype),
                                 MIXERS[k].init_state(model, batch, length, dtype))
                 for k in MIXERS if model.layers_of(k) and k not in READS}
    return {"state": state, "mask": jnp.zeros((batch, length), bool), "index": jnp.zeros((), jnp.int32)}


def split_cache(model: Model, cache: Cache) -> Cache:
    """A stacked cache (``init_cache(...)``, filled by a scanned prefill) as per-layer states, to go on with
    ``split_layers`` params (an unrolled decode): each layer's state out of its kind's stack (one copy), None for a
    layer that reads another's keys and values."""
    def mine(i, kind):
        if kind in READS:
            return None
        j = model.layers_of(kind).index(i)
        return jax.tree.map(lambda a: a[j], cache["state"][kind])

    return {**cache, "state": tuple(mine(i, k) for i, k in enumerate(model.kinds))}


def hidden_states(model: Model, params: Params, tokens_BL: jax.Array, mask_BL: jax.Array,
                  cache: Cache | None = None, *, empty_cache: bool = False, with_router: bool = False,
                  routes: jax.Array | None = None):
    """Final-normed hidden states ``[B, L, D]`` (compute dtype) and the updated cache; ``with_router`` (a MoE model):
    a third output, the ``moe.Routing`` of the tokens in each of the M layers with experts (router logits
    ``[M, B, L, E]``, for ``moe.load_balancing_loss``; the experts each chose ``[M, B, L, k]``). ``routes`` (a MoE
    model, without a cache: routing replay): i32[M, B, L, k] the experts each token takes in each of those layers
    instead of its router's choice, where >= 0 (-1: its own choice; ``moe.route``).

    ``mask_BL`` marks real tokens (1) and padding (0). With ``cache``, the tokens follow what it holds: attention
    layers write their keys and values at ``cache["index"]`` and attend to every earlier real slot (positions continue
    each row's count), DeltaNet layers continue from their states. ``empty_cache=True`` promises the cache holds
    nothing yet (a prefill): attention then attends among the new tokens with the forward's kernel
    (``Model.attention``) instead of over the whole cache slab.
    """
    B, L = tokens_BL.shape
    mask_BL = mask_BL.astype(bool)
    x, extra = _embed(model, params, tokens_BL)
    extra = None if extra is None else (extra,)
    dist_LL = jnp.arange(L)[:, None] - jnp.arange(L)[None, :]
    split = isinstance(params["layers"], (tuple, list))
    if split != (cache is not None and isinstance(cache["state"], (tuple, list))):
        raise ValueError("split_layers params go with a per-layer cache (init_cache(..., per_layer=True)) and "
                         "stacked params with a stacked cache or none")
    if cache is None:
        pos = _positions(mask_BL, jnp.zeros((B,), jnp.int32))
        ctx = Context(mask=(mask_BL,), dist=(dist_LL,), rope=(rope_tables(model.rope, pos),), positions=(pos,))

        def mix(kind, p, normed, site, kv, j):
            y, kv = MIXERS[kind].full(model, p[KEYS[kind]], normed[0], ctx, site, kv)
            return (y,), kv

        (x,), _, routers = _stack(model, params, (x,), mix, _shared_slots(model, (x,)), remat=True, extra=extra,
                                  routes=None if routes is None else (routes,))
        h = norm(model, params["final_norm"], x)
        return (h, None, routers[0]) if with_router else (h, None)
    if routes is not None:
        raise ValueError("routes replay experts in the cache-free forwards (training); a cached forward routes itself")

    start = cache["index"]
    S = cache["mask"].shape[1]
    if jnp.ndim(start) == 1:  # each row at its own slot (the sampler's refill): one token, written row by row
        if L != 1 or not split:
            raise ValueError("a cache with an index per row takes one token at a time, with per-layer states")
        kv_mask_BS = cache["mask"].at[jnp.arange(B), start].set(mask_BL[:, 0], mode="drop")
        dist_LS = start[:, None, None] - jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [B, 1, S]
    else:
        kv_mask_BS = jax.lax.dynamic_update_slice(cache["mask"], mask_BL, (0, start))
        dist_LS = (start + jnp.arange(L, dtype=jnp.int32))[:, None] - jnp.arange(S, dtype=jnp.int32)[None, :]
    pos = _positions(mask_BL, jnp.sum(cache["mask"], -1, dtype=jnp.int32))
    ctx = Context(mask=(mask_BL, kv_mask_BS), dist=(dist_LL, dist_LS), rope=(rope_tables(model.rope, pos),),
                  start=start, empty=empty_cache, positions=(pos,))

    def mix(kind, p, normed, site, state, j):
        y, state = MIXERS[kind].cached(model, p[KEYS[kind]], normed[0], state, j, ctx, site)
        return (y,), state

    # Several new tokens: the kinds that keep them apart until every layer has read them (the sliding kind's ring:
    # its KV-sharing readers attend to all of them) make room first and put them in place after
    states = _each_state(model, cache["state"], "open_state", L) if L > 1 else cache["state"]
    if split:
        # Unrolled (see split_layers): per-layer weights and cache states, so a decode step slices nothing; each
        # layer's state is updated in place where it lives (a KV-sharing layer's: its source's, read in place).
        all_sites, states, routers = sites(model), list(states), []
        for i, p in enumerate(params["layers"]):
            kind = model.kinds[i]
            src = i if kind not in READS else model.layers_of(READS[kind])[-1]
            site = Site(*(int(a[i]) for a in all_sites))
            (x,), states[src], router = _layer(model, kind, model.ffns[i], p, (x,), site, mix, states[src], None,
                                               None if extra is None else (extra[0][i],))
            routers += [] if router is None else [router[0]]
        states = tuple(states)
        routing = jax.tree.map(lambda *a: jnp.stack(a), *routers) if routers else None
    else:
        (x,), states, routers = _stack(model, params, (x,), mix, states=states, extra=extra)
        routing = None if routers is None else routers[0]
    if L > 1:
        states = _each_state(model, states, "close_state", ctx)
    x = norm(model, params["final_norm"], x)
    cache = {"state": states, "mask": kv_mask_BS, "index": start + L}
    return (x, cache, routing) if with_router else (x, cache)


def prefixed_hidden_states(model: Model, params: Params, prefix_ids_BP: jax.Array, prefix_mask_BP: jax.Array,
                           suffix_ids_NC: jax.Array, suffix_mask_NC: jax.Array, *, with_router: bool = False,
                           routes: jax.Array | None = None):
    """``hidden_states`` of ``concatenate([tile(prefix), suffix], 1)``, ``[N, P + C, D]``, computing every
    prefix once instead of once per suffix: N = n x B suffix rows in block layout (row r continues prefix
    ``r % B``). The suffix tokens attend to the prefix's keys and values, or continue its DeltaNet states (shared,
    so their gradients add up); the result equals the plain forward of the concatenated rows up to float rounding.
    Online DPO's two completions of a prompt share its forward this way (policy, reference and reward model).
    ``with_router`` (a MoE model): also the ``moe.Routing`` of those rows in each layer with experts (``[M, N, P + C,
    ...]``). ``routes`` (routing replay): the suffix tokens' forced experts, i32[M, N, C, k] (``hidden_states``); the
    prefix routes itself."""
    (B, P), (N, C) = prefix_ids_BP.shape, suffix_ids_NC.shape
    if N % B:
        raise ValueError(f"{N} suffix rows do not continue {B} prefixes in block layout (need a multiple of {B})")

    def tile(a):
        return jnp.concatenate([a] * (N // B), 0)

    pmask, smask = prefix_mask_BP.astype(bool), suffix_mask_NC.astype(bool)
    pos = (_positions(pmask, jnp.zeros((B,), jnp.int32)), _positions(smask, tile(jnp.sum(pmask, -1, dtype=jnp.int32))))
    slots = jnp.arange(P + C, dtype=jnp.int32)
    ctx = Context(mask=(pmask, jnp.concatenate([tile(pmask), smask], 1)),
                  dist=(slots[:P, None] - slots[None, :P], slots[P:, None] - slots[None, :]),
                  rope=tuple(rope_tables(model.rope, p) for p in pos), positions=pos)

    def mix(kind, p, normed, site, kv, j):  # query slot - key slot, as in the concatenated sequence
        return MIXERS[kind].prefixed(model, p[KEYS[kind]], normed, ctx, site, kv)

    (xp, ep), (xs, es) = _embed(model, params, prefix_ids_BP), _embed(model, params, suffix_ids_NC)
    x = (xp, xs)
    (h_prefix, h_suffix), _, routers = _stack(model, params, x, mix, _shared_slots(model, x), remat=True,
                                              extra=None if ep is None else (ep, es),
                                              routes=None if routes is None else (None, routes))
    h_prefix, h_suffix = norm(model, params["final_norm"], h_prefix), norm(model, params["final_norm"], h_suffix)
    h = jnp.concatenate([tile(h_prefix), h_suffix], 1)
    if not with_router:
        return h
    # the routing of the concatenated rows, as a plain forward of them has it: [M, N, P + C, ...]
    return h, jax.tree.map(lambda p, s: jnp.concatenate([jnp.concatenate([p] * (N // B), 1), s], 2), *routers)
