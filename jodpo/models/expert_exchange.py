"""The experts of a mixture on a mesh of several devices (``expert_parallel``, called by
``jodpo.models.moe.sorted_experts``), and the routed experts' weighted sum on one device (``routed``).

On a mesh the experts run in a ``shard_map`` over every axis: each device takes its share of the tokens and, where
the ``expert`` axis splits the experts, the token copies reach their experts' devices and come back. On TPUs and
GPUs that is two ``jax.lax.ragged_all_to_all`` calls (the dispatch MaxText and SkyRL tx use): each device sorts its
``T x k`` copies by expert (expert ``e`` is on device ``e // here``, ``here = E / n``); from every device's rows per
expert, ``counts [n, E]`` (one all-gather of integers), every device computes the same layout (``plan``): on an
expert's device its rows sit after those of the device's earlier experts, from every sender, and within an expert in
the senders' order. So the received rows are sorted by local expert, as the grouped matmuls read them, with no second
sort and no expert ids sent. The buffer holds the worst case (every copy of the group routed to one device: ``n x T
x k`` rows, as many as the gathering path sorts); the rows past those received are past the groups, and the grouped
matmuls skip them. The trip back swaps the offsets (``dispatched``). XLA:CPU has no ragged all-to-all, so a CPU
gathers the group's tokens instead and adds the devices' outputs; the tests run the all-to-all path there with an
exchange written from ``all_gather`` to ``ragged_all_to_all``'s definition (``exchange``).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jodpo.models.layers import batch_axes
from jodpo.models.model import Model, Params

EXPERT_AXIS = "expert"  # the mesh axis that splits the experts (jodpo.parallel.sharding)
TENSOR_AXIS = "tensor"  # the one that splits their width


def routed(model: Model, p: Params, x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array, first,
           grouped) -> jax.Array:
    """The weighted sum ``[T, D]`` of the routed experts ``first ..`` whose weights ``p`` holds (all of them on one
    device); a token's other experts add nothing. Their copies of the tokens sort last, past the groups, and the
    grouped matmuls skip them."""
    (T, K), E = experts_TK.shape, p["gate"].shape[0]
    here = experts_TK.reshape(-1) - first
    group = jnp.where((here >= 0) & (here < E), here, E)  # E: an expert of another device
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=E + 1)[:E].astype(jnp.int32)
    x_MD = x_TD[order // K]
    y_MD = grouped(model, p, x_MD, sizes)
    y_TKD = jnp.zeros_like(y_MD).at[order].set(y_MD).reshape(T, K, -1)
    return jnp.sum(y_TKD * weights_TK[..., None], axis=1)


def mesh_of(w: jax.Array):
    """The mesh of more than one device the weights ``w`` sit on (their sharding, which ``jax.jit`` knows from its
    arguments while it traces), or None: one device, or inside a ``shard_map`` already (the weights there are the
    device's own)."""
    mesh = jax.typeof(w).sharding.mesh
    if mesh.empty or mesh.size <= 1 or jax.sharding.AxisType.Manual in mesh.axis_types:
        return None
    return mesh


def expert_parallel(model: Model, p: Params, x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array,
                    grouped, exchange=None) -> jax.Array:
    """``sorted_experts`` on the mesh of the experts' weights, in a ``shard_map`` over all of its axes: each device
    takes its share of the tokens (split as the batch is, over ``layers.BATCH_AXES``; padded to a multiple with rows
    of zero weight) and the experts' weights gathered over ``fsdp``, split by expert over the ``expert`` axis where
    its size divides their number, and by width over ``tensor`` where its size divides that (the partial outputs
    summed over it, in float32). A TPU's Pallas kernels run only in such a region: XLA cannot partition them.

    With the experts split over ``expert`` (n ways): on a TPU or a GPU each device sends the copies of its tokens to
    their experts' devices and gets the outputs back (``dispatched``: two ragged all-to-alls; also on a CPU given
    ``exchange``, the tests'). On a CPU, which has no ragged all-to-all, every device gathers its group's
    tokens, runs the copies routed to its own E / n experts (from ``axis_index x E / n``), and the devices' sums are
    added and split again (``psum_scatter``, in float32). The gradient is the same map's. Only the chosen experts'
    weights are read, each on its own device."""
    mesh = jax.typeof(p["gate"]).sharding.mesh
    sizes, E, F = dict(mesh.shape), model.moe.num_experts, p["gate"].shape[-1]
    n = sizes.get(EXPERT_AXIS, 1) if E % sizes.get(EXPERT_AXIS, 1) == 0 else 1  # else the axis is one more fsdp
    expert = EXPERT_AXIS if n > 1 else None
    tensor = TENSOR_AXIS if sizes.get(TENSOR_AXIS, 1) > 1 and F % sizes[TENSOR_AXIS] == 0 else None
    batch = batch_axes(mesh)
    T, parts = x_TD.shape[0], math.prod(sizes[a] for a in batch)
    tokens = [jnp.pad(a, [(0, -T % parts)] + [(0, 0)] * (a.ndim - 1)) for a in (x_TD, experts_TK, weights_TK)]
    weights = {k: p[k] for k in ("gate", "up", "down")}
    specs = {"gate": P(expert, None, tensor), "up": P(expert, None, tensor), "down": P(expert, tensor, None)}

    def gathered(w, x, experts, route_weights):
        first = jax.lax.axis_index(EXPERT_AXIS) * (E // n)
        x, experts, route_weights = (jax.lax.all_gather(a, EXPERT_AXIS, tiled=True) for a in (x, experts,
                                                                                              route_weights))
        y = routed(model, w, x, experts, route_weights, first, grouped)
        return jax.lax.psum_scatter(y.astype(jnp.float32), EXPERT_AXIS, tiled=True)

    def sent(w, x, experts, route_weights):
        here = lambda rows, groups: grouped(model, w, rows, groups)  # noqa: E731
        return dispatched(x, experts, route_weights, here, E, EXPERT_AXIS, exchange).astype(jnp.float32)

    def body(w, x, experts, route_weights):
        if n == 1:
            y = routed(model, w, x, experts, route_weights, 0, grouped).astype(jnp.float32)
        elif exchange is not None:
            y = sent(w, x, experts, route_weights)
        else:
            y = jax.lax.platform_dependent(w, x, experts, route_weights, cpu=gathered, default=sent)
        return (jax.lax.psum(y, tensor) if tensor else y).astype(x.dtype)

    run = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(batch), P(batch), P(batch)), out_specs=P(batch),
                        check_vma=False)
    return run(weights, *tokens)[:T]


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
