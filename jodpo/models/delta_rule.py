"""The gated delta rule, the recurrence at the core of Gated DeltaNet (Qwen3.5's linear-attention layers), as pure,
jittable functions: token by token (``recurrent_delta_rule``, also the sampler's one-token decode step) and chunk by
chunk in the WY/UT form (``chunked_delta_rule``, for training and prefill), whose backward recomputes the states
instead of keeping them from the forward.

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
import numpy as np


def _dot(spec: str, *operands: jax.Array, precision) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision(precision))


def _grouped(q_BTHD, k_BTHD, v_BTVD, g_BTV, beta_BTV):
    """float32 copies, the value heads (and g, beta) split into [Hk, G]; q and k keep their Hk heads."""
    B, T, Hk, _ = k_BTHD.shape
    Hv, Dv = v_BTVD.shape[-2:]
    if Hv % Hk:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk})")
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


# --------------------------------------------------------------------------------------------------
# chunks: the WY/UT form, one unit lower triangular system per chunk
# --------------------------------------------------------------------------------------------------


def _unit_lower_inverse(A_NCC: jax.Array, precision) -> jax.Array:
    """``(I + A)^-1`` for strictly lower triangular ``A`` (batched over the leading axes), by merging the inverses of
    diagonal blocks of 1, 2, 4, ... rows: ``[[L11, 0], [L21, L22]]^-1 = [[X1, 0], [-X2 L21 X1, X2]]`` with X1, X2
    the inverses of L11, L22 (recursive triangular inversion, as flash-linear-attention's chunk kernels merge blocks).
    Each level is written on the whole matrix: with X block diagonal (the inverses of the blocks of s rows), the next
    X is ``X - X A X`` on the lower-left s x s block of each block of 2s rows (there ``X A X`` is ``X2 L21 X1``) and X
    elsewhere: two matmuls of the chunk's size and one masked subtraction a level, no slicing or stitching of blocks.

    Batched matmuls only, on every backend: XLA:CPU would run ``triangular_solve`` as a LAPACK call through scipy's
    OpenBLAS, whose threads fight XLA's own for the cores (measured on the project's shared 2-core VM, 16 systems of
    64 rows and 256 right-hand sides: 250 ms against this function's 1-4 ms, and 2-10 ms with
    OPENBLAS_NUM_THREADS=1). C is padded to a power of two with identity rows, which leave the leading block's
    inverse as it is."""
    C = A_NCC.shape[-1]
    P = 1 << max(C - 1, 0).bit_length()
    batch = A_NCC.shape[:-2]
    A = jnp.pad(A_NCC, [(0, 0)] * len(batch) + [(0, P - C), (0, P - C)])
    row, col = np.arange(P)[:, None], np.arange(P)[None, :]  # (the masks: constants of the program)
    lower_left = lambda s: (row // (2 * s) == col // (2 * s)) & (row // s != col // s)  # noqa: E731  (of 2s-blocks)
    X = np.eye(P, dtype=A.dtype) - jnp.where(lower_left(1), A, 0.0)  # the blocks of 2 rows (X of 1 x 1 blocks: I)
    s = 2
    while s < P:  # on the lower-left blocks X A X is X2 L21 X1 (X is block diagonal): the mask after the matmuls
        X = X - jnp.where(lower_left(s), _dot("...ij,...jk,...kl->...il", X, A, X, precision=precision), 0.0)
        s *= 2
    return X[..., :C, :C]


# The chunks' terms, written for any leading axes: all N chunks at once (``[N, B, ...]``, batched matmuls before the
# sequential scan) or one chunk inside a scan (``[B, ...]``). A chunk's inputs as ``_chunked_inputs`` lays them out:
# q, k ``[..., C, Hk, Dk]``, v ``[..., C, Hk, G, Dv]``, g, beta ``[..., C, Hk, G]``.


def _decays(g):
    """gamma ``[..., Hk, G, C]``, the cumulative log-decay up to each position of the chunk, and the decays between
    positions D_ij = exp(gamma_i - gamma_j) (i >= j; 0 above the diagonal) ``[..., Hk, G, C, C]``."""
    C = g.shape[-3]
    gamma = jnp.moveaxis(jnp.cumsum(g, axis=-3), -3, -1)
    row, col = np.arange(C)[:, None], np.arange(C)[None, :]
    # Above the diagonal gamma_i - gamma_j > 0 and its exp could overflow: masked before the exp, not after.
    return gamma, jnp.exp(jnp.where(row >= col, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))


def _system(k, g, beta, precision):
    """The strictly lower triangular A of the chunk's unit lower triangular system (I + A):
    A_ij = beta_i (k_i . k_j) D_ij below the diagonal (the UT transform: each write corrects for the earlier writes of
    the chunk that its key reads back)."""
    C = k.shape[-3]
    _, decay = _decays(g)
    kk = _dot("...ihk,...jhk->...hij", k, k, precision=precision)  # once per key head, shared by its G value heads
    beta_c = jnp.moveaxis(beta, -3, -1)
    row, col = np.arange(C)[:, None], np.arange(C)[None, :]
    return jnp.where(row > col, beta_c[..., :, None] * kk[..., None, :, :] * decay, 0.0)


def _terms(q, k, v, g, beta, inverse, precision):
    """What the chunk's scan step reads, from its inputs and ``(I + A)^-1``:
      U, W   the chunk's writes are ``U - W S`` for the state S before it: (I + A) [U W] = [beta v, beta k e^gamma];
      P      ``(q_i . k_j) D_ij``: how each position reads the chunk's own writes;
      q, eg  the queries and ``e^gamma``: how each position reads the state before the chunk;
      k, tail  the keys and each write's decay to the chunk's end, ``e^(gamma_C - gamma_i)`` (1 at the chunk's end:
             the whole chunk's decay of the state before it is ``eg``'s last)."""
    gamma, decay = _decays(g)
    beta_c, eg = jnp.moveaxis(beta, -3, -1), jnp.exp(gamma)
    k_hc = jnp.moveaxis(k, -3, -2)  # [..., Hk, C, Dk]
    U = _dot("...ij,...jd->...id", inverse, jnp.moveaxis(v, -4, -2) * beta_c[..., None], precision=precision)
    W = _dot("...ij,...jd->...id", inverse, k_hc[..., None, :, :] * (beta_c * eg)[..., None], precision=precision)
    P = _dot("...ihk,...jhk->...hij", q, k, precision=precision)[..., None, :, :] * decay
    return U, W, P, q, k, eg, jnp.exp(gamma[..., -1:] - gamma)


def _chunk_step(S_BHGKV, x, precision):
    """One chunk of C tokens from the state before it (its ``_terms``): the state after it and the chunk's outputs
    ``[B, C, Hk, G, Dv]``, equal to C steps of ``_token_step``. Only what reads or writes the state: four dots."""
    U, W, P, q_BCHK, k_BCHK, eg_BHGC, tail_BHGC = x
    new_BHGCV = U - _dot("bhgck,bhgkv->bhgcv", W, S_BHGKV, precision=precision)  # the chunk's writes
    inter_BCHGV = (_dot("bchk,bhgkv->bchgv", q_BCHK, S_BHGKV, precision=precision)
                   * jnp.einsum("bhgc->bchg", eg_BHGC)[..., None])  # the state before, decayed to each position
    intra_BCHGV = _dot("bhgij,bhgjv->bihgv", P, new_BHGCV, precision=precision)  # the chunk's own writes, read
    S_BHGKV = (S_BHGKV * eg_BHGC[..., -1, None, None]  # each write decays from its position to the chunk's end
               + _dot("bchk,bhgcv->bhgkv", k_BCHK, new_BHGCV * tail_BHGC[..., None], precision=precision))
    return S_BHGKV, inter_BCHGV + intra_BCHGV


def _chunked_inputs(q, k, v, g, beta, chunk: int):
    """The grouped float32 inputs padded to whole chunks (k = v = q = 0, beta = g = 0: no write, no decay) and laid
    out chunk-major: ``[N, B, C, ...]``."""
    T = k.shape[1]
    N = -(-T // chunk)
    out = []
    for x in _grouped(q, k, v, g, beta):
        x = jnp.pad(x, [(0, 0), (0, N * chunk - T)] + [(0, 0)] * (x.ndim - 2))
        out.append(jnp.moveaxis(x.reshape(x.shape[0], N, chunk, *x.shape[2:]), 1, 0))
    return out


def _forward(xs, S, precision):
    """The chunks' inverses and terms for all chunks at once, then the scan over them: (outputs, state, inverses)."""
    q, k, v, g, beta = xs
    inverse = _unit_lower_inverse(_system(k, g, beta, precision), precision)
    S, out_NBCHGV = jax.lax.scan(functools.partial(_chunk_step, precision=precision), S,
                                 _terms(*xs, inverse, precision=precision))
    return out_NBCHGV, S, inverse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _chunked_recomputing(q, k, v, g, beta, S, chunk, precision):
    return _forward(_chunked_inputs(q, k, v, g, beta, chunk), S, precision)[:2]


def _chunked_fwd(q, k, v, g, beta, S, chunk, precision):
    # The inputs (in their own dtype), the initial state and each chunk's (I + A)^-1 cross to the backward, never a
    # state per chunk: the backward inverts nothing again
    out, S_last, inverse = _forward(_chunked_inputs(q, k, v, g, beta, chunk), S, precision)
    return (out, S_last), (q, k, v, g, beta, S, inverse)


def _chunked_bwd(chunk, precision, res, cts):
    *inputs, S0, inverse = res
    d_out_NBCHGV, d_S = cts
    xs, inputs_vjp = jax.vjp(functools.partial(_chunked_inputs, chunk=chunk), *inputs)

    # The states entering each chunk, from its inputs and inverse (a chunk's terms at a time: none kept for all)
    def state_after(S, item):
        x, X = item
        U, W, _, _, k, eg, tail = _terms(*x, X, precision=precision)
        new = U - _dot("bhgck,bhgkv->bhgcv", W, S, precision=precision)
        return S * eg[..., -1, None, None] + _dot("bchk,bhgcv->bhgkv", k, new * tail[..., None],
                                                  precision=precision), S

    _, S_before_N = jax.lax.scan(state_after, S0, (xs, inverse))

    # Backward through the chunks, last first, each from the state before it and its inverse: the chunk's terms and
    # step differentiated together (their intermediates live for one iteration), then through the inverse
    # (d(I + A) = -X^T dX X^T for X its inverse) and the system's A.
    step = functools.partial(_chunk_step, precision=precision)

    def chunk_back(d_S, item):
        x, X, S, d_out = item
        _, vjp = jax.vjp(lambda S, x, X: step(S, _terms(*x, X, precision=precision)), S, x, X)
        d_S_before, d_x, d_X = vjp((d_S, d_out))
        d_A = -_dot("...ji,...jk,...lk->...il", X, d_X, X, precision=precision)
        q, k, v, g, beta = x
        _, system_vjp = jax.vjp(lambda k, g, beta: _system(k, g, beta, precision), k, g, beta)
        d_k, d_g, d_beta = system_vjp(d_A)
        d_q, d_k2, d_v, d_g2, d_beta2 = d_x
        return d_S_before, (d_q, d_k + d_k2, d_v, d_g + d_g2, d_beta + d_beta2)

    d_S0, d_xs = jax.lax.scan(chunk_back, d_S, (xs, inverse, S_before_N, d_out_NBCHGV), reverse=True)
    return (*inputs_vjp(list(d_xs)), d_S0)


_chunked_recomputing.defvjp(_chunked_fwd, _chunked_bwd)


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


def _chunked(q, k, v, g, beta, state, chunk: int, recompute: bool, precision: str, row_parts: int = 1,
             rows_in_turn: bool = False):
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    S = _initial_state(state, B, Hk, Hv // Hk, Dk, Dv)
    if T == 0:
        return jnp.zeros((B, 0, Hv, Dv), jnp.float32), S.reshape(B, Hv, Dk, Dv)
    chunk = min(chunk, T)  # a sequence shorter than a chunk is one chunk of its own length, not padded

    def rows(q, k, v, g, beta, S):
        if recompute:
            out_NBCHGV, S = _chunked_recomputing(q, k, v, g, beta, S, chunk, precision)
        else:
            out_NBCHGV, S, _ = _forward(_chunked_inputs(q, k, v, g, beta, chunk), S, precision)
        N = out_NBCHGV.shape[0]
        return jnp.moveaxis(out_NBCHGV, 0, 1).reshape(q.shape[0], N * chunk, Hv, Dv)[:, :T], S

    if rows_in_turn and B % row_parts:
        raise ValueError(f"chunked_delta_rule: row_parts={row_parts} does not divide the {B} rows; pass the number "
                         "of devices the batch is split over (a divisor of B), or rows_in_turn=False")
    in_turn = rows_in_turn and row_parts < B  # (as many parts as rows: one turn, all at once)
    out_BTVD, S = (_rows_in_turn(rows, row_parts) if in_turn else rows)(q, k, v, g, beta, S)
    return out_BTVD, S.reshape(B, Hv, Dk, Dv)


def chunked_delta_rule(q, k, v, g, beta, state=None, chunk: int = 64, precision: str = "highest",
                       row_parts: int = 1, rows_in_turn: bool = False) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule chunk by chunk: the same outputs and final state as ``recurrent_delta_rule`` (up to
    float32 rounding), computed ``chunk`` tokens at a time in the WY/UT form (one unit lower triangular system per
    chunk and value head, solved by its inverse) with a ``lax.scan`` over the chunks.

    Its gradient is exact and cheap in memory: the forward keeps only its inputs and the initial state for the
    backward, which recomputes the state before each chunk (a forward scan), then runs backward through the chunks
    with each chunk's ``jax.vjp`` from its recomputed state. Autodiff through the scan instead would keep every
    chunk's state and intermediates from the forward until the backward (``chunked_delta_rule_autodiff``).

    Args:
      q, k, v, g, beta, state: as ``recurrent_delta_rule``'s (q and k L2-normalised by the caller, q also scaled by
        ``Dk ** -0.5``; value head h reads key head ``h // (Hv // Hk)``).
      chunk: tokens per chunk (static). T is padded up to a multiple of it with positions that neither write nor
        decay; a T below it is one chunk of T tokens.
      precision: the float32 dots' (static), as ``recurrent_delta_rule``'s.
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
    return _chunked(q, k, v, g, beta, state, chunk, True, precision, row_parts, rows_in_turn)


def chunked_delta_rule_autodiff(q, k, v, g, beta, state=None, chunk: int = 64,
                                precision: str = "highest") -> tuple[jax.Array, jax.Array]:
    """``chunked_delta_rule`` without its custom backward: jax differentiates through the scan over chunks, keeping
    each chunk's state and intermediates from the forward. The same forward; the reference its gradient and memory
    are measured against (tests/test_delta_rule.py, ``bench.py deltanet``)."""
    return _chunked(q, k, v, g, beta, state, chunk, False, precision)
