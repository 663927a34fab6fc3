"""The decoder every family shares, as pure functions of ``(model, params, ...)``.

``Model`` is the static architecture (frozen, hashable: a valid ``static_argnums`` of ``jax.jit``);
``params`` is a plain nested dict of arrays whose per-layer leaves are stacked on a leading ``layers``
axis, so the layers run as one ``lax.scan`` (one compiled layer body, whatever the depth).

The families differ only in switches on ``Model``:
  GPT-NeoX  LayerNorm with bias, parallel residual, partial rotary, GELU MLP with biases;
  Llama     RMSNorm, sequential residual, full rotary, SwiGLU, grouped-query attention;
  Qwen2     Llama with q/k/v biases.

The KV cache is a dict pytree passed in and returned (never a mutable collection):
  k, v   [layers, B, S, kv_heads, head_dim]   keys/values by slot
  mask   bool[B, S]                           which slots hold a real (non-pad) token
  index  i32[]                                the next slot to write
Positions always come from the masks (count of real tokens before), so left padding shifts nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]
Cache = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Model:
    """Static architecture of a decoder (and its head). Hashable; holds no arrays."""

    family: str  # "gpt_neox" | "llama" | "qwen2" (Mistral and SmolLM load as "llama")
    task: str  # "causal_lm" (LM head) | "reward" (score head, num_labels=1)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    norm: str  # "layernorm" | "rmsnorm"
    norm_eps: float
    activation: str  # transformers' hidden_act name
    gated_mlp: bool  # SwiGLU-style gate * up
    mlp_bias: bool
    qkv_bias: bool
    out_bias: bool
    parallel_residual: bool
    rotary_dim: int  # leading head dims that are rotated (partial rotary for Pythia)
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies, scaling (linear, llama3) already applied
    tie_embeddings: bool
    sliding_windows: tuple[int, ...] = ()  # per layer, 0 = full attention; () = all full
    pad_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # compute dtype; log-softmax and attention softmax stay in float32
    remat: str = "none"  # "none" | "full" | "dots": rematerialisation of the layer body
    # The source config.json (for export); not part of the identity of the compiled function.
    hf_config: str = dataclasses.field(default="{}", compare=False, repr=False)

    def replace(self, **changes) -> "Model":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Parameters: shapes and logical axis names in one table.
# --------------------------------------------------------------------------------------------------


def param_specs(model: Model) -> dict:
    """Nested dict of ``(shape, logical_axes)`` mirroring ``params``; the one source of shapes."""
    D, N, H, K, Dh, F, V = (model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads,
                            model.head_dim, model.mlp_dim, model.vocab_size)

    def norm():
        p = {"scale": ((N, D), ("layers", "embed"))}
        if model.norm == "layernorm":
            p["bias"] = ((N, D), ("layers", "embed"))
        return p

    attn = {
        "q": ((N, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "k": ((N, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "v": ((N, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "o": ((N, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
    }
    if model.qkv_bias:
        attn["q_bias"] = ((N, H, Dh), ("layers", "heads", "head_dim"))
        attn["k_bias"] = ((N, K, Dh), ("layers", "kv_heads", "head_dim"))
        attn["v_bias"] = ((N, K, Dh), ("layers", "kv_heads", "head_dim"))
    if model.out_bias:
        attn["o_bias"] = ((N, D), ("layers", "embed"))
    mlp = {"up": ((N, D, F), ("layers", "embed", "mlp")), "down": ((N, F, D), ("layers", "mlp", "embed"))}
    if model.gated_mlp:
        mlp["gate"] = ((N, D, F), ("layers", "embed", "mlp"))
    if model.mlp_bias:
        mlp["up_bias"] = ((N, F), ("layers", "mlp"))
        mlp["down_bias"] = ((N, D), ("layers", "embed"))
        if model.gated_mlp:
            mlp["gate_bias"] = ((N, F), ("layers", "mlp"))
    final = {k: (shape[1:], axes[1:]) for k, (shape, axes) in norm().items()}
    specs = {
        "embed": ((V, D), ("vocab", "embed")),
        "layers": {"ln1": norm(), "ln2": norm(), "attn": attn, "mlp": mlp},
        "final_norm": final,
    }
    if model.task == "causal_lm" and not model.tie_embeddings:
        specs["lm_head"] = ((D, V), ("embed", "vocab"))
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
    """Random parameters (normal(0, std) weights, unit norm scales, zero biases), as HF initialises."""
    specs = param_specs(model)
    leaves, treedef = jax.tree.flatten_with_path(specs, is_leaf=_is_spec)
    keys = jax.random.split(rng, len(leaves))
    out = []
    for key, (path, (shape, _)) in zip(keys, leaves):
        name = jax.tree_util.keystr(path)
        if "bias" in name:
            out.append(jnp.zeros(shape, dtype))
        elif "scale" in name:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------

_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
}
ACTIVATIONS = tuple(_ACTIVATIONS)


def _norm(model: Model, p: Params, x_BLD: jax.Array) -> jax.Array:
    x = x_BLD.astype(jnp.float32)
    if model.norm == "rmsnorm":
        # As transformers' LlamaRMSNorm: normalise in float32, cast back, then scale.
        y = (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + model.norm_eps)).astype(x_BLD.dtype)
        return p["scale"].astype(x_BLD.dtype) * y
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + model.norm_eps) * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x_BLD.dtype)


def _rope(model: Model, x_BLHD: jax.Array, cos_BLR: jax.Array, sin_BLR: jax.Array) -> jax.Array:
    """Rotary embedding on the first ``rotary_dim`` dims, rotate-half convention (HF, NeoX and Llama)."""
    r = model.rotary_dim
    x_rot, x_pass = x_BLHD[..., :r], x_BLHD[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = jnp.concatenate([-x2, x1], -1)
    cos, sin = cos_BLR[:, :, None, :].astype(x_BLHD.dtype), sin_BLR[:, :, None, :].astype(x_BLHD.dtype)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], -1)


def _rope_tables(model: Model, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq = jnp.asarray(np.asarray(model.inv_freq, np.float32))
    freqs = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], -1)
    return jnp.cos(emb), jnp.sin(emb)


def _mlp(model: Model, p: Params, x_BLD: jax.Array) -> jax.Array:
    dt = x_BLD.dtype
    act = _ACTIVATIONS[model.activation]
    up = jnp.einsum("bld,df->blf", x_BLD, p["up"].astype(dt))
    if model.mlp_bias:
        up = up + p["up_bias"].astype(dt)
    if model.gated_mlp:
        gate = jnp.einsum("bld,df->blf", x_BLD, p["gate"].astype(dt))
        if model.mlp_bias:
            gate = gate + p["gate_bias"].astype(dt)
        h = act(gate) * up
    else:
        h = act(up)
    out = jnp.einsum("blf,fd->bld", h, p["down"].astype(dt))
    if model.mlp_bias:
        out = out + p["down_bias"].astype(dt)
    return out


def _attention(model: Model, p: Params, x_BLD, cos, sin, k_BSKD, v_BSKD, start, attend_BLS):
    """Self-attention over a cache of S slots; the new keys/values are written at ``start``.

    Returns the output and the updated k/v slabs. Without a cache, S == L and ``start`` == 0.
    """
    dt = x_BLD.dtype
    B, L, _ = x_BLD.shape
    K, Dh = model.num_kv_heads, model.head_dim
    G = model.num_heads // K
    q = jnp.einsum("bld,dhk->blhk", x_BLD, p["q"].astype(dt))
    k = jnp.einsum("bld,dhk->blhk", x_BLD, p["k"].astype(dt))
    v = jnp.einsum("bld,dhk->blhk", x_BLD, p["v"].astype(dt))
    if model.qkv_bias:
        q, k, v = q + p["q_bias"].astype(dt), k + p["k_bias"].astype(dt), v + p["v_bias"].astype(dt)
    q, k = _rope(model, q, cos, sin), _rope(model, k, cos, sin)
    if k_BSKD is None:
        k_BSKD, v_BSKD = k, v
    else:
        k_BSKD = jax.lax.dynamic_update_slice(k_BSKD, k.astype(k_BSKD.dtype), (0, start, 0, 0))
        v_BSKD = jax.lax.dynamic_update_slice(v_BSKD, v.astype(v_BSKD.dtype), (0, start, 0, 0))
    q_BLKGD = q.reshape(B, L, K, G, Dh)  # head h reads kv head h // G, as transformers' repeat_kv
    scores = jnp.einsum("blkgd,bskd->bkgls", q_BLKGD, k_BSKD.astype(dt), preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5)
    scores = jnp.where(attend_BLS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v_BSKD.astype(dt)).reshape(B, L, K * G, Dh)
    out = jnp.einsum("blhk,hkd->bld", out, p["o"].astype(dt))
    if model.out_bias:
        out = out + p["o_bias"].astype(dt)
    return out, k_BSKD, v_BSKD


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
REMAT_POLICIES = ("none",) + tuple(_REMAT_POLICIES)


# --------------------------------------------------------------------------------------------------
# The forward pass
# --------------------------------------------------------------------------------------------------


def init_cache(model: Model, batch: int, length: int, dtype=None) -> Cache:
    """An empty KV cache of ``length`` slots for ``batch`` rows."""
    dtype = jnp.dtype(dtype or model.dtype)
    shape = (model.num_layers, batch, length, model.num_kv_heads, model.head_dim)
    return {
        "k": jnp.zeros(shape, dtype),
        "v": jnp.zeros(shape, dtype),
        "mask": jnp.zeros((batch, length), bool),
        "index": jnp.zeros((), jnp.int32),
    }


def hidden_states(model: Model, params: Params, tokens_BL: jax.Array, mask_BL: jax.Array,
                  cache: Cache | None = None) -> tuple[jax.Array, Cache | None]:
    """Final-normed hidden states ``[B, L, D]`` (compute dtype) and the updated cache.

    ``mask_BL`` marks real tokens (1) and padding (0). With ``cache``, the tokens are appended at
    ``cache["index"]`` and attend to every earlier real slot; their positions continue each row's count.
    """
    dt = jnp.dtype(model.dtype)
    B, L = tokens_BL.shape
    mask_BL = mask_BL.astype(bool)
    x = jnp.take(params["embed"], tokens_BL, axis=0).astype(dt)
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
    positions_BL = n_before_B[:, None] + jnp.maximum(jnp.cumsum(mask_BL, -1, dtype=jnp.int32) - 1, 0)
    cos, sin = _rope_tables(model, positions_BL)
    q_slot_L = start + jnp.arange(L, dtype=jnp.int32)
    k_slot_S = jnp.arange(S, dtype=jnp.int32)
    dist_LS = q_slot_L[:, None] - k_slot_S[None, :]
    attend_BLS = kv_mask_BS[:, None, :] & (dist_LS >= 0)[None]
    windows = np.asarray(model.sliding_windows or (0,) * model.num_layers, np.int32)
    windows = np.where(windows > 0, windows, np.iinfo(np.int32).max)

    def layer(x, xs):
        p, window, k_cache, v_cache = xs
        attend = attend_BLS & (dist_LS < window)[None]
        h = _norm(model, p["ln1"], x)
        attn, k_cache, v_cache = _attention(model, p["attn"], h, cos, sin, k_cache, v_cache, start, attend)
        if model.parallel_residual:
            x = x + attn + _mlp(model, p["mlp"], _norm(model, p["ln2"], x))
        else:
            x = x + attn
            x = x + _mlp(model, p["mlp"], _norm(model, p["ln2"], x))
        # Without a cache nothing is stacked per layer (the training forward keeps no k/v around).
        return x, (None, None) if cache is None else (k_cache, v_cache)

    if model.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[model.remat], prevent_cse=False)
    kv = (None, None) if cache is None else (cache["k"], cache["v"])
    x, (k_new, v_new) = jax.lax.scan(layer, x, (params["layers"], jnp.asarray(windows)) + kv)
    x = _norm(model, params["final_norm"], x)
    if cache is None:
        return x, None
    return x, {"k": k_new, "v": v_new, "mask": kv_mask_BS, "index": start + L}


def lm_head(model: Model, params: Params, h_BXD: jax.Array) -> jax.Array:
    """Float32 logits of hidden states of any leading shape ``[..., D] -> [..., V]``."""
    dt = h_BXD.dtype
    if model.tie_embeddings:
        return jnp.einsum("...d,vd->...v", h_BXD, params["embed"].astype(dt), preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", h_BXD, params["lm_head"].astype(dt), preferred_element_type=jnp.float32)


def logits(model: Model, params: Params, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """f32[B, L, V] next-token logits of a causal LM, as ``transformers`` computes them."""
    if model.task != "causal_lm":
        raise ValueError(f"logits() needs a causal LM; this model was loaded with task={model.task!r}")
    h, _ = hidden_states(model, params, input_ids, attention_mask)
    return lm_head(model, params, h)


def last_token_index(model: Model, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Where a sequence classifier reads its value, exactly as transformers does: the rightmost token
    that is not ``pad_token_id`` (so with pad == EOS a trailing EOS is skipped, as in HF). Without a pad
    id in the config, the rightmost real token by the attention mask."""
    L = input_ids.shape[1]
    idx = jnp.arange(L, dtype=jnp.int32)
    keep = attention_mask.astype(bool) if model.pad_token_id is None else input_ids != model.pad_token_id
    return jnp.argmax(idx * keep.astype(jnp.int32), axis=-1)


def reward_scores(model: Model, params: Params, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """f32[B]: a ``*ForSequenceClassification`` (num_labels=1) value at the last non-pad token."""
    if model.task != "reward":
        raise ValueError(f"reward_scores() needs a reward model; this model was loaded with task={model.task!r}")
    h, _ = hidden_states(model, params, input_ids, attention_mask)
    last = last_token_index(model, input_ids, attention_mask)
    h_BD = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    return jnp.einsum("bd,dk->bk", h_BD, params["score"].astype(h_BD.dtype),
                      preferred_element_type=jnp.float32)[:, 0]
