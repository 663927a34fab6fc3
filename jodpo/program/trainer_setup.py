"""What ``OnlineDPOTrainer``'s constructor builds beside the run's config, as TRL 1.16's constructor builds it: the
attributes a TRL script or test reads off the trainer (``reward_funcs``, ``reward_weights``, ``generation_config``,
the sampling settings), with TRL's names and, where TRL's are torch's, their torch-free counterparts."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jodpo.errors import ConfigError
from jodpo.models import load_tokenizer
from jodpo.program import trl_fields
from jodpo.program.config import TrainConfig
from jodpo.program.sources import is_jodpo_model, named, on_host, read_policy
from jodpo.program.user_code import import_reward_function


def read_model(model, processing_class, cfg: TrainConfig) -> tuple[object, object]:
    """The policy and its tokenizer as the trainer holds them from its constructor on, read there as TRL's
    constructor reads them (so that what cannot be trained is said in TRL's order, before ``train()``): a path or hub
    id (``model``, or ``args.model_name_or_path``) read into host memory as jodpo's ``(Model, params)`` (no device is
    touched: ``train()`` places them); a transformers object or jodpo's own pair as given. The tokenizer:
    ``processing_class``, or the model's own."""
    if model is None or isinstance(model, (str, Path)):
        if not cfg.model_name_or_path:
            raise ConfigError("OnlineDPOTrainer: no model: give model (a path, a hub id, a transformers model or "
                              "jodpo's (model, params)) or args.model_name_or_path")
        # one copy whichever dtype the run reads it in: train() casts it (float32 holds bfloat16 exactly)
        dtype = cfg.param_dtype if cfg.param_dtype == cfg.frozen_param_dtype else "float32"
        model = read_policy(cfg.model_name_or_path, dtype, cfg, None, place=on_host)
    if processing_class is None:
        with named("model_name_or_path"):
            processing_class = load_tokenizer(cfg.model_name_or_path, cfg.model_revision)
    return model, processing_class


def eos_token_ids(model, tokenizer) -> list[int]:
    """TRL's ``trainer.eos_token_ids``: the tokenizer's EOS first, then every EOS id the model declares."""
    if is_jodpo_model(model):
        declared = list(model[0].eos_token_ids)
    else:
        declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    eos = getattr(tokenizer, "eos_token_id", None)
    return declared if eos is None or eos in declared else [eos, *declared]


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
