"""TRL's Python API over jodpo's training program: ``OnlineDPOConfig`` and ``OnlineDPOTrainer``, with TRL 1.16's
constructor (``trl.experimental.online_dpo``), so that a TRL script runs on jodpo with its import changed.

The trainer runs the program ``python -m jodpo.train`` runs (``loop.train``: checkpoints, the output_dir's lock,
exact resume, metrics.jsonl, trackers, evaluation), handing it the objects the script built (a transformers model, a
``datasets.Dataset``, Python reward functions) in place of the names a config file gives. Errors are raised as
exceptions (``jodpo.errors``), never ``SystemExit``; ``train()`` may be called again in the same process.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import NamedTuple

from jodpo.errors import ConfigError
from jodpo.program import loop
from jodpo.program import trainer_setup as setup
from jodpo.program.config import FIELDS, TrainConfig, coerce
from jodpo.program.rewards import function_name
from jodpo.program.sources import Given, is_jodpo_model


class OnlineDPOConfig(TrainConfig):
    """TRL's ``OnlineDPOConfig``: jodpo's ``TrainConfig`` itself (TRL's field names and defaults, plus jodpo's own
    fields; one set of fields), taking TRL's forms: ``output_dir`` first, lists for tuples, a one-element ``beta`` as
    TRL makes it a float. TRL's other fields are answered as ``TrainConfig`` answers them (docs/config.md); unknown
    fields are a ``ConfigError`` naming every one, with the field each most resembles."""

    def __init__(self, output_dir: str | None = None, **fields):
        if output_dir is not None:
            fields["output_dir"] = output_dir
        if isinstance(fields.get("beta"), (list, tuple)) and len(fields["beta"]) == 1:
            fields["beta"] = fields["beta"][0]
        super().__init__(**{k: coerce(k, v) if k in FIELDS else v for k, v in fields.items()})


_TORCH_ONLY = ("data_collator", "compute_metrics", "optimizers", "preprocess_logits_for_metrics")


class OnlineDPOTrainer:
    """TRL 1.16's ``OnlineDPOTrainer(model, ref_model, reward_funcs, args, data_collator, train_dataset, eval_dataset,
    processing_class, reward_processing_classes, peft_config, compute_metrics, callbacks, optimizers,
    preprocess_logits_for_metrics)``, and ``judge`` as TRL took it before 1.1.

    model: a path or hub id (read when the trainer is built, into host memory, as jodpo's ``(model, params)``:
      ``trainer.model``), the transformers ``*ForCausalLM`` object a script built (its config and weights read once,
      from memory, when training starts), or jodpo's own ``(model, params)`` (``jodpo.load_model``'s; with a
      tokenizer as ``processing_class``, or ``args.model_name_or_path`` naming where it came from). None:
      ``args.model_name_or_path``. A checkpoint with code of its own needs ``args.trust_remote_code``, as in TRL.
    ref_model: None (TRL's default: the reference is the starting policy; with ``peft_config`` the base without
      adapters), or the frozen reference as ``model`` takes it (a path, a transformers object, jodpo's
      ``(model, params)``), of the policy's architecture and size; with ``peft_config`` (whose reference is the base
      with its adapters off) only the base's weights (TRL's tests give the policy's checkpoint again), others
      refused; refused with a reference-free ``loss_type``. A resumed run must be given the same one.
    reward_funcs: one or a list of: callables ``f(prompts, completions, completion_ids, **columns)``,
      ``module:function`` strings, a reward model's path or hub id, or a ``*ForSequenceClassification`` object (at
      most one model; TRL weighs them with ``args.reward_weights``, model first).
    train_dataset / eval_dataset: ``datasets.Dataset`` or ``IterableDataset`` (read whole), standard or
      conversational prompts. ``eval_dataset`` may be a dict of sets: each is evaluated, its metrics named
      ``eval_<name>/...`` (transformers' ``eval_<name>_...``, with jodpo's ``/``). None: the config's datasets.
    processing_class / reward_processing_classes: the tokenizers (default: the models' own); processing_class may be
      a vision-language model's processor, whose tokenizer reads the prompts (jodpo trains the language model of a
      ``*ForConditionalGeneration`` on text: a dataset with images is refused, naming the column).
    peft_config: a peft ``LoraConfig`` or its dict: use_peft with its r, lora_alpha, target_modules,
      target_parameters, lora_dropout. A ``model`` wrapped by peft's ``get_peft_model`` trains adapters of its own
      config on its base weights (as TRL trains its adapters).
    callbacks: transformers ``TrainerCallback``s (or their classes), called as TRL's trainer calls them with
      ``(args, state, control, **kwargs)``: ``on_train_begin``, ``on_step_end``, ``on_log`` (each logged line),
      ``on_evaluate`` (``metrics``), ``on_save`` (the checkpoint is written in the background), ``on_train_end``;
      ``state`` a transformers ``TrainerState`` (``global_step``, ``max_steps``, ``epoch``, ``log_history``, ...),
      ``control`` a ``TrainerControl`` whose ``should_training_stop`` ends the run, saved.
    judge: a pairwise judge (a callable, an object with ``judge()``, or ``module:function``) or an LLM's path.
    """

    def __init__(self, model=None, ref_model=None, reward_funcs=None, args: TrainConfig | None = None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, peft_config=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, *, judge=None):
        given = dict(data_collator=data_collator, compute_metrics=compute_metrics, optimizers=optimizers,
                     preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        for name in _TORCH_ONLY:
            if given[name] not in (None, (None, None)):
                raise ConfigError(f"OnlineDPOTrainer: {name} is a torch Trainer's; jodpo builds its own batches, "
                                  "optimizer and metrics (from args): leave it None")
        cfg = args if args is not None else OnlineDPOConfig()
        if not isinstance(cfg, TrainConfig):
            raise ConfigError(f"OnlineDPOTrainer: args is a {type(cfg).__name__}; give a jodpo.OnlineDPOConfig")
        if ref_model is not None and ref_model is model and not isinstance(model, (str, Path)):
            raise ConfigError("OnlineDPOTrainer: model and ref_model are the same object, which training changes, so "
                              "it would be no reference (TRL refuses it too); leave ref_model None for the starting "
                              "policy as the reference, or give another copy")
        fields, objects = {}, {}
        if ref_model is not None:
            if isinstance(ref_model, tuple) and not is_jodpo_model(ref_model):
                raise ConfigError("OnlineDPOTrainer: ref_model is a tuple but not jodpo's (model, params); give that, "
                                  "a path, or a transformers model")
            objects["ref_model"] = str(ref_model) if isinstance(ref_model, Path) else ref_model
        if model is not None:
            if isinstance(model, (str, Path)):
                fields["model_name_or_path"] = str(model)
            elif isinstance(model, tuple):
                if not is_jodpo_model(model):
                    raise ConfigError("OnlineDPOTrainer: model is a tuple but not jodpo's (model, params) as "
                                      "jodpo.load_model returns it; give that, a path, or a transformers model")
                if processing_class is None and not cfg.model_name_or_path:
                    raise ConfigError("OnlineDPOTrainer: model is jodpo's (model, params), which holds no tokenizer; "
                                      "give its tokenizer as processing_class (or args.model_name_or_path)")
                fields["model_name_or_path"] = cfg.model_name_or_path or "<jodpo (model, params)>"
            else:
                if setup.is_peft_model(model):  # TRL trains its adapters: they are the run's LoRA
                    if peft_config is not None:
                        raise ConfigError("OnlineDPOTrainer: model is a peft model already and peft_config is "
                                          "given too; give one (the peft model's own config is its LoRA)")
                    fields |= _lora_fields(setup.adapter_config(model))
                fields["model_name_or_path"] = getattr(model, "name_or_path", "") or cfg.model_name_or_path
        rewards = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        functions, names, models = [], [], []
        for r in rewards:
            if isinstance(r, str) and ":" in r and not Path(r).exists():
                names.append(r)
            elif callable(r) and not hasattr(r, "state_dict"):
                functions.append(r)
                names.append(function_name(r))
            else:
                models.append(r)
        if functions and len(functions) != len(names):
            raise ConfigError("OnlineDPOTrainer: reward_funcs mixes callables and 'module:function' strings; give "
                              "them all as callables (or all as strings)")
        if len(models) > 1:
            raise ConfigError(f"OnlineDPOTrainer: reward_funcs holds {len(models)} reward models; jodpo scores with "
                              "one reward model (plus any number of functions)")
        if rewards:
            fields["reward_funcs"] = tuple(names)
            fields["reward_model_path"] = None
        if models:
            if isinstance(models[0], (str, Path)):
                fields["reward_model_path"] = str(models[0])
            else:
                objects["reward_model"] = models[0]
                fields["reward_model_path"] = getattr(models[0], "name_or_path", "") or "<reward model object>"
        objects["reward_functions"] = tuple(functions)
        tokenizers = reward_processing_classes
        if isinstance(tokenizers, (list, tuple)):
            tokenizers = tokenizers[0] if tokenizers else None
        objects["reward_tokenizer"] = tokenizers
        if judge is not None:
            if isinstance(judge, (str, Path)):
                fields["judge"] = str(judge)
            else:
                objects["judge"] = judge
                fields["judge"] = function_name(getattr(judge, "judge", judge))
        if train_dataset is not None:
            objects["train_rows"] = _rows(train_dataset, "train_dataset")
            fields["dataset_name"] = _describe(train_dataset)
            fields["dataset_mixer"] = None
        if eval_dataset is not None:  # a dict of sets: each logged as eval_<name>/..., as transformers names them
            sets = {f"eval_{k}": v for k, v in eval_dataset.items()} if isinstance(eval_dataset, dict) else \
                {"eval": eval_dataset}
            if not sets:
                raise ConfigError("OnlineDPOTrainer: eval_dataset is an empty dict; give a dataset, a dict of them, "
                                  "or None")
            objects["eval_rows"] = {k: _rows(v, f"eval_dataset[{k[5:]!r}]" if k != "eval" else "eval_dataset")
                                    for k, v in sets.items()}
            fields["eval_dataset"] = ", ".join(f"{k[5:] + ': ' if k != 'eval' else ''}{_describe(v)}"
                                               for k, v in sets.items())
        if peft_config is not None:
            fields |= _lora_fields(peft_config)
        self.args = cfg.replace(**fields) if fields else cfg
        self._reward_attributes(rewards, reward_processing_classes)  # TRL checks the rewards before the model
        # read now, as TRL's constructor reads them; what callbacks get as model= and processing_class=
        self.model, self.processing_class = setup.read_model(model, processing_class, self.args)
        objects["model"], objects["tokenizer"] = self.model, setup.tokenizer_of(self.processing_class)
        self.given = Given(**objects)
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks or []]
        self.ref_model, self.train_dataset, self.eval_dataset = ref_model, train_dataset, eval_dataset
        self._sampling_attributes()
        self.metrics: dict = {}
        self._state = None  # transformers' TrainerState, made when first needed (its import loads peft and torch)
        self._policy = None  # with save_strategy="no", the trained policy on the host (no checkpoint holds it)

    def _reward_attributes(self, rewards, reward_processing_classes) -> None:
        """TRL's attributes of the rewards, as its constructor sets them (``trainer_setup``)."""
        cfg = self.args
        self.reward_funcs = setup.reward_funcs(rewards, cfg)
        self.reward_func_names = [function_name(r) if callable(r) and not hasattr(r, "state_dict") else
                                  str(getattr(r, "name_or_path", r)).rstrip("/").split("/")[-1]
                                  for r in self.reward_funcs]
        self.reward_weights = setup.reward_weights(cfg, len(self.reward_funcs))
        classes = reward_processing_classes
        self.reward_processing_classes = list(classes) if isinstance(classes, (list, tuple)) else \
            [classes] * len(self.reward_funcs)

    def _sampling_attributes(self) -> None:
        """TRL's attributes of the sampling, as its constructor sets them (``trainer_setup``)."""
        cfg = self.args
        self.use_vllm, self.vllm_mode = cfg.use_vllm, cfg.vllm_mode if cfg.use_vllm else None
        self.num_generations, self.max_length = cfg.num_generations, cfg.max_length
        self.temperature, self.top_p, self.top_k, self.min_p = cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p
        self.repetition_penalty = cfg.repetition_penalty
        self.eos_token_ids = setup.eos_token_ids(self.model, self.given.tokenizer)
        self.generation_kwargs = setup.generation_kwargs(cfg, self.given.tokenizer, self.eos_token_ids)
        self.generation_config = setup.generation_config(self.generation_kwargs)

    @property
    def beta(self):
        """TRL's ``trainer.beta``: ``args.beta``, a list's entry for the current epoch (the last kept)."""
        if isinstance(self.args.beta, tuple):
            return self.args.beta[min(int(self.state.epoch or 0), len(self.args.beta) - 1)]
        return self.args.beta

    def train(self, resume_from_checkpoint: bool | str | None = None, *, allow_config_change: bool = False):
        """Run the training (the same program as ``python -m jodpo.train``); returns transformers' ``TrainOutput``
        as TRL's ``train()`` does: ``global_step``, ``training_loss`` (the mean of the losses logged by this call)
        and ``metrics`` (``train_runtime``, ``train_samples_per_second``, ``train_steps_per_second``,
        ``train_loss``, ``epoch``; jodpo counts no FLOPs, so no ``total_flos``). ``self.metrics`` holds the last
        logged metrics, ``self.state`` transformers' ``TrainerState`` (``global_step``, ``log_history``, ...).

        A run resumes from its output_dir's newest checkpoint whenever there is one (``resume_from_checkpoint`` True
        or None alike); a path names the run directory (or a checkpoint inside it) to continue."""
        cfg = self.args
        if isinstance(resume_from_checkpoint, (str, Path)):
            path = Path(resume_from_checkpoint)
            run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
            if not (run_dir / "checkpoints").is_dir():
                raise ConfigError(f"resume_from_checkpoint={str(path)!r}: no checkpoints/ there; give a run's "
                                  "output_dir (or one of its checkpoints/<step>)")
            cfg = cfg.replace(output_dir=str(run_dir))
        events = _Callbacks(self, cfg)
        self._policy = None
        began = time.monotonic()
        self.metrics = loop.train(cfg, allow_config_change, self.given, events)
        return events.output(time.monotonic() - began)

    @property
    def state(self):
        """transformers' ``TrainerState``: ``global_step``, ``epoch``, ``log_history`` (every logged line, then
        ``train()``'s summary), ``max_steps`` and the rest callbacks read; before ``train()``, a fresh one."""
        if self._state is None:
            from transformers.trainer_callback import TrainerState

            self._state = TrainerState()
        return self._state

    def save_model(self, output_dir: str | None = None) -> Path:
        """The trained policy (the run's newest checkpoint; with ``save_strategy="no"``, the policy ``train()`` ended
        with) as a transformers directory, or with ``peft_config`` as a PEFT adapter directory, with the tokenizer;
        default: ``args.output_dir``/final (so is ``args.output_dir`` itself: its config.json is the run's). With
        ``push_to_hub``, the directory is then pushed to the Hub ("Model save"), as transformers' ``save_model``
        does."""
        from jodpo.program.trained_policy import export_run

        run_dir = Path(self.args.output_dir)
        out = Path(output_dir) if output_dir is not None else run_dir / "final"
        if out.absolute() == run_dir.absolute():
            warnings.warn(f"save_model({str(output_dir)!r}) names the run's output_dir, whose config.json and "
                          f"checkpoints/ are the run's: the model goes to {out / 'final'}", stacklevel=2)
            out = out / "final"
        out = export_run(run_dir, out, params=self._policy)
        if self.args.push_to_hub:
            self._hub().upload(out, "Model save")
        return out

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """transformers' ``Trainer.push_to_hub``: the trained policy (as ``save_model`` writes it) uploaded to the
        repo ``args.hub_model_id`` (created if need be; ``token`` and ``private`` replace ``hub_token`` and
        ``hub_private_repo``, ``revision`` ``hub_revision``); returns huggingface_hub's ``CommitInfo``. The upload
        completes before it returns (``blocking`` is always so); the model-card arguments transformers takes
        (``dataset_name``, ``tags``, ...) are accepted and unused: jodpo writes no model card."""
        return self._hub(token, private).push_policy(Path(self.args.output_dir), commit_message or "End of training",
                                                     params=self._policy, revision=revision)

    def _hub(self, token: str | None = None, private: bool | None = None):
        from jodpo.program.hub import Hub

        return Hub(self.args, token, private)


class _Callbacks(loop.Events):
    """The loop's events as TRL's trainer calls its callbacks: transformers' ``TrainerState`` and ``TrainerControl``
    (importable without torch), the same keyword arguments (no torch model, optimizer or data loaders: None)."""

    wants_policy = True  # save_model() exports it when no checkpoint holds it (save_strategy="no")

    def __init__(self, trainer: OnlineDPOTrainer, args: TrainConfig):
        from transformers.trainer_callback import TrainerControl, TrainerState

        self.trainer, self.args = trainer, args
        self.state, self.control = TrainerState(), TrainerControl()
        self.first_step = self.prompts_per_step = 0
        trainer._state = self.state

    def _call(self, event: str, **kwargs) -> None:
        for callback in self.trainer.callbacks:
            hook = getattr(callback, event, None)
            if hook is None:
                continue
            result = hook(self.args, self.state, self.control, model=self.trainer.model,
                          processing_class=self.trainer.processing_class, optimizer=None, lr_scheduler=None,
                          train_dataloader=None, eval_dataloader=None, **kwargs)
            if result is not None:  # a callback may return the control it changed
                self.control = result

    def train_begin(self, run, start: int) -> None:
        s, cfg = self.state, run.cfg
        s.global_step, s.max_steps, s.epoch = start, run.total_steps, start / run.steps_per_epoch
        s.num_train_epochs = -(-run.total_steps // run.steps_per_epoch)
        s.logging_steps, s.save_steps = cfg.logging_steps, run.schedule.save_every
        s.eval_steps = run.schedule.eval_every if cfg.eval_strategy == "steps" else 0
        s.train_batch_size = cfg.per_device_train_batch_size
        self.first_step, self.prompts_per_step = start, run.global_batch
        self.control.should_training_stop = False
        self._call("on_train_begin")

    def step_end(self, step: int, epoch: float) -> None:
        self.state.global_step, self.state.epoch = step, epoch
        self._call("on_step_end")

    def log(self, metrics: dict) -> None:
        logs = {k: v for k, v in metrics.items() if k != "step"}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._call("on_log", logs=logs)

    def evaluate(self, metrics: dict) -> None:
        self._call("on_evaluate", metrics=dict(metrics))

    def save(self, step: int) -> None:
        self._call("on_save")

    def train_end(self, step: int) -> None:
        self._call("on_train_end")

    def trained(self, params) -> None:
        self.trainer._policy = params

    def should_stop(self) -> bool:
        return bool(self.control.should_training_stop)

    def output(self, seconds: float):
        """What ``train()`` returns, as transformers' Trainer makes it; its summary also ends ``log_history``."""
        try:
            from transformers.trainer_utils import TrainOutput
        except ImportError:  # transformers' own class where it imports; the same fields where it does not
            TrainOutput = _TrainOutput
        s = self.state
        losses = [line["loss"] for line in s.log_history if "loss" in line]
        loss = sum(losses) / len(losses) if losses else float("nan")
        steps = s.global_step - self.first_step
        metrics = {"train_runtime": round(seconds, 4),
                   "train_samples_per_second": round(steps * self.prompts_per_step / seconds, 3),
                   "train_steps_per_second": round(steps / seconds, 3), "train_loss": loss, "epoch": s.epoch}
        s.log_history.append({**metrics, "step": s.global_step})
        return TrainOutput(s.global_step, loss, metrics)


class _TrainOutput(NamedTuple):
    """transformers' ``TrainOutput``'s fields."""
    global_step: int
    training_loss: float
    metrics: dict


def _rows(ds, what: str):
    """A ``datasets.Dataset`` of ``ds`` (an ``IterableDataset`` is read whole)."""
    import datasets

    if isinstance(ds, datasets.IterableDataset):
        return datasets.Dataset.from_list(list(ds))
    if isinstance(ds, datasets.Dataset):
        return ds
    if isinstance(ds, list) and all(isinstance(r, dict) for r in ds):
        return datasets.Dataset.from_list(ds)
    raise ConfigError(f"OnlineDPOTrainer: {what} is a {type(ds).__name__}; give a datasets.Dataset (or "
                      "IterableDataset, or a list of row dicts)")


def _describe(ds) -> str:
    """What config.json records of an in-memory dataset (its contents are checked on resume by their fingerprint)."""
    return f"<{type(ds).__name__}: {getattr(ds, 'num_rows', '?')} rows>"


def _lora_fields(peft_config) -> dict:
    """A peft ``LoraConfig`` (or its dict) as jodpo's LoRA fields (TRL's ModelConfig names)."""
    d = peft_config if isinstance(peft_config, dict) else (
        peft_config.to_dict() if hasattr(peft_config, "to_dict") else vars(peft_config))
    kind = str(d.get("peft_type", "LORA")).split(".")[-1].upper()
    if kind != "LORA":
        raise ConfigError(f"peft_config: a {kind} config; jodpo trains LoRA adapters (peft.LoraConfig)")
    targets, parameters = d.get("target_modules"), d.get("target_parameters")
    if isinstance(targets, str):
        targets = [targets]
    fields = {"use_peft": True, "lora_r": int(d.get("r", 8)), "lora_alpha": d.get("lora_alpha", 8),
              "lora_dropout": float(d.get("lora_dropout", 0.0)),
              "lora_target_modules": None if targets is None else tuple(sorted(targets)),
              "lora_target_parameters": tuple(sorted(parameters)) if parameters else None}
    return {k: coerce(k, v) for k, v in fields.items()}
