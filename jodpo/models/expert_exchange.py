"""Expert parallelism's exchange of tokens on TPUs and GPUs: inside a ``shard_map`` over the ``expert`` axis, each
device sends the copies of its own tokens to the devices that hold their experts and gets the experts' outputs back,
two ``jax.lax.ragged_all_to_all`` calls (the dispatch MaxText and SkyRL tx use), instead of every device gathering
the whole group's tokens and the devices' outputs being summed.

Each device sorts its ``T x k`` copies by expert (expert ``e`` is on device ``e // here``, ``here = E / n``). From
every device's rows per expert, ``counts [n, E]`` (one all-gather of integers), every device computes the same
layout: on an expert's device its rows sit after those of the device's earlier experts, from every sender, and
within an expert in the senders' order. So the received rows are sorted by local expert, as the grouped matmuls read
them, with no second sort and no expert ids sent. The buffer holds the worst case (every copy of the group routed to
one device: ``n x T x k`` rows, as many as the gathering path sorts); the rows past those received are past the
groups, and the grouped matmuls skip them. The trip back swaps the offsets. XLA:CPU has no ragged all-to-all, so a
CPU keeps the gathering path (``jodpo.models.moe.expert_parallel``); the tests run this one there with an exchange
written from ``all_gather`` to ``ragged_all_to_all``'s definition (``exchange``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def plan(counts_nE: jax.Array, me: jax.Array, here: int):
    """From every device's rows per expert ``counts [n, E]``, device ``me``'s arguments for the trip there and back
    (``(input_offsets, send_sizes, output_offsets, recv_sizes)`` each, ``E`` slices: ``here`` a device) and the rows
    of each of its experts once received, ``[here]``."""
    n, E = counts_nE.shape
    total = jnp.sum(counts_nE, axis=0).reshape(n, here)
    start_E = (jnp.cumsum(total, axis=1) - total).reshape(E)  # where each expert's rows start on its device
    landing_nE = start_E + jnp.cumsum(counts_nE, axis=0) - counts_nE  # sender s's rows of expert e, there
    sorted_nE = jnp.cumsum(counts_nE, axis=1) - counts_nE  # the same rows in sender s's sorted copies
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, me * here, here, axis=1).reshape(-1)  # noqa: E731  [n x here]
    there = (sorted_nE[me], counts_nE[me], landing_nE[me], mine(counts_nE))
    back = (mine(landing_nE), mine(counts_nE), mine(sorted_nE), counts_nE[me])
    return there, back, total[me]


def dispatched(x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array, run_here, num_experts: int, axis: str,
               exchange=None) -> jax.Array:
    """The routed experts' weighted sum ``[T, D]`` of this device's tokens, inside a ``shard_map`` over ``axis``:
    the copies sent to their experts' devices, ``run_here(rows [R, D], sizes [here]) -> [R, D]`` there (rows sorted
    by this device's experts, those past the groups to come out zero), the outputs sent back, unsorted, weighted and
    summed. ``exchange``: ``jax.lax.ragged_all_to_all`` (None) or a function with its signature."""
    exchange = exchange or jax.lax.ragged_all_to_all
    (T, K), D, n = experts_TK.shape, x_TD.shape[-1], jax.lax.axis_size(axis)
    flat = experts_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts_nE = jax.lax.all_gather(jnp.bincount(flat, length=num_experts).astype(jnp.int32), axis)
    there, back, sizes = plan(counts_nE, jax.lax.axis_index(axis), num_experts // n)
    x_here = exchange(x_TD[order // K], jnp.zeros((n * T * K, D), x_TD.dtype), *there, axis_name=axis)
    y_here = run_here(x_here, sizes)
    y_sorted = exchange(y_here, jnp.zeros((T * K, D), y_here.dtype), *back, axis_name=axis)
    y_TKD = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(T, K, D)
    return jnp.sum(y_TKD * weights_TK[..., None], axis=1)
