"""When a run logs, evaluates, saves and pushes: transformers' strategies (``logging_strategy``, ``eval_strategy``,
``save_strategy``, ``hub_strategy``) with their meanings (transformers' ``DefaultFlowCallback``), in one place.

- ``"steps"``: every ``logging_steps`` / ``eval_steps`` / ``save_steps`` (a fraction below 1 of the run's steps, as
  transformers reads it), and the run's last step (transformers evaluates and saves it too; jodpo also logs it).
  ``eval_steps`` None is ``logging_steps``, as transformers sets it.
- ``"epoch"``: at the end of each epoch (every ``steps_per_epoch`` steps) and at the run's last step (transformers
  ends the run's last epoch there).
- ``"no"``: never (``logging_first_step`` still logs step 1, as in transformers).
``eval_delay`` holds evaluations back until that many steps (``"steps"``) or epochs (``"epoch"``) are done.
"""
from __future__ import annotations

import dataclasses
import math

from jodpo.errors import ConfigError

STRATEGIES = ("no", "steps", "epoch")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")


def check(c) -> None:
    """The strategies of a config (a ``TrainConfig``) and their step counts."""
    if c.save_strategy == "best":
        raise ConfigError("save_strategy='best' saves when metric_for_best_model improves, and jodpo keeps no best "
                          "checkpoint: use 'steps' or 'epoch'")
    for name in ("logging_strategy", "eval_strategy", "save_strategy"):
        if getattr(c, name) not in STRATEGIES:
            raise ConfigError(f"{name} must be one of {STRATEGIES}, got {getattr(c, name)!r}")
    if c.hub_strategy not in HUB_STRATEGIES:
        raise ConfigError(f"hub_strategy must be one of {HUB_STRATEGIES}, got {c.hub_strategy!r}")
    if not c.save_steps > 0:
        raise ConfigError(f"save_steps must be > 0 (a step count, or a fraction of the run below 1), got "
                          f"{c.save_steps}")
    if c.eval_steps is not None and not c.eval_steps > 0:
        raise ConfigError(f"eval_steps must be > 0 (a step count, or a fraction of the run below 1) or None "
                          f"(logging_steps), got {c.eval_steps}")
    if c.eval_delay < 0:
        raise ConfigError(f"eval_delay must be >= 0 (steps or epochs before the first evaluation), got {c.eval_delay}")


def every(value: float, total: int) -> int:
    """Steps between events: ``value`` steps, or below 1 that fraction of the ``total`` steps (at least 1)."""
    return int(value) if value >= 1 else max(1, math.ceil(total * value))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A run's schedule: ``total`` steps of ``steps_per_epoch`` each epoch, as ``cfg`` asks."""

    cfg: object  # the TrainConfig
    total: int
    steps_per_epoch: int

    @property
    def save_every(self) -> int:
        return every(self.cfg.save_steps, self.total)

    @property
    def eval_every(self) -> int:
        return every(self.cfg.eval_steps if self.cfg.eval_steps is not None else self.cfg.logging_steps, self.total)

    def _epoch_ends(self, done: int) -> bool:
        return done % self.steps_per_epoch == 0 or done == self.total

    def logs(self, done: int) -> bool:
        """Step ``done`` (counted from 1) writes its training line."""
        how = self.cfg.logging_strategy
        if done == 1 and self.cfg.logging_first_step:
            return True
        return how != "no" and (done == self.total or (how == "steps" and done % self.cfg.logging_steps == 0)
                                or (how == "epoch" and self._epoch_ends(done)))

    def evaluates(self, done: int) -> bool:
        how, delay = self.cfg.eval_strategy, self.cfg.eval_delay
        if how == "steps":
            return delay <= done and (done % self.eval_every == 0 or done == self.total)
        return how == "epoch" and self._epoch_ends(done) and delay <= done / self.steps_per_epoch

    @property
    def saving(self) -> bool:
        return self.cfg.save_strategy != "no"

    def saves(self, done: int) -> bool:
        how = self.cfg.save_strategy
        if how == "steps":
            return done % self.save_every == 0 or done == self.total
        return how == "epoch" and self._epoch_ends(done)

    def saves_after(self, start: int) -> int:
        """The checkpoints the run still writes after step ``start``."""
        if self.cfg.save_strategy == "steps":
            every_, total = self.save_every, self.total
            return total // every_ - start // every_ + (1 if total % every_ else 0)
        return sum(self.saves(done) for done in range(start + 1, self.total + 1))
