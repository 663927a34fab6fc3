"""The Gated DeltaNet mixer kind (Qwen3.5's and Qwen3-Next's ``linear_attention`` layers): linear attention with a
recurrent state, exactly as transformers' ``Qwen3_5GatedDeltaNet``. Its functions are the ones every mixer kind offers
the decoder (``jodpo.models.attention_mixer`` lists them).

A layer, per token: the hidden states of padding zeroed (and there g = beta = 0, and the convolution's window skips
it: padding leaves the state as it was); q, k ([Hk, Dk] heads), v, z ([Hv, Dv] heads) and b, a ([Hv]) projected by one
matmul (their weights side by side per key head, ``decode_params``); q, k, v through a causal depthwise convolution of
width ``conv_kernel`` and SiLU; q and k L2-normalised in float32, q scaled by Dk**-0.5; beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias) in float32; the gated delta rule (``jodpo.models.delta_rule``) with value head
h reading key head h // (Hv / Hk); a gated RMSNorm of the output (w * norm(o), times SiLU(z)); the output projection.

Its cache state, per layer: the convolution's window (the last ``conv_kernel - 1`` inputs of q, k, v, side by side
per key head: ``[B, W - 1, Hk, 2 Dk + G Dv]`` with G = Hv / Hk) and the recurrent state ``[B, Hv, Dk, Dv]`` in
float32: constant in the sequence's length. A prompt's state is computed once and every completion row continues from
a copy of it (the shared-prompt layout and the sampler's tiled prefill).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models.delta_rule import chunked_delta_rule, join_rows, joined_delta_rule, recurrent_delta_rule, split_rows
from jodpo.models.layers import Context
from jodpo.models.model import Model, Params, einsum

WEIGHTS = ("in_q", "in_k", "in_v", "in_z", "in_b", "in_a", "out")  # the projections LoRA can adapt
_CONV = ("conv_q", "conv_k", "conv_v")  # q, k, v: one convolution (``_conv``)
_IN = ("in_q", "in_k", "in_v", "in_z", "in_b", "in_a")  # one projection (``decode_params``), in this order


def specs(model: Model, n: int) -> dict:
    d, D = model.deltanet, model.hidden_size
    Hk, Hv, Dk, Dv, W = d.num_k_heads, d.num_v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel
    k_heads, v_heads = ("layers", "embed", "kv_heads", "head_dim"), ("layers", "embed", "heads", "head_dim")
    return {
        "in_q": ((n, D, Hk, Dk), k_heads), "in_k": ((n, D, Hk, Dk), k_heads), "in_v": ((n, D, Hv, Dv), v_heads),
        "in_z": ((n, D, Hv, Dv), v_heads),
        "in_b": ((n, D, Hv), ("layers", "embed", "heads")), "in_a": ((n, D, Hv), ("layers", "embed", "heads")),
        "conv_q": ((n, W, Hk, Dk), ("layers", None, "kv_heads", "head_dim")),
        "conv_k": ((n, W, Hk, Dk), ("layers", None, "kv_heads", "head_dim")),
        "conv_v": ((n, W, Hv, Dv), ("layers", None, "heads", "head_dim")),
        "dt_bias": ((n, Hv), ("layers", "heads")), "a_log": ((n, Hv), ("layers", "heads")),
        "gnorm": ((n, Dv), ("layers", "head_dim")),  # the gated norm's weight, w (not 1 + w)
        "out": ((n, Hv, Dv, D), ("layers", "heads", "head_dim", "embed")),
    }


def init(name: str, key: jax.Array, shape, dtype):
    """transformers' initialisation of the leaves that are not plain weights (None: the generic rule): dt_bias ones,
    A_log the log of uniform(0.01, 16) (kept away from -inf), the gated norm's weight ones."""
    if name in ("dt_bias", "gnorm"):
        return jnp.ones(shape, dtype)
    if name == "a_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)
    return None


def init_state(model: Model, batch: int, length: int, dtype) -> dict:
    d = model.deltanet
    W = d.conv_kernel - 1
    per_key_head = 2 * d.k_head_dim + d.num_v_heads // d.num_k_heads * d.v_head_dim  # q, k and its G value heads
    return {"conv": jnp.zeros((batch, W, d.num_k_heads, per_key_head), dtype),
            "rec": jnp.zeros((batch, d.num_v_heads, d.k_head_dim, d.v_head_dim), jnp.float32)}


def _conv(x_BLHD, window_BWHD, w_KHD, last_BW):
    """The causal depthwise convolution and SiLU over ``window`` (the inputs before) and ``x``, as transformers'
    ``causal_conv1d_fn``/``_update`` (the sum in float32, the result rounded to the compute dtype, then SiLU);
    returns the outputs and the new window: the inputs at ``last`` (``_window_slots``: the last real ones). q, k and
    v go through it as one (``_side_by_side``): one convolution and one window update a layer instead of three, in
    the compiled code of every decode step (the sampler unrolls its layers)."""
    dt, W, L = x_BLHD.dtype, w_KHD.shape[0], x_BLHD.shape[1]
    xw = jnp.concatenate([window_BWHD.astype(dt), x_BLHD], 1)  # [B, W - 1 + L, H, D]
    y = sum(xw[:, j:j + L].astype(jnp.float32) * w_KHD[j].astype(dt).astype(jnp.float32) for j in range(W))
    y = jax.nn.silu(y.astype(dt).astype(jnp.float32)).astype(dt)
    return y, jnp.take_along_axis(xw, last_BW[:, :, None, None], 1)


def _side_by_side(d, qkv):
    """q, k ``[..., Hk, Dk]`` and v ``[..., Hv, Dv]`` (inputs or convolution weights) as one ``[..., Hk, 2 Dk + G Dv]``:
    each key head beside its G value heads, so an axis that splits the heads over devices splits this one alike."""
    q, k, v = qkv
    return jnp.concatenate([q, k, v.reshape(*v.shape[:-2], d.num_k_heads, -1)], -1)


def _window_slots(mask_BL, W: int):
    """Where the convolution's next window comes from in ``concatenate([window, x])``: its last ``W - 1`` real
    inputs (the old window's count as real), so padding never enters it and a step on padding leaves it as it was."""
    real = jnp.concatenate([jnp.ones((mask_BL.shape[0], W - 1), bool), mask_BL.astype(bool)], 1)
    at = jnp.where(real, jnp.arange(real.shape[1], dtype=jnp.int32), -1)
    return jnp.sort(at, axis=1)[:, real.shape[1] - (W - 1):]


def _l2norm(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)


def _gated_norm(model: Model, w_D, o_BLHD, z_BLHD):
    """transformers' ``Qwen3NextRMSNormGated``: normalise in float32, round to the compute dtype, times w, times
    SiLU(z) in float32, rounded again."""
    dt = o_BLHD.dtype
    x = o_BLHD.astype(jnp.float32)
    y = (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + model.norms.eps)).astype(dt)
    y = (w_D.astype(dt) * y).astype(jnp.float32) * jax.nn.silu(z_BLHD.astype(jnp.float32))
    return y.astype(dt)


def decode_params(model: Model, p: Params) -> Params:
    """One layer's parameters (or a stack of them, under ``jax.vmap``) as the layer reads them: the input projections'
    weights, q, k, v, z, b and a, side by side per key head as ``"in"``, ``[D, Hk, 2 Dk + 2 G Dv + 2 G]``
    (``_side_by_side``'s layout, then z and b and a: one projection a layer, the first ``2 Dk + G Dv`` of each key
    head what the convolution reads), and the convolution's weights side by side as ``"conv"``. The sampler does it
    once a call (``params.decode_params``), not at every step; parameters already in this form are returned as they
    are."""
    if "in" in p:
        return p
    d = model.deltanet
    w_in = jnp.concatenate([p[name].reshape(p[name].shape[0], d.num_k_heads, -1) for name in _IN], -1)
    return {**{k: v for k, v in p.items() if k not in _IN + _CONV}, "in": w_in,
            "conv": _side_by_side(d, [p[name] for name in _CONV])}


def _projected(model: Model, p: Params, x_BLD, mask_BL):
    """The input projection of a group of tokens (``p`` from ``decode_params``): q, k and v side by side (what the
    convolution reads), z (the gated norm's gate), b and a."""
    dt, d = x_BLD.dtype, model.deltanet
    x = x_BLD * mask_BL[..., None].astype(dt)  # padding contributes nothing (transformers' apply_mask_to_padding)
    G = d.num_v_heads // d.num_k_heads
    conv_width = 2 * d.k_head_dim + G * d.v_head_dim
    return jnp.split(einsum(model, "bld,dhk->blhk", x, p["in"].astype(dt)),
                     [conv_width, conv_width + G * d.v_head_dim, conv_width + G * (d.v_head_dim + 1)], -1)


def _rule_inputs(model: Model, p: Params, qkv, z, b, a, mask_BL):
    """What the delta rule reads of the convolution's outputs ``qkv`` and the projection's z, b, a: q (L2-normalised,
    scaled), k (L2-normalised), v, g, beta; and z as the gated norm reads it."""
    dt, d = qkv.dtype, model.deltanet
    qk, v = jnp.split(qkv, [2 * d.k_head_dim], -1)
    # q and k L2-normalised together (one kernel, not one each), then q scaled by Dk**-0.5
    qk = _l2norm(qk.reshape(*qk.shape[:-1], 2, d.k_head_dim)) * np.array([[d.k_head_dim ** -0.5], [1.0]], np.float32)
    v, z = (y.reshape(*y.shape[:2], d.num_v_heads, d.v_head_dim) for y in (v, z))
    b, a = (y.reshape(*y.shape[:2], d.num_v_heads) for y in (b, a))
    # Padding is inert: no decay (g = 0) and no write (beta = 0), so the state after [x1 .. x5, pad, x6] is the state
    # after [x1 .. x6] (transformers runs sigmoid(0) and softplus(dt_bias) there: harmless only where the pads lead)
    real = mask_BL.astype(jnp.float32)[..., None]
    beta = jax.nn.sigmoid(b) * real.astype(dt)
    g = -jnp.exp(p["a_log"].astype(dt).astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(dt).astype(jnp.float32)) * real
    return (qk[..., 0, :], qk[..., 1, :], v, g, beta), z


def _rule_output(model: Model, p: Params, o_BLHD, z_BLHD):
    """The layer's output from the rule's: the gated norm, then the output projection."""
    dt = z_BLHD.dtype
    o_BLHD = _gated_norm(model, p["gnorm"], o_BLHD.astype(dt), z_BLHD)
    return einsum(model, "blhk,hkd->bld", o_BLHD, p["out"].astype(dt))


def _run(model: Model, p: Params, x_BLD, mask_BL, state: dict) -> tuple[jax.Array, dict]:
    """One layer over a group of tokens that follows ``state`` (zeros: nothing before)."""
    p = decode_params(model, p)
    qkv, z, b, a = _projected(model, p, x_BLD, mask_BL)
    qkv, window = _conv(qkv, state["conv"], p["conv"], _window_slots(mask_BL, model.deltanet.conv_kernel))
    rule_in, z = _rule_inputs(model, p, qkv, z, b, a, mask_BL)
    rule = recurrent_delta_rule if x_BLD.shape[1] == 1 else chunked_delta_rule  # one decode step: no chunk to solve
    o, rec = rule(*rule_in, state["rec"], precision=model.precision)
    return _rule_output(model, p, o, z), {"conv": window, "rec": rec}


def full(model: Model, p: Params, x, ctx: Context, site, kv=None):
    return _run(model, p, x, ctx.mask[0], init_state(model, x.shape[0], 0, x.dtype))[0], kv


def prefixed(model: Model, p: Params, xs, ctx: Context, site, kv=None):
    """The prefix from nothing; each suffix row (block layout) from its prefix's final convolution window and state,
    so the prefix's gradient gathers every suffix's. The layer runs on each prefix's row followed by its suffixes
    (``join_rows``): what works token by token (the projections, the rule's inputs, the gated norm) once over both
    groups' tokens, the convolution over the prefix and then each suffix from the prefix's window, the delta rule once
    over all of them (``joined_delta_rule``). One copy of each in the program, not one for each group."""
    (xp, xs_), p, K = xs, decode_params(model, p), model.deltanet.conv_kernel
    (B, P), n = xp.shape[:2], xs_.shape[0] // xp.shape[0]
    mask = join_rows(ctx.mask[0], ctx.mask[1][:, P:])
    qkv, z, b, a = _projected(model, p, join_rows(xp, xs_), mask)

    def suffixes(a):  # [B, P + n C, ...] -> the suffixes after each row's prefix, [B n, C, ...] (row b n + s)
        return a[:, P:].reshape(B * n, -1, *a.shape[2:])

    qkv_p, window = _conv(qkv[:, :P], init_state(model, B, 0, xp.dtype)["conv"], p["conv"],
                          _window_slots(mask[:, :P], K))
    qkv_s, _ = _conv(suffixes(qkv), jnp.repeat(window, n, 0), p["conv"], _window_slots(suffixes(mask), K))
    qkv = jnp.concatenate([qkv_p, qkv_s.reshape(B, -1, *qkv_s.shape[2:])], 1)
    rule_in, z = _rule_inputs(model, p, qkv, z, b, a, mask)
    o, _ = joined_delta_rule(*rule_in, P, n, precision=model.precision)
    return split_rows(_rule_output(model, p, o, z), P, n), kv


def cached(model: Model, p: Params, x, state: dict, j, ctx: Context, site) -> tuple[jax.Array, dict]:
    mine = state if j is None else jax.tree.map(lambda a: a[j], state)
    y, new = _run(model, p, x, ctx.mask[0], mine)
    if j is not None:
        new = jax.tree.map(lambda a, n: jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), j, 0), state, new)
    return y, new
