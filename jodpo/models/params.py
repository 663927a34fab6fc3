"""The parameters of ``jodpo.models.decoder``'s decoder: their shapes and logical axis names in one table
(``param_specs``, the one source of shapes, read by loading, export and sharding), random initialisation, and
the per-call transforms the sampler applies (``compute_params``, ``split_layers``), and the frozen models' form
(``frozen_params``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodpo.models import mlp, moe
from jodpo.models.decoder import KEYS, KINDS_OF_KEY, MIXERS, Model, Params, layer_params, merge_adapters
from jodpo.models.layout import subtree_layers


# --------------------------------------------------------------------------------------------------
# Parameters: shapes and logical axis names in one table.
# --------------------------------------------------------------------------------------------------


def param_specs(model: Model) -> dict:
    """Nested dict of ``(shape, logical_axes)`` mirroring ``params``; the one source of shapes. What every layer has
    is stacked over all N layers; each mixer kind's parameters (``decoder.KEYS``) over the layers of that kind (or
    kinds: ``"attn"``, the full and sliding attention layers'); the feed-forwards' over the layers that have them
    (``layout.subtree_layers``)."""
    D, N, V = model.hidden_size, model.num_layers, model.vocab_size

    def norm():
        p = {"scale": ((N, D), ("layers", "embed"))}
        if model.norms.kind == "layernorm":
            p["bias"] = ((N, D), ("layers", "embed"))
        return p

    final = {k: (shape[1:], axes[1:]) for k, (shape, axes) in norm().items()}
    layers = {"ln1": norm(), "ln2": norm()} if model.norms.pre else {}
    layers |= {key: MIXERS[kinds[0]].specs(model, len(model.layers_of(*kinds)))
               for key, kinds in KINDS_OF_KEY.items() if model.layers_of(*kinds)}
    m = model.mlp
    if m is not None:  # the dense MLP (jodpo.models.mlp); Gemma 4's KV-sharing layers' twice as wide (mlp_wide)
        layers |= {key: mlp.specs(m, D, n, width) for key, width in (("mlp", m.width), ("mlp_wide", 2 * m.width))
                   if (n := len(subtree_layers(model, key)))}
    if model.layers_with("moe"):  # the experts, in place of the dense MLP or beside it (jodpo.models.moe)
        layers["moe"] = moe.specs(model, len(model.layers_with("moe")))
    if model.norms.post:  # Gemma, OLMo 2: the attention's and the MLP's outputs normed before their residuals
        layers |= {"post_attn": norm(), "post_mlp": norm()}
    specs = {"embed": ((V, D), ("vocab", "embed")), "layers": layers, "final_norm": final}
    if model.layer_scalar:
        layers["scalar"] = ((N, 1), ("layers", None))
    if model.per_layer_embeddings is not None:  # Gemma 4: HF's packed table transposed, split by its N * Dp values
        Vp, Dp = model.per_layer_embeddings.vocab_size, model.per_layer_embeddings.dim
        layers["ple"] = {"ple_gate": ((N, D, Dp), ("layers", "embed", None)),
                         "ple_proj": ((N, Dp, D), ("layers", None, "embed"))}
        layers["ple_norm"] = {"scale": ((N, D), ("layers", "embed"))}
        specs |= {"embed_per_layer": ((N * Dp, Vp), ("layer_values", None)),
                  "per_layer_proj": ((D, N, Dp), ("embed", None, None)),
                  "per_layer_norm": {"scale": ((Dp,), (None,))}}
    if model.task == "causal_lm" and not model.tie_embeddings:
        specs["lm_head"] = ((V, D), ("vocab", "embed"))  # HF's layout; also the faster one for decode dots
    if model.task == "reward":
        specs["score"] = ((D, 1), ("embed", None))
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def param_axes(model: Model) -> dict:
    """Logical axis names of every parameter (same tree as ``params``), for the sharding rules."""
    return jax.tree.map(lambda s: s[1], param_specs(model), is_leaf=_is_spec)


def param_shapes(model: Model, dtype=jnp.float32) -> dict:
    """``jax.ShapeDtypeStruct`` of every parameter (same tree as ``params``)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], dtype), param_specs(model), is_leaf=_is_spec)


def init_params(model: Model, rng: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random parameters (normal(0, std) weights, zero biases, norm scales of 1: ones, or zeros where the norm
    adds 1 itself as Gemma's does), as HF initialises."""
    specs = param_specs(model)
    leaves, treedef = jax.tree.flatten_with_path(specs, is_leaf=_is_spec)
    keys = jax.random.split(rng, len(leaves))
    out = []
    for key, (path, (shape, _)) in zip(keys, leaves):
        name = jax.tree_util.keystr(path)
        kind = KINDS_OF_KEY.get(getattr(path[1], "key", None), (None,))[0] if len(path) > 2 else None
        own = getattr(MIXERS[kind], "init", lambda *a: None)(path[-1].key, key, shape, dtype) if kind else None
        if own is not None:  # a mixer's own rule (DeltaNet's decay parameters and gated norm)
            out.append(own)
        elif path[-1].key == "scalar":  # Gemma 4's layer scalar: ones, as transformers initialises it
            out.append(jnp.ones(shape, dtype))
        elif "bias" in name:
            out.append(jnp.zeros(shape, dtype))
        elif "scale" in name:
            out.append(jnp.full(shape, 1.0 - model.norms.offset, dtype))
        else:
            out.append((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def buffers(model: Model) -> tuple[str, ...]:
    """The leaves that transformers keeps as buffers, loaded and saved but never trained (Gemma 4's ``layer_scalar``):
    the forward stops their gradient and the optimizer leaves them as they are (``optim.make_optimizer``'s frozen)."""
    return ("scalar",) if model.layer_scalar else ()


_NORMS = ("ln1", "ln2", "final_norm", "post_attn", "post_mlp", "q_norm", "k_norm", "ple_norm",
          "per_layer_norm") + moe.NORMS


def compute_params(model: Model, params: Params) -> Params:
    """``params`` with any LoRA adapters merged and every weight the forward casts to the compute dtype already cast
    (the norms stay as they are: LayerNorm reads its scale and bias in float32). The forward then computes exactly
    the same numbers and converts nothing; the sampler does this once per call, rather than on every decode step."""
    dt = jnp.dtype(model.dtype)
    layers = params["layers"]  # LoRA adapters merged once per call, a layer at a time once split (split_layers)
    layers = tuple(merge_adapters(model, p) for p in layers) if isinstance(layers, tuple) else merge_adapters(
        model, layers)
    params = {**params, "layers": layers}

    def cast(path, x):
        if any(getattr(k, "key", None) in _NORMS for k in path) or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(dt)

    return jax.tree_util.tree_map_with_path(cast, params)


def frozen_params(model: Model, params: Params) -> Params:
    """Parameters held for forwards only (the frozen reference, reward model and judge; a sampler's weights) as
    those forwards read them: with a compute dtype narrower than theirs, ``compute_params`` once (weights in the
    compute dtype, norms as loaded), so the forwards compute the same numbers as casting them every time, from half
    the bytes (float32 -> bf16), and convert nothing; otherwise ``params`` as they are (nothing is ever widened;
    LoRA adapters, merged in float32, are left alone). Arrays keep their shardings."""
    dt = jnp.dtype(model.dtype)
    if model.lora_rank or not any(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > dt.itemsize
                                  for x in jax.tree.leaves(params)):
        return params
    return compute_params(model, params)


def split_layers(model: Model, params: Params) -> Params:
    """``params`` with the stacked layers split into a tuple of per-layer dicts (``decoder.layer_params``: each
    layer's norms, MLP and its own mixer's parameters), for unrolled decoding with a per-layer cache
    (``init_cache(..., per_layer=True)``): a decode step then slices no weights and no cache state. Costs one copy of
    the layer weights; do it once per sampling call."""
    layers = params["layers"]
    return {**params, "layers": tuple(layer_params(model, layers, i) for i in range(model.num_layers))}


def decode_params(model: Model, params: Params) -> Params:
    """``params`` with each layer's mixer parameters as its decode steps read them, where its kind prepares them
    (``decode_params``: a Gated DeltaNet layer's input projections side by side, one weight and one matmul a step
    instead of six): done once per sampling call, not on every step, and each layer's decode step compiles fewer
    kernels. Stacked layers without LoRA adapters (before ``split_layers``) are prepared whole, in the compute dtype:
    one kernel for all the layers of a kind, where split ones (``split_layers`` and ``compute_params``: adapters merged
    a layer at a time) take one for each weight of each layer."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        def one(kind, p):
            prepare = getattr(MIXERS[kind], "decode_params", None)
            return p if prepare is None else {**p, KEYS[kind]: prepare(model, p[KEYS[kind]])}

        return {**params, "layers": tuple(one(kind, p) for kind, p in zip(model.kinds, layers))}
    layers, dt = dict(layers), jnp.dtype(model.dtype)
    for kind in dict.fromkeys(model.kinds):
        prepare = getattr(MIXERS[kind], "decode_params", None)
        if prepare is not None:
            cast = lambda p, prepare=prepare: {k: v.astype(dt) if k not in p else v  # noqa: E731
                                               for k, v in prepare(model, p).items()}
            layers[KEYS[kind]] = jax.vmap(cast)(layers[KEYS[kind]])
    return {**params, "layers": layers}
