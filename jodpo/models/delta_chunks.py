"""The gated delta rule chunk by chunk, in the WY/UT form (``jodpo.models.delta_rule``'s ``chunked_delta_rule`` and
``prefixed_delta_rule`` run it): each chunk's unit lower triangular system and its inverse, the terms a chunk's step
reads, the state-free work of a group of chunks at once before the sequential scan through them, and its custom
backward from one saved state and inverse a chunk. The layout: q, k ``[..., Hk, C, Dk]``, v ``[..., Hk, G, C, Dv]``,
g, beta ``[..., Hk, G, C]`` inside; chunk-major ``[N, (B,) C, H, (D)]`` outside."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _dot(spec: str, *operands: jax.Array, precision) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision(precision))


def _check_heads(Hk: int, Hv: int) -> None:
    if Hv % Hk:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk})")


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


# The chunks' terms, written for any leading axes: a group's n chunks at once (``[n, B, ...]``, batched matmuls
# before the sequential scan over them) or one chunk inside a scan (``[B, ...]``; one row may come without its row
# axis). A chunk's inputs as ``_heads_first`` lays them out, heads before positions so that every dot is a plain
# batched matmul over the leading axes: q, k ``[..., Hk, C, Dk]``, v ``[..., Hk, G, C, Dv]``, g, beta
# ``[..., Hk, G, C]``.


def _decays(g):
    """gamma ``[..., Hk, G, C]``, the cumulative log-decay up to each position of the chunk, and the decays between
    positions D_ij = exp(gamma_i - gamma_j) (i >= j; 0 above the diagonal) ``[..., Hk, G, C, C]``."""
    C = g.shape[-1]
    gamma = jnp.cumsum(g, axis=-1)
    row, col = np.arange(C)[:, None], np.arange(C)[None, :]
    # Above the diagonal gamma_i - gamma_j > 0 and its exp could overflow: masked before the exp, not after.
    return gamma, jnp.exp(jnp.where(row >= col, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))


def _system(k, g, beta, precision):
    """The strictly lower triangular A of the chunk's unit lower triangular system (I + A):
    A_ij = beta_i (k_i . k_j) D_ij below the diagonal (the UT transform: each write corrects for the earlier writes of
    the chunk that its key reads back)."""
    C = k.shape[-2]
    _, decay = _decays(g)
    kk = _dot("...ik,...jk->...ij", k, k, precision=precision)  # once per key head, shared by its G value heads
    row, col = np.arange(C)[:, None], np.arange(C)[None, :]
    return jnp.where(row > col, beta[..., :, None] * kk[..., None, :, :] * decay, 0.0)


def _per_value_head(x, G):
    """A key head's ``[..., Hk, C, D]`` read by each of its G value heads: ``[..., Hk, G, C, D]``."""
    return jnp.broadcast_to(x[..., None, :, :], (*x.shape[:-2], G, *x.shape[-2:]))


def _terms(q, k, v, g, beta, inverse, precision):
    """What the chunk's scan step reads, from its inputs and ``(I + A)^-1``:
      U, W   the chunk's writes are ``U - W S`` for the state S before it: (I + A) [U W] = [beta v, beta k e^gamma];
      P      ``(q_i . k_j) D_ij``: how each position reads the chunk's own writes;
      qe     ``q e^gamma``: how each position reads the state before the chunk (the decay on the query, not on the
             read: the backward's cotangent of e^gamma is then elementwise, not one more product with the state);
      k, tail  the keys and each write's decay to the chunk's end, ``e^(gamma_C - gamma_i)``;
      last   the whole chunk's decay of the state before it, ``e^gamma_C``."""
    G = v.shape[-3]
    gamma, decay = _decays(g)
    eg = jnp.exp(gamma)
    U = _dot("...ij,...jd->...id", inverse, v * beta[..., None], precision=precision)
    W = _dot("...ij,...jd->...id", inverse, _per_value_head(k, G) * (beta * eg)[..., None], precision=precision)
    P = _dot("...ik,...jk->...ij", q, k, precision=precision)[..., None, :, :] * decay
    qe = _per_value_head(q, G) * eg[..., None]
    return U, W, P, qe, k, jnp.exp(gamma[..., -1:] - gamma), eg[..., -1]


def _chunk_step(S_BHGKV, x, precision):
    """One chunk of C tokens from the state before it (its ``_terms``): the state after it and the chunk's outputs
    ``[B, Hk, G, C, Dv]``, equal to C steps of ``_token_step``. Only what reads or writes the state: four dots, each a
    batched matmul over (B, Hk, G)."""
    U, W, P, qe_BHGCK, k_BHCK, tail_BHGC, last_BHG = x
    new_BHGCV = U - _dot("...ck,...kv->...cv", W, S_BHGKV, precision=precision)  # the chunk's writes
    inter_BHGCV = _dot("...ck,...kv->...cv", qe_BHGCK, S_BHGKV, precision=precision)  # the state before, decayed
    intra_BHGCV = _dot("...ij,...jv->...iv", P, new_BHGCV, precision=precision)  # the chunk's own writes, read
    S_BHGKV = (S_BHGKV * last_BHG[..., None, None]  # each write decays from its position to the chunk's end
               + _dot("...ck,...cv->...kv", _per_value_head(k_BHCK, U.shape[-3]), new_BHGCV * tail_BHGC[..., None],
                      precision=precision))
    return S_BHGKV, inter_BHGCV + intra_BHGCV


def _group_size(N: int, group: int) -> int:
    """Chunks a group for N chunks in groups of at most ``group``: as many groups as ``group`` needs, as even as they
    go, so that padding N to whole groups adds fewer chunks than there are groups."""
    return -(-N // -(-N // group))


def _chunked_inputs(q, k, v, g, beta, chunk: int, group: int):
    """The inputs, in their own dtype, padded to whole groups of ``group`` whole chunks (k = v = q = 0, beta = g = 0:
    no write, no decay) and laid out chunk-major: ``[N, B, C, H, (D)]``, or ``[N, C, H, (D)]`` for one row passed
    without its row axis. One row's is then a view of its inputs, where a unit row axis moved behind N would be
    copied: XLA:CPU lays out an array with a transposed unit axis that enters a loop again, a copy of the whole
    array."""
    rows = q.ndim - 3  # 1, or 0 without the row axis
    T = k.shape[rows]
    N = -(-T // chunk)
    N = -(-N // group) * group
    _check_heads(k.shape[-2], v.shape[-2])
    out = []
    for x in (q, k, v, g, beta):
        x = jnp.pad(x, [(0, 0)] * rows + [(0, N * chunk - T)] + [(0, 0)] * (x.ndim - rows - 1))
        x = x.reshape(*x.shape[:rows], N, chunk, *x.shape[rows + 1:])
        out.append(jnp.swapaxes(x, 0, 1) if rows else x)
    return tuple(out)


def _heads_first(q, k, v, g, beta):
    """A chunk's inputs (any leading axes, ``[..., C, H, (D)]``) with the value heads split into [Hk, G] and the heads
    before the positions, as the terms read them: q, k ``[..., Hk, C, Dk]``, v ``[..., Hk, G, C, Dv]``, g, beta
    ``[..., Hk, G, C]``. (Split here, not before: XLA:CPU copies an array that enters a loop with a unit axis, G = 1,
    to lay that axis out again.)"""
    Hk = k.shape[-2]
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    split = lambda x: x.reshape(*x.shape[:-1], Hk, x.shape[-1] // Hk)  # noqa: E731
    return (jnp.swapaxes(q, -3, -2), jnp.swapaxes(k, -3, -2), _heads_first_v(v, Hk), jnp.moveaxis(split(g), -3, -1),
            jnp.moveaxis(split(beta), -3, -1))


def _heads_first_v(v, Hk):
    """Values or their cotangents ``[..., C, Hv, Dv]`` as ``[..., Hk, G, C, Dv]``."""
    return jnp.moveaxis(v.reshape(*v.shape[:-2], Hk, v.shape[-2] // Hk, v.shape[-1]), -4, -2)


def _positions_first(out):
    """A chunk's outputs ``[..., Hk, G, C, Dv]`` as ``[..., C, Hv, Dv]`` (the inverse of ``_heads_first_v``)."""
    out = jnp.moveaxis(out, -2, -4)
    return out.reshape(*out.shape[:-3], -1, out.shape[-1])


def _in_groups(group_step, carry, xs, group: int):
    """``group_step(carry, xs_of_a_group) -> (carry, ys)`` over the chunks ``group`` at a time (a ``lax.scan`` over
    the groups, none for one group; N a multiple of ``group``); the ys of every chunk back as ``[N, ...]``. Each
    group's xs are sliced out of the whole arrays in the loop (a view), not read from a copy laid out by group."""
    N = jax.tree.leaves(xs)[0].shape[0]
    if group == N:
        return group_step(carry, xs)

    def one_group(carry, i):
        return group_step(carry, jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * group, group), xs))

    carry, ys = jax.lax.scan(one_group, carry, jnp.arange(N // group))
    return carry, jax.tree.map(lambda y: y.reshape(N, *y.shape[2:]), ys)


def _marks(N: int, fork) -> tuple[jax.Array, jax.Array]:
    """For a chunk axis of N chunks laid out as ``fork = (Np, Ns, n)`` (a prefix of Np chunks, then n continuations
    of Ns chunks each; whole groups' padding after them): which chunks start a continuation, and which one keeps the
    prefix's last state for the others (the first continuation's first chunk). bool[N] each, constants."""
    Np, Ns, n = fork
    c = np.arange(N)
    return jnp.asarray((c >= Np) & (c < Np + n * Ns) & ((c - Np) % Ns == 0)), jnp.asarray(c == Np)


def _forward(xs, S, precision, group, fork=None):
    """The chunks a group at a time: the group's systems, inverses and terms for all its chunks at once (batched
    matmuls; a group's, not the sequence's, so that they hold a group's memory), then the scan through its chunks.
    ``fork`` (``_marks``): the state at each continuation's first chunk is the prefix's last one (kept in the carry
    beside the state), not the previous chunk's. Returns the outputs ``[N, (B,) C, Hv, Dv]``, the state after the last
    chunk (with ``fork``: and the prefix's last state), each chunk's inverse and the state each chunk started from."""
    step = functools.partial(_chunk_step, precision=precision)

    def keeping_the_state(carry, x):
        if fork is None:
            S_after, out = step(carry, x)
            return S_after, (_positions_first(out), carry)
        (S, prefix_S), (x, start, keep) = carry, x
        prefix_S = jnp.where(keep, S, prefix_S)
        S = jnp.where(start, prefix_S, S)
        S_after, out = step(S, x)
        return (S_after, prefix_S), (_positions_first(out), S)

    def group_step(carry, xs):
        x = _heads_first(*xs[:5])
        inverse = _unit_lower_inverse(_system(*[x[i] for i in (1, 3, 4)], precision), precision)
        terms = _terms(*x, inverse, precision=precision)
        carry, (out, S_before) = jax.lax.scan(keeping_the_state, carry, terms if fork is None else (terms, *xs[5:]))
        return carry, (out, inverse, S_before)

    N = xs[0].shape[0]
    xs, carry = (xs, S) if fork is None else ((*xs, *_marks(N, fork)), (S, jnp.zeros_like(S)))
    carry, (out, inverse, S_before) = _in_groups(group_step, carry, xs, group)
    return out, carry, inverse, S_before


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _chunked_recomputing(q, k, v, g, beta, S, precision, group, fork=None):
    return _forward((q, k, v, g, beta), S, precision, group, fork)[:2]


def _chunked_fwd(q, k, v, g, beta, S, precision, group, fork=None):
    # The chunk-major inputs (in their own dtype), each chunk's (I + A)^-1 and the state before it cross to the
    # backward: the backward inverts nothing again and runs no scan to find the states
    out, carry, inverse, S_before_N = _forward((q, k, v, g, beta), S, precision, group, fork)
    return (out, carry), ((q, k, v, g, beta), inverse, S_before_N)


def _chunked_bwd(precision, group, fork, res, cts):
    xs, inverse, S_before_N = res
    d_out, d_carry = cts

    # Backward through the chunks, last first, each from the state before it and its inverse: the chunk's terms and
    # step differentiated together (their intermediates live for one iteration), then through the inverse
    # (d(I + A) = -X^T dX X^T for X its inverse) and the system's A. With ``fork``, a continuation's first chunk
    # hands its state's cotangent to the prefix's last state (summed over the continuations), not to the chunk before.
    step = functools.partial(_chunk_step, precision=precision)

    def chunk_back(d_carry, item):
        x, X, S, d_out, *marks = item
        x, heads_vjp = jax.vjp(_heads_first, *x)
        _, vjp = jax.vjp(lambda S, x, X: step(S, _terms(*x, X, precision=precision)), S, x, X)
        d_S_before, d_x, d_X = vjp((d_carry if fork is None else d_carry[0], _heads_first_v(d_out, X.shape[-4])))
        if fork is not None:
            start, keep = marks
            d_prefix_S = d_carry[1] + jnp.where(start, d_S_before, 0.0)
            d_S_before = jnp.where(start, 0.0, d_S_before) + jnp.where(keep, d_prefix_S, 0.0)
            d_S_before = (d_S_before, jnp.where(keep, 0.0, d_prefix_S))
        d_A = -_dot("...ji,...jk,...lk->...il", X, d_X, X, precision=precision)
        q, k, v, g, beta = x
        _, system_vjp = jax.vjp(lambda k, g, beta: _system(k, g, beta, precision), k, g, beta)
        d_k, d_g, d_beta = system_vjp(d_A)
        d_q, d_k2, d_v, d_g2, d_beta2 = d_x
        return d_S_before, heads_vjp((d_q, d_k + d_k2, d_v, d_g + d_g2, d_beta + d_beta2))

    items = (xs, inverse, S_before_N, d_out) + (() if fork is None else _marks(d_out.shape[0], fork))
    d_carry, d_xs = jax.lax.scan(chunk_back, d_carry, items, reverse=True)
    return (*d_xs, d_carry if fork is None else d_carry[0])


_chunked_recomputing.defvjp(_chunked_fwd, _chunked_bwd)
