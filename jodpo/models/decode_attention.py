"""A decode step's attention over the filled cache slots only: a Pallas kernel (``Model.decode_attention="pallas"``).

``layers.attention`` reads a row's whole cache slab at every decode step, filled or not. This kernel walks each row's
slots in blocks and reads only the blocks that hold a slot the row attends to: a table of each row's occupied blocks,
derived from the attention mask (``attend``) and prefetched into scalar memory, steers the kernel's input pipeline, so
a step past a row's last occupied block asks for the block it already holds and nothing is copied from HBM. Which
slots a row attends to comes from ``attend`` alone (the cache's per-slot mask and any causal or window limit its
caller applied), not from where the slots sit: a row's tokens may lie anywhere in its slab (a ring, a refilled row),
and a row that attends to nothing (a finished one) reads no block at all and gets zeros.

The numbers are ``layers.attention``'s for one query a row: float32 scores (``Model.precision`` on float32 dots), the
scale, the soft-cap before the mask, grouped kv heads (head h reads kv head h // G), the probabilities in the compute
dtype times the values; the softmax runs online over the blocks (flash attention's running maximum and sum), so the
output differs from the one-pass softmax by rounding only. On TPUs the kernel compiles with Mosaic; lowered for any
other platform (a CPU: the tests) it runs in Pallas' interpret mode, the same program step by step
(``jax.lax.platform_dependent`` picks at lowering, so a program compiled ahead of time for a TPU on a CPU host gets
the TPU kernel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jodpo.models.model import Model

BLOCKS = 8  # a row's slab in at most this many blocks (block_size), of at most MAX_BLOCK slots
MAX_BLOCK = 512


def block_size(slots: int) -> int:
    """The slots of a block over a slab of ``slots``: the smallest of 16, 32, ..., ``MAX_BLOCK`` that cuts it in at
    most ``BLOCKS`` blocks. A row reads up to a block beyond its last filled slot, half of one on average (at a
    prompt of 128 + 128 new tokens: blocks of 32, 8% more than the filled slots), and every block is a step of the
    kernel's grid, which costs its fixed overhead (a fraction of a microsecond on a TPU) whether it reads or not. A
    slab of at most 16 slots is one block."""
    if slots <= 16:
        return slots
    bs = 16
    while bs < MAX_BLOCK and -(-slots // bs) > BLOCKS:
        bs *= 2
    return bs


def kernel_reads(slots: int, filled: int) -> int:
    """The slots of a row's keys and values the kernel reads when its ``filled`` slots are the first ones (today's
    sampler's layout): whole blocks, up to the one holding the last filled slot (what ``bench.py traffic`` counts)."""
    bs = block_size(slots)
    return min(-(-filled // bs) * bs, slots)


def fetch_tables(attend_BS: jax.Array, bs: int):
    """Which block each step of the kernel's grid ``(row, step)`` computes and which it fetches, from the mask.

    Returns ``(count [B], blocks [B, n], fetch_row [B, n], fetch_block [B, n])``: row b's occupied blocks (a block
    holding a slot it attends to) are ``blocks[b, :count[b]]``, in order, and steps past ``count[b]`` compute nothing;
    step (b, j) fetches block ``fetch_block[b, j]`` of row ``fetch_row[b, j]``, which for a step that computes nothing
    is the last block fetched before it (the first one the grid computes, before any), so the pipeline, which copies a
    block only when its index changes, reads each occupied block once and nothing else."""
    B, S = attend_BS.shape
    n = -(-S // bs)
    occupied = jnp.pad(attend_BS, ((0, 0), (0, n * bs - S))).reshape(B, n, bs).any(-1)
    count = occupied.sum(-1, dtype=jnp.int32)
    blocks = jnp.argsort(~occupied, axis=-1, stable=True).astype(jnp.int32)  # the occupied first, in order
    computes = (jnp.arange(n, dtype=jnp.int32)[None] < count[:, None]).reshape(-1)
    step = jnp.arange(B * n, dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(computes, step, -1))  # the latest step at or before each that computes
    src = jnp.where(last >= 0, last, jnp.argmax(computes).astype(jnp.int32))
    return count, blocks, (src // n).reshape(B, n), blocks.reshape(-1)[src].reshape(B, n)


def _kernel(layer_ref, count_ref, blocks_ref, rows_ref, fetch_ref, q_ref, k_ref, v_ref, mask_ref, o_ref,
            m_ref, l_ref, acc_ref, *, scale, softcap, precision, n, slots):
    """One grid step (row b, step j): block ``blocks[b, j]`` of row b's keys and values into the running softmax."""
    b, j = pl.program_id(0), pl.program_id(1)
    dt = q_ref.dtype

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j < count_ref[b])
    def _():
        attend = mask_ref[0, 0] > 0  # [1, bs]
        for g in range(q_ref.shape[1]):  # each kv head and the G query heads that read it
            q, k, v = q_ref[0, g], k_ref[0, 0, g], v_ref[0, 0, g]  # [G, Dh], [bs, Dh], [bs, Dh]
            s = jax.lax.dot_general(q, k.astype(dt), (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * scale  # [G, bs]
            if softcap:  # as layers.attention: after the scale, before the mask
                s = jnp.tanh(s / softcap) * softcap
            s = jnp.where(attend, s, -jnp.inf)
            m_old = m_ref[g]  # [G, 1]
            m_new = jnp.maximum(m_old, s.max(-1, keepdims=True))  # finite: the block holds an attended slot
            p = jnp.where(attend, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_old - m_new)
            l_ref[g] = alpha * l_ref[g] + p.sum(-1, keepdims=True)
            v = v.astype(dt)
            if slots % v.shape[0]:  # a partial last block's slots past the slab hold whatever the copy left: zeroed,
                # so that 0 x NaN makes no NaN (a slot in the slab the row does not attend to holds a finite value)
                slot = fetch_ref[b, j] * v.shape[0] + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
                v = jnp.where(slot < slots, v, jnp.zeros((), dt))
            pv = jax.lax.dot_general(p.astype(dt), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
            acc_ref[g] = alpha * acc_ref[g] + pv
            m_ref[g] = m_new

    @pl.when(j == n - 1)
    def _():
        l = l_ref[...]
        o_ref[0] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def _call(q_BKGD, k_NBKSD, v_NBKSD, mask_Bn1b, tables, layer, *, bs, scale, softcap, precision, interpret):
    B, K, G, Dh = q_BKGD.shape
    n = tables[1].shape[1]

    def kv_map(b, j, layer, count, blocks, rows, fetch):
        return layer[0], rows[b, j], 0, fetch[b, j], 0

    def mask_map(b, j, layer, count, blocks, rows, fetch):
        return rows[b, j], fetch[b, j], 0, 0

    row_map = lambda b, j, *_: (b, 0, 0, 0)  # noqa: E731
    kv_spec = pl.BlockSpec((1, 1, K, bs, Dh), kv_map)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(B, n),
        in_specs=[pl.BlockSpec((1, K, G, Dh), row_map), kv_spec, kv_spec, pl.BlockSpec((1, 1, 1, bs), mask_map)],
        out_specs=pl.BlockSpec((1, K, G, Dh), row_map),
        scratch_shapes=[pltpu.VMEM((K, G, 1), jnp.float32), pltpu.VMEM((K, G, 1), jnp.float32),
                        pltpu.VMEM((K, G, Dh), jnp.float32)])
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, precision=precision, n=n,
                               slots=k_NBKSD.shape[3])
    return pl.pallas_call(
        kernel, grid_spec=grid, out_shape=jax.ShapeDtypeStruct(q_BKGD.shape, q_BKGD.dtype), interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name="jodpo_decode_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), *tables, q_BKGD, k_NBKSD, v_NBKSD, mask_Bn1b)


def decode_attention(model: Model, q_BLHD, k_BKSD, v_BKSD, attend_BLS, layer=None, block: int | None = None):
    """``layers.attention`` of one query a row (``L`` = 1) over the slots ``attend`` marks, reading only the blocks of
    ``block`` slots (``block_size``'s by default) that hold one: ``[B, 1, H, Dh]``. ``k``/``v``: one layer's cache
    ``[B, K, S, Dh]``, or (``layer``, an int32 scalar) a stack of them ``[N, B, K, S, Dh]`` of which it reads layer
    ``layer``'s in place. A row that attends to no slot gets zeros (``layers.attention`` gives it a finite mean of
    its slab's values: ignored either way)."""
    B, L, H, Dh = q_BLHD.shape
    if L != 1:
        raise ValueError(f"decode_attention attends one query a row (a decode step), got {L}")
    if layer is None:
        k_BKSD, v_BKSD, layer = k_BKSD[None], v_BKSD[None], 0
    K, S = k_BKSD.shape[2], k_BKSD.shape[3]
    bs = block or block_size(S)
    attend_BS = attend_BLS[:, 0]
    tables = fetch_tables(attend_BS, bs)
    n = tables[1].shape[1]
    # a block's slots as a tile of their own (a block's last two dims are the whole array's): [B, n, 1, bs]
    mask = jnp.pad(attend_BS, ((0, 0), (0, n * bs - S))).astype(jnp.int32).reshape(B, n, 1, bs)
    dt = q_BLHD.dtype
    kw = dict(bs=bs, scale=Dh ** -0.5 if model.query_scale is None else model.query_scale,
              softcap=model.attn_softcap, precision=jax.lax.Precision(model.precision) if dt == jnp.float32 else None)
    q = q_BLHD.reshape(B, K, H // K, Dh)  # head h reads kv head h // G, as transformers' repeat_kv
    args = (q, k_BKSD, v_BKSD, mask, tables, layer)
    out = jax.lax.platform_dependent(*args, tpu=functools.partial(_call, **kw, interpret=False),
                                     default=functools.partial(_call, **kw, interpret=True))
    return out.reshape(B, 1, H, Dh)
