"""The decoder every family shares, as pure functions of ``(model, params, ...)``.

``Model`` (``jodpo.models.model``) is the static architecture; ``params`` is a plain nested dict of arrays whose
per-layer leaves are stacked on a leading ``layers`` axis, so the layers run as one ``lax.scan`` (one compiled
layer body, whatever the depth).

The families differ only in switches on ``Model`` (the pieces that read them are in ``jodpo.models.layers``):
  GPT-NeoX  LayerNorm with bias, parallel residual, partial rotary, GELU MLP with biases;
  Llama     RMSNorm, sequential residual, full rotary, SwiGLU, grouped-query attention;
  Qwen2     Llama with q/k/v biases;
  Qwen3     Llama with an RMSNorm on each head's queries and keys;
  Gemma 2   (1 + w) RMSNorms in float32, four a layer (post_norms), scaled embeddings, GeGLU, query_pre_attn_scalar,
            local (sliding-window) and global layers, soft-capped attention scores and logits;
  Gemma 3   Gemma 2 with q/k norms instead of soft-capping, and the local layers' own RoPE base.

The KV cache is a dict pytree passed in and returned (never a mutable collection):
  k, v   [layers, B, kv_heads, S, head_dim]   keys/values by slot (head-major, as attention reads them)
  mask   bool[B, S]                           which slots hold a real (non-pad) token
  index  i32[]                                the next slot to write
Positions always come from the masks (count of real tokens before), so left padding shifts nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models.layers import (FULL_WINDOW, attention, embed, forward_attention, layer_rope, mlp, norm, qkv,
                                 rope_tables)
from jodpo.models.model import ATTENTIONS, PRECISIONS, Cache, Model, Params, einsum  # noqa: F401 - re-exported


ATTENTION_WEIGHTS = ("q", "k", "v", "o")


def merge_adapters(model: Model, p: Params) -> Params:
    """Layer parameters (stacked ``[N, ...]`` or one layer's) with their LoRA adapters folded in:
    ``W + lora_alpha / lora_rank * a.b`` in float32, the adapters gone. ``p["lora"]`` maps a group (a HF module name)
    to ``{"a": [..., in..., r], "b": {weight: [..., r, out...]}}``; several weights sharing one ``a`` are GPT-NeoX's
    fused ``query_key_value``. Without adapters ``p`` comes back as it is."""
    if "lora" not in p:
        return p
    p = {**p, "attn": dict(p["attn"]), "mlp": dict(p["mlp"])}
    scale = model.lora_alpha / model.lora_rank
    for group in p.pop("lora").values():
        a = group["a"]
        for name, b in group["b"].items():
            sub = "attn" if name in ATTENTION_WEIGHTS else "mlp"
            w = p[sub][name]
            lead = a.ndim + b.ndim - 2 - w.ndim  # the stacked layer axis, if any
            n_in = a.ndim - 1 - lead
            letters = "abcdefgh"
            L, i, o = letters[:lead], letters[lead:lead + n_in], letters[lead + n_in:lead + n_in + b.ndim - 1 - lead]
            delta = einsum(model, f"{L}{i}r,{L}r{o}->{L}{i}{o}", a.astype(jnp.float32), b.astype(jnp.float32))
            p[sub][name] = w.astype(jnp.float32) + scale * delta
    return p


def _block(model: Model, p: Params, xs, rope, attend) -> tuple:
    """One decoder layer over groups of tokens ``xs`` (a tuple of ``[B_i, L_i, D]``, with their ``(cos, sin)``
    tables in ``rope``). ``attend(qs, ks, vs)`` gets the groups' queries ``[B_i, L_i, H, Dh]``, keys and
    values ``[B_i, L_i, K, Dh]`` and returns their attended values ``[B_i, L_i, H, Dh]``: it decides which keys
    each query sees (and writes them to a cache if there is one). LoRA adapters are folded into the layer's weights
    here, one layer at a time (inside the scan and its rematerialisation: no whole merged copy of the model)."""
    p = merge_adapters(model, p)
    projected = [qkv(model, p["attn"], norm(model, p["ln1"], x), cos, sin) for x, (cos, sin) in zip(xs, rope)]
    outs = attend(*zip(*projected))
    new = []
    for x, a in zip(xs, outs):
        attn = einsum(model, "blhk,hkd->bld", a, p["attn"]["o"].astype(x.dtype))
        if model.out_bias:
            attn = attn + p["attn"]["o_bias"].astype(x.dtype)
        if model.post_norms:  # Gemma: the attention's output is normed before the residual
            attn = norm(model, p["post_attn"], attn)
        if model.parallel_residual:
            x = x + attn + mlp(model, p["mlp"], norm(model, p["ln2"], x))
        else:
            x = x + attn
            out = mlp(model, p["mlp"], norm(model, p["ln2"], x))
            x = x + (norm(model, p["post_mlp"], out) if model.post_norms else out)
        new.append(x)
    return tuple(new)


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_POLICIES = ("none",) + tuple(_REMAT_POLICIES)


# --------------------------------------------------------------------------------------------------
# The forward pass
# --------------------------------------------------------------------------------------------------


def init_cache(model: Model, batch: int, length: int, dtype=None, per_layer: bool = False) -> Cache:
    """An empty KV cache of ``length`` slots for ``batch`` rows (``per_layer``: a tuple of per-layer
    slabs, to go with ``split_layers`` params)."""
    dtype = jnp.dtype(dtype or model.dtype)
    shape = (model.num_layers, batch, model.num_kv_heads, length, model.head_dim)
    if per_layer:
        k = v = tuple(jnp.zeros(shape[1:], dtype) for _ in range(model.num_layers))
    else:
        k = v = jnp.zeros(shape, dtype)
    return {
        "k": k,
        "v": v,
        "mask": jnp.zeros((batch, length), bool),
        "index": jnp.zeros((), jnp.int32),
    }


def _positions(mask_BL: jax.Array, n_before_B: jax.Array) -> jax.Array:
    """Rotary positions: the count of real tokens before each one (padding repeats its neighbour's)."""
    return n_before_B[:, None] + jnp.maximum(jnp.cumsum(mask_BL, -1, dtype=jnp.int32) - 1, 0)


def _windows(model: Model) -> np.ndarray:
    """Each layer's attention window in slots (full attention: the largest int)."""
    windows = np.asarray(model.sliding_windows or (0,) * model.num_layers, np.int32)
    return np.where(windows > 0, windows, FULL_WINDOW)


def _run_layers(model: Model, params: Params, x, block):
    """``x`` (any pytree of activations) through every layer as one ``lax.scan`` of ``block(x, p, window)``,
    rematerialised as ``model.remat`` says, then the final norm on each of its arrays. No cache: these are
    the training and scoring passes."""
    def layer(x, xs):
        return block(x, *xs), None

    if model.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[model.remat], prevent_cse=False)
    x, _ = jax.lax.scan(layer, x, (params["layers"], jnp.asarray(_windows(model))))
    return jax.tree.map(lambda a: norm(model, params["final_norm"], a), x)


def hidden_states(model: Model, params: Params, tokens_BL: jax.Array, mask_BL: jax.Array,
                  cache: Cache | None = None, *, empty_cache: bool = False) -> tuple[jax.Array, Cache | None]:
    """Final-normed hidden states ``[B, L, D]`` (compute dtype) and the updated cache.

    ``mask_BL`` marks real tokens (1) and padding (0). With ``cache``, the tokens are appended at
    ``cache["index"]`` and attend to every earlier real slot; their positions continue each row's count.
    ``empty_cache=True`` promises the cache holds nothing yet (a prefill): the tokens then attend among
    themselves with the forward's kernel (``Model.attention``) instead of over the whole cache slab.
    """
    B, L = tokens_BL.shape
    mask_BL = mask_BL.astype(bool)
    x = embed(model, params, tokens_BL)
    if cache is None:
        start = jnp.zeros((), jnp.int32)
        kv_mask_BS = mask_BL
        n_before_B = jnp.zeros((B,), jnp.int32)
        S = L
    else:
        start = cache["index"]
        n_before_B = jnp.sum(cache["mask"], -1, dtype=jnp.int32)
        kv_mask_BS = jax.lax.dynamic_update_slice(cache["mask"], mask_BL, (0, start))
        S = cache["mask"].shape[1]
    tables = rope_tables(model, _positions(mask_BL, n_before_B))
    q_slot_L = start + jnp.arange(L, dtype=jnp.int32)
    k_slot_S = jnp.arange(S, dtype=jnp.int32)
    dist_LS = q_slot_L[:, None] - k_slot_S[None, :]
    attend_BLS = kv_mask_BS[:, None, :] & (dist_LS >= 0)[None]
    dist_LL = jnp.arange(L)[:, None] - jnp.arange(L)[None, :]
    attend_BLL = mask_BL[:, None, :] & (dist_LL >= 0)[None]  # among the new tokens only
    windows = _windows(model)

    def block(x, p, window, write):
        """One layer; ``write(k, v)`` puts the new keys/values in the cache and returns the slabs to attend
        over, or None when the new tokens attend among themselves only (no cache, or an empty one)."""
        def attend(q, k, v):
            slabs = write(k[0], v[0])
            if slabs is None:
                return (forward_attention(model, q[0], k[0], v[0], attend_BLL & (dist_LL < window)[None]),)
            return (attention(model, q[0], *slabs, attend_BLS & (dist_LS < window)[None]),)

        return _block(model, p, (x,), (layer_rope(model, tables, window),), attend)[0]

    split = isinstance(params["layers"], (tuple, list))
    if split != (cache is not None and isinstance(cache["k"], (tuple, list))):
        raise ValueError("split_layers params go with a per-layer cache (init_cache(..., per_layer=True)) and "
                         "stacked params with a stacked cache or none")
    xs = None if split else (params["layers"], jnp.asarray(windows), jnp.arange(model.num_layers, dtype=jnp.int32))
    if cache is None:
        return _run_layers(model, params, x, lambda x, p, window: block(x, p, window, lambda k, v: None)), None

    # The cache rides in the scan carry and is updated in place: only the new tokens' slots are written,
    # instead of every layer's whole slab being copied through the scan's inputs and outputs.
    def cached_layer(carry, xs):
        x, k_cache, v_cache = carry
        p, window, i = xs

        def write(k, v):
            nonlocal k_cache, v_cache
            k = k.transpose(0, 2, 1, 3)[None].astype(k_cache.dtype)
            v = v.transpose(0, 2, 1, 3)[None].astype(v_cache.dtype)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (i, 0, 0, start, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (i, 0, 0, start, 0))
            return None if empty_cache else (k_cache[i], v_cache[i])

        x = block(x, p, window, write)
        return (x, k_cache, v_cache), None

    if split:
        # Unrolled (see split_layers): per-layer weights and cache buffers, so a decode step slices
        # nothing; each layer's cache is updated in place where it lives.
        k_new, v_new = list(cache["k"]), list(cache["v"])
        for i, p in enumerate(params["layers"]):
            def write(k, v, i=i):
                k_new[i] = jax.lax.dynamic_update_slice(k_new[i], k.transpose(0, 2, 1, 3).astype(k_new[i].dtype),
                                                        (0, 0, start, 0))
                v_new[i] = jax.lax.dynamic_update_slice(v_new[i], v.transpose(0, 2, 1, 3).astype(v_new[i].dtype),
                                                        (0, 0, start, 0))
                return None if empty_cache else (k_new[i], v_new[i])

            x = block(x, p, int(windows[i]), write)
        k_new, v_new = tuple(k_new), tuple(v_new)
    else:
        (x, k_new, v_new), _ = jax.lax.scan(cached_layer, (x, cache["k"], cache["v"]), xs)
    x = norm(model, params["final_norm"], x)
    return x, {"k": k_new, "v": v_new, "mask": kv_mask_BS, "index": start + L}


def prefixed_hidden_states(model: Model, params: Params, prefix_ids_BP: jax.Array, prefix_mask_BP: jax.Array,
                           suffix_ids_NC: jax.Array, suffix_mask_NC: jax.Array) -> jax.Array:
    """``hidden_states`` of ``concatenate([tile(prefix), suffix], 1)``, ``[N, P + C, D]``, computing every
    prefix once instead of once per suffix: N = n x B suffix rows in block layout (row r continues prefix
    ``r % B``). The suffix tokens attend to the prefix's keys and values (shared, so their gradients add up);
    the result equals the plain forward of the concatenated rows up to float rounding. Online DPO's two
    completions of a prompt share its forward this way (policy, reference and reward model)."""
    (B, P), (N, C) = prefix_ids_BP.shape, suffix_ids_NC.shape
    if N % B:
        raise ValueError(f"{N} suffix rows do not continue {B} prefixes in block layout (need a multiple of {B})")

    def tile(a):
        return jnp.concatenate([a] * (N // B), 0)

    pmask, smask = prefix_mask_BP.astype(bool), suffix_mask_NC.astype(bool)
    tables = (rope_tables(model, _positions(pmask, jnp.zeros((B,), jnp.int32))),
              rope_tables(model, _positions(smask, tile(jnp.sum(pmask, -1, dtype=jnp.int32)))))
    slots = jnp.arange(P + C, dtype=jnp.int32)
    dist_PP = slots[:P, None] - slots[None, :P]  # query slot - key slot, as in the concatenated sequence
    dist_CS = slots[P:, None] - slots[None, :]
    kv_mask_NS = jnp.concatenate([tile(pmask), smask], 1)

    def block(x, p, window):
        attend_p = pmask[:, None, :] & ((dist_PP >= 0) & (dist_PP < window))[None]
        attend_s = kv_mask_NS[:, None, :] & ((dist_CS >= 0) & (dist_CS < window))[None]

        def attend(q, k, v):
            k_all = jnp.concatenate([tile(k[0]), k[1]], 1)
            v_all = jnp.concatenate([tile(v[0]), v[1]], 1)
            return (forward_attention(model, q[0], k[0], v[0], attend_p),
                    forward_attention(model, q[1], k_all, v_all, attend_s))

        return _block(model, p, x, tuple(layer_rope(model, t, window) for t in tables), attend)

    x = (embed(model, params, prefix_ids_BP), embed(model, params, suffix_ids_NC))
    h_prefix, h_suffix = _run_layers(model, params, x, block)
    return jnp.concatenate([tile(h_prefix), h_suffix], 1)
