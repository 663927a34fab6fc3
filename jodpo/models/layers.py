"""The pieces of a decoder layer, as pure functions of ``(model, params, ...)``: norms, RoPE, the attention
projections and the attention itself (the feed-forward kinds are ``jodpo.models.mlp`` and ``moe``).
``jodpo.models.decoder`` puts them together into layers, the layer stack and the KV cache.

What differs between families is a field of ``Model`` read here, never the family's name; the attention pieces
read what differs between a model's attention kinds from the kind's ``Attention`` description
(``Model.attention_of``), the rest from the ``Model``:
  norms                  LayerNorm (NeoX); RMSNorm as Llama computes it; x * (1 + w) in float32 (Gemma); the
                         scale multiplied in float32 before the cast back (OLMo 2, Gemma 4); where a layer has them
  qkv_bias               biases on q, k, v (Qwen2)
  Attention.options      q/k norms over each head (Qwen3, Gemma 3) or the whole projection (OLMo 2 and 3); a
                         scale-free norm over each head's values, values that are the projected keys (Gemma 4); an
                         output gate (Qwen3.5)
  Attention.rope         partial rotary (NeoX); the sliding-window layers' own RoPE base (local_inv_freq, Gemma 3,
                         OLMo 3); YaRN's scale of cos and sin; layers without RoPE (nope_layers, SmolLM3)
  query_scale            the scores' scale (Gemma's query_pre_attn_scalar)
  attn_softcap           cap * tanh(scores / cap) before the mask (Gemma 2)
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models import decode_attention, splash
from jodpo.models.model import Attention, Model, Params, Rope, einsum

# transformers' hidden_act names jodpo computes -> the function
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
}


class Site(NamedTuple):
    """A layer's scalars that change no shapes, scan inputs of the layer stack (``decoder.sites``): whether it rotates
    its queries and keys (SmolLM3's NoPE layers do not). Ints, or traced int32 scalars inside a scan. (A layer's
    window is its kind's: ``Attention.window``, ``Model.sliding_window`` on the sliding kinds, whose caches hold that
    many slots.)"""

    rope: Any


class Context(NamedTuple):
    """What the decoder computes once per forward for every layer's mixer (``jodpo.models.attention_mixer``), by mode:

    ============  =====================================  ===========================  ==============================
    mode          mask                                   dist (query slot - key slot)  rope
    ============  =====================================  ===========================  ==============================
    full          (tokens [B, L],)                       ([L, L],)                     (tables,)
    prefixed      (prefix [B, P], suffix keys [N, P+C])  ([P, P], [C, P + C])          (prefix's, suffix's)
    cached        (new tokens [B, L], slots [B, S])      ([L, L], [L, S])              (new tokens',)
    ============  =====================================  ===========================  ==============================
    ``start``: the cache slot of the first new token; ``empty``: the cache holds nothing yet (a prefill);
    ``positions``: each group's rotary positions, from which a mixer of another head size makes its own RoPE tables
    (``jodpo.models.global_attention``)."""

    mask: tuple
    dist: tuple
    rope: tuple
    start: Any = None
    empty: bool = False
    positions: tuple = ()


def recomputed(f):
    """``f`` differentiated from its inputs alone: its backward recomputes what it needs instead of keeping it from the
    forward. For the cheap elementwise pieces of a layer whose autodiff residuals outweigh their inputs: a LayerNorm
    keeps three float32 copies of its input (an input in bf16: 12x its bytes), an exact GELU four copies of the MLP's
    widest activation. A forward that is not differentiated (sampling, scoring) runs ``f`` as it is."""
    return jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)


def norm(model: Model, p: Params, x: jax.Array, over: int = 1) -> jax.Array:
    """The model's norm over the last ``over`` axes of ``x`` (hidden states ``[..., D]``, a head's ``[..., Dh]``, or a
    whole projection's ``[..., H, Dh]``); ``p`` None: an RMSNorm without a scale (Gemma 4's value norm)."""
    return recomputed(functools.partial(_normalise, model, over=over))(p, x)


def _normalise(model: Model, p: Params | None, x_BLD: jax.Array, over: int = 1) -> jax.Array:
    x, axes, n = x_BLD.astype(jnp.float32), tuple(range(-over, 0)), model.norms
    if n.kind == "rmsnorm":
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axes, keepdims=True) + n.eps)
        if p is None:
            return y.astype(x_BLD.dtype)
        if n.offset or n.scale_f32:
            # As Gemma's (and OLMo 2's) RMSNorm: x * (offset + w) in float32 (w as the compute dtype holds it), then
            # the cast.
            w = p["scale"].astype(x_BLD.dtype).astype(jnp.float32)
            return (y * (n.offset + w)).astype(x_BLD.dtype)
        # As transformers' LlamaRMSNorm: normalise in float32, cast back, then scale.
        return p["scale"].astype(x_BLD.dtype) * y.astype(x_BLD.dtype)
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + n.eps) * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x_BLD.dtype)


BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes that split a batch (jodpo.parallel.sharding's mesh)


def rows_split(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` split by its rows (its first axis) over the batch axes (``BATCH_AXES``) of the mesh the parameter ``like``
    sits on, where they divide it; as it is without such a mesh. The embeddings' lookup says so: left to itself XLA
    kept the table's split (its hidden size over ``fsdp``) for the looked-up rows, and every chip then ran the layers
    on the whole batch, a slice of the hidden size each, with an all-reduce per product. XLA:TPU's temporaries of the
    step on 8 v5e chips: Gemma 4 E2B 23.6 -> 16.8 GiB, Gemma 3 4B 21.4 -> 16.2, Qwen3-1.7B's peak 12.8 -> 10.9.

    With ``data`` beside another batch axis, the rows are split over ``data`` first: rows looked up from a parameter
    are whole over ``data`` (it splits no parameter), so that is a slice of what each chip holds, and the rest a
    reshard within each ``data`` group. In one step (hidden size over fsdp, whole over data -> rows over data x fsdp)
    XLA's partitioner finds no collective for it and gathers the whole array on every chip, forward and backward
    ("Involuntary full rematerialization": 32 of them in a step on a (2, 2, 2) mesh)."""
    mesh, axes = _batch_split(x.shape[0], like)
    if not axes:
        return x
    P = jax.sharding.PartitionSpec
    if len(axes) > 1 and axes[0] == "data":
        x = jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, P("data", *[P.UNCONSTRAINED] *
                                                                                   (x.ndim - 1))))
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, P(axes)))


def row_shards(rows: int, like: jax.Array) -> int:
    """How many parts ``rows_split`` splits ``rows`` rows into beside the parameter ``like`` (1 without a mesh)."""
    mesh, axes = _batch_split(rows, like)
    return math.prod(dict(mesh.shape)[a] for a in axes)


def batch_axes(mesh) -> tuple[str, ...]:
    """The batch axes (``BATCH_AXES``) of ``mesh`` that have more than one device."""
    sizes = dict(mesh.shape) if mesh.axis_names else {}
    return tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)


def _batch_split(rows: int, like: jax.Array):
    """``(mesh, axes)``: the mesh ``like`` sits on, and its batch axes of more than one device where together they
    divide ``rows`` (else none)."""
    mesh = jax.typeof(like).sharding.mesh
    axes = batch_axes(mesh)
    return mesh, axes if axes and rows % math.prod(dict(mesh.shape)[a] for a in axes) == 0 else ()


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array on every process: on a mesh a forward's outputs are split
    by rows (``rows_split``), over the processes of a job of several."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def embed(model: Model, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings in the compute dtype, times ``model.embed_scale`` rounded to that dtype (Gemma's sqrt(D),
    as transformers' ScaledWordEmbedding rounds its float32 buffer to the weights' dtype)."""
    dt = jnp.dtype(model.dtype)
    x = rows_split(jnp.take(params["embed"], tokens, axis=0).astype(dt), params["embed"])
    if model.embed_scale != 1.0:
        x = x * jnp.asarray(np.float32(model.embed_scale)).astype(dt)
    return x


def rope(attn: Attention, x_BLHD: jax.Array, cos_BLR: jax.Array, sin_BLR: jax.Array) -> jax.Array:
    """Rotary embedding on the first ``attn.rope.rotary_dim`` dims, rotate-half convention (HF, NeoX and Llama)."""
    r = attn.rope.rotary_dim
    x_rot, x_pass = x_BLHD[..., :r], x_BLHD[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = jnp.concatenate([-x2, x1], -1)
    cos, sin = cos_BLR[:, :, None, :].astype(x_BLHD.dtype), sin_BLR[:, :, None, :].astype(x_BLHD.dtype)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], -1)


def _tables(inv_freq, positions_BL, scale: float = 1.0):
    freqs = positions_BL.astype(jnp.float32)[..., None] * jnp.asarray(np.asarray(inv_freq, np.float32))
    emb = jnp.concatenate([freqs, freqs], -1)
    if scale != 1.0:  # YaRN's attention factor, on cos and sin in float32 as transformers applies it
        return jnp.cos(emb) * np.float32(scale), jnp.sin(emb) * np.float32(scale)
    return jnp.cos(emb), jnp.sin(emb)


def rope_tables(r: Rope, positions_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of the positions, ``[B, L, R]``; with ``r.local_inv_freq`` the global layers' and the local
    layers' stacked, ``[2, B, L, R]`` (``layer_rope`` picks a layer's)."""
    main = _tables(r.inv_freq, positions_BL, r.scale)
    if not r.local_inv_freq:
        return main
    local = _tables(r.local_inv_freq, positions_BL)
    return jnp.stack([main[0], local[0]]), jnp.stack([main[1], local[1]])


def layer_rope(attn: Attention, tables, site: Site) -> tuple[jax.Array, jax.Array]:
    """One layer's ``(cos, sin)`` out of ``rope_tables(attn.rope, ...)``: the local ones on a sliding-window layer
    (``attn.window``) where the rope has them; on a layer without RoPE (``site.rope`` 0) cos 1 and sin 0, which rotate
    nothing (x * 1 + rotate_half(x) * 0 is x exactly)."""
    if attn.rope.local_inv_freq:
        tables = tuple(t[1] if attn.window else t[0] for t in tables)
    if attn.rope.nope_layers:
        on = jnp.asarray(site.rope) > 0
        tables = (jnp.where(on, tables[0], 1.0), jnp.where(on, tables[1], 0.0))
    return tables


def per_layer_inputs(model: Model, params: Params, tokens_BL: jax.Array, x_BLD: jax.Array) -> jax.Array:
    """Gemma 4's per-layer inputs of the tokens, layer-major ``[N, B, L, Dp]`` (as the layer scan reads them): each
    token's N x Dp values in the per-layer table (stored ``[N * Dp, V]``; times sqrt(Dp) rounded to the compute dtype,
    as its scaled embedding) plus the RMSNorm of the scaled embeddings ``x`` projected to every layer's Dp values
    (times D^-1/2), times 2^-1/2."""
    Dp, dt, packed = model.per_layer_embeddings.dim, x_BLD.dtype, params["embed_per_layer"]  # [N * Dp, V]
    table = jnp.moveaxis(jnp.take(packed, tokens_BL, axis=1), 0, -1)  # each chip's share of every token's values
    table = rows_split(table.astype(dt), packed)  # then the batch's rows, all values
    table = table.reshape(*tokens_BL.shape, -1, Dp) * jnp.asarray(np.float32(Dp ** 0.5)).astype(dt)  # [B, L, N, Dp]
    proj = einsum(model, "bld,dnk->blnk", x_BLD, params["per_layer_proj"].astype(dt)) * model.hidden_size ** -0.5
    return ((norm(model, params["per_layer_norm"], proj) + table) * 2 ** -0.5).transpose(2, 0, 1, 3)


def per_layer_block(model: Model, p: Params, x_BLD: jax.Array, inputs_BLK: jax.Array) -> jax.Array:
    """``x`` plus the RMSNorm of its gated projection times the layer's per-layer inputs, projected back (Gemma 4's
    ``per_layer_input_gate``, ``per_layer_projection``, ``post_per_layer_input_norm``; after the MLP's residual)."""
    dt = x_BLD.dtype
    act = ACTIVATIONS[model.per_layer_embeddings.activation]
    h = act(einsum(model, "bld,dk->blk", x_BLD, p["ple"]["ple_gate"].astype(dt)))
    h = einsum(model, "blk,kd->bld", h * inputs_BLK.astype(dt), p["ple"]["ple_proj"].astype(dt))
    return x_BLD + norm(model, p["ple_norm"], h)


def queries(model: Model, attn: Attention, p: Params, x_BLD, cos, sin):
    """Rotated queries [B, L, H, Dh] of the new tokens."""
    dt = x_BLD.dtype
    q = einsum(model, "bld,dhk->blhk", x_BLD, p["q"].astype(dt))
    if model.qkv_bias:
        q = q + p["q_bias"].astype(dt)
    if attn.options.qk_norm:
        q = _qk_norm(model, attn, p["q_norm"], q)
    return rope(attn, q, cos, sin)


def keys_values(model: Model, attn: Attention, p: Params, x_BLD, cos, sin):
    """Rotated keys and values [B, L, K, Dh] of the new tokens (``attn.options.k_eq_v``: the values are the keys as
    projected, before their norm and RoPE; ``v_norm``: normed without a scale)."""
    dt = x_BLD.dtype
    k = einsum(model, "bld,dhk->blhk", x_BLD, p["k"].astype(dt))
    if model.qkv_bias:
        k = k + p["k_bias"].astype(dt)
    o = attn.options
    if o.k_eq_v:
        v = k
    else:
        v = einsum(model, "bld,dhk->blhk", x_BLD, p["v"].astype(dt))
        if model.qkv_bias:
            v = v + p["v_bias"].astype(dt)
    if o.qk_norm:
        k = _qk_norm(model, attn, p["k_norm"], k)
    if o.v_norm:
        v = norm(model, None, v)
    return rope(attn, k, cos, sin), v


def _qk_norm(model: Model, attn: Attention, p: Params, x_BLHD):
    """The q or k norm: over each head's ``[Dh]``, or (``"whole"``) over the whole projection's ``[H, Dh]``."""
    return norm(model, p, x_BLHD, 2 if attn.options.qk_norm == "whole" else 1)


def attention(model: Model, q_BLHD, k_BKSD, v_BKSD, attend_BLS) -> jax.Array:
    """Softmax attention of L queries over S key slots (float32 scores): ``[B, L, H, Dh]``, before the output
    projection. Keys and values are head-major ``[B, K, S, Dh]`` (the cache's layout), so the batched dots read
    them in place rather than transposing a whole cache slab every decode step. The scale: ``model.query_scale``, or
    the heads' ``Dh ** -0.5`` (the shapes are the layer's kind's: ``Attention``)."""
    dt = q_BLHD.dtype
    B, L, H, Dh = q_BLHD.shape
    K = k_BKSD.shape[1]
    q_BLKGD = q_BLHD.reshape(B, L, K, H // K, Dh)  # head h reads kv head h // G, as transformers' repeat_kv
    scores = einsum(model, "blkgd,bksd->bkgls", q_BLKGD, k_BKSD.astype(dt), preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5 if model.query_scale is None else model.query_scale)
    if model.attn_softcap:  # as transformers: after the scale, before the mask
        scores = jnp.tanh(scores / model.attn_softcap) * model.attn_softcap
    scores = jnp.where(attend_BLS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return einsum(model, "bkgls,bksd->blkgd", probs, v_BKSD.astype(dt)).reshape(B, L, H, Dh)


def cache_attention(model: Model, q_BLHD, k_BKSD, v_BKSD, attend_BLS, j=None) -> jax.Array:
    """``attention`` over a cache's slots: one layer's ``[B, K, S, Dh]`` keys and values, or (``j``, an int32 index)
    layer ``j``'s of a stack ``[N, B, K, S, Dh]``. ``model.decode_attention == "pallas"`` runs a decode step (one new
    token a row) through ``jodpo.models.decode_attention``'s kernel, which reads only the cache blocks holding a slot
    the row attends to, the stacked cache's layer in place; several new tokens, or ``"xla"``: ``attention`` over the
    whole slab."""
    if model.decode_attention == "pallas" and q_BLHD.shape[1] == 1:
        return _pallas_decode(model, q_BLHD, k_BKSD, v_BKSD, attend_BLS, j)
    if j is not None:
        k_BKSD, v_BKSD = k_BKSD[j], v_BKSD[j]
    return attention(model, q_BLHD, k_BKSD, v_BKSD, attend_BLS)


def _pallas_decode(model: Model, q_BLHD, k, v, attend_BLS, j):
    """The decode kernel, per device on a mesh (``_sharded``)."""
    def run(q, k, v, attend, layer):
        return decode_attention.decode_attention(model, q, k, v, attend, None if j is None else layer)

    kv = ("rows", "heads") if j is None else (None, "rows", "heads")
    return _sharded(run, k, k.shape[-3], (q_BLHD, k, v, attend_BLS, jnp.int32(0) if j is None else j),
                    ("rows", None, "heads"), kv, kv, ("rows",), (), out=("rows", None, "heads"))


def _sharded(run, kv, kv_heads: int, args, *specs, out):
    """``run(*args)``, a Pallas kernel, on the mesh the keys and values ``kv`` sit on in a ``shard_map`` (XLA cannot
    partition a Pallas kernel: it would gather every operand to every device): each device its rows (``"rows"`` in
    an argument's spec: split as the batch's, ``BATCH_AXES``, where they divide it) and, where ``tensor`` divides the
    ``kv_heads``, its kv heads with the query heads that read them (``"heads"``). As it is without a mesh."""
    mesh = jax.typeof(kv).sharding.mesh
    if mesh.empty or mesh.size <= 1 or jax.sharding.AxisType.Manual in mesh.axis_types:
        return run(*args)
    _, rows = _batch_split(args[0].shape[0], kv)
    t = dict(mesh.shape).get("tensor", 1)
    names = {"rows": rows or None, "heads": "tensor" if t > 1 and kv_heads % t == 0 else None, None: None}
    P = jax.sharding.PartitionSpec
    spec = lambda axes: P(*(names[a] for a in axes))  # noqa: E731
    return jax.shard_map(run, mesh=mesh, in_specs=tuple(map(spec, specs)), out_specs=spec(out),
                         check_vma=False)(*args)


def within(window: int, dist):
    """Causal, and within ``window`` slots (0: no window), of ``dist`` = query slot - key slot."""
    return (dist >= 0) & (dist < window) if window else dist >= 0


def causal_attention(model: Model, q_BLHD, k_BSKD, v_BSKD, keys_BS, offset: int = 0, window: int = 0) -> jax.Array:
    """``forward_attention`` with the mask every cache-free forward and prefill has: query i (at slot ``offset + i``)
    attends to the real keys (``keys_BS``) at slots j <= offset + i, within ``window`` slots (0: none).
    ``model.attention == "splash"`` computes it with splash attention (``jodpo.models.splash``: the causal part and
    the window as its static mask, the real keys as segment ids) where the compute dtype is bfloat16."""
    if model.attention == "splash" and q_BLHD.dtype == jnp.bfloat16:
        tokens = ("rows", None, "heads")  # [B, L, heads, Dh]
        return _sharded(functools.partial(splash.splash_attention, model, offset=offset, window=window), k_BSKD,
                        k_BSKD.shape[2], (q_BLHD, k_BSKD, v_BSKD, keys_BS), tokens, tokens, tokens, ("rows",),
                        out=tokens)
    dist = offset + jnp.arange(q_BLHD.shape[1])[:, None] - jnp.arange(k_BSKD.shape[1])[None, :]
    return forward_attention(model, q_BLHD, k_BSKD, v_BSKD, keys_BS[:, None, :] & within(window, dist)[None])


def forward_attention(model: Model, q_BLHD, k_BSKD, v_BSKD, attend_BLS) -> jax.Array:
    """The attention of the cache-free forwards and the prefill, keys and values token-major ``[B, S, K, Dh]``
    (as the projections make them). ``model.attention``: ``"xla"``, jodpo's einsum attention (the decode steps'
    own; on a CPU it is 5% faster in a forward+backward than ``jax.nn.dot_product_attention``'s XLA version);
    ``"cudnn"``, cuDNN's flash attention through ``jax.nn.dot_product_attention`` (``library_attention``), except
    for a model that soft-caps its scores, which cuDNN cannot do (``jodpo.models.model.attention_note`` says so)."""
    if model.attention == "cudnn" and not model.attn_softcap:
        return library_attention(model, q_BLHD, k_BSKD, v_BSKD, attend_BLS, "cudnn")
    return attention(model, q_BLHD, k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3), attend_BLS)


def library_attention(model: Model, q_BLHD, k_BSKD, v_BSKD, attend_BLS, implementation: str) -> jax.Array:
    """``attention`` through ``jax.nn.dot_product_attention(implementation=...)``. The boolean mask carries left
    padding, causality, sliding windows and the shared-prompt layout (cuDNN takes it as a bias); a query that sees
    no key (a pad slot) gets a finite, ignored value, as in ``attention``. float32 dots get ``model.precision``
    (jax reads the default precision when it traces them, the backward's too). The ``"xla"`` implementation is
    the CPU-testable twin of the ``"cudnn"`` call: same arguments, same mask. No soft-capping."""
    dt = q_BLHD.dtype
    scale = None if model.query_scale is None else model.query_scale  # None: jax's own 1/sqrt(head_dim)
    with jax.default_matmul_precision(model.precision if dt == jnp.float32 else None):
        return jax.nn.dot_product_attention(q_BLHD, k_BSKD.astype(dt), v_BSKD.astype(dt), mask=attend_BLS[:, None],
                                            scale=scale, implementation=implementation)
