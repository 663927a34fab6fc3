"""The mixture-of-experts feed-forward kind (``Model.moe``): its parameters, its router, its experts and the
load-balancing loss, exactly as transformers 5.24 computes the sparse blocks of Qwen3-MoE, OLMoE, Qwen3.5-MoE,
Qwen3-Next and Gemma 4 26B-A4B.

Routing: the router's logits ``x . router`` in the compute dtype, a softmax over the experts in float32, the ``top_k``
most probable experts (ties to the lower index), their probabilities renormalised to sum to 1 where
``MoE.norm_topk_prob`` says, then cast to the compute dtype. Gemma 4's router (``MoE.router_norm``) reads the
residual stream through a scale-free RMSNorm times a learned scale and hidden_size^-1/2, and multiplies the
renormalised weights by a learned scale of each chosen expert. Each expert is a gated MLP of ``MoE.activation``.
Beside them, where ``MoE.shared_dim``, a shared expert every token takes, times sigmoid of its gate; or, where the
model has a dense MLP too (``Model.mlp``: Gemma 4), that MLP, each branch between norms of its own (``beside_mlp``).

The experts are dropless: every token reaches each of its k experts (no capacity, nothing dropped, so the numbers are
transformers'). The k copies of the tokens are sorted by expert, so that each expert's rows are contiguous, and run
through grouped matmuls, then unsorted and summed, weighted by their routing probabilities (``sorted_experts``). On a
GPU or a TPU the grouped matmuls are ``jax.lax.ragged_dot``; on a CPU, whose ``ragged_dot`` multiplies every row by
every expert's weights, a scan over tiles of rows, each tile one expert's, which skips the tiles no row
fills, so a decode step reads only the chosen experts' weights (``grouped_tiles``). ``dense_experts`` is the one-hot reference: every
token through every expert, the outputs weighted by the routing (tests, and ``bench.py moe``).

Parameters, stacked over the layers (``params["layers"]["moe"]``): ``router`` ``[D, E]``; ``gate``, ``up``
``[E, D, F]``; ``down`` ``[E, F, D]``; with a shared expert ``shared`` (``gate``, ``up`` ``[D, Fs]``, ``down``
``[Fs, D]``) and ``shared_gate`` ``[D, 1]``; Gemma 4's ``router_scale`` ``[D]``, ``expert_scale`` ``[E]`` and the
norms beside its dense MLP (``NORMS``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jodpo.models import mlp
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
    if model.mlp is not None:  # beside a dense MLP (Gemma 4): the experts' input and output norms, the MLP's output's
        scale = {"scale": ((n, D), ("layers", "embed"))} | (
            {"bias": ((n, D), ("layers", "embed"))} if model.norms.kind == "layernorm" else {})
        out |= {name: dict(scale) for name in NORMS}
    return out


def route(model: Model, router_DE: jax.Array, x_TD: jax.Array, expert_scale_E: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(logits [T, E] in the compute dtype, weights [T, k] in the compute dtype, experts [T, k])`` of each token, as
    transformers' ``TopKRouter`` (``expert_scale_E``: Gemma 4's ``Gemma4TextRouter``, the weights times each chosen
    expert's scale, in float32, after the renormalisation)."""
    m = model.moe
    logits = einsum(model, "td,de->te", x_TD, router_DE.astype(x_TD.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, m.top_k)
    if m.norm_topk_prob:
        top = top / jnp.sum(top, -1, keepdims=True)
    if expert_scale_E is not None:
        top = top * expert_scale_E.astype(jnp.float32)[experts]
    return logits, top.astype(x_TD.dtype), experts.astype(jnp.int32)


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


def _tile(rows: int, experts: int) -> int:
    """The CPU's tile of rows: about what one expert gets (``rows / experts``), a power of two from 8 to 128."""
    t = 8
    while t < 128 and t < rows // experts:
        t *= 2
    return t


def grouped_tiles(model: Model, p: Params, x_MD: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """The experts on rows sorted by expert (``sizes_E`` rows each, in order), one tile of rows at a time: each
    expert's rows padded to whole tiles, a ``lax.scan`` over the tiles, each through its expert's weights (the tiles
    past the last filled one run nothing and read no weights). Its backward is ``_tiles_bwd``'s."""
    (M, D), E = x_MD.shape, sizes_E.shape[0]
    t = _tile(M, E)
    n = -(-(M + E * (t - 1)) // t)  # enough tiles for any split of M rows over E experts
    padded = (sizes_E + t - 1) // t * t
    ends = jnp.cumsum(padded)
    group = jnp.repeat(jnp.arange(E, dtype=jnp.int32), sizes_E, total_repeat_length=M)
    dest = (ends - padded)[group] + jnp.arange(M, dtype=jnp.int32) - (jnp.cumsum(sizes_E) - sizes_E)[group]
    tiles = jnp.zeros((n * t, D), x_MD.dtype).at[dest].set(x_MD).reshape(n, t, D)
    expert = jnp.searchsorted(ends, jnp.arange(n, dtype=jnp.int32) * t, side="right")  # E: a tile past the rows
    dt = x_MD.dtype
    out = _tiles(model, p["gate"].astype(dt), p["up"].astype(dt), p["down"].astype(dt), tiles, expert)
    return out.reshape(n * t, D)[dest]


def _tile_forward(model: Model, w_gate, w_up, w_down, tiles_ntD, expert_n):
    """Each tile through its expert: the outputs ``[n, t, D]`` and the gate and up projections ``[n, t, F]`` (the
    backward's residuals); zeros for the tiles past the rows."""
    E, act = w_gate.shape[0], ACTIVATIONS[model.moe.activation]

    def run(x, e):
        gate = einsum(model, "td,df->tf", x, w_gate[e])
        up = einsum(model, "td,df->tf", x, w_up[e])
        return einsum(model, "tf,fd->td", act(gate) * up, w_down[e]), gate, up

    def none(x, e):
        z = jnp.zeros((x.shape[0], w_gate.shape[-1]), x.dtype)
        return jnp.zeros_like(x), z, z

    def body(_, tile):
        x_tD, e = tile
        return None, jax.lax.cond(e < E, run, none, x_tD, jnp.minimum(e, E - 1))

    return jax.lax.scan(body, None, (tiles_ntD, expert_n))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiles(model: Model, w_gate, w_up, w_down, tiles_ntD, expert_n):
    return _tile_forward(model, w_gate, w_up, w_down, tiles_ntD, expert_n)[0]


def _tiles_fwd(model: Model, w_gate, w_up, w_down, tiles_ntD, expert_n):
    out, gate, up = _tile_forward(model, w_gate, w_up, w_down, tiles_ntD, expert_n)
    return out, (w_gate, w_up, w_down, tiles_ntD, expert_n, gate, up)


def _tiles_bwd(model: Model, res, d_out_ntD):
    """The tiles' backward, a second scan over them: from each tile's gate and up projections, its input's gradient
    (a tile) and its weights', added in place at the expert's slot of the weights' gradients (an expert's tiles are
    consecutive). Autodiff of the forward's scan would instead add a whole zero-padded copy of every weight's gradient
    per tile."""
    w_gate, w_up, w_down, tiles_ntD, expert_n, gate_ntF, up_ntF = res
    E, act = w_gate.shape[0], ACTIVATIONS[model.moe.activation]

    def grads(x, gate, up, dy, e):
        a, act_vjp = jax.vjp(act, gate)
        d_h = einsum(model, "td,fd->tf", dy, w_down[e])
        d_gate, d_up = act_vjp(d_h * up)[0], d_h * a
        dx = einsum(model, "tf,df->td", d_gate, w_gate[e]) + einsum(model, "tf,df->td", d_up, w_up[e])
        return (dx, einsum(model, "td,tf->df", x, d_gate), einsum(model, "td,tf->df", x, d_up),
                einsum(model, "tf,td->fd", a * up, dy))

    def none(x, gate, up, dy, e):
        return jnp.zeros_like(x), jnp.zeros_like(w_gate[0]), jnp.zeros_like(w_up[0]), jnp.zeros_like(w_down[0])

    def body(whole, tile):
        x, gate, up, dy, e = tile
        at = jnp.minimum(e, E - 1)  # a tile past the rows adds zeros to the last expert's
        dx, *dw = jax.lax.cond(e < E, grads, none, x, gate, up, dy, at)
        return tuple(w.at[at].add(g) for w, g in zip(whole, dw)), dx

    zeros = tuple(jnp.zeros_like(w) for w in (w_gate, w_up, w_down))
    whole, d_tiles = jax.lax.scan(body, zeros, (tiles_ntD, gate_ntF, up_ntF, d_out_ntD, expert_n))
    return (*whole, d_tiles, None)


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def grouped_ragged(model: Model, p: Params, x_MD: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """The experts on rows sorted by expert through ``jax.lax.ragged_dot`` (grouped matmuls: GPUs, TPUs)."""
    dt = x_MD.dtype
    precision = jax.lax.Precision(model.precision) if dt == jnp.float32 else None
    dot = lambda x, w: jax.lax.ragged_dot(x, w.astype(dt), sizes_E, precision=precision)  # noqa: E731
    act = ACTIVATIONS[model.moe.activation]
    down = recomputed(lambda gate, up, w: dot(act(gate) * up, w))
    return down(dot(x_MD, p["gate"]), dot(x_MD, p["up"]), p["down"])


def sorted_experts(model: Model, p: Params, x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array,
                   grouped=None):
    """The routed experts' weighted sum ``[T, D]``, dropless: the tokens' k copies sorted by expert, through the
    grouped matmuls, unsorted, times their weights, summed. ``grouped``: ``grouped_ragged`` or ``grouped_tiles``;
    None: each platform's (``ragged_dot`` on GPUs and TPUs, the tiles on a CPU)."""
    (T, K), E = experts_TK.shape, model.moe.num_experts
    flat = experts_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    x_MD = x_TD[order // K]
    if grouped is None:
        y_MD = jax.lax.platform_dependent(p, x_MD, sizes, cpu=functools.partial(grouped_tiles, model),
                                          default=functools.partial(grouped_ragged, model))
    else:
        y_MD = grouped(model, p, x_MD, sizes)
    y_TKD = jnp.zeros_like(y_MD).at[order].set(y_MD).reshape(T, K, -1)
    return jnp.sum(y_TKD * weights_TK[..., None], axis=1)


def dense_experts(model: Model, p: Params, x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array):
    """The one-hot reference of ``sorted_experts``: every token through every expert, the outputs summed with the
    routing weights (zero for the experts a token did not choose)."""
    E = model.moe.num_experts
    y_TED = _swiglu(model, x_TD, p["gate"], p["up"], p["down"], "td,edf->tef", "tef,efd->ted")
    w_TE = jnp.sum(jax.nn.one_hot(experts_TK, E, dtype=weights_TK.dtype) * weights_TK[..., None], axis=1)
    return jnp.sum(y_TED * w_TE[..., None], axis=1)


def block(model: Model, p: Params, x_BLD: jax.Array, experts=sorted_experts, router_BLD: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """The MoE feed-forward of normed hidden states: ``(output [B, L, D], router logits [B, L, E])``. ``experts``:
    ``sorted_experts`` (dropless grouped matmuls) or ``dense_experts`` (the reference). ``router_BLD``: what the
    router reads where it is not ``x`` (Gemma 4: the layer's residual stream)."""
    B, L, D = x_BLD.shape
    x_TD = x_BLD.reshape(B * L, D)
    r_TD = x_TD if router_BLD is None else router_BLD.reshape(B * L, D)
    logits, weights, chosen = route(model, p["router"], _router_input(model, p, r_TD), p.get("expert_scale"))
    out = experts(model, p, x_TD, chosen, weights)
    if model.moe.shared_dim:  # Qwen3.5-MoE, Qwen3-Next: a shared expert times sigmoid(its gate), added
        s = p["shared"]
        shared = _swiglu(model, x_TD, s["gate"], s["up"], s["down"])
        out = out + jax.nn.sigmoid(einsum(model, "td,dk->tk", x_TD, p["shared_gate"].astype(x_TD.dtype))) * shared
    return out.reshape(B, L, D), logits.reshape(B, L, -1)


def beside_mlp(model: Model, p: Params, p_mlp: Params, x_BLD: jax.Array, normed_BLD: jax.Array,
               experts=sorted_experts) -> tuple[jax.Array, jax.Array]:
    """The experts beside a dense MLP, as Gemma 4 26B-A4B's layer (``enable_moe_block``): the MLP on the layer's normed
    input (``pre_feedforward_layernorm``), its output normed (``mlp_post_norm``: ``post_feedforward_layernorm_1``),
    plus the experts on the residual stream ``x`` normed by their own ``pre_norm`` (``pre_feedforward_layernorm_2``),
    routed from ``x`` itself (``MoE.router_norm``), their output normed (``post_norm``:
    ``post_feedforward_layernorm_2``). ``(output [B, L, D], router logits [B, L, E])``; the decoder norms the sum
    (``post_feedforward_layernorm``) before the residual."""
    dense = norm(model, p["mlp_post_norm"], mlp.forward(model, model.mlp, p_mlp, normed_BLD))
    sparse, logits = block(model, p, norm(model, p["pre_norm"], x_BLD), experts, router_BLD=x_BLD)
    return dense + norm(model, p["post_norm"], sparse), logits


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
