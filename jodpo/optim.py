"""The optimizer: AdamW with global-norm clipping and transformers' learning-rate schedules, as one optax chain."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("linear", "constant", "constant_with_warmup", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warm-up schedule, with TRL/transformers' defaults."""

    learning_rate: float = 5e-7
    total_steps: int = 1  # optimizer steps of the run (the schedule's horizon)
    warmup_steps: int = 0
    lr_scheduler_type: str = "linear"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 or None: no clipping

    def __post_init__(self):
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"unknown lr_scheduler_type {self.lr_scheduler_type!r}; choose one of {SCHEDULES}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """transformers' schedules as a function of the number of updates already applied.

    ``linear``: ``lr * s / W`` during the W warm-up steps, then linear decay to 0 at ``total_steps``
    (``get_linear_schedule_with_warmup``); ``cosine`` decays as ``(1 + cos(pi * progress)) / 2``.
    """
    lr, W, T = cfg.learning_rate, cfg.warmup_steps, cfg.total_steps

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = s / max(1, W)
        progress = (s - W) / max(1, T - W)
        after = {"linear": jnp.maximum(0.0, 1.0 - progress),
                 "cosine": jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * progress))),
                 "constant": jnp.ones_like(s), "constant_with_warmup": jnp.ones_like(s)}[cfg.lr_scheduler_type]
        if cfg.lr_scheduler_type == "constant":
            return lr * after
        return lr * jnp.where(s < W, warm, after)

    return schedule


def make_optimizer(cfg: OptimizerConfig, frozen: tuple[str, ...] = ()) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW (decoupled weight decay, as torch.optim.AdamW) with the schedule. ``frozen``: the
    names of leaves never updated, weight decay neither (what transformers keeps as buffers, outside the optimizer:
    ``jodpo.models.params.buffers``)."""
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon,
                        weight_decay=cfg.weight_decay)
    tx = adamw if not cfg.max_grad_norm else optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    if not frozen:
        return tx

    def hold(updates, params=None):
        return jax.tree_util.tree_map_with_path(
            lambda path, u: jnp.zeros_like(u) if any(getattr(k, "key", None) in frozen for k in path) else u, updates)

    return optax.chain(tx, optax.stateless(hold))


def restarted(cfg: OptimizerConfig, params, updates_done, frozen: tuple[str, ...] = ()) -> optax.OptState:
    """A fresh optimizer state for ``params`` after ``updates_done`` updates: what a resume from a checkpoint without
    one (``save_only_model``) continues with. AdamW's moments start from zero and its bias correction from its first
    step, as a new AdamW's, so the first update is an ordinary first step (a moment count left at ``updates_done``
    would skip the correction and make that update (1 - beta1) / sqrt(1 - beta2), about 3.2, times Adam's first);
    the learning-rate schedule stands at ``updates_done``, where the run is."""
    done = jnp.asarray(updates_done, jnp.int32)
    is_schedule = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree.map(lambda s: s._replace(count=done) if is_schedule(s) else s,
                        make_optimizer(cfg, frozen).init(params), is_leaf=is_schedule)
