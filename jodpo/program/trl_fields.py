"""TRL's fields that are not jodpo's own, each answered: every field of TRL 1.16's ``OnlineDPOConfig`` (with
transformers' ``TrainingArguments``), of TRL 1.12's ``NashMDConfig`` / ``XPOConfig``, and of the ``ModelConfig`` /
``ScriptArguments`` that TRL's example scripts parse beside them, is either a ``TrainConfig`` field (TRL's name,
meaning and default) or here, as data: a no-op (any value accepted, the reason it means nothing in jodpo said), a
field accepted at the values that mean what jodpo does (others refused with the reason), or a field mapped onto
jodpo's own. No trl or torch is imported: tests/test_trl_fields.py compares this table with TRL's dataclasses.

``answer`` is the one place a config's given names are checked (``TrainConfig``, config files, YAML recipes, the
command line): every unknown name and every refused value is said at once, in one line.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Callable

from jodpo.errors import ConfigError

NOOP, ONLY, MAPPED = "no-op", "only", "mapped"


@dataclasses.dataclass(frozen=True)
class Answer:
    kind: str  # NOOP: any value, ignored | ONLY: the values in ``accepted`` | MAPPED: ``maps`` gives jodpo's fields
    default: object  # TRL's default
    reason: str  # one line: why it means nothing here, why other values are refused, or what it maps onto
    accepted: tuple = ()  # ONLY: the values accepted (TRL's default among them, where it means what jodpo does)
    maps: Callable[[object], dict] | None = None  # MAPPED: value -> jodpo's fields; ValueError says what it refuses


def noop(default, reason: str) -> Answer:
    return Answer(NOOP, default, reason)


def only(default, reason: str, *also) -> Answer:
    """Accepted at ``default`` (and the values ``also``), which mean what jodpo does; refused otherwise."""
    return Answer(ONLY, default, reason, (default, *also))


def mapped(default, reason: str, maps: Callable[[object], dict]) -> Answer:
    return Answer(MAPPED, default, reason, maps=maps)


# --- the mappings ---------------------------------------------------------------------------------------------


def _keys(value, what: str) -> dict:
    """A dict field's value: a dict, or its JSON text (as transformers reads its dict fields), or None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a dict of keyword arguments (or its JSON), got a {type(value).__name__}")
    return value


SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# use_cache: jodpo's sampler always decodes with its own KV cache; do_sample: True samples (TRL's online trainers'
# default), False decodes greedily (``do_sample``)
_GENERATION_IGNORED = ("use_cache", "do_sample")


def _generation(value) -> dict:
    """TRL's ``generation_kwargs`` (they update its GenerationConfig): jodpo's sampling fields of the same names."""
    kwargs = _keys(value, "generation_kwargs")
    if not isinstance(kwargs.get("do_sample", True), bool):
        raise ValueError(f"do_sample is True or False, got {kwargs['do_sample']!r}")
    other = sorted(set(kwargs) - set(SAMPLING) - set(_GENERATION_IGNORED))
    if other:
        raise ValueError(f"{other} have no counterpart in jodpo's sampler, which takes {', '.join(SAMPLING)}; "
                         "drop them")
    return {k: v for k, v in kwargs.items() if k in SAMPLING}


def generation_settings(cfg) -> dict:
    """A config's ``generation_kwargs``, as the dict TRL updates its GenerationConfig with ({} when None)."""
    return dict(_keys(cfg.generation_kwargs, "generation_kwargs"))


def do_sample(cfg) -> bool:
    """Whether completions are sampled (``generation_kwargs``' ``do_sample``, True unless it says False: then they are
    decoded greedily, as transformers' generate does with do_sample=False, whatever temperature says)."""
    return generation_settings(cfg).get("do_sample", True) is not False


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "torch.float32": "float32", "torch.bfloat16": "bfloat16"}


def _dtype(value, what: str) -> dict:
    name = _DTYPES.get(str(value))
    if name is None:
        raise ValueError(f"{what}={value!r}: jodpo reads the policy in param_dtype and the frozen models in "
                         "frozen_param_dtype, float32 or bfloat16 (never the checkpoint's own, 'auto', nor float16); "
                         "give float32 or bfloat16")
    return {"param_dtype": name, "frozen_param_dtype": name}


_INIT_IGNORED = ("attn_implementation", "device_map", "use_cache", "low_cpu_mem_usage")


def _model_init(value) -> dict:
    """TRL's ``model_init_kwargs`` (``from_pretrained``'s arguments for a model given by name)."""
    kwargs = _keys(value, "model_init_kwargs")
    out = {}
    for key in ("dtype", "torch_dtype"):
        if kwargs.get(key) is not None:
            out |= _dtype(kwargs[key], f"model_init_kwargs[{key!r}]")
    if kwargs.get("revision") is not None:
        out["model_revision"] = kwargs["revision"]
    other = sorted(set(kwargs) - {"dtype", "torch_dtype", "revision", "trust_remote_code", *_INIT_IGNORED})
    if other:
        raise ValueError(f"{other} have no counterpart in jodpo (which maps dtype, torch_dtype, revision and "
                         f"trust_remote_code, and needs none of {', '.join(_INIT_IGNORED)}: it reads the weights "
                         "itself, onto its mesh); drop them")
    return out


_REMAT_IGNORED = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug")


def _checkpointing(value) -> dict:
    """transformers' ``activation_checkpointing_kwargs`` / ``gradient_checkpointing_kwargs``."""
    kwargs = _keys(value, "activation_checkpointing_kwargs")
    other = sorted(k for k, v in kwargs.items() if k not in _REMAT_IGNORED and (k, v) not in
                   (("every_n_layers", 1), ("offload", False)))
    if other:
        raise ValueError(f"{other}: jodpo's remat is remat=none|full|dots for every layer (no every_n_layers, no "
                         "offload to the host); drop them")
    return {}


def _flag(field: str, when, value) -> Callable[[object], dict]:
    return lambda given: {field: value} if given == when else {}


# --- the reasons several fields share ------------------------------------------------------------------------

_DATALOADER = "torch DataLoader's; jodpo tokenizes the data once, before training, and has no data loader"
_DDP = "torch DistributedDataParallel's; jodpo's multi-process runs are jax.distributed's (docs/tpu.md)"
_VLLM = "vLLM's; jodpo samples with its own JAX sampler whatever use_vllm says"
_TORCH_COMPILE = "XLA compiles every program jodpo runs, whatever this says"
_EVAL_OUTPUTS = ("shapes what evaluation hands compute_metrics, which jodpo does not take: its evaluation samples "
                 "and scores completions")
_TRACKIO = "Trackio's; jodpo's report_to offers tensorboard and wandb (W&B's project is $WANDB_PROJECT)"
_BEST = "jodpo keeps no best checkpoint (no metric_for_best_model): leave it unset"
_BNB = "bitsandbytes' 4-bit options, used only with load_in_4bit, which jodpo refuses"
_SCRIPTS = "not used by transformers' Trainer either (for scripts to read)"

TABLE: dict[str, Answer] = {
    # --- OnlineDPOConfig (TRL 1.16), and what TRL 1.12's and earlier versions had
    "generation_kwargs": mapped(None, f"keys {', '.join(SAMPLING)} set those fields; do_sample=False decodes "
                                      "greedily, as TRL's generate then does (both completions of a prompt are the "
                                      "same: every pair ties, nothing is learned); use_cache accepted; any other key "
                                      "is refused, named", _generation),
    "cache_implementation": noop(None, "transformers' KV cache class; jodpo's sampler has its own KV cache"),
    "disable_dropout": only(True, "jodpo's models run without dropout, which is TRL's disable_dropout=True; False "
                                  "would need dropout in training, which jodpo does not have"),
    "use_vllm": mapped(False, "True is accepted and samples as False does: with jodpo's own JAX sampler, with the "
                              "same settings vLLM would take (temperature, top_k, top_p, min_p, repetition_penalty, "
                              "max_new_tokens, generation_kwargs), on the training devices, or with sampler_devices=k "
                              "on devices of its own, as vLLM's server mode", lambda v: {}),
    **{name: noop(default, _VLLM) for name, default in (
        ("vllm_model_impl", "vllm"), ("vllm_structured_outputs_regex", None), ("vllm_guided_decoding_regex", None),
        ("vllm_gpu_memory_utilization", 0.55), ("gpu_memory_utilization", 0.9), ("vllm_mode", "colocate"),
        ("vllm_server_base_url", None), ("vllm_server_host", "0.0.0.0"), ("vllm_server_port", 8000),
        ("vllm_server_timeout", 240.0), ("vllm_group_port", 51216), ("vllm_tensor_parallel_size", 1),
        ("vllm_enable_sleep_mode", False))},
    "ds3_gather_for_generation": noop(True, "DeepSpeed ZeRO-3's; jodpo's sampler reads mesh_fsdp-sharded weights "
                                            "where XLA lays them out"),
    "model_init_kwargs": mapped(None, "dtype / torch_dtype (float32 or bfloat16) set param_dtype and "
                                      "frozen_param_dtype, revision sets model_revision, trust_remote_code as the "
                                      "field of that name; attn_implementation, device_map, use_cache, "
                                      "low_cpu_mem_usage are not needed; "
                                      "other keys are refused, named", _model_init),
    "trust_remote_code": mapped(False, "a checkpoint with code of its own (config.json's auto_map) is refused "
                                       "without it, as transformers refuses it; True trains it as jodpo's own "
                                       "implementation of its model_type: jodpo never runs a checkpoint's Python "
                                       "code", lambda v: {}),
    "use_transformers_paged": noop(False, "transformers' paged generation; jodpo samples with its own sampler"),
    "dataset_num_proc": noop(None, "jodpo tokenizes the data in one process, once, before training"),
    "log_completions": mapped(False, "jodpo prints a table of sample completions num_sample_generations times (and "
                                     "sends it to W&B); False sets num_sample_generations=0, True keeps it",
                              _flag("num_sample_generations", False, 0)),
    # --- TrainingArguments: the optimizer and its schedule
    "optim": only("adamw_torch_fused", "jodpo's optimizer is AdamW with float32 moments (optax), which these are; "
                                       "other optimizers are not offered", "adamw_torch", "adamw_torch_xla",
                "adamw_torch_npu_fused"),
    "optim_args": only(None, "arguments of optimizers jodpo does not have (its AdamW takes adam_beta1, adam_beta2, "
                             "adam_epsilon, weight_decay)"),
    "optim_target_modules": only(None, "GaLore's and APOLLO's, optimizers jodpo does not have"),
    "lr_scheduler_kwargs": only(None, "jodpo's schedules (lr_scheduler_type) take no arguments", {}),
    "average_tokens_across_devices": noop(True, "jodpo's losses are means over pairs, not over tokens: no token "
                                                "count to average"),
    "label_smoothing_factor": only(0.0, "smooths a token cross-entropy's labels; DPO's label smoothing is "
                                        "label_smoothing (cDPO), another field", 0),
    # --- precision and compilation
    "fp16": only(False, "float16 compute is not offered: bf16=True computes in bfloat16, bf16=False in float32"),
    "bf16_full_eval": only(False, "evaluation computes as training does (bf16); a bfloat16 copy of the weights for "
                                  "it is not offered"),
    "fp16_full_eval": only(False, "float16 is not offered (bf16 sets the compute dtype of evaluation too)"),
    "tf32": mapped(None, "True: matmul_precision='high' (TF32 on GPUs); None/False: jodpo's float32 dots "
                         "(matmul_precision='highest', as torch's default)", _flag("matmul_precision", True, "high")),
    "full_determinism": mapped(False, "True: deterministic=True (XLA's deterministic GPU kernels)",
                               _flag("deterministic", True, True)),
    "activation_checkpointing": mapped(None, "transformers 5's name of gradient_checkpointing: sets it",
                                       lambda v: {} if v is None else {"gradient_checkpointing": v}),
    "activation_checkpointing_kwargs": mapped(None, "torch.utils.checkpoint's options (use_reentrant, ...) mean "
                                                    "nothing to JAX's remat and are ignored; every_n_layers > 1 and "
                                                    "offload are refused", _checkpointing),
    "gradient_checkpointing_kwargs": mapped(None, "as activation_checkpointing_kwargs (its old name)", _checkpointing),
    "torch_compile": noop(False, _TORCH_COMPILE),
    "torch_compile_backend": noop(None, _TORCH_COMPILE),
    "torch_compile_mode": noop(None, _TORCH_COMPILE),
    "use_liger_kernel": noop(False, "Liger's Triton kernels patch torch models; jodpo's step is compiled by XLA and "
                                    "computes the LM head only at completion positions"),
    "liger_kernel_config": noop(None, "Liger's (see use_liger_kernel)"),
    "use_cache": noop(False, "a torch model's KV cache in training forwards; jodpo's sampler always decodes with its "
                             "own KV cache and its training forwards need none"),
    "neftune_noise_alpha": only(None, "NEFTune's noise on the embeddings is not offered"),
    "torch_empty_cache_steps": noop(None, "torch's CUDA caching allocator; XLA manages device memory itself"),
    "auto_find_batch_size": only(False, "jodpo does not retry smaller batches after running out of memory: choose "
                                        "per_device_train_batch_size (gradient_accumulation_steps keeps the batch)"),
    # --- logging
    "log_on_each_node": noop(True, "jodpo's lines are printed by process 0 only"),
    "logging_nan_inf_filter": noop(True, "jodpo logs a non-finite loss as it is and skips that update "
                                         "(max_nonfinite_steps); no NaN is ever averaged into a logged loss"),
    "include_num_input_tokens_seen": only("no", "jodpo does not count the input tokens seen", False),
    "log_level": noop("passive", "transformers' logging verbosity; jodpo prints its own lines"),
    "log_level_replica": noop("warning", "transformers' logging verbosity; jodpo prints on process 0 only"),
    "disable_tqdm": noop(None, "jodpo always shows its one-line progress bar (on stderr: rewritten in place on a terminal, a line per logged step elsewhere)"),
    "project": noop("huggingface", _TRACKIO),
    "trackio_space_id": noop(None, _TRACKIO),
    "trackio_bucket_id": noop(None, _TRACKIO),
    "trackio_static_space_id": noop(None, _TRACKIO),
    # --- evaluation
    "prediction_loss_only": noop(False, _EVAL_OUTPUTS),
    "eval_do_concat_batches": noop(True, _EVAL_OUTPUTS),
    "eval_use_gather_object": noop(False, _EVAL_OUTPUTS),
    "eval_accumulation_steps": noop(None, _EVAL_OUTPUTS),
    "include_for_metrics": noop([], _EVAL_OUTPUTS),
    "batch_eval_metrics": noop(False, _EVAL_OUTPUTS),
    "load_best_model_at_end": only(False, _BEST),
    "metric_for_best_model": only(None, _BEST),
    "greater_is_better": only(None, _BEST),
    # --- saving
    "save_on_each_node": only(False, "jodpo's processes write each checkpoint together into one output_dir (Orbax), "
                                     "which must be storage they share"),
    "enable_jit_checkpoint": noop(False, "jodpo always saves the current step on SIGTERM or SIGINT (unless "
                                         "save_strategy='no')"),
    "hub_always_push": noop(False, "jodpo's pushes finish before training goes on, so none is ever skipped"),
    "ignore_data_skip": only(False, "a resume restores its data position exactly (the order comes from seed and the "
                                    "step): nothing is fast-forwarded, so nothing to skip"),
    "restore_callback_states_from_checkpoint": only(False, "jodpo's checkpoints hold no callback state"),
    "resume_from_checkpoint": only(None, "jodpo resumes from output_dir's newest checkpoint by itself; give the run's "
                                         "output_dir (a script: trainer.train(resume_from_checkpoint=PATH))",
                                   True, False),
    # --- data
    "data_seed": only(None, "jodpo draws the data order from seed, as everything else; set seed"),
    "dataloader_drop_last": noop(False, "jodpo's batches are whole (an epoch drops its last partial batch: static "
                                        "shapes)"),
    **{name: noop(default, _DATALOADER) for name, default in (
        ("dataloader_num_workers", 0), ("dataloader_pin_memory", True), ("dataloader_persistent_workers", False),
        ("dataloader_prefetch_factor", None), ("dataloader_multiprocessing_context", None),
        ("dataloader_in_order", True))},
    "remove_unused_columns": noop(False, "jodpo keeps every column of the dataset: reward functions read them"),
    "label_names": noop(None, "labels of a torch model's forward; jodpo's losses take none"),
    "train_sampling_strategy": only("random", "jodpo shuffles the prompts every epoch (from seed); sequential and "
                                              "length-grouped sampling are not offered"),
    "length_column_name": noop("length", "read only by group_by_length sampling, which jodpo does not offer"),
    # --- devices and processes
    "use_cpu": only(False, "jax picks its backend when it starts: run with JAX_PLATFORMS=cpu in the environment"),
    "accelerator_config": only(None, "Accelerate's; jodpo runs without Accelerate"),
    "parallelism_config": only(None, "Accelerate's parallelism; jodpo's mesh_data, mesh_fsdp, mesh_expert and "
                                     "mesh_tensor lay out the devices"),
    **{name: noop(default, _DDP) for name, default in (
        ("ddp_find_unused_parameters", None), ("ddp_bucket_cap_mb", None), ("ddp_broadcast_buffers", None),
        ("ddp_static_graph", None), ("ddp_backend", None), ("ddp_timeout", 1800), ("local_rank", -1),
        ("ignore_bias_buffers", False))},
    "fsdp": only(None, "torch FSDP: jodpo shards parameters, gradients and optimizer state over its mesh's fsdp "
                       "axis (mesh_fsdp, by default every device)", "", False),
    "fsdp_config": only(None, "torch FSDP's (see fsdp)"),
    "deepspeed": only(None, "DeepSpeed ZeRO: jodpo shards parameters, gradients and optimizer state over "
                            "mesh_fsdp (docs/tpu.md)"),
    "debug": only("", "transformers' underflow_overflow and tpu_metrics_debug are not offered (a non-finite "
                      "update is skipped and counted: max_nonfinite_steps)", [], None),
    "skip_memory_metrics": noop(True, "jodpo logs no memory metrics"),
    "do_train": noop(False, _SCRIPTS),
    "do_eval": noop(False, _SCRIPTS),
    "do_predict": noop(False, _SCRIPTS),
    # --- TRL's ModelConfig and ScriptArguments (its example scripts parse them with the config)
    "dtype": mapped("float32", "float32 or bfloat16: sets param_dtype and frozen_param_dtype (others refused)",
                    lambda v: _dtype(v, "dtype")),
    "lora_modules_to_save": only(None, "jodpo's LoRA trains the adapters alone"),
    "lora_task_type": only("CAUSAL_LM", "the policy is a causal LM"),
    "use_rslora": only(False, "jodpo's adapters are scaled by lora_alpha / lora_r (rank-stabilised scaling is not "
                              "offered)"),
    "use_dora": only(False, "DoRA is not offered (jodpo's adapters are LoRA's)"),
    "load_in_8bit": only(False, "jodpo trains unquantised weights (param_dtype='bfloat16' halves them)"),
    "load_in_4bit": only(False, "jodpo trains unquantised weights (param_dtype='bfloat16' halves them)"),
    "bnb_4bit_quant_type": noop("nf4", _BNB),
    "use_bnb_nested_quant": noop(False, _BNB),
    "bnb_4bit_quant_storage": noop(None, _BNB),
    "dataset_streaming": only(False, "jodpo tokenizes the whole dataset before training (an IterableDataset is read "
                                     "whole)"),
}

# Names that are not TRL 1.16's but mean one of jodpo's fields (older transformers and TRL names, TRL GRPO's,
# open-instruct's: docs/open_instruct.md): the hint a wrong name gets
ALIASES = {"evaluation_strategy": "eval_strategy", "max_completion_length": "max_new_tokens",
           "torch_dtype": "dtype", "push_to_hub_model_id": "hub_model_id", "push_to_hub_token": "hub_token",
           "response_length": "max_new_tokens", "max_token_length": "max_length",
           "max_prompt_token_length": "max_prompt_length", "non_stop_penalty": "non_eos_penalty",
           "dataset_train_splits": "dataset_train_split", "dataset_eval_splits": "dataset_test_split",
           "exp_name": "run_name"}


def _accepted(a: Answer, value) -> bool:
    return any(type(value) is type(x) and value == x for x in a.accepted)


def check(name: str, value) -> dict:
    """jodpo's fields that TRL's field ``name`` at ``value`` sets ({} for most); ValueError with the reason when
    jodpo refuses it."""
    a = TABLE[name]
    if a.kind == NOOP:
        return {}
    if a.kind == ONLY:
        if not _accepted(a, value):
            raise ValueError(f"refused (jodpo takes {' or '.join(repr(x) for x in a.accepted)}): {a.reason}")
        return {}
    return a.maps(value)


HINT_CUTOFF = 0.8  # a misspelling (learnin_rate, betta), not another name that shares a word (num_evals, num_epochs)


def hint(name: str, fields) -> str | None:
    """The field a wrong name most likely meant: an alias, or a close spelling of a jodpo or TRL field (every TRL
    field is one of them, so a real TRL field never gets here and is never pointed at another of other meaning)."""
    if name in ALIASES:
        return ALIASES[name]
    close = difflib.get_close_matches(name, [*fields, *TABLE], n=1, cutoff=HINT_CUTOFF)
    return close[0] if close else None


def unknown_line(unknown: list[str], fields, what: str = "field", hints: dict | None = None) -> str:
    """``unknown field 'x'.`` (or ``fields 'x', 'y'``; ``what``: another noun), with a "Did you mean" for each name
    that has one (``hints``: name -> hint, default ``hint`` among ``fields``)."""
    hints = {u: hint(u, fields) for u in unknown} if hints is None else hints
    pairs = [(u, hints[u]) for u in unknown if hints.get(u) is not None]
    line = f"unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(repr(u) for u in unknown)}."
    if len(unknown) == 1 and pairs:
        line += f" Did you mean {pairs[0][1]!r}?"
    elif pairs:
        line += " Did you mean " + ", ".join(f"{h!r} for {u!r}" for u, h in pairs) + "?"
    return line


def answer(given: dict, fields, source: str) -> tuple[dict, dict]:
    """``given`` (names -> values) as ``(jodpo's fields, TRL's accepted fields)``: jodpo's fields as given, with what
    TRL's mapped fields set; a ``ConfigError`` naming every unknown name and every refused value at once, and a
    mapped field that disagrees with a jodpo field given beside it."""
    unknown = [k for k in given if k not in fields and k not in TABLE]
    problems = [unknown_line(unknown, fields)] if unknown else []
    out, trl = {k: v for k, v in given.items() if k in fields}, {}
    for name, value in given.items():
        if name in fields or name not in TABLE:
            continue
        try:
            sets = check(name, value)
        except ValueError as e:
            problems.append(f"{name}={value!r} {e}" if str(e).startswith("refused") else f"{name}={value!r}: {e}")
            continue
        for k, v in sets.items():
            if k in given and given[k] != v:
                problems.append(f"{name}={value!r} sets {k}={v!r}, and {k}={given[k]!r} is given too: give one")
            out[k] = v
        trl[name] = value
    if problems:
        raise ConfigError(f"{source}: {'; '.join(p.rstrip('.') for p in problems)}. docs/config.md lists jodpo's "
                          "fields and answers each of TRL's")
    return out, trl


def notes(trl: dict) -> list[str]:
    """A line for each TRL field given at another value than TRL's default that jodpo ignores or maps."""
    said = {NOOP: "has no effect in jodpo", MAPPED: "is mapped"}
    return [f"{name}={value!r} {said[TABLE[name].kind]}: {TABLE[name].reason}" for name, value in trl.items()
            if TABLE[name].kind in said and value != TABLE[name].default]


def markdown_table() -> str:
    """The table of docs/config.md ("TRL's other fields")."""
    kinds = {NOOP: "no-op", ONLY: "accepted at {}", MAPPED: "mapped"}
    rows = ["| TRL field | TRL default | jodpo | why |", "| --- | --- | --- | --- |"]
    for name, a in sorted(TABLE.items()):
        kind = kinds[a.kind].format(" / ".join(f"`{x!r}`" for x in a.accepted))
        rows.append(f"| `{name}` | `{a.default!r}` | {kind} | {a.reason.replace('|', '/')} |")
    return "\n".join(rows)
