"""The mixture-of-experts feed-forward kind (``Model.moe``): its parameters, its router, its experts and the
load-balancing loss, exactly as transformers 5.24 computes the sparse blocks of Qwen3-MoE, OLMoE, Qwen3.5-MoE,
Qwen3-Next and Gemma 4 26B-A4B.

Routing: the router's logits ``x . router`` in the compute dtype, a softmax over the experts in float32, the ``top_k``
most probable experts (ties to the lower index), their probabilities renormalised to sum to 1 where
``MoE.norm_topk_prob`` says, then cast to the compute dtype. Gemma 4's router (``MoE.router_norm``) reads the
residual stream through a scale-free RMSNorm times a learned scale and hidden_size^-1/2, and multiplies the
renormalised weights by a learned scale of each chosen expert. Routing replay forces the experts of chosen tokens
(``route``'s ``forced_TK``: the router's probabilities of the forced experts, renormalised, weigh them); ``block``
reports the router's own choice beside its logits (``Routing``). Each expert is a gated MLP of ``MoE.activation``.
Beside them, where ``MoE.shared_dim``, a shared expert every token takes, times sigmoid of its gate; or, where the
model has a dense MLP too (``Model.mlp``: Gemma 4), that MLP, each branch between norms of its own (``beside_mlp``).

The experts are dropless: every token reaches each of its k experts (no capacity, nothing dropped, so the numbers are
transformers'). The k copies of the tokens are sorted by expert, so that each expert's rows are contiguous, and run
through grouped matmuls, then unsorted and summed, weighted by their routing probabilities (``sorted_experts``). On a
TPU in bf16 the grouped matmuls are Pallas' megablox kernels (``grouped_megablox``: ``ragged_dot``'s weight gradient
is a dense contraction over every expert there); on a CPU, whose ``ragged_dot`` multiplies every row by every
expert's weights, a loop over tiles of rows, each tile one expert's, which visits only the tiles rows fill, so a
decode step reads only the chosen experts' weights (``grouped_tiles``); on a GPU, whose ``ragged_dot`` does the same,
``jax.lax.ragged_dot`` for a few rows (a decode step: the weights' reading is the cost) and the tiles for many
(``gpu_grouped``). ``dense_experts`` is the one-hot reference: every token through every expert, the outputs weighted
by the routing (tests, and ``bench.py moe``).

Parameters, stacked over the layers (``params["layers"]["moe"]``): ``router`` ``[D, E]``; ``gate``, ``up``
``[E, D, F]``; ``down`` ``[E, F, D]``; with a shared expert ``shared`` (``gate``, ``up`` ``[D, Fs]``, ``down``
``[Fs, D]``) and ``shared_gate`` ``[D, 1]``; Gemma 4's ``router_scale`` ``[D]``, ``expert_scale`` ``[E]`` and the
norms beside its dense MLP (``NORMS``).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jodpo.models import expert_exchange, mlp
from jodpo.models.layers import ACTIVATIONS, norm, recomputed
from jodpo.models.model import Model, MoE, Params, einsum

WEIGHTS = ("router", "gate", "up", "down", "shared_gate")
NORMS = ("pre_norm", "post_norm", "mlp_post_norm")  # beside a dense MLP (Gemma 4): the branches' own norms


def specs(model: Model, n: int) -> dict:
    """The parameters of ``n`` layers' MoE blocks, ``(shape, logical_axes)`` stacked on a ``layers`` axis."""
    m, D = model.moe, model.hidden_size
    E, F = m.num_experts, m.expert_dim
    out = {"router": ((n, D, E), ("layers", "embed", None)),
           "gate": ((n, E, D, F), ("layers", "expert", "embed", "mlp")),
           "up": ((n, E, D, F), ("layers", "expert", "embed", "mlp")),
           "down": ((n, E, F, D), ("layers", "expert", "mlp", "embed"))}
    if m.shared_dim:
        Fs = m.shared_dim
        out["shared"] = {"gate": ((n, D, Fs), ("layers", "embed", "mlp")),
                         "up": ((n, D, Fs), ("layers", "embed", "mlp")),
                         "down": ((n, Fs, D), ("layers", "mlp", "embed"))}
        out["shared_gate"] = ((n, D, 1), ("layers", "embed", None))
    if m.router_norm:  # Gemma 4: the router's learned scale of its normed input, and each expert's of its weight
        out["router_scale"] = ((n, D), ("layers", "embed"))
        out["expert_scale"] = ((n, E), ("layers", None))
    if "moe_and_mlp" in model.ffns:  # beside a dense MLP (Gemma 4): the experts' in and out norms, the MLP's out's
        scale = {"scale": ((n, D), ("layers", "embed"))} | (
            {"bias": ((n, D), ("layers", "embed"))} if model.norms.kind == "layernorm" else {})
        out |= {name: dict(scale) for name in NORMS}
    return out


class Routing(NamedTuple):
    """What a MoE layer's router did with its tokens: its logits (compute dtype; the load-balancing loss reads them)
    and the ``top_k`` experts it chose itself, int32, in its order (most probable first). The decoder's forwards stack
    them over the layers (``decoder.hidden_states(..., with_router=True)``): the sampler records the experts of its
    completion tokens, the training forward compares its own with them (routing replay)."""

    logits: jax.Array  # [..., E]
    experts: jax.Array  # i32[..., k]


def route(model: Model, router_DE: jax.Array, x_TD: jax.Array, forced_TK: jax.Array | None = None,
          expert_scale_E: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logits [T, E] in the compute dtype, weights [T, k] in the compute dtype, experts [T, k])`` of each token, as
    transformers' ``TopKRouter`` (``expert_scale_E``: Gemma 4's ``Gemma4TextRouter``, the weights times each chosen
    expert's scale, in float32, after the renormalisation). ``forced_TK`` (routing replay): i32[T, k] experts that
    replace the top-k choice of each token where they are >= 0 (-1: the token's own choice); their weights are still
    the router's probabilities of those experts, renormalised as the family does, so the router's gradient flows
    through them as through its own choice (Megatron's R3)."""
    m = model.moe
    logits = einsum(model, "td,de->te", x_TD, router_DE.astype(x_TD.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, m.top_k)
    if forced_TK is not None:
        experts = jnp.where(forced_TK >= 0, forced_TK, experts)
        top = jnp.take_along_axis(probs, experts, -1)
    if m.norm_topk_prob:
        top = top / jnp.sum(top, -1, keepdims=True)
    if expert_scale_E is not None:
        top = top * expert_scale_E.astype(jnp.float32)[experts]
    return logits, top.astype(x_TD.dtype), experts.astype(jnp.int32)


def own_experts(moe: MoE, logits: jax.Array) -> jax.Array:
    """i32[..., k]: the experts a router of these ``logits`` chooses (``route``'s top-k, ties to the lower index)."""
    return jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), moe.top_k)[1].astype(jnp.int32)


def _router_input(model: Model, p: Params, x_TD: jax.Array) -> jax.Array:
    """What the router reads: the tokens' hidden states, or (``MoE.router_norm``, Gemma 4) their scale-free RMSNorm
    times the learned ``router_scale`` and hidden_size^-1/2, in the compute dtype, as ``Gemma4TextRouter``."""
    if not model.moe.router_norm:
        return x_TD
    return norm(model, None, x_TD) * p["router_scale"].astype(x_TD.dtype) * model.hidden_size ** -0.5


def _swiglu(model: Model, x, w_gate, w_up, w_down, spec_in: str = "td,df->tf", spec_out: str = "tf,fd->td"):
    act = ACTIVATIONS[model.moe.activation]

    def down(gate, up, w):  # the backward keeps the projections' outputs and recomputes the activation
        return einsum(model, spec_out, act(gate) * up, w)

    gate = einsum(model, spec_in, x, w_gate.astype(x.dtype))
    up = einsum(model, spec_in, x, w_up.astype(x.dtype))
    return recomputed(down)(gate, up, w_down.astype(x.dtype))


def cpu_tile(rows: int, experts: int) -> int:
    """The CPU's tile of rows: a quarter more than an expert gets on average (``rows / experts``), in multiples of 8
    up to 128, so that most experts fill one tile and few rows are padding; below 8, the next power of two (a decode
    step's experts get a row or two each). One layer's forward and backward over 256 tokens on a 2-core CPU, float32,
    in one run: OLMoE's shape (32 rows an expert) tiles of 32: 2.30 s, 40: 2.07, 48: 2.02, 64: 2.11; Qwen3-30B-A3B's
    (16 rows) 16: 2.63, 24: 2.27, 32: 2.54. A decode step of 8 tokens at OLMoE's shape (1 row an expert; 2026-12-01,
    EPYC): tiles of 8: 0.54 s, 4: 0.47, 2: 0.35, 1: 0.34; of 32 tokens (4 rows) 8: 0.86, 4: 0.98, 2: 1.07."""
    t = -(-5 * rows // (4 * experts))
    return 1 << (t - 1).bit_length() if t <= 8 else min(128, -(-t // 8) * 8)


def grouped_tiles(model: Model, p: Params, x_MD: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """The experts on rows sorted by expert (``sizes_E`` rows each, in order; the rows past them, another device's
    experts', come out zero), one tile of rows at a time: each expert's rows padded to whole tiles, a loop over the
    tiles those fill, each through its expert's weights (the tiles past them are never visited: they run nothing and
    read no weights). Its backward is ``_tiles_bwd``'s."""
    (M, D), E = x_MD.shape, sizes_E.shape[0]
    t = cpu_tile(M, E)
    n = -(-(M + E * (t - 1)) // t)  # enough tiles for any split of M rows over E experts
    sizes = jnp.append(sizes_E, M - jnp.sum(sizes_E))  # group E: the rows of no expert here, in tiles never run
    padded = jnp.append((sizes_E + t - 1) // t * t, sizes[E])
    ends = jnp.cumsum(padded)
    group = jnp.repeat(jnp.arange(E + 1, dtype=jnp.int32), sizes, total_repeat_length=M)
    dest = (ends - padded)[group] + jnp.arange(M, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[group]
    tiles = jnp.zeros((n * t, D), x_MD.dtype).at[dest].set(x_MD).reshape(n, t, D)
    # each tile's expert: how many groups end at or before its first row (searchsorted's side="right", which jax
    # 0.10 cannot trace inside a shard_map); the experts' tiles come first, ends[E - 1] // t of them
    expert = jnp.sum(ends[None, :] <= (jnp.arange(n, dtype=jnp.int32) * t)[:, None], axis=1, dtype=jnp.int32)
    dt = x_MD.dtype
    out = _tiles(model, p["gate"].astype(dt), p["up"].astype(dt), p["down"].astype(dt), tiles, expert,
                 ends[E - 1] // t)
    return out.reshape(n * t, D)[dest]


def _across(a_KN: jax.Array) -> jax.Array:
    """``a`` transposed in memory, ``[N, K]`` (a weight's slice is copied anyway; a tile is small). Without the barrier
    XLA folds the transpose into the dot's dimension numbers, and XLA:CPU runs a dot whose operands are read across
    their rows (Eigen's, not YNNPACK's) at a third to a half of the speed."""
    return jax.lax.optimization_barrier(a_KN.T)


def _tile_forward(model: Model, w_gate, w_up, w_down, tiles_ntD, expert_n, used):
    """Each of the ``used`` tiles through its expert: the outputs ``[n, t, D]`` and the gate and up projections
    ``[n, t, F]`` (the backward's residuals); zeros for the tiles past them."""
    (n, t, _), F, act = tiles_ntD.shape, w_gate.shape[-1], ACTIVATIONS[model.moe.activation]

    def body(i, outs):
        x, e = tiles_ntD[i], expert_n[i]
        gate = einsum(model, "td,df->tf", x, w_gate[e])
        up = einsum(model, "td,df->tf", x, w_up[e])
        y = einsum(model, "tf,fd->td", act(gate) * up, w_down[e])
        return tuple(o.at[i].set(v) for o, v in zip(outs, (y, gate, up)))

    zeros = (jnp.zeros_like(tiles_ntD),) + (jnp.zeros((n, t, F), tiles_ntD.dtype),) * 2
    return jax.lax.fori_loop(0, used, body, zeros)  # (a traced count: the tiles past it never run)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiles(model: Model, w_gate, w_up, w_down, tiles_ntD, expert_n, used):
    return _tile_forward(model, w_gate, w_up, w_down, tiles_ntD, expert_n, used)[0]


def _tiles_fwd(model: Model, w_gate, w_up, w_down, tiles_ntD, expert_n, used):
    out, gate, up = _tile_forward(model, w_gate, w_up, w_down, tiles_ntD, expert_n, used)
    return out, (w_gate, w_up, w_down, tiles_ntD, expert_n, used, gate, up)


def _tiles_bwd(model: Model, res, d_out_ntD):
    """The tiles' backward. A loop over the used tiles does what reads an expert's weights: each tile's input's
    gradient, and the gradients of its gate and up projections with its hidden activation, kept for the weights'
    gradients. Those contract over the tiles' rows: the first tile of every expert in one product batched over the
    experts, which writes the three gradients whole (no buffer of zeros, nothing read back), then a loop adding in
    place the tiles past an expert's first (an expert with more rows than a tile). Adding every tile's products into
    zeros would read and write each expert's slot of all three once per tile (at OLMoE's layer over 256 tokens: 1.5 GiB
    of zeros made and 4.6 GB more read and written a step; docs/performance.md). Autodiff of the forward's loop would
    add a whole zero-padded copy of every weight's gradient per tile. The products read the weights as they are
    stored, wide dimension first."""
    w_gate, w_up, w_down, tiles_ntD, expert_n, used, gate_ntF, up_ntF = res
    (n, t, _), (E, _, F) = tiles_ntD.shape, w_gate.shape
    act = ACTIVATIONS[model.moe.activation]

    def body(i, carry):
        d_tiles, *kept = carry
        gate, up, dy, e = _across(gate_ntF[i]), _across(up_ntF[i]), d_out_ntD[i], expert_n[i]
        a, act_vjp = jax.vjp(act, gate)
        d_h = einsum(model, "fd,td->ft", w_down[e], dy)
        d_gate, d_up = act_vjp(d_h * up)[0], d_h * a
        dx = einsum(model, "df,ft->dt", w_gate[e], d_gate) + einsum(model, "df,ft->dt", w_up[e], d_up)
        return (d_tiles.at[i].set(dx.T), *(k.at[i].set(v) for k, v in zip(kept, (d_gate, d_up, a * up))))

    zeros = (jnp.zeros_like(tiles_ntD),) + (jnp.zeros((n, F, t), tiles_ntD.dtype),) * 3
    d_tiles, *kept_nFt = jax.lax.fori_loop(0, used, body, zeros)
    x_nDt = jax.lax.optimization_barrier(jnp.swapaxes(tiles_ntD, 1, 2))  # (as _across, each tile)

    def products(x_Dt, d_gate, d_up, h, dy, batch=""):  # the three weights' gradients of a tile (or a batch of tiles)
        return (einsum(model, f"{batch}dt,{batch}ft->{batch}df", x_Dt, d_gate),
                einsum(model, f"{batch}dt,{batch}ft->{batch}df", x_Dt, d_up),
                einsum(model, f"{batch}ft,{batch}td->{batch}fd", h, dy))

    # An expert's tiles are consecutive: the first of each is the first used tile of it; an expert with no rows has
    # none, and its gradients come out zero (its gathered tile masked)
    i_n = jnp.arange(n, dtype=jnp.int32)
    live = i_n < used
    starts = live & ((i_n == 0) | (expert_n != jnp.roll(expert_n, 1)))
    counts = jnp.sum((expert_n[None, :] == jnp.arange(E, dtype=jnp.int32)[:, None]) & live[None, :], axis=1)
    first_E, has_E = jnp.cumsum(counts) - counts, (counts > 0)[:, None, None]
    operands = (x_nDt, *kept_nFt, d_out_ntD)
    whole = products(*(jnp.where(has_E, a[first_E], 0) for a in operands), batch="e")
    extra = jnp.nonzero(live & ~starts, size=n, fill_value=0)[0]

    def add(j, whole):
        i = extra[j]
        return tuple(w.at[expert_n[i]].add(g) for w, g in zip(whole, products(*(a[i] for a in operands))))

    whole = jax.lax.fori_loop(0, jnp.sum(live & ~starts), add, whole)
    return (*whole, d_tiles, None, None)


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def grouped_ragged(model: Model, p: Params, x_MD: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """The experts on rows sorted by expert through ``jax.lax.ragged_dot`` (grouped matmuls: GPUs, TPUs in float32);
    the rows past ``sizes_E``'s come out zero."""
    dt = x_MD.dtype
    precision = jax.lax.Precision(model.precision) if dt == jnp.float32 else None
    dot = lambda x, w: jax.lax.ragged_dot(x, w.astype(dt), sizes_E, precision=precision)  # noqa: E731
    act = ACTIVATIONS[model.moe.activation]
    down = recomputed(lambda gate, up, w: dot(act(gate) * up, w))
    y_MD = down(dot(x_MD, p["gate"]), dot(x_MD, p["up"]), p["down"])
    return jnp.where((jnp.arange(x_MD.shape[0]) < jnp.sum(sizes_E))[:, None], y_MD, 0)


@functools.cache
def _megablox():
    """jax's megablox ops (``gmm`` with its custom VJP), or None where this jax has none at that path (an experimental
    module: every platform traces the TPU's branch, so a jax without it falls back to ``ragged_dot``, not to an
    error)."""
    try:
        from jax.experimental.pallas.ops.tpu.megablox import ops
    except ImportError:
        return None
    return ops if hasattr(ops, "gmm") else None


def megablox_tiling(rows: int, k: int, n: int, tile=(512, 512, 1024)) -> tuple[int, int, int]:
    """The TPU kernels' (rows, contracted, output) tile: ``tile``, smaller where the problem is (the rows in steps of
    128, which they are padded to a multiple of). (512, 512, 1024) at OLMoE's layer shape: 2.49 TFLOP and 38 GiB
    accessed in XLA:TPU's count of a v5p's forward and backward over 8,192 tokens, against 68 GiB with 128-tiles;
    (512, 1024, 1024) overflows the 16 MiB of VMEM a v5p kernel may take."""
    return min(tile[0], -(-rows // 128) * 128), min(tile[1], k), min(tile[2], n)


@functools.cache
def _tiling(tile: tuple[int, int, int]):
    """``megablox_tiling`` as the kernels' look-up function: ``gmm`` and ``tgmm`` call it with each product's own
    (rows, contracted, output), so the backward's products, whose contracted and output dimensions are the forward's
    swapped, get tiles valid for their own shapes. (A TPU block is a multiple of 128 or the whole dimension: the
    forward's tuple, reused there, put Gemma 4 26B-A4B's 704-wide block on its 2816-wide hidden dimension, and the
    step did not lower.)"""
    return lambda m, k, n: megablox_tiling(m, k, n, tile)


def grouped_megablox(model: Model, p: Params, x_MD: jax.Array, sizes_E: jax.Array, interpret: bool = False,
                     tile=(512, 512, 1024)):
    """The experts on rows sorted by expert through the Pallas TPU kernels of ``jax.experimental.pallas.ops.tpu.
    megablox`` (a TPU's bf16 runs): ``gmm`` forward, and its custom backward, ``gmm`` for the rows' gradient and
    ``tgmm`` for the weights', each over the groups' rows alone. XLA:TPU's own ``ragged_dot`` transposes the weights'
    gradient into a masked contraction over every expert (E times the FLOPs, and at OLMoE's shape the temporaries of a
    dense layer per expert). The kernels visit only the groups' rows and leave the others unwritten, so every output
    (and the input, for its gradient) is masked there; the rows past ``sizes_E``'s come out zero. ``interpret``: run
    the kernels in Pallas' interpreter (a CPU; the tests)."""
    megablox = _megablox()
    M, dt = x_MD.shape[0], x_MD.dtype
    tm = megablox_tiling(M, 1, 1, tile)[0]
    padded = -(-M // tm) * tm
    valid = (jnp.arange(padded) < jnp.sum(sizes_E))[:, None]

    def dot(x, w):  # (lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset, existing_out,
        tiling = _tiling(tuple(tile))  # transpose_rhs, interpret)
        return jnp.where(valid, megablox.gmm(x, w.astype(dt), sizes_E, dt, tiling, None, None, False, interpret), 0)

    act = ACTIVATIONS[model.moe.activation]
    down = recomputed(lambda gate, up, w: dot(act(gate) * up, w))
    x = jnp.where(valid, jnp.pad(x_MD, ((0, padded - M), (0, 0))), 0)
    return down(dot(x, p["gate"]), dot(x, p["up"]), p["down"])[:M]


def sorted_experts(model: Model, p: Params, x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array,
                   grouped=None):
    """The routed experts' weighted sum ``[T, D]``, dropless: the tokens' k copies sorted by expert, through the
    grouped matmuls, unsorted, times their weights, summed. ``grouped``: ``grouped_ragged``, ``grouped_megablox`` or
    ``grouped_tiles``; None: each platform's (``_platform_grouped``). Where the experts' weights sit on a mesh of
    several devices, each device runs its own tokens (and, where the ``expert`` axis splits them, its own experts):
    ``expert_exchange.expert_parallel``."""
    if grouped is None:
        grouped = _platform_grouped
    if expert_exchange.mesh_of(p["gate"]) is not None:
        return expert_exchange.expert_parallel(model, p, x_TD, experts_TK, weights_TK, grouped)
    return expert_exchange.routed(model, p, x_TD, experts_TK, weights_TK, 0, grouped)


# XLA:GPU (jax 0.11.2) lowers ragged_dot to one dense product of every row with every expert's weights: E times the
# FLOPs, hidden behind reading the weights while the rows are few (a decode step), not over a sequence's. On an H200
# at OLMoE's layer (64 experts, 8 a token, bf16; bench.py moe): forward and backward over 2,048 tokens (16,384 rows),
# the tiles 22 ms, ragged_dot 63 ms; a decode step of 8 tokens (64 rows), the tiles 2.8 ms (a loop iteration per
# tile), ragged_dot 0.63 ms. Rows above this go through the tiles on a GPU; the crossover, estimated from those two
# points (ragged_dot ~1.2 us a row there, the tiles ~65 us a tile), is 4-6 thousand rows at OLMoE's and Qwen3-30B's.
GPU_RAGGED_ROWS = 4096


def gpu_grouped(rows: int):
    """A GPU's grouped matmuls for ``rows`` sorted rows: ``grouped_ragged`` up to ``GPU_RAGGED_ROWS``, else
    ``grouped_tiles``."""
    return grouped_ragged if rows <= GPU_RAGGED_ROWS else grouped_tiles


def _platform_grouped(model: Model, p: Params, x_MD: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """The tiles on a CPU; on a GPU ``ragged_dot`` for a few rows, the tiles for many (``gpu_grouped``); on a TPU the
    megablox kernels in bf16 (their dots take no precision: a float32 run keeps ``ragged_dot``'s, at the model's)."""
    tpu = grouped_megablox if x_MD.dtype == jnp.bfloat16 and _megablox() is not None else grouped_ragged
    return jax.lax.platform_dependent(p, x_MD, sizes_E, cpu=functools.partial(grouped_tiles, model),
                                      tpu=functools.partial(tpu, model),
                                      default=functools.partial(gpu_grouped(x_MD.shape[0]), model))


def dense_experts(model: Model, p: Params, x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array):
    """The one-hot reference of ``sorted_experts``: every token through every expert, the outputs summed with the
    routing weights (zero for the experts a token did not choose)."""
    E = model.moe.num_experts
    y_TED = _swiglu(model, x_TD, p["gate"], p["up"], p["down"], "td,edf->tef", "tef,efd->ted")
    w_TE = jnp.sum(jax.nn.one_hot(experts_TK, E, dtype=weights_TK.dtype) * weights_TK[..., None], axis=1)
    return jnp.sum(y_TED * w_TE[..., None], axis=1)


def block(model: Model, p: Params, x_BLD: jax.Array, experts=sorted_experts, forced: jax.Array | None = None,
          router_BLD: jax.Array | None = None) -> tuple[jax.Array, Routing]:
    """The MoE feed-forward of normed hidden states: ``(output [B, L, D], Routing of [B, L, ...])``. ``experts``:
    ``sorted_experts`` (dropless grouped matmuls) or ``dense_experts`` (the reference). ``forced``: i32[B, L, k] the
    experts each token takes instead of its own choice where >= 0 (``route``); the ``Routing`` still holds the
    router's own choice. ``router_BLD``: what the router reads where it is not ``x`` (Gemma 4: the layer's residual
    stream)."""
    B, L, D = x_BLD.shape
    x_TD = x_BLD.reshape(B * L, D)
    r_TD = x_TD if router_BLD is None else router_BLD.reshape(B * L, D)
    forced_TK = None if forced is None else forced.reshape(B * L, -1)
    logits, weights, chosen = route(model, p["router"], _router_input(model, p, r_TD), forced_TK,
                                    p.get("expert_scale"))
    out = experts(model, p, x_TD, chosen, weights)
    if model.moe.shared_dim:  # Qwen3.5-MoE, Qwen3-Next: a shared expert times sigmoid(its gate), added
        s = p["shared"]
        shared = _swiglu(model, x_TD, s["gate"], s["up"], s["down"])
        out = out + jax.nn.sigmoid(einsum(model, "td,dk->tk", x_TD, p["shared_gate"].astype(x_TD.dtype))) * shared
    own = chosen if forced is None else own_experts(model.moe, logits)
    return out.reshape(B, L, D), Routing(logits.reshape(B, L, -1), own.reshape(B, L, -1))


def beside_mlp(model: Model, p: Params, p_mlp: Params, x_BLD: jax.Array, normed_BLD: jax.Array,
               experts=sorted_experts, forced: jax.Array | None = None) -> tuple[jax.Array, Routing]:
    """The experts beside a dense MLP, as Gemma 4 26B-A4B's layer (``enable_moe_block``): the MLP on the layer's normed
    input (``pre_feedforward_layernorm``), its output normed (``mlp_post_norm``: ``post_feedforward_layernorm_1``),
    plus the experts on the residual stream ``x`` normed by their own ``pre_norm`` (``pre_feedforward_layernorm_2``),
    routed from ``x`` itself (``MoE.router_norm``), their output normed (``post_norm``:
    ``post_feedforward_layernorm_2``). ``(output [B, L, D], Routing)``; the decoder norms the sum
    (``post_feedforward_layernorm``) before the residual."""
    dense = norm(model, p["mlp_post_norm"], mlp.forward(model, model.mlp, p_mlp, normed_BLD))
    sparse, routing = block(model, p, norm(model, p["pre_norm"], x_BLD), experts, forced, router_BLD=x_BLD)
    return dense + norm(model, p["post_norm"], sparse), routing


def load_balancing_loss(moe: MoE, logits_NBLE: jax.Array, mask_BL: jax.Array) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer's): over every MoE layer's router logits
    ``[N, B, L, E]`` and the real tokens of ``mask``, the fraction of top-k assignments each expert got times its mean
    routing probability, summed over the experts, times their number. A float32 scalar."""
    E = moe.num_experts
    probs = jax.nn.softmax(logits_NBLE.astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(probs, moe.top_k)
    m = mask_BL.astype(jnp.float32)[None, :, :, None]
    counts = jnp.sum(jax.nn.one_hot(chosen, E, dtype=jnp.float32).sum(-2) * m, axis=(0, 1, 2))
    prob_sums = jnp.sum(probs * m, axis=(0, 1, 2))
    rows = logits_NBLE.shape[0] * jnp.sum(mask_BL.astype(jnp.float32))
    return jnp.sum((counts / rows) * (prob_sums / rows)) * E
