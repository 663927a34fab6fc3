"""The decoder every family shares, as pure functions of ``(model, params, ...)``.

``Model`` (``jodpo.models.model``) is the static architecture; ``params`` is a plain nested dict of arrays whose
per-layer leaves are stacked on a leading ``layers`` axis, so the layers run as one ``lax.scan`` (one compiled
layer body, whatever the depth).

The families differ only in switches on ``Model``:
  GPT-NeoX  LayerNorm with bias, parallel residual, partial rotary, GELU MLP with biases;
  Llama     RMSNorm, sequential residual, full rotary, SwiGLU, grouped-query attention;
  Qwen2     Llama with q/k/v biases.

The KV cache is a dict pytree passed in and returned (never a mutable collection):
  k, v   [layers, B, kv_heads, S, head_dim]   keys/values by slot (head-major, as attention reads them)
  mask   bool[B, S]                           which slots hold a real (non-pad) token
  index  i32[]                                the next slot to write
Positions always come from the masks (count of real tokens before), so left padding shifts nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models.model import ATTENTIONS, PRECISIONS, Cache, Model, Params, einsum  # noqa: F401 - re-exported

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


def _recomputed(f):
    """``f`` differentiated from its inputs alone: its backward recomputes what it needs instead of keeping it from the
    forward. For the cheap elementwise pieces of a layer whose autodiff residuals outweigh their inputs: a LayerNorm
    keeps three float32 copies of its input (an input in bf16: 12x its bytes), an exact GELU four copies of the MLP's
    widest activation. A forward that is not differentiated (sampling, scoring) runs ``f`` as it is."""
    return jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)


def _norm(model: Model, p: Params, x_BLD: jax.Array) -> jax.Array:
    return _recomputed(functools.partial(_normalise, model))(p, x_BLD)


def _normalise(model: Model, p: Params, x_BLD: jax.Array) -> jax.Array:
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
    up = einsum(model, "bld,df->blf", x_BLD, p["up"].astype(dt))
    if model.mlp_bias:
        up = up + p["up_bias"].astype(dt)
    gate = None
    if model.gated_mlp:
        gate = einsum(model, "bld,df->blf", x_BLD, p["gate"].astype(dt))
        if model.mlp_bias:
            gate = gate + p["gate_bias"].astype(dt)

    def down(gate, up, w):  # the backward keeps only the projections' outputs and recomputes the activation
        h = act(gate) * up if model.gated_mlp else act(up)
        return einsum(model, "blf,fd->bld", h, w)

    out = _recomputed(down)(gate, up, p["down"].astype(dt))
    if model.mlp_bias:
        out = out + p["down_bias"].astype(dt)
    return out


def _qkv(model: Model, p: Params, x_BLD, cos, sin):
    """Rotated queries [B, L, H, Dh] and keys, values [B, L, K, Dh] of the new tokens."""
    dt = x_BLD.dtype
    q = einsum(model, "bld,dhk->blhk", x_BLD, p["q"].astype(dt))
    k = einsum(model, "bld,dhk->blhk", x_BLD, p["k"].astype(dt))
    v = einsum(model, "bld,dhk->blhk", x_BLD, p["v"].astype(dt))
    if model.qkv_bias:
        q, k, v = q + p["q_bias"].astype(dt), k + p["k_bias"].astype(dt), v + p["v_bias"].astype(dt)
    return _rope(model, q, cos, sin), _rope(model, k, cos, sin), v


def _attention(model: Model, q_BLHD, k_BKSD, v_BKSD, attend_BLS) -> jax.Array:
    """Softmax attention of L queries over S key slots (float32 scores): ``[B, L, H, Dh]``, before the output
    projection. Keys and values are head-major ``[B, K, S, Dh]`` (the cache's layout), so the batched dots read
    them in place rather than transposing a whole cache slab every decode step."""
    dt = q_BLHD.dtype
    B, L, H, Dh = q_BLHD.shape
    K = model.num_kv_heads
    q_BLKGD = q_BLHD.reshape(B, L, K, H // K, Dh)  # head h reads kv head h // G, as transformers' repeat_kv
    scores = einsum(model, "blkgd,bksd->bkgls", q_BLKGD, k_BKSD.astype(dt), preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5)
    scores = jnp.where(attend_BLS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return einsum(model, "bkgls,bksd->blkgd", probs, v_BKSD.astype(dt)).reshape(B, L, H, Dh)


def _forward_attention(model: Model, q_BLHD, k_BSKD, v_BSKD, attend_BLS) -> jax.Array:
    """The attention of the cache-free forwards and the prefill, keys and values token-major ``[B, S, K, Dh]``
    (as the projections make them). ``model.attention``: ``"xla"``, jodpo's einsum attention (the decode steps'
    own; on a CPU it is 5% faster in a forward+backward than ``jax.nn.dot_product_attention``'s XLA version);
    ``"cudnn"``, cuDNN's flash attention through ``jax.nn.dot_product_attention`` (``_library_attention``)."""
    if model.attention == "cudnn":
        return _library_attention(model, q_BLHD, k_BSKD, v_BSKD, attend_BLS, "cudnn")
    return _attention(model, q_BLHD, k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3), attend_BLS)


def _library_attention(model: Model, q_BLHD, k_BSKD, v_BSKD, attend_BLS, implementation: str) -> jax.Array:
    """``_attention`` through ``jax.nn.dot_product_attention(implementation=...)``. The boolean mask carries left
    padding, causality, sliding windows and the shared-prompt layout (cuDNN takes it as a bias); a query that sees
    no key (a pad slot) gets a finite, ignored value, as in ``_attention``. float32 dots get ``model.precision``
    (jax reads the default precision when it traces them, the backward's too). The ``"xla"`` implementation is
    the CPU-testable twin of the ``"cudnn"`` call: same arguments, same mask."""
    dt = q_BLHD.dtype
    with jax.default_matmul_precision(model.precision if dt == jnp.float32 else None):
        return jax.nn.dot_product_attention(q_BLHD, k_BSKD.astype(dt), v_BSKD.astype(dt), mask=attend_BLS[:, None],
                                            implementation=implementation)


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


def _block(model: Model, p: Params, xs, rope, attention) -> tuple:
    """One decoder layer over groups of tokens ``xs`` (a tuple of ``[B_i, L_i, D]``, with their ``(cos, sin)``
    tables in ``rope``). ``attention(qs, ks, vs)`` gets the groups' queries ``[B_i, L_i, H, Dh]``, keys and
    values ``[B_i, L_i, K, Dh]`` and returns their attended values ``[B_i, L_i, H, Dh]``: it decides which keys
    each query sees (and writes them to a cache if there is one). LoRA adapters are folded into the layer's weights
    here, one layer at a time (inside the scan and its rematerialisation: no whole merged copy of the model)."""
    p = merge_adapters(model, p)
    qkv = [_qkv(model, p["attn"], _norm(model, p["ln1"], x), cos, sin) for x, (cos, sin) in zip(xs, rope)]
    outs = attention(*zip(*qkv))
    new = []
    for x, a in zip(xs, outs):
        attn = einsum(model, "blhk,hkd->bld", a, p["attn"]["o"].astype(x.dtype))
        if model.out_bias:
            attn = attn + p["attn"]["o_bias"].astype(x.dtype)
        if model.parallel_residual:
            x = x + attn + _mlp(model, p["mlp"], _norm(model, p["ln2"], x))
        else:
            x = x + attn
            x = x + _mlp(model, p["mlp"], _norm(model, p["ln2"], x))
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
    return np.where(windows > 0, windows, np.iinfo(np.int32).max)


def _run_layers(model: Model, params: Params, x, block):
    """``x`` (any pytree of activations) through every layer as one ``lax.scan`` of ``block(x, p, window)``,
    rematerialised as ``model.remat`` says, then the final norm on each of its arrays. No cache: these are
    the training and scoring passes."""
    def layer(x, xs):
        return block(x, *xs), None

    if model.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[model.remat], prevent_cse=False)
    x, _ = jax.lax.scan(layer, x, (params["layers"], jnp.asarray(_windows(model))))
    return jax.tree.map(lambda a: _norm(model, params["final_norm"], a), x)


def hidden_states(model: Model, params: Params, tokens_BL: jax.Array, mask_BL: jax.Array,
                  cache: Cache | None = None, *, empty_cache: bool = False) -> tuple[jax.Array, Cache | None]:
    """Final-normed hidden states ``[B, L, D]`` (compute dtype) and the updated cache.

    ``mask_BL`` marks real tokens (1) and padding (0). With ``cache``, the tokens are appended at
    ``cache["index"]`` and attend to every earlier real slot; their positions continue each row's count.
    ``empty_cache=True`` promises the cache holds nothing yet (a prefill): the tokens then attend among
    themselves with the forward's kernel (``Model.attention``) instead of over the whole cache slab.
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
    cos, sin = _rope_tables(model, _positions(mask_BL, n_before_B))
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
        def attention(q, k, v):
            slabs = write(k[0], v[0])
            if slabs is None:
                return (_forward_attention(model, q[0], k[0], v[0], attend_BLL & (dist_LL < window)[None]),)
            return (_attention(model, q[0], *slabs, attend_BLS & (dist_LS < window)[None]),)

        return _block(model, p, (x,), ((cos, sin),), attention)[0]

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
    x = _norm(model, params["final_norm"], x)
    return x, {"k": k_new, "v": v_new, "mask": kv_mask_BS, "index": start + L}


def prefixed_hidden_states(model: Model, params: Params, prefix_ids_BP: jax.Array, prefix_mask_BP: jax.Array,
                           suffix_ids_NC: jax.Array, suffix_mask_NC: jax.Array) -> jax.Array:
    """``hidden_states`` of ``concatenate([tile(prefix), suffix], 1)``, ``[N, P + C, D]``, computing every
    prefix once instead of once per suffix: N = n x B suffix rows in block layout (row r continues prefix
    ``r % B``). The suffix tokens attend to the prefix's keys and values (shared, so their gradients add up);
    the result equals the plain forward of the concatenated rows up to float rounding. Online DPO's two
    completions of a prompt share its forward this way (policy, reference and reward model)."""
    dt = jnp.dtype(model.dtype)
    (B, P), (N, C) = prefix_ids_BP.shape, suffix_ids_NC.shape
    if N % B:
        raise ValueError(f"{N} suffix rows do not continue {B} prefixes in block layout (need a multiple of {B})")

    def tile(a):
        return jnp.concatenate([a] * (N // B), 0)

    pmask, smask = prefix_mask_BP.astype(bool), suffix_mask_NC.astype(bool)
    rope = (_rope_tables(model, _positions(pmask, jnp.zeros((B,), jnp.int32))),
            _rope_tables(model, _positions(smask, tile(jnp.sum(pmask, -1, dtype=jnp.int32)))))
    slots = jnp.arange(P + C, dtype=jnp.int32)
    dist_PP = slots[:P, None] - slots[None, :P]  # query slot - key slot, as in the concatenated sequence
    dist_CS = slots[P:, None] - slots[None, :]
    kv_mask_NS = jnp.concatenate([tile(pmask), smask], 1)

    def block(x, p, window):
        attend_p = pmask[:, None, :] & ((dist_PP >= 0) & (dist_PP < window))[None]
        attend_s = kv_mask_NS[:, None, :] & ((dist_CS >= 0) & (dist_CS < window))[None]

        def attention(q, k, v):
            k_all = jnp.concatenate([tile(k[0]), k[1]], 1)
            v_all = jnp.concatenate([tile(v[0]), v[1]], 1)
            return (_forward_attention(model, q[0], k[0], v[0], attend_p),
                    _forward_attention(model, q[1], k_all, v_all, attend_s))

        return _block(model, p, x, rope, attention)

    x = (jnp.take(params["embed"], prefix_ids_BP, axis=0).astype(dt),
         jnp.take(params["embed"], suffix_ids_NC, axis=0).astype(dt))
    h_prefix, h_suffix = _run_layers(model, params, x, block)
    return jnp.concatenate([tile(h_prefix), h_suffix], 1)
