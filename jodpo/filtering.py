"""One step's choice of the sampler: its static settings (``SamplingConfig``) and the filters and exact draw that
turn a step's logits into each row's next token (``choose``).

Filtering follows transformers exactly, in its order: repetition penalty, then temperature, top-k, top-p
(nucleus, keeping the token that crosses p), min-p (relative to the top token's probability).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings (hashable: pass as a static argument of ``jax.jit``).

    ``temperature=0`` is greedy decoding. ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch those filters off.
    """

    max_new_tokens: int = 64
    temperature: float = 0.9
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    chunk: int = 8  # decode steps between checks for "every row has ended" (and, with ``slots``, between refills)
    unroll: int = 1  # decode steps per iteration of the compiled loop (lax.scan's unroll); results do not depend on it
    # Prompts decoded at once (0: all of a call's). Fewer: the call's prompts are a queue and between decode chunks
    # the prompts whose completions have all ended give their rows to the next ones (prefilled into them), so a call
    # may hold more prompts than the rows whose caches fit, and short completions do not wait for the longest. The
    # completions are the same whatever the slots (each draws from its own keys: ``completion_keys``).
    slots: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0 or self.chunk < 1 or self.unroll < 1 or self.repetition_penalty <= 0 or self.slots < 0:
            raise ValueError("top_k and slots must be >= 0, chunk and unroll >= 1, and repetition_penalty > 0")
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))


def process_logits(logits_BV: jax.Array, seen_BV: jax.Array | None, cfg: SamplingConfig) -> jax.Array:
    """The filtered, tempered logits that a token is sampled from (-inf where filtered out)."""
    x = logits_BV.astype(jnp.float32)
    if cfg.repetition_penalty != 1.0:
        penalised = jnp.where(x < 0, x * cfg.repetition_penalty, x / cfg.repetition_penalty)
        x = jnp.where(seen_BV, penalised, x)
    if cfg.temperature == 0:
        return x
    if cfg.temperature != 1.0:
        x = x / cfg.temperature
    neg_inf = jnp.float32(-jnp.inf)
    if cfg.top_k > 0 and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][:, -1:]
        x = jnp.where(x < kth, neg_inf, x)
    if cfg.top_p < 1.0:
        # Ascending sort; drop tokens whose cumulative probability stays <= 1 - p (always keep the top one).
        s = jnp.sort(x, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(s, axis=-1), axis=-1)
        keep = (cum > 1.0 - cfg.top_p).at[:, -1].set(True)
        threshold = jnp.min(jnp.where(keep, s, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, neg_inf, x)
    if cfg.min_p > 0:
        p = jax.nn.softmax(x, axis=-1)
        x = jnp.where(p < cfg.min_p * jnp.max(p, -1, keepdims=True), neg_inf, x)
    return x


def choose(logits_BV: jax.Array, seen_BV, rng: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """One decoding step: the next token of every row and its raw log-probability. ``rng``: one key for the batch,
    or a key per row (the sampler's: ``token_keys``), each row's draw then its own key's alone."""
    x = process_logits(logits_BV, seen_BV, cfg)
    if cfg.temperature == 0:
        token = jnp.argmax(x, axis=-1).astype(jnp.int32)
    else:
        token = _inverse_cdf(x, rng)
    logits = logits_BV.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, token[:, None], -1)[:, 0]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    return token, logp


def _inverse_cdf(x_BV: jax.Array, rng: jax.Array, block: int = 128) -> jax.Array:
    """An exact categorical draw with one uniform per row (``rng`` one key, or one a row), by searching the cumulative probabilities,
    instead of a Gumbel variate for every vocabulary entry (which dominates a decode step on a CPU with a
    50k vocabulary). Two levels: the cumulative sum of per-block totals finds the block where the uniform
    falls, then the cumulative sum inside that block alone finds the token (a flat cumulative sum over the
    vocabulary took 3 ms of a 25 ms decode step at batch 16; this takes 0.5 ms)."""
    B, V = x_BV.shape
    n = -(-V // block)
    p = jnp.exp(x_BV - jnp.max(x_BV, -1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, n * block - V))).reshape(B, n, block)
    block_p = jnp.sum(p, -1)
    block_cdf = jnp.cumsum(block_p, -1)
    if jnp.ndim(rng) == (1 if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else 2):  # a key per row
        u = jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(rng)
    else:
        u = jax.random.uniform(rng, (B, 1), jnp.float32)
    u = u * block_cdf[:, -1:]
    # Rounding can put u at a total (of the row or of the chosen block): then take the last block, and the last
    # token in its block, of nonzero probability, never a filtered token or the padding.
    last_block = jnp.max(jnp.where(block_p > 0, jnp.arange(n), 0), -1)
    b = jnp.minimum(jnp.sum(block_cdf <= u, -1), last_block)[:, None]  # the first block whose cdf exceeds u
    inner = jnp.take_along_axis(p, b[:, :, None], 1)[:, 0]  # [B, block]; its total is > 0
    u_in = jnp.maximum(u - (jnp.take_along_axis(block_cdf, b, -1) - jnp.take_along_axis(block_p, b, -1)), 0.0)
    i = jnp.sum(jnp.cumsum(inner, -1) <= u_in, -1)
    last = jnp.max(jnp.where(inner > 0, jnp.arange(block), 0), -1)
    return (b[:, 0] * block + jnp.minimum(i, last)).astype(jnp.int32)
