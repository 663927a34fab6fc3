"""The checks of a ``TrainConfig``'s values (``config.TrainConfig`` runs them when it is made): one ``ConfigError``
naming the field, the problem and the fix."""
from __future__ import annotations

import warnings

from jodpo.errors import ConfigError
from jodpo.losses import LOSSES, LossOptions, check_loss_options
from jodpo.methods import FIXED_PAIR_SHAPE, check_method
from jodpo.models.model import ATTENTIONS, DECODE_ATTENTIONS, PRECISIONS
from jodpo.pairing import PAIRINGS
from jodpo.program import schedule
from jodpo.program.tracking import trackers


def check(c) -> None:
    """Every field's value, and the fields that go together; a ``ConfigError`` naming the field and the fix."""
    positive = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                "num_epochs", "num_mini_batches",
                "max_new_tokens", "max_length", "max_prompt_length", "logging_steps", "decode_chunk",
                "max_nonfinite_steps", "sync_steps")
    for name in positive:
        if getattr(c, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(c, name)}")
    if c.sampler_slots < 0:
        raise ConfigError(f"sampler_slots must be >= 0 (0: every prompt of a step at once), got {c.sampler_slots}")
    if not c.learning_rate > 0:
        raise ConfigError(f"learning_rate must be > 0, got {c.learning_rate}")
    if c.num_generations < 2:
        raise ConfigError(f"num_generations must be >= 2 (a pair needs two completions of a prompt), got "
                          f"{c.num_generations}")
    if c.pairing not in PAIRINGS:
        raise ConfigError(f"pairing must be one of {PAIRINGS}, got {c.pairing!r}")
    if c.sync_steps > 1 and c.sync_steps % c.updates_per_step:
        raise ConfigError(f"sync_steps={c.sync_steps} is not a multiple of the {c.updates_per_step} optimizer steps "
                          "of a rollout (num_epochs x num_mini_batches): the sampler is refreshed between rollouts; "
                          "use a multiple")
    betas = c.beta if isinstance(c.beta, tuple) else (c.beta,)
    if not betas or any(not b > 0 for b in betas):
        raise ConfigError(f"beta must be > 0 (a number or a list of numbers), got {c.beta}")
    if c.loss_type not in LOSSES:
        raise ConfigError(f"unknown loss_type {c.loss_type!r}; choose one of {sorted(LOSSES)}")
    try:
        check_loss_options(c.loss_type, LossOptions(c.label_smoothing, c.discopop_tau, c.ipo_length_normalized,
                                                     c.simpo_gamma, c.rdpo_alpha, c.ld_alpha))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_method(c)
    for name in ("param_dtype", "frozen_param_dtype"):
        if getattr(c, name) not in ("float32", "bfloat16"):
            raise ConfigError(f"{name} must be float32 or bfloat16, got {getattr(c, name)!r}")
    sizes = (c.mesh_data, c.mesh_fsdp, c.mesh_expert, c.mesh_tensor)
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh_data, mesh_fsdp, mesh_expert, mesh_tensor must be >= 1, with at most one -1; got "
                          f"{sizes}")
    if c.matmul_precision not in PRECISIONS:
        raise ConfigError(f"matmul_precision must be one of {PRECISIONS}, got {c.matmul_precision!r}")
    if c.attn_implementation not in ("auto", *ATTENTIONS):
        raise ConfigError(f"attn_implementation must be one of {('auto', *ATTENTIONS)}, got {c.attn_implementation!r}")
    if c.decode_attn_implementation not in ("auto", *DECODE_ATTENTIONS):
        raise ConfigError(f"decode_attn_implementation must be one of {('auto', *DECODE_ATTENTIONS)}, got "
                          f"{c.decode_attn_implementation!r}")
    if c.attn_implementation == "cudnn" and not c.bf16:
        raise ConfigError("attn_implementation='cudnn' needs bf16=True (cuDNN's flash attention has no float32 "
                          "kernel); use 'xla' for float32 compute")
    if c.attn_implementation == "splash" and not c.bf16:
        raise ConfigError("attn_implementation='splash' needs bf16=True (jodpo runs splash attention on bf16 compute "
                          "only: float32 keeps the XLA attention's explicit precision); use 'xla' for float32 compute")
    if c.dataset_mixer is not None and c.dataset_name:
        raise ConfigError("dataset_mixer and dataset_name are both set: the mixer replaces dataset_name; unset one")
    if c.stop_token not in (None, "eos", "period"):
        raise ConfigError(f"stop_token must be eos or period (open-instruct's), got {c.stop_token!r}")
    if c.total_episodes is not None and (c.total_episodes < 1 or c.max_steps > 0):
        raise ConfigError(f"total_episodes must be >= 1 and max_steps unset (both give the run's length); got "
                          f"total_episodes={c.total_episodes}, max_steps={c.max_steps}")
    if c.temperature_scaled_logprobs and not c.temperature > 0:
        raise ConfigError("temperature_scaled_logprobs divides the loss's logits by temperature, which is "
                          f"{c.temperature}; use a temperature > 0 or turn it off")
    if c.use_peft and (c.lora_r < 1 or not c.lora_alpha > 0 or not 0 <= c.lora_dropout < 1):
        raise ConfigError(f"use_peft needs lora_r >= 1, lora_alpha > 0 and 0 <= lora_dropout < 1; got lora_r="
                          f"{c.lora_r}, lora_alpha={c.lora_alpha}, lora_dropout={c.lora_dropout}")
    if c.judge is not None:
        others = [n for n in ("reward_model_path", "reward_funcs", "reward_weights") if getattr(c, n)]
        if others:
            raise ConfigError(f"judge and {', '.join(others)} are both set: a run pairs its completions by a judge or "
                              "by rewards (as TRL enforces); unset one")
        if c.missing_eos_penalty is not None or c.non_eos_penalty:
            raise ConfigError("missing_eos_penalty and non_eos_penalty change rewards, and a judge gives none (TRL "
                              "applies them only with rewards); unset them, or use a reward model")
        if len(c.judge_answer_tokens) != 2 or c.judge_answer_tokens[0] == c.judge_answer_tokens[1]:
            raise ConfigError(f"judge_answer_tokens must be two different strings, got {c.judge_answer_tokens!r}")
    if c.sampler_devices < 0:
        raise ConfigError(f"sampler_devices must be >= 0 (0: sample on the training devices), got {c.sampler_devices}")
    trackers(c.report_to)  # unknown names, and a tracker not installed, fail before the run starts
    if c.remat not in ("auto", "none", "full", "dots"):
        raise ConfigError(f"remat must be auto, none, full or dots, got {c.remat!r}")
    schedule.check(c)
    if c.max_new_tokens >= c.max_length:
        warnings.warn(f"max_new_tokens ({c.max_new_tokens}) >= max_length ({c.max_length}): prompts will be truncated "
                      "or removed in the loss forward; use max_length > max_new_tokens + the prompt length "
                      "(as TRL warns).", stacklevel=5)


def _check_method(c) -> None:
    """``method`` and the settings of TRL's online family (``jodpo.methods.check_method``)."""
    options = LossOptions(c.label_smoothing, c.discopop_tau, c.ipo_length_normalized, c.simpo_gamma, c.rdpo_alpha,
                          c.ld_alpha)
    try:
        check_method(c.method, mixture_coef=c.mixture_coef, alpha=c.alpha, loss_type=c.loss_type,
                     loss_options=options, **{k: getattr(c, k) for k in FIXED_PAIR_SHAPE})
    except ValueError as e:
        raise ConfigError(str(e)) from None
