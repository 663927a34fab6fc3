"""The decoder every family shares, as pure functions of ``(model, params, ...)``.

``Model`` (``jodpo.models.model``) is the static architecture; ``params`` is a plain nested dict of arrays. A layer is
a *mixer* (``Model.kinds``: softmax attention, ``jodpo.models.attention_mixer``; Gated DeltaNet,
``jodpo.models.deltanet``) plus an MLP, with norms around both. ``params["layers"]`` holds what every layer has (norms,
MLP) stacked on a leading axis over all layers, and each mixer kind's parameters (``"attn"``, ``"deltanet"``) stacked
over the layers of that kind. The layers run as ``lax.scan``s over ``layer_runs``: a run repeats a period of kinds
(one layer for a uniform model; Qwen3.5's three DeltaNet layers and one attention layer), so one compiled body
serves any depth.

Where families differ inside a mixer or the MLP, a field of ``Model`` says so (``jodpo.models.layers`` reads them):
  GPT-NeoX  LayerNorm with bias, parallel residual, partial rotary, GELU MLP with biases;
  Llama     RMSNorm, sequential residual, full rotary, SwiGLU, grouped-query attention;
  Qwen2     Llama with q/k/v biases;
  Qwen3     Llama with an RMSNorm on each head's queries and keys;
  Gemma 2   (1 + w) RMSNorms in float32, four a layer (post_norms), scaled embeddings, GeGLU, query_pre_attn_scalar,
            local (sliding-window) and global layers, soft-capped attention scores and logits;
  Gemma 3   Gemma 2 with q/k norms instead of soft-capping, and the local layers' own RoPE base;
  Qwen3.5   (1 + w) RMSNorms; Gated DeltaNet layers and gated attention (an output gate, partial RoPE), 3 : 1;
  SmolLM3   Llama with no RoPE on every 4th layer (NoPE);
  OLMo 2    norms after the attention and the MLP (none before), q/k norms over the whole projections;
  OLMo 3    OLMo 2 with three sliding layers to a global one, their own RoPE beside the global layers' YaRN.

The cache is a dict pytree passed in and returned (never a mutable collection):
  state  each layer's mixer state: per kind, stacked over that kind's layers ({"attention": {"k", "v"}, ...}), or,
         with ``per_layer=True`` (the sampler's), a tuple of per-layer states (attention: keys/values by slot
         ``[B, kv_heads, S, head_dim]``; DeltaNet: its convolution window and recurrent state)
  mask   bool[B, S]   which slots hold a real (non-pad) token
  index  i32[]        the next slot to write
Positions always come from the masks (count of real tokens before), so left padding shifts nothing.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models import attention_mixer, deltanet
from jodpo.models.layers import FULL_WINDOW, Context, Site, embed, mlp, norm, rope_tables
from jodpo.models.model import ATTENTIONS, PRECISIONS, Cache, Model, Params, einsum  # noqa: F401 - re-exported

# mixer kind -> its module, and where its parameters sit in params["layers"]
MIXERS = {"attention": attention_mixer, "deltanet": deltanet}
KEYS = {"attention": "attn", "deltanet": "deltanet"}
KIND_OF_KEY = {v: k for k, v in KEYS.items()}
# a weight LoRA can adapt -> the subtree of params["layers"] it sits in
SUBTREES = {w: KEYS[k] for k, m in MIXERS.items() for w in m.WEIGHTS} | {w: "mlp" for w in ("up", "gate", "down")}


def merge_adapters(model: Model, p: Params) -> Params:
    """Layer parameters (stacked ``[N, ...]`` or one layer's) with their LoRA adapters folded in:
    ``W + lora_alpha / lora_rank * a.b`` in float32, the adapters gone. ``p["lora"]`` maps a group (a HF module name)
    to ``{"a": [..., in..., r], "b": {weight: [..., r, out...]}}``; several weights sharing one ``a`` are a fused HF
    module (GPT-NeoX's ``query_key_value``, Qwen3.5's ``in_proj_qkv``, a gated ``q_proj``)."""
    if "lora" not in p:
        return p
    p = dict(p)
    scale = model.lora_alpha / model.lora_rank
    for group in p.pop("lora").values():
        a = group["a"]
        for name, b in group["b"].items():
            sub = SUBTREES[name]
            p[sub] = dict(p[sub])
            w = p[sub][name]
            lead = a.ndim + b.ndim - 2 - w.ndim  # the stacked layer axis, if any
            n_in = a.ndim - 1 - lead
            letters = "abcdefgh"
            L, i, o = letters[:lead], letters[lead:lead + n_in], letters[lead + n_in:lead + n_in + b.ndim - 1 - lead]
            delta = einsum(model, f"{L}{i}r,{L}r{o}->{L}{i}{o}", a.astype(jnp.float32), b.astype(jnp.float32))
            p[sub][name] = w.astype(jnp.float32) + scale * delta
    return p


# --------------------------------------------------------------------------------------------------
# The layer stack: runs of a repeated period of kinds, each a lax.scan
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers ``start .. start + reps * len(period)``: ``period`` (their kinds) repeated ``reps`` times."""

    start: int
    period: tuple[str, ...]
    reps: int

    @property
    def end(self) -> int:
        return self.start + self.reps * len(self.period)


@functools.lru_cache(maxsize=None)
def layer_runs(kinds: tuple[str, ...]) -> tuple[Run, ...]:
    """The layers as few scans as possible, each with a short body: from the first layer on, the period (shortest
    first) that covers the most layers by repeating, then the same for the layers after it. A uniform model is one
    run of one layer; Qwen3.5's 24 layers one run of (deltanet x 3, attention) x 6."""
    runs, start = [], 0
    while start < len(kinds):
        rest, best = kinds[start:], None
        for p in range(1, len(rest) + 1):
            reps = 1
            while rest[reps * p:(reps + 1) * p] == rest[:p] and (reps + 1) * p <= len(rest):
                reps += 1
            if (reps > 1 or p == len(rest)) and (best is None or reps * p > best.reps * len(best.period)):
                best = Run(start, rest[:p], reps)
        runs.append(best)
        start = best.end
    return tuple(runs)


def _leaf_kinds(layers: Params) -> dict:
    """For each subtree of ``params["layers"]``: the kind whose layers it is stacked over (None: every layer). A LoRA
    group follows the weights it adapts."""
    out = {}
    for key, sub in layers.items():
        if key == "lora":
            out[key] = {g: KIND_OF_KEY.get(SUBTREES[next(iter(ad["b"]))]) for g, ad in sub.items()}
        else:
            out[key] = KIND_OF_KEY.get(key)
    return out


def _map_layers(layers: Params, fn) -> Params:
    """``fn(leaf, kind)`` on every leaf of ``params["layers"]``, ``kind`` the one it is stacked over (None: all)."""
    kinds = _leaf_kinds(layers)
    out = {}
    for key, sub in layers.items():
        if key == "lora":
            out[key] = {g: jax.tree.map(lambda x, k=kinds[key][g]: fn(x, k), ad) for g, ad in sub.items()}
        else:
            out[key] = jax.tree.map(lambda x, k=kinds[key]: fn(x, k), sub)
    return out


def _for_kinds(layers: Params, kinds) -> Params:
    """The subtrees of ``params["layers"]`` that layers of these kinds read: what every layer has, their mixers',
    and the LoRA groups of either."""
    which = _leaf_kinds(layers)
    out = {k: v for k, v in layers.items() if k != "lora" and which[k] in (None, *kinds)}
    lora = {g: ad for g, ad in layers.get("lora", {}).items() if which["lora"][g] in (None, *kinds)}
    return out | ({"lora": lora} if lora else {})


def layer_params(model: Model, layers: Params, i: int) -> Params:
    """Layer ``i``'s own parameters out of stacked ``params["layers"]``: what every layer has at ``i``, and its
    mixer's at ``i``'s place among the layers of its kind."""
    kind = model.kinds[i]
    j = model.layers_of(kind).index(i)
    return _map_layers(_for_kinds(layers, (kind,)), lambda x, k: x[i if k is None else j])


def _positions(mask_BL: jax.Array, n_before_B: jax.Array) -> jax.Array:
    """Rotary positions: the count of real tokens before each one (padding repeats its neighbour's)."""
    return n_before_B[:, None] + jnp.maximum(jnp.cumsum(mask_BL, -1, dtype=jnp.int32) - 1, 0)


def sites(model: Model) -> Site:
    """Each layer's ``Site`` as int32 arrays ``[N]``: its attention window in slots (full attention, and the other
    kinds: the largest int) and whether it rotates (1) or not (0, ``Model.nope_layers``)."""
    windows = np.asarray(model.sliding_windows or (0,) * model.num_layers, np.int32)
    rope = np.ones(model.num_layers, np.int32)
    rope[list(model.nope_layers)] = 0
    return Site(np.where(windows > 0, windows, FULL_WINDOW).astype(np.int32), rope)


def _site(all_sites: Site, i) -> Site:
    return Site(*(a[i] for a in all_sites))


def _layer(model: Model, kind: str, p: Params, xs: tuple, site: Site, mix, state=None, j=None):
    """One decoder layer over groups of tokens ``xs`` (a tuple of ``[B_i, L_i, D]``): norm, the mixer
    (``mix(kind, p, normed, site, state, j)`` returns its outputs, one per group, and its updated cache state, in
    the caller's mode), residual, MLP. LoRA adapters are folded into the layer's weights here, one layer at a time
    (inside the scan and its rematerialisation: no merged copy of the model)."""
    p = merge_adapters(model, p)
    pre = (lambda name, x: norm(model, p[name], x)) if model.pre_norms else (lambda name, x: x)  # noqa: E731
    outs, state = mix(kind, p, tuple(pre("ln1", x) for x in xs), site, state, j)
    new = []
    for x, a in zip(xs, outs):
        if model.post_norms:  # Gemma, OLMo 2: the mixer's output is normed before the residual
            a = norm(model, p["post_attn"], a)
        if model.parallel_residual:
            x = x + a + mlp(model, p["mlp"], pre("ln2", x))
        else:
            x = x + a
            out = mlp(model, p["mlp"], pre("ln2", x))
            x = x + (norm(model, p["post_mlp"], out) if model.post_norms else out)
        new.append(x)
    return tuple(new), state


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_POLICIES = ("none",) + tuple(_REMAT_POLICIES)


def _stack(model: Model, params: Params, xs: tuple, mix, states=None, remat: bool = False):
    """``xs`` (a tuple of token groups) through every layer, one ``lax.scan`` per run of ``layer_runs``; with
    ``states`` (the cache's states, per kind stacked over its layers) each mixer reads and writes its layer's, at its
    index among its kind's layers, and the scan carries them (updated in place). ``remat``: each layer
    rematerialised as ``model.remat`` says (the forwards that are differentiated)."""
    all_sites, layers = sites(model), params["layers"]
    for run in layer_runs(model.kinds):
        period, n = run.period, len(run.period)
        occ = [period[:q].count(k) for q, k in enumerate(period)]  # layer q's place among its kind in the period
        lo = {k: model.layers_of(k).index(next(i for i in range(run.start, run.end) if model.kinds[i] == k))
              for k in set(period)}  # the run's first layer of each kind, among that kind's layers

        def take(leaf, kind, run=run, lo=lo, n=n):  # the run's layers, [reps, layers of the kind in a period, ...]
            start, count = (run.start, n) if kind is None else (lo[kind], run.period.count(kind))
            return leaf[start:start + run.reps * count].reshape(run.reps, count, *leaf.shape[1:])

        scanned = (_map_layers(_for_kinds(layers, period), take),
                   Site(*(jnp.asarray(a[run.start:run.end].reshape(run.reps, n)) for a in all_sites)),
                   jnp.arange(run.reps, dtype=jnp.int32))

        def body(carry, scanned, period=period, occ=occ, lo=lo):
            x, states = carry
            p_run, site_run, rep = scanned
            for q, kind in enumerate(period):
                p = _map_layers(_for_kinds(p_run, (kind,)), lambda leaf, k, q=q: leaf[q if k is None else occ[q]])
                j = lo[kind] + rep * period.count(kind) + occ[q]

                def one(x, states, p, site, kind=kind, j=j):
                    x, state = _layer(model, kind, p, x, site, mix, None if states is None else states[kind], j)
                    return x, None if states is None else {**states, kind: state}

                if remat and model.remat != "none":
                    one = jax.checkpoint(one, policy=_REMAT_POLICIES[model.remat], prevent_cse=False)
                x, states = one(x, states, p, _site(site_run, q))
            return (x, states), None

        (xs, states), _ = jax.lax.scan(body, (xs, states), scanned)
    return xs, states


# --------------------------------------------------------------------------------------------------
# The forward passes
# --------------------------------------------------------------------------------------------------


def init_cache(model: Model, batch: int, length: int, dtype=None, per_layer: bool = False) -> Cache:
    """An empty cache of ``length`` slots for ``batch`` rows (``per_layer``: a tuple of per-layer states, to go with
    ``split_layers`` params). Attention layers' keys and values in ``dtype`` (the compute dtype by default); a
    DeltaNet layer's convolution window in it too, its recurrent state in float32."""
    dtype = jnp.dtype(dtype or model.dtype)
    if per_layer:
        state = tuple(MIXERS[k].init_state(model, batch, length, dtype) for k in model.kinds)
    else:
        state = {k: jax.tree.map(lambda a, n=len(model.layers_of(k)): jnp.zeros((n, *a.shape), a.dtype),
                                 MIXERS[k].init_state(model, batch, length, dtype))
                 for k in MIXERS if model.layers_of(k)}
    return {"state": state, "mask": jnp.zeros((batch, length), bool), "index": jnp.zeros((), jnp.int32)}


def hidden_states(model: Model, params: Params, tokens_BL: jax.Array, mask_BL: jax.Array,
                  cache: Cache | None = None, *, empty_cache: bool = False) -> tuple[jax.Array, Cache | None]:
    """Final-normed hidden states ``[B, L, D]`` (compute dtype) and the updated cache.

    ``mask_BL`` marks real tokens (1) and padding (0). With ``cache``, the tokens follow what it holds: attention
    layers write their keys and values at ``cache["index"]`` and attend to every earlier real slot (positions continue
    each row's count), DeltaNet layers continue from their states. ``empty_cache=True`` promises the cache holds
    nothing yet (a prefill): attention then attends among the new tokens with the forward's kernel
    (``Model.attention``) instead of over the whole cache slab.
    """
    B, L = tokens_BL.shape
    mask_BL = mask_BL.astype(bool)
    x = embed(model, params, tokens_BL)
    dist_LL = jnp.arange(L)[:, None] - jnp.arange(L)[None, :]
    split = isinstance(params["layers"], (tuple, list))
    if split != (cache is not None and isinstance(cache["state"], (tuple, list))):
        raise ValueError("split_layers params go with a per-layer cache (init_cache(..., per_layer=True)) and "
                         "stacked params with a stacked cache or none")
    if cache is None:
        ctx = Context(mask=(mask_BL,), dist=(dist_LL,), rope=(rope_tables(model, _positions(mask_BL, jnp.zeros(
            (B,), jnp.int32))),))

        def mix(kind, p, normed, site, state, j):
            return (MIXERS[kind].full(model, p[KEYS[kind]], normed[0], ctx, site),), None

        (x,), _ = _stack(model, params, (x,), mix, remat=True)
        return norm(model, params["final_norm"], x), None

    start = cache["index"]
    kv_mask_BS = jax.lax.dynamic_update_slice(cache["mask"], mask_BL, (0, start))
    S = cache["mask"].shape[1]
    tables = rope_tables(model, _positions(mask_BL, jnp.sum(cache["mask"], -1, dtype=jnp.int32)))
    dist_LS = (start + jnp.arange(L, dtype=jnp.int32))[:, None] - jnp.arange(S, dtype=jnp.int32)[None, :]
    ctx = Context(mask=(mask_BL, kv_mask_BS), dist=(dist_LL, dist_LS), rope=(tables,), start=start, empty=empty_cache)

    def mix(kind, p, normed, site, state, j):
        y, state = MIXERS[kind].cached(model, p[KEYS[kind]], normed[0], state, j, ctx, site)
        return (y,), state

    if split:
        # Unrolled (see split_layers): per-layer weights and cache states, so a decode step slices nothing; each
        # layer's state is updated in place where it lives.
        all_sites, states = sites(model), list(cache["state"])
        for i, p in enumerate(params["layers"]):
            site = Site(*(int(a[i]) for a in all_sites))
            (x,), states[i] = _layer(model, model.kinds[i], p, (x,), site, mix, states[i], None)
        states = tuple(states)
    else:
        (x,), states = _stack(model, params, (x,), mix, states=cache["state"])
    x = norm(model, params["final_norm"], x)
    return x, {"state": states, "mask": kv_mask_BS, "index": start + L}


def prefixed_hidden_states(model: Model, params: Params, prefix_ids_BP: jax.Array, prefix_mask_BP: jax.Array,
                           suffix_ids_NC: jax.Array, suffix_mask_NC: jax.Array) -> jax.Array:
    """``hidden_states`` of ``concatenate([tile(prefix), suffix], 1)``, ``[N, P + C, D]``, computing every
    prefix once instead of once per suffix: N = n x B suffix rows in block layout (row r continues prefix
    ``r % B``). The suffix tokens attend to the prefix's keys and values, or continue its DeltaNet states (shared,
    so their gradients add up); the result equals the plain forward of the concatenated rows up to float rounding.
    Online DPO's two completions of a prompt share its forward this way (policy, reference and reward model)."""
    (B, P), (N, C) = prefix_ids_BP.shape, suffix_ids_NC.shape
    if N % B:
        raise ValueError(f"{N} suffix rows do not continue {B} prefixes in block layout (need a multiple of {B})")

    def tile(a):
        return jnp.concatenate([a] * (N // B), 0)

    pmask, smask = prefix_mask_BP.astype(bool), suffix_mask_NC.astype(bool)
    tables = (rope_tables(model, _positions(pmask, jnp.zeros((B,), jnp.int32))),
              rope_tables(model, _positions(smask, tile(jnp.sum(pmask, -1, dtype=jnp.int32)))))
    slots = jnp.arange(P + C, dtype=jnp.int32)
    ctx = Context(mask=(pmask, jnp.concatenate([tile(pmask), smask], 1)),
                  dist=(slots[:P, None] - slots[None, :P], slots[P:, None] - slots[None, :]), rope=tables)

    def mix(kind, p, normed, site, state, j):  # query slot - key slot, as in the concatenated sequence
        return MIXERS[kind].prefixed(model, p[KEYS[kind]], normed, ctx, site), None

    x = (embed(model, params, prefix_ids_BP), embed(model, params, suffix_ids_NC))
    (h_prefix, h_suffix), _ = _stack(model, params, x, mix, remat=True)
    h_prefix, h_suffix = norm(model, params["final_norm"], h_prefix), norm(model, params["final_norm"], h_suffix)
    return jnp.concatenate([tile(h_prefix), h_suffix], 1)
