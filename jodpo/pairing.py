"""One preference pair per prompt out of k sampled completions (``num_generations`` = k, ``pairing``).

TRL's online DPO samples two completions per prompt and pairs them. With k >= 2 completions per prompt (one decode,
the prompt's prefill shared by its k samples) a step keeps one pair per prompt:
- ``best_worst``: the highest- against the lowest-scored of the k (Xiong et al. 2024, best and worst of 8;
  Lanchantin et al. 2025, arXiv 2506.21495). A prompt whose k scores are all equal (or not finite) has no pair: it
  weighs 0 in the loss and is counted in ``frac_reward_zero_std`` (TRL GRPO's name for such groups).
- ``random``: two of the k at random, in their sampled order; with k = 2 always completions 0 and 1, so a k = 2 run
  is exactly TRL's.
- ``auto`` (the default): ``random`` for k = 2 (TRL's behaviour, bit for bit), ``best_worst`` for k > 2.

Rows are in block layout: for B prompts, k completions occupy rows ``s * B + b`` (completion s of prompt b); the
chosen pairs come back in TRL's two-completion block layout, rows ``b`` and ``B + b``. Everything here is a pure,
jittable function of one micro-batch; ``jax.vmap`` maps it over a window. A pairwise judge ranks the k completions by
a round robin (``round_robin``, ``win_scores``: host side, between sampling and the update).
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

PAIRINGS = ("auto", "best_worst", "random")


def resolve_pairing(pairing: str, k: int) -> str:
    """``auto`` made explicit: ``random`` (TRL's pair) for k = 2, ``best_worst`` for k > 2."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
    if pairing == "auto":
        return "random" if k == 2 else "best_worst"
    return pairing


def _best_worst(scores_kB: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per prompt: the index (of k) of the highest and of the lowest finite score, and whether they differ."""
    finite = jnp.isfinite(scores_kB)
    best = jnp.argmax(jnp.where(finite, scores_kB, -jnp.inf), axis=0)
    worst = jnp.argmin(jnp.where(finite, scores_kB, jnp.inf), axis=0)
    pick = lambda i: jnp.take_along_axis(scores_kB, i[None], 0)[0]  # noqa: E731
    hi, lo = pick(best), pick(worst)
    return best, worst, jnp.isfinite(hi) & jnp.isfinite(lo) & (hi > lo)


def pair_rows(scores: jax.Array, k: int, pairing: str, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Which two of each prompt's k completions form its pair.

    Args:
      scores: f32[kB] block-layout scores (rewards after any EOS penalty, or a judge's win scores).
      pairing: ``best_worst`` or ``random`` (``resolve_pairing`` first for ``auto``).
      key: the draw of ``random``.
    Returns:
      ``(rows, weights)``: i32[2B] rows into the kB completions in two-completion block layout (the best, or the
      earlier sampled, at ``b``; the other at ``B + b``), and f32[B] pair weights: 1, or 0 for a ``best_worst``
      prompt without a pair.
    """
    B = scores.shape[0] // k
    b = jnp.arange(B, dtype=jnp.int32)
    if pairing == "random":
        if k == 2:
            return jnp.arange(2 * B, dtype=jnp.int32), jnp.ones((B,), jnp.float32)
        two = jnp.sort(jnp.argsort(jax.random.uniform(key, (k, B)), axis=0)[:2], axis=0).astype(jnp.int32)
        return jnp.concatenate([two[0] * B + b, two[1] * B + b]), jnp.ones((B,), jnp.float32)
    if pairing != "best_worst":
        raise ValueError(f"pair_rows: pairing must be best_worst or random, got {pairing!r}")
    best, worst, valid = _best_worst(scores.reshape(k, B))
    return (jnp.concatenate([best.astype(jnp.int32) * B + b, worst.astype(jnp.int32) * B + b]),
            valid.astype(jnp.float32))


def group_metrics(scores: jax.Array, k: int) -> dict:
    """Metrics of the k scores of each prompt (f32[kB], block layout): ``objective/scores_all``, their mean (the
    policy's mean score; ``objective/scores`` is over the chosen pairs); ``objective/scores_spread``, the mean over
    prompts of max - min of the finite scores (0 when fewer than two); ``frac_reward_zero_std``, the fraction of
    prompts whose scores are all equal or not finite (no ``best_worst`` pair)."""
    s = scores.reshape(k, -1)
    finite = jnp.isfinite(s)
    hi = jnp.max(jnp.where(finite, s, -jnp.inf), 0)
    lo = jnp.min(jnp.where(finite, s, jnp.inf), 0)
    _, _, valid = _best_worst(s)
    return {"objective/scores_all": scores.mean(),
            "objective/scores_spread": jnp.where(valid, hi - lo, 0.0).mean(),
            "frac_reward_zero_std": 1.0 - valid.astype(jnp.float32).mean()}


def take_rows(tree, rows: jax.Array):
    """The rows ``rows`` (i32[A, 2B]) of every [A, kB, ...] array of ``tree`` (None leaves stay None)."""
    return jax.tree.map(lambda x: jax.vmap(lambda xa, ra: xa[ra])(x, rows), tree)


# --------------------------------------------------------------------------------------------------
# A pairwise judge and k > 2 completions (host side)
# --------------------------------------------------------------------------------------------------


def round_robin(k: int) -> list[tuple[int, int]]:
    """The k(k-1)/2 pairs ``(i, j)``, i < j, of k completions a judge compares (its own ``judge_both_orders``
    reads each in both orders)."""
    return list(itertools.combinations(range(k), 2))


def win_scores(p_first: np.ndarray, k: int) -> np.ndarray:
    """f32[..., k] each completion's mean probability of beating the others, from f32[..., k(k-1)/2] verdicts
    ``p(i beats j)`` of the ``round_robin`` pairs (NaN: no verdict, left out; NaN if a completion has none)."""
    p = np.asarray(p_first, np.float64)
    wins = np.zeros(p.shape[:-1] + (k,))
    seen = np.zeros(p.shape[:-1] + (k,))
    for n, (i, j) in enumerate(round_robin(k)):
        ok = np.isfinite(p[..., n])
        wins[..., i] += np.where(ok, p[..., n], 0.0)
        wins[..., j] += np.where(ok, 1.0 - p[..., n], 0.0)
        seen[..., i] += ok
        seen[..., j] += ok
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(seen > 0, wins / seen, np.nan).astype(np.float32)


def verdict_of(p_first: np.ndarray, k: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """p(completion ``first`` beats completion ``second``) (indices in 0..k-1, arrays of one shape) read from the
    ``round_robin`` verdicts f32[..., k(k-1)/2]; NaN where ``first == second``."""
    index = {pair: n for n, pair in enumerate(round_robin(k))}
    out = np.full(first.shape, np.nan, np.float32)
    for pos in np.ndindex(first.shape):
        i, j = int(first[pos]), int(second[pos])
        if i != j:
            p = p_first[pos + (index[(min(i, j), max(i, j))],)]
            out[pos] = p if i < j else 1.0 - p
    return out
