"""Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) for the cache-free forwards and the prefill
on TPUs (``Model.attention="splash"``): flash attention that skips the blocks its mask rules out, so no forward or
backward materialises a ``[L, S]`` score matrix and attention's temporaries grow with the sequence, not its square.

jodpo's forwards' attention masks (``layers.causal_attention``) are all of one form: query i (at slot ``offset + i``)
attends to key slot j where the key is a real token, j <= offset + i, and, in a windowed layer, offset + i - j <
window. The causal part and the window are splash's static masks (``CausalMask``, ``LocalMask`` with the offset: the
shared-prompt layout's completions sit after their prompt's P slots, offset P); which keys are real tokens is a
segment id per key (1 real, 0 padding), every query in segment 1, so a query attends exactly to the real keys the mask
allows, as in the XLA attention (a query that sees none, left padding's, gets some finite value there and here, never
read). The sequences are padded to a multiple of the kernel's blocks, the padding in segment 0.

The numbers: the scores in float32 from the queries times the scale (the scale folded into the queries, in the
compute dtype), soft-capped as ``layers.attention`` does, the softmax online over the blocks; gradients by the
kernel's own backward. bfloat16 compute only (``layers.causal_attention`` runs float32 on the XLA attention, whose
precision is ``Model.precision``'s). On TPUs the kernel compiles with Mosaic; lowered for another platform (a CPU:
the tests) it runs in Pallas' interpret mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from jodpo.models.model import Model

LANES = 128  # a kernel block's sequence length is a multiple of this; the sequences are padded to one


def _block(length: int) -> int:
    """The largest of 512, 256, 128 that divides ``length`` (a multiple of ``LANES``)."""
    return next(b for b in (512, 256, 128) if length % b == 0)


def _mask(q_len: int, kv_len: int, offset: int, window: int, heads: int):
    causal = (sm.LocalMask((q_len, kv_len), window_size=(window - 1, 0), offset=offset) if window
              else sm.CausalMask((q_len, kv_len), offset=offset))
    return sm.MultiHeadMask([causal] * heads)


def _kernel(q_len: int, kv_len: int, offset: int, window: int, heads: int, softcap: float, interpret: bool):
    """The splash kernel of one shape and mask (splash works its mask's block tables out in numpy, and keeps the last
    few: the kernel holds them as arrays of the trace that made it, so it is made again in each)."""
    bq, bkv = _block(q_len), _block(kv_len)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    return sk.make_splash_mha(_mask(q_len, kv_len, offset, window, heads), block_sizes=sizes, head_shards=1,
                              q_seq_shards=1, attn_logits_soft_cap=softcap or None, interpret=interpret)


def _run(q_BHLD, k_BKSD, v_BKSD, keys_BS, *, offset, window, softcap, interpret):
    B, H, L, _ = q_BHLD.shape
    S = k_BKSD.shape[2]
    kernel = _kernel(L, S, offset, window, H, softcap, interpret)
    segments = sk.SegmentIds(q=jnp.ones((B, L), jnp.int32), kv=keys_BS.astype(jnp.int32))
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s))(q_BHLD, k_BKSD, v_BKSD, segments)


def splash_attention(model: Model, q_BLHD, k_BSKD, v_BSKD, keys_BS, offset: int = 0, window: int = 0) -> jax.Array:
    """``layers.attention`` of L queries over S keys (token-major, as the projections make them) where query i at slot
    ``offset + i`` attends to the real keys (``keys_BS``) at slots j <= offset + i, within ``window`` slots (0: no
    window): ``[B, L, H, Dh]``, differentiable."""
    B, L, H, Dh = q_BLHD.shape
    S = k_BSKD.shape[1]
    Lp, Sp = -(-L // LANES) * LANES, -(-S // LANES) * LANES
    dt = q_BLHD.dtype
    scale = Dh ** -0.5 if model.query_scale is None else model.query_scale
    head_major = lambda x, n: jnp.pad(x.astype(dt), ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0))).transpose(  # noqa
        0, 2, 1, 3)
    q, k, v = head_major(q_BLHD * jnp.asarray(scale, dt), Lp), head_major(k_BSKD, Sp), head_major(v_BSKD, Sp)
    keys = jnp.pad(keys_BS, ((0, 0), (0, Sp - S)))
    run = functools.partial(_run, offset=offset, window=window, softcap=float(model.attn_softcap))
    out = jax.lax.platform_dependent(q, k, v, keys, tpu=functools.partial(run, interpret=False),
                                     default=functools.partial(run, interpret=True))
    return out.transpose(0, 2, 1, 3)[:, :L].astype(dt)
