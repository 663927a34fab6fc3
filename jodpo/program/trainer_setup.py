"""What ``OnlineDPOTrainer``'s constructor builds beside the run's config, as TRL 1.16's constructor builds it: the
attributes a TRL script or test reads off the trainer (``reward_funcs``, ``reward_weights``, ``generation_config``,
the sampling settings), with TRL's names and, where TRL's are torch's, their torch-free counterparts."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jodpo.errors import ConfigError
from jodpo.program import trl_fields
from jodpo.program.config import TrainConfig
from jodpo.program.user_code import import_reward_function


def reward_funcs(given: list, cfg: TrainConfig) -> list:
    """TRL's ``trainer.reward_funcs``: the rewards given, in order (``module:function`` strings imported, as TRL's
    callables), or the config's (the reward model's path first, then its functions); a reward model's path stays
    a path (TRL loads it as a torch model, jodpo reads it when training starts)."""
    if given:
        return [import_reward_function(r) if isinstance(r, str) and ":" in r and not Path(r).exists() else r
                for r in given]
    return [*([cfg.reward_model_path] if cfg.reward_model_path else []),
            *(import_reward_function(s) for s in cfg.reward_funcs)]


def reward_weights(cfg: TrainConfig, n: int) -> np.ndarray:
    """TRL's ``trainer.reward_weights``: f32[n], ``args.reward_weights`` or ones (TRL's is a torch tensor; this
    numpy array indexes alike: ``reward_weights[0].item()``); a count other than the rewards' is TRL's ValueError."""
    if cfg.reward_weights is None:
        return np.ones(n, np.float32)
    if len(cfg.reward_weights) != n:
        raise ConfigError(f"Number of reward weights ({len(cfg.reward_weights)}) must match number of reward "
                          f"functions ({n}): reward_weights weighs the rewards in order, the reward model first")
    return np.asarray(cfg.reward_weights, np.float32)


def generation_kwargs(cfg: TrainConfig, tokenizer, eos_token_ids) -> dict:
    """TRL's ``trainer.generation_kwargs``: what its ``GenerationConfig`` is made of, its transformers branch (with
    ``use_vllm=True`` too: jodpo's sampler takes the same settings), None values left out."""
    kwargs = {"max_new_tokens": cfg.max_new_tokens, "do_sample": True,
              "pad_token_id": getattr(tokenizer, "pad_token_id", None),
              "bos_token_id": getattr(tokenizer, "bos_token_id", None), "eos_token_id": list(eos_token_ids) or None,
              "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
              "repetition_penalty": cfg.repetition_penalty, "use_cache": not cfg.gradient_checkpointing,
              "min_p": cfg.min_p}
    kwargs |= trl_fields.generation_settings(cfg)
    return {k: v for k, v in kwargs.items() if v is not None}


def generation_config(kwargs: dict):
    """TRL's ``trainer.generation_config``: transformers' ``GenerationConfig`` of ``generation_kwargs`` (importable
    without torch)."""
    from transformers import GenerationConfig

    return GenerationConfig(**kwargs)
