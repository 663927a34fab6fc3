"""The user's code named by ``module:name`` strings: reward functions (``reward_funcs``) and pairwise judges
(``judge``), as TRL takes them.

A run's ``config.json`` stores these strings, so a run started before a module of jodpo's own moved must still
find it when it resumes: ``MOVED`` maps the old module names to the new ones (and a config file that imports an old
name is told the new one).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from jodpo.errors import JudgeError
from jodpo.judges import CallableJudge

RewardFn = Callable[..., Sequence[float | None]]

# jodpo's modules that moved when the package was laid out in layers (docs/architecture.md): old name -> new
MOVED = {
    "jodpo.toy": "jodpo.tasks.toy", "jodpo.summaries": "jodpo.tasks.summaries",
    "jodpo.config": "jodpo.program.config", "jodpo.data": "jodpo.program.data",
    "jodpo.rewards": "jodpo.program.rewards", "jodpo.checkpoint": "jodpo.program.checkpoint",
    "jodpo.run": "jodpo.program.run", "jodpo.rundir": "jodpo.program.output_dir",
    "jodpo.run_policy": "jodpo.program.trained_policy", "jodpo.logging": "jodpo.program.metrics_log",
    "jodpo.tracking": "jodpo.program.tracking", "jodpo.evaluation": "jodpo.program.training_eval",
    "jodpo.preemption": "jodpo.program.preemption", "jodpo.backend": "jodpo.program.backend",
    "jodpo.hostmem": "jodpo.program.hostmem", "jodpo.sharding": "jodpo.parallel.sharding",
    "jodpo.split_sampler": "jodpo.parallel.split_sampler", "jodpo.models.core": "jodpo.models.decoder",
}


def import_object(spec: str, what: str = "reward function"):
    """``'package.module:name'`` -> the object (a reward function, a judge)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r}: write it as 'module.path:name'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a module beside the user imports, as in a TRL script
        sys.path.append(os.getcwd())
    try:
        return getattr(importlib.import_module(MOVED.get(module, module)), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r} cannot be imported: {e}") from e


def import_reward_function(spec: str) -> RewardFn:
    """``'package.module:function'`` -> the function (TRL's callable reward)."""
    return import_object(spec, "reward function")


def import_judge(spec: str) -> CallableJudge:
    """``'module:function'``, ``'module:Class'`` (instantiated without arguments; its ``judge`` method is called) or
    ``'module:instance'`` -> a ``CallableJudge``."""
    return judge_object(import_object(spec, "judge"), spec)


def judge_object(obj, name: str) -> CallableJudge:
    """A function, a class (instantiated without arguments), or an object with TRL's ``judge`` method, as a judge."""
    if isinstance(obj, type):
        obj = obj()
    fn = getattr(obj, "judge", obj)
    if not callable(fn):
        raise JudgeError(f"judge {name!r} is neither a function nor an object with a judge() method")
    return CallableJudge(fn, name)


def is_import_path(spec: str) -> bool:
    """``judge`` names a Python object (``module:name``) rather than a model directory or hub id."""
    return ":" in spec and not Path(spec).exists()
