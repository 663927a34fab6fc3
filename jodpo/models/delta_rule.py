"""The gated delta rule, the recurrence at the core of Gated DeltaNet (Qwen3.5's linear-attention layers), as pure,
jittable functions: token by token (``recurrent_delta_rule``, also the sampler's one-token decode step) and chunk by
chunk in the WY/UT form (``chunked_delta_rule``, for training and prefill; ``prefixed_delta_rule``, prompts and their
completions in one pass), whose backward keeps one state a chunk from the forward and recomputes everything else a
chunk at a time.

The semantics are transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``
(models/qwen3_next), per value head, token by token::

    S_t = S_{t-1} * exp(g_t)                 # g_t <= 0: the log of the state's decay
    delta_t = (v_t - k_t^T S_t) * beta_t     # what the decayed state mispredicts for k_t, times the write strength
    S_t = S_t + k_t delta_t^T
    out_t = q_t^T S_t

Shapes: q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]``; g, beta ``[B, T, Hv]``; the state ``[B, Hv, Dk, Dv]``. Value
head h reads query/key head ``h // (Hv // Hk)`` (transformers' ``repeat_interleave`` on the head axis: consecutive
value heads share a key head). The functions view the value heads as ``[Hk, G]`` (G = Hv // Hk) and never repeat q or
k G times. Unlike transformers, q and k arrive as the kernel reads them: the caller L2-normalises both (transformers'
``use_qk_l2norm_in_kernel``) and scales q by ``Dk ** -0.5`` (transformers' in-kernel scaling).

Everything here runs in float32 (inputs in bf16 are cast on the way in, as transformers does), and every dot at
``precision`` (the model's, ``Model.precision``: ``"highest"`` unless a run opts into TF32 or fewer bf16 passes): the
state is summed over the whole sequence, and TF32 or one bf16 pass would put their rounding into it at every step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jodpo.models.delta_chunks import (_check_heads, _chunked_inputs, _chunked_recomputing, _dot, _forward,
                                       _group_size)


def _grouped(q_BTHD, k_BTHD, v_BTVD, g_BTV, beta_BTV):
    """float32 copies, the value heads (and g, beta) split into [Hk, G]; q and k keep their Hk heads."""
    B, T, Hk, _ = k_BTHD.shape
    Hv, Dv = v_BTVD.shape[-2:]
    _check_heads(Hk, Hv)
    G = Hv // Hk
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return (f32(q_BTHD), f32(k_BTHD), f32(v_BTVD).reshape(B, T, Hk, G, Dv), f32(g_BTV).reshape(B, T, Hk, G),
            f32(beta_BTV).reshape(B, T, Hk, G))


def _initial_state(state, B, Hk, G, Dk, Dv):
    if state is None:
        return jnp.zeros((B, Hk, G, Dk, Dv), jnp.float32)
    return state.astype(jnp.float32).reshape(B, Hk, G, Dk, Dv)


def _token_step(S_BHGKV, x, precision):
    """One token of the recurrence: the state after it and the token's output."""
    q_BHK, k_BHK, v_BHGV, g_BHG, beta_BHG = x
    S_BHGKV = S_BHGKV * jnp.exp(g_BHG)[..., None, None]
    delta_BHGV = (v_BHGV - _dot("bhk,bhgkv->bhgv", k_BHK, S_BHGKV, precision=precision)) * beta_BHG[..., None]
    S_BHGKV = S_BHGKV + k_BHK[:, :, None, :, None] * delta_BHGV[:, :, :, None, :]
    return S_BHGKV, _dot("bhk,bhgkv->bhgv", q_BHK, S_BHGKV, precision=precision)


def recurrent_delta_rule(q, k, v, g, beta, state=None, precision: str = "highest") -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token: a ``lax.scan`` over T (none for T = 1, the decode step).

    Args:
      q: ``[B, T, Hk, Dk]`` queries, already L2-normalised and scaled by ``Dk ** -0.5`` by the caller.
      k: ``[B, T, Hk, Dk]`` keys, already L2-normalised by the caller.
      v: ``[B, T, Hv, Dv]`` values; Hv a multiple of Hk, value head h reading query/key head ``h // (Hv // Hk)``.
      g: ``[B, T, Hv]`` log-decays (<= 0): the state is multiplied by ``exp(g_t)`` before token t writes.
      beta: ``[B, T, Hv]`` write strengths (0 = token t leaves the state as it is).
      state: ``[B, Hv, Dk, Dv]`` the state before the first token (None: zeros).
      precision: the float32 dots' (``jax.lax.Precision`` names; static).

    Inputs may be bf16; all arithmetic is float32. A position with ``k = 0, beta = 0, g = 0`` (padding) leaves the
    state unchanged and outputs ``q^T S``.

    Returns:
      ``(out [B, T, Hv, Dv], state [B, Hv, Dk, Dv])``, both float32: each token's ``q_t^T S_t`` and the state after
      the last token.
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    xs = _grouped(q, k, v, g, beta)
    S = _initial_state(state, B, Hk, Hv // Hk, Dk, Dv)
    step = functools.partial(_token_step, precision=precision)
    if T == 1:  # the decode step: no loop to enter
        S, out_BHGV = step(S, [x[:, 0] for x in xs])
        out_BTHGV = out_BHGV[:, None]
    else:
        S, out_TBHGV = jax.lax.scan(step, S, [jnp.moveaxis(x, 1, 0) for x in xs])
        out_BTHGV = jnp.moveaxis(out_TBHGV, 0, 1)
    return out_BTHGV.reshape(B, T, Hv, Dv), S.reshape(B, Hv, Dk, Dv)


def _rows_in_turn(rows, parts: int):
    """``rows`` (a function of the rows' inputs and states) on ``parts`` rows at a time in a ``lax.map``: the rows
    split ``[parts, B / parts]`` so that each turn takes one row from each of the ``parts`` devices the batch is split
    over (its leading part), and no device waits for another's rows."""
    def in_turn(*xs):
        B = xs[0].shape[0]
        split = lambda x: jnp.swapaxes(x.reshape(parts, B // parts, *x.shape[1:]), 0, 1)  # noqa: E731
        ys = jax.lax.map(lambda x: rows(*x), [split(x) for x in xs])
        return tuple(jnp.swapaxes(y, 0, 1).reshape(B, *y.shape[2:]) for y in ys)
    return in_turn


def _chunked(q, k, v, g, beta, state, chunk: int, recompute: bool, precision: str, group: int, row_parts: int = 1,
             rows_in_turn: bool = False):
    if group < 1 or chunk < 1:
        raise ValueError(f"chunked_delta_rule: chunk={chunk} and group={group} must be at least 1 (tokens a chunk, "
                         "chunks a group)")
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    S = _initial_state(state, B, Hk, Hv // Hk, Dk, Dv)
    if T == 0:
        return jnp.zeros((B, 0, Hv, Dv), jnp.float32), S.reshape(B, Hv, Dk, Dv)
    chunk = min(chunk, T)  # a sequence shorter than a chunk is one chunk of its own length, not padded
    group = _group_size(-(-T // chunk), group)

    def row_or_rows(q, k, v, g, beta, S):  # [B, T, ...] or one row's [T, ...]
        xs = _chunked_inputs(q, k, v, g, beta, chunk, group)
        if recompute:
            out, S = _chunked_recomputing(*xs, S, precision, group)
        else:
            out, S = _forward(xs, S, precision, group)[:2]
        N, lead = out.shape[0], out.shape[1:-3]  # out [N, (B,) C, Hv, Dv]
        out = (jnp.swapaxes(out, 0, 1) if lead else out).reshape(*lead, N * chunk, Hv, Dv)
        return out[..., :T, :, :], S

    def rows(*xs):
        if xs[0].shape[0] > 1:
            return row_or_rows(*xs)
        return tuple(y[None] for y in row_or_rows(*[x[0] for x in xs]))  # one row: without its row axis

    if rows_in_turn and B % row_parts:
        raise ValueError(f"chunked_delta_rule: row_parts={row_parts} does not divide the {B} rows; pass the number "
                         "of devices the batch is split over (a divisor of B), or rows_in_turn=False")
    in_turn = rows_in_turn and row_parts < B  # (as many parts as rows: one turn, all at once)
    out_BTVD, S = (_rows_in_turn(rows, row_parts) if in_turn else rows)(q, k, v, g, beta, S)
    return out_BTVD, S.reshape(B, Hv, Dk, Dv)


def chunked_delta_rule(q, k, v, g, beta, state=None, chunk: int = 64, precision: str = "highest", group: int = 4,
                       row_parts: int = 1, rows_in_turn: bool = False) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule chunk by chunk: the same outputs and final state as ``recurrent_delta_rule`` (up to
    float32 rounding), computed ``chunk`` tokens at a time in the WY/UT form (one unit lower triangular system per
    chunk and value head, solved by its inverse) with a ``lax.scan`` over the chunks.

    The work that does not read the state (the decays, k k^T, each chunk's triangular system and its inverse, the
    writes' U and W, q k^T) runs for ``group`` chunks at once, before the scan through them, whose body is the four
    dots that read or write the state.

    Its gradient is exact and cheap in memory: the forward keeps its inputs, each chunk's inverse and the state
    before each chunk (one a chunk: ``chunk`` times fewer than the recurrence's autodiff keeps) for the backward,
    which runs back through the chunks with each chunk's ``jax.vjp`` of its terms and step (their intermediates
    live for one chunk). Autodiff through the scan instead would keep every chunk's intermediates from the forward
    until the backward (``chunked_delta_rule_autodiff``).

    Args:
      q, k, v, g, beta, state: as ``recurrent_delta_rule``'s (q and k L2-normalised by the caller, q also scaled by
        ``Dk ** -0.5``; value head h reads key head ``h // (Hv // Hk)``).
      chunk: tokens per chunk (static). T is padded up to a multiple of it with positions that neither write nor
        decay; a T below it is one chunk of T tokens.
      precision: the float32 dots' (static), as ``recurrent_delta_rule``'s.
      group: at most this many chunks' state-free work at once (static; the chunks split into as few groups as that
        allows, as even as they go, T padded to whole groups): a group's terms are held at once, so the memory grows
        with it; 4 (256 tokens) is about as fast on a CPU as the whole sequence at once (``bench.py deltanet``).
      row_parts: how many devices the rows (B) are split over, in equal leading parts (static; the caller's mesh; a
        divisor of B).
      rows_in_turn: the rows ``row_parts`` at a time (one a device) in a ``lax.map`` instead of all at once
        (static): the same numbers, a compile that does not grow with the batch, ``B / row_parts`` times the
        sequential steps. XLA:TPU emits a batch of small float32 matmuls (a chunk's 64 x 64 systems) whole as
        straight-line code: at Qwen3.5-0.8B's heads, 16 rows of 192 tokens, this gradient compiles for a v6e in 70 s
        all at once, 12-17 s one row a turn, 84 s four rows a turn (docs/tpu.md).

    Returns:
      ``(out [B, T, Hv, Dv], state [B, Hv, Dk, Dv])``, both float32.
    """
    return _chunked(q, k, v, g, beta, state, chunk, True, precision, group, row_parts, rows_in_turn)


def chunked_delta_rule_autodiff(q, k, v, g, beta, state=None, chunk: int = 64, precision: str = "highest",
                                group: int = 4) -> tuple[jax.Array, jax.Array]:
    """``chunked_delta_rule`` without its custom backward: jax differentiates through the scan over chunks, keeping
    each chunk's state and intermediates from the forward. The same forward; the reference its gradient and memory
    are measured against (tests/test_delta_rule.py, ``bench.py deltanet``)."""
    return _chunked(q, k, v, g, beta, state, chunk, False, precision, group)


def _pad_time(x: jax.Array, T: int) -> jax.Array:
    """``[B, t, ...]`` padded after its t positions to T (zeros: no write, no decay)."""
    return jnp.pad(x, [(0, 0), (0, T - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def join_rows(prefix: jax.Array, suffix: jax.Array) -> jax.Array:
    """The shared-prompt layout's two groups, a prefix ``[B, P, ...]`` and its n continuations ``[n B, C, ...]``
    (block layout: row r continues prefix ``r % B``), as one ``[B, P + n C, ...]``: each row its prefix, then its
    continuations in order. Everything before is on the rows' axis, as the groups' batch is."""
    B, n = prefix.shape[0], suffix.shape[0] // prefix.shape[0]
    rest = jnp.swapaxes(suffix.reshape(n, B, *suffix.shape[1:]), 0, 1)
    return jnp.concatenate([prefix, rest.reshape(B, n * suffix.shape[1], *suffix.shape[2:])], 1)


def split_rows(joined: jax.Array, P: int, n: int) -> tuple[jax.Array, jax.Array]:
    """``join_rows``' inverse: the prefix ``[B, P, ...]`` and the continuations ``[n B, C, ...]``."""
    B, C = joined.shape[0], (joined.shape[1] - P) // n
    rest = jnp.swapaxes(joined[:, P:].reshape(B, n, C, *joined.shape[2:]), 0, 1)
    return joined[:, :P], rest.reshape(n * B, C, *joined.shape[2:])


def joined_delta_rule(q, k, v, g, beta, P: int, n: int, chunk: int = 64, precision: str = "highest",
                      group: int = 4) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over rows of a prefix of P tokens and then n continuations of it (``join_rows``' layout,
    ``[B, P + n C, ...]``), each continuation from the prefix's last state, in one chunked pass.

    The prefix and each continuation are padded to whole chunks on one chunk axis (positions that neither write nor
    decay), and the chunk scan starts each continuation from the prefix's last state, kept in its carry beside the
    state (its backward adds each continuation's cotangent of it there). So the state-free work of every chunk,
    prefixes' and continuations', is one batched computation, and a program holds one copy of the rule, forward and
    backward, where a call for the prefixes and another for the continuations would hold two (the training step's
    gradient at Qwen3.5-0.8B: 1,672 -> 1,492 XLA:CPU kernels, compiled in 0.90x the time: docs/performance.md).

    Args:
      q, k, v, g, beta: as ``chunked_delta_rule``'s, ``[B, P + n C, ...]``, each row from a zero state.
      P, n: the prefix's length and the number of continuations (each of C tokens, none of them empty).
      chunk, precision, group: as ``chunked_delta_rule``'s; a chunk longer than both P and C is the longer one's.

    Returns:
      ``(out [B, P + n C, Hv, Dv], prefix_state [B, Hv, Dk, Dv])``, both float32.
    """
    B, T = k.shape[:2]
    C = (T - P) // n if n >= 1 else 0
    if n < 1 or not (P and C) or P + n * C != T or group < 1 or chunk < 1:
        raise ValueError(f"joined_delta_rule: {T} tokens a row must be a prefix of P={P} and n={n} continuations of "
                         f"one length, none of them empty; chunk={chunk} and group={group} at least 1")
    chunk = min(chunk, max(P, C))
    Np, Ns = -(-P // chunk), -(-C // chunk)

    def padded(a):  # [B, P + n C, ...] -> [B, (Np + n Ns) chunk, ...]: the prefix and each continuation whole chunks
        rest = _pad_time(a[:, P:].reshape(B * n, C, *a.shape[2:]), Ns * chunk)
        return jnp.concatenate([_pad_time(a[:, :P], Np * chunk), rest.reshape(B, n * Ns * chunk, *a.shape[2:])], 1)

    q, k, v, g, beta = map(padded, (q, k, v, g, beta))
    (Hk, Dk), (Hv, Dv) = k.shape[-2:], v.shape[-2:]
    group = _group_size(Np + n * Ns, group)
    xs = _chunked_inputs(q, k, v, g, beta, chunk, group)
    out, (_, prefix_S) = _chunked_recomputing(*xs, _initial_state(None, B, Hk, Hv // Hk, Dk, Dv), precision, group,
                                              (Np, Ns, n))
    out = jnp.swapaxes(out, 0, 1).reshape(B, -1, Hv, Dv)
    rest = out[:, Np * chunk:].reshape(B * n, Ns * chunk, Hv, Dv)[:, :C].reshape(B, n * C, Hv, Dv)
    return jnp.concatenate([out[:, :P], rest], 1), prefix_S.reshape(B, Hv, Dk, Dv)


def prefixed_delta_rule(prefix, suffix, chunk: int = 64, precision: str = "highest",
                        group: int = 4) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gated delta rule over B prefixes and the n continuations of each, in one chunked pass
    (``joined_delta_rule``): ``suffix`` row r (block layout: n x B rows) continues prefix ``r % B`` from the prefix's
    last state, as ``chunked_delta_rule`` of it from that state would; each prefix runs once (the shared-prompt
    layout's prompts and their completions).

    Args:
      prefix: ``(q, k, v, g, beta)`` as ``chunked_delta_rule``'s, ``[B, P, ...]``, from a zero state.
      suffix: the same, ``[n B, C, ...]``.
      chunk, precision, group: as ``joined_delta_rule``'s.

    Returns:
      ``(prefix_out [B, P, Hv, Dv], suffix_out [n B, C, Hv, Dv], prefix_state [B, Hv, Dk, Dv])``, all float32.
    """
    (B, P), (N, C) = prefix[1].shape[:2], suffix[1].shape[:2]
    if N % B or not (P and C):
        raise ValueError(f"prefixed_delta_rule: {N} continuations of {C} tokens must be a whole number of times the "
                         f"{B} prefixes of {P} tokens (block layout), none of them empty")
    out, state = joined_delta_rule(*map(join_rows, prefix, suffix), P, N // B, chunk, precision, group)
    return (*split_rows(out, P, N // B), state)
