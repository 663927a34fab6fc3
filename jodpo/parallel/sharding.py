"""Device meshes, the logical-axis rules, and shardings of parameters, optimizer state and batches.

One mesh with four axes:
- ``data``: pure data parallelism (parameters replicated);
- ``fsdp``: data parallelism with parameters, gradients and optimizer state split (ZeRO-3 / FSDP);
- ``expert``: expert parallelism: a mixture of experts' experts split by expert (their weights, gradients and Adam
  moments), the tokens reaching their experts inside the MoE block (``jodpo.models.expert_exchange.expert_parallel``); outside
  the experts it is one more FSDP axis (the batch and the other parameters' ``embed`` split over it too), so no
  device repeats another's work;
- ``tensor``: tensor parallelism (attention heads, MLP width and vocabulary split).
The batch axis is split over ``data`` x ``fsdp`` x ``expert``. Every parameter names its axes logically
(``jodpo.models.param_axes``: ``vocab``, ``embed``, ``heads``, ...); ``RULES`` maps those names to mesh axes
in this one place. An axis whose size the mesh axis does not divide stays whole (replicated), so tiny
models and odd head counts work on any mesh. Optimizer state follows the parameter it belongs to.

Arrays are placed with ``jax.make_array_from_callback``, which asks each process only for the pieces its
own devices hold, so the same code runs on one device, eight, or a multi-host pod.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jodpo.errors import MeshError
from jodpo.models.decoder import Model, Params
from jodpo.models import layers
from jodpo.models.params import param_specs

AXES = ("data", "fsdp", "expert", "tensor")  # tensor innermost: its collectives are per layer and the most frequent
BATCH = layers.BATCH_AXES  # the mesh axes that split a batch
# logical parameter axis -> mesh axes, in order (None: never split): ``embed`` over fsdp and the expert axis where
# the parameter is not split by expert already (an expert's weights: over fsdp alone); ``layer_values``, a token's
# N x Dp values in Gemma 4's per-layer table (35 x 256 in E2B; the table is stored [N * Dp, V], vocabulary minor),
# over every axis but data. Each chip then looks up every token's share of the values, and the batch's split takes
# them apart (``layers.rows_split``). XLA:TPU's temporaries of Gemma 4 E2B's step on 8 v5e chips: split by its Dp
# (a chip's 32 values padded to 128 lanes) 34.9 GiB a chip; by its rows 16.8 (each chip looks up every token from
# its rows, a [128, 512, 35, 256] partial the chips add up); by its values 16.3, and 8.7 with the LM head in chunks of
# tokens (``logprobs.token_logprobs``), where stored [V, N * Dp] it was 15.6 (XLA:TPU lays a chip's 1120 values out
# minor-major and copies the table, its moments and its gradient for the update).
RULES: dict[str | None, tuple[str, ...]] = {
    "vocab": ("tensor",), "embed": ("fsdp", "expert"), "heads": ("tensor",), "kv_heads": ("tensor",),
    "mlp": ("tensor",), "expert": ("expert",), "layer_values": ("tensor", "fsdp", "expert"), "layers": (),
    "head_dim": (), None: (),
}


def mesh_shape(data: int = 1, fsdp: int = -1, tensor: int = 1, n_devices: int | None = None, *,
               expert: int = 1) -> tuple[int, int, int, int]:
    """The four axis sizes in ``AXES`` order (data, fsdp, expert, tensor); one of them may be -1, meaning all the
    devices the others leave."""
    n = jax.device_count() if n_devices is None else n_devices
    sizes = [data, fsdp, expert, tensor]
    given = f"data={data}, fsdp={fsdp}, expert={expert}, tensor={tensor}"
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise MeshError(f"mesh ({given}): sizes must be >= 1, with at most one -1")
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % fixed:
            raise MeshError(f"mesh ({given}): {n} devices are not a multiple of {fixed}; choose sizes whose product "
                            f"divides {n}")
        sizes[sizes.index(-1)] = n // fixed
    if math.prod(sizes) != n:
        raise MeshError(f"mesh ({given}) needs {math.prod(sizes)} devices, there are {n}; set mesh_data/mesh_fsdp/"
                        f"mesh_expert/mesh_tensor so their product is {n} (or use -1)")
    return tuple(sizes)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None, *, expert: int = 1) -> Mesh:
    """A ``Mesh`` over all devices (all processes) with axes ``data``, ``fsdp``, ``expert``, ``tensor``."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices), expert=expert)
    try:  # a physical-topology-aware order on TPU and GPU
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices)
    except Exception:  # noqa: BLE001 - e.g. fake CPU devices: plain order
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, AXES)


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways a batch is split: ``data`` x ``fsdp`` x ``expert``."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH)


def spec_for(shape: tuple[int, ...], axes: tuple, mesh: Mesh) -> P:
    """The partition spec of an array with these logical ``axes``: each axis goes to its mesh axes (``RULES``, in
    order) as far as their sizes multiply to a divisor of it and no earlier axis of the array took them, else stays
    whole. The expert axis is claimed first, so that an expert's weights split by expert, their ``embed`` over fsdp.
    Trailing whole axes are left out, as XLA writes the shardings of a program's outputs: jax tells ``P(x, None)``
    from ``P(x)`` when it looks a program up, so parameters placed with the one and returned by a step with the other
    would compile the step a second time."""
    order = sorted(range(len(axes)), key=lambda i: axes[i] != "expert")
    used, out = set(), [None] * len(axes)
    for i in order:
        taken, ways = [], 1
        for m in RULES.get(axes[i], ()):
            k = mesh.shape.get(m, 1)
            if m not in used and k > 1 and shape[i] % (ways * k) == 0:
                taken.append(m)
                ways *= k
        used.update(taken)
        out[i] = None if not taken else taken[0] if len(taken) == 1 else tuple(taken)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_shardings(model: Model, mesh: Mesh, specs: dict | None = None) -> Params:
    """``NamedSharding`` of every parameter (same tree as ``params``), or of the tree of ``(shape, axes)``
    ``specs`` given (LoRA adapters: ``jodpo.models.lora.adapter_specs``)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, spec_for(s[0], s[1], mesh)),
                        param_specs(model) if specs is None else specs,
                        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple))


def _dict_path(path) -> tuple[str, ...]:
    """The trailing dict keys of a tree path: where a leaf of an optimizer state sits in the params tree."""
    keys = []
    for k in reversed(path):
        if not isinstance(k, jax.tree_util.DictKey):
            break
        keys.append(k.key)
    return tuple(reversed(keys))


def like_params(abstract_tree, params_sharding: Params, mesh: Mesh):
    """Shardings for any tree whose array leaves mirror parameters (optimizer moments, gradients, a whole
    train state): a leaf that sits at a parameter's path (the trailing dict keys of its tree path) gets that
    parameter's sharding; anything else (step counters, keys) is replicated. (An optimizer whose state has
    other shapes at a parameter's path, e.g. factored moments, would need its own rule.)"""
    by_path = {_dict_path(p): s for p, s in jax.tree.leaves_with_path(params_sharding)}
    return jax.tree_util.tree_map_with_path(lambda p, _: by_path.get(_dict_path(p), replicated(mesh)), abstract_tree)


def batch_sharding(mesh: Mesh, ndim: int, axis: int = 1) -> NamedSharding:
    """Split axis ``axis`` (the batch axis; axis 0 of ``[A, B, ...]`` batches is the micro-batch) over
    ``data`` x ``fsdp`` x ``expert``."""
    spec = [None] * ndim
    spec[axis] = BATCH
    return NamedSharding(mesh, P(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a host array that every process holds (each process transfers only its pieces)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


to_host = layers.to_host  # the whole value of a (possibly multi-process) array on every process


def placer(mesh: Mesh) -> Callable[[Model, Any], Callable[[tuple[str, ...], np.ndarray], jax.Array]]:
    """``load_model``'s ``place`` for a mesh: each loaded host tensor (by its parameter path) goes where the mesh
    wants it, in the loading dtype."""
    def place(model: Model, dtype):
        shardings = {_dict_path(p): s for p, s in jax.tree.leaves_with_path(param_shardings(model, mesh))}
        return lambda path, host: put(np.asarray(host, dtype), shardings[tuple(path)])

    return place
