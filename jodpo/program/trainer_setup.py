"""What ``OnlineDPOTrainer``'s constructor builds beside the run's config, as TRL 1.16's constructor builds it: the
attributes a TRL script or test reads off the trainer (``reward_funcs``, ``reward_weights``, ``generation_config``,
the sampling settings), with TRL's names and, where TRL's are torch's, their torch-free counterparts."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from jodpo.errors import ConfigError
from jodpo.models import load_tokenizer
from jodpo.models.loading import is_model_object, load_params, model_from_object
from jodpo.program import trl_fields
from jodpo.program.config import TrainConfig
from jodpo.program.sources import is_jodpo_model, named, on_host, read_policy
from jodpo.program.user_code import import_reward_function


def is_peft_model(x) -> bool:
    """A peft ``PeftModel`` (``get_peft_model``'s): a transformers model with LoRA layers injected."""
    return is_model_object(x) and hasattr(x, "peft_config") and hasattr(x, "get_base_model")


def adapter_config(model) -> dict:
    """A peft model's active LoRA config, as a dict for ``peft_config``; one whose adapters were trained already (a
    ``lora_B`` not zero: jodpo starts adapters afresh) or that trains whole modules besides them is refused."""
    config = model.peft_config[getattr(model, "active_adapter", "default")]
    d = config.to_dict()
    if d.get("modules_to_save"):
        raise ConfigError(f"model is a peft model with modules_to_save={d['modules_to_save']}; jodpo's LoRA trains the "
                          "adapters alone: give one without")
    trained = [n for n, t in model.named_parameters() if ".lora_B." in n and bool(t.detach().abs().sum() > 0)]
    if trained:
        raise ConfigError(f"model is a peft model whose adapters have been trained ({trained[0]} is not zero); jodpo "
                          "trains adapters from a fresh start on the base: give model.merge_and_unload() and a "
                          "peft_config to train new adapters on the merged weights, or get_peft_model's fresh model")
    return d


def _base_tensors(model):
    """A peft model's base weights under transformers' names (its LoRA layers' ``base_layer`` as the module), the
    adapters left out; float32 numpy arrays, one at a time, through the tensors' own methods (no torch import)."""
    for name, t in model.get_base_model().state_dict().items():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), t.detach().to("cpu").float().numpy()


def tokenizer_of(processing_class):
    """The tokenizer of a ``processing_class``: a processor's own (a vision-language model's ``ProcessorMixin``, as
    TRL takes its ``.tokenizer`` for text), else the tokenizer itself."""
    if hasattr(processing_class, "tokenizer") and not hasattr(processing_class, "convert_tokens_to_ids"):
        return processing_class.tokenizer
    return processing_class


def read_model(model, processing_class, cfg: TrainConfig) -> tuple[object, object]:
    """The policy and its processing class as the trainer holds them from its constructor on, read there as TRL's
    constructor reads them (so that what cannot be trained is said in TRL's order, before ``train()``): a path or hub
    id (``model``, or ``args.model_name_or_path``) read into host memory as jodpo's ``(Model, params)`` (no device is
    touched: ``train()`` places them); a transformers object or jodpo's own pair as given. The processing class:
    ``processing_class`` (a tokenizer, or a vision-language model's processor: ``tokenizer_of``), or the model's own
    tokenizer."""
    if model is None or isinstance(model, (str, Path)):
        if not cfg.model_name_or_path:
            raise ConfigError("OnlineDPOTrainer: no model: give model (a path, a hub id, a transformers model or "
                              "jodpo's (model, params)) or args.model_name_or_path")
        # one copy whichever dtype the run reads it in: train() casts it (float32 holds bfloat16 exactly)
        dtype = cfg.param_dtype if cfg.param_dtype == cfg.frozen_param_dtype else "float32"
        model = read_policy(cfg.model_name_or_path, dtype, cfg, None, place=on_host)
    elif is_peft_model(model):  # its base, on the host; its LoRA config is the run's (use_peft)
        base = model.get_base_model()
        described = model_from_object(base, "causal_lm", "float32")
        model = described, load_params(described, f"the peft model's base ({cfg.model_name_or_path})", "float32",
                                       on_host(described, "float32"), _base_tensors(model))
        warnings.warn("model is a peft model: jodpo trains LoRA adapters of its config (rank, alpha, target modules) "
                      "on its base weights, from a fresh start of jodpo's own (lora_B zero, as get_peft_model starts "
                      "them; lora_A drawn from seed)", stacklevel=3)
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
