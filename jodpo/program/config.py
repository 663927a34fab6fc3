"""The training config: one typed, frozen dataclass; config files; ``--config.FIELD=VALUE`` overrides.

Fields that TRL's ``OnlineDPOConfig`` / ``TrainingArguments`` have keep TRL's names, meanings and defaults,
so a TRL command line translates field by field. A config file is a Python file defining ``get_config()``
that returns a ``TrainConfig`` (or a dict of fields); ``--config NAME`` also finds ``configs/NAME``.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import types
import typing
import traceback
from pathlib import Path

from jodpo.errors import ConfigError
from jodpo.methods import OWN_SETTINGS
from jodpo.program import trl_fields
from jodpo.program.config_checks import check
from jodpo.program.user_code import MOVED

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"  # the bundled recipes, jodpo/configs/



def _f(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class _Fields:
    # --- models and rewards
    model_name_or_path: str = _f("", "policy (and reference): a local HF checkpoint directory or a hub id")
    reward_model_path: str | None = _f(None, "reward model (*ForSequenceClassification, num_labels=1): dir or hub id")
    reward_funcs: tuple[str, ...] = _f((), "reward functions as 'module:function' import paths (TRL's callables)")
    reward_weights: tuple[float, ...] | None = _f(None, "weights of the rewards (model first, then functions)")
    judge: str | None = _f(None, "a pairwise judge instead of rewards: 'module:function' / 'module:Class' (TRL's "
                                 "BasePairwiseJudge.judge), or a causal LM (dir or hub id) asked which is better")
    judge_prompt: str | None = _f(None, "the LLM judge's prompt with {prompt}, {response0}, {response1}, or a file "
                                        "holding it (None: TRL's default pairwise prompt)")
    judge_answer_tokens: tuple[str, ...] = _f(("0", "1"), "the LLM judge's answers naming completion 0 and 1 (one "
                                                          "token each); read from their logits")
    judge_both_orders: bool = _f(True, "the LLM judge reads each pair in both orders and averages (position bias)")
    model_revision: str | None = _f(None, "hub revision (branch, tag or commit) of the policy")
    chat_template_path: str | None = _f(None, "the policy tokenizer's chat template, for chat prompts (TRL SFT's): a "
                                              "Jinja template file, or a tokenizer (directory, .gguf, hub id) whose "
                                              "template to use (None: the tokenizer's own)")
    # --- LoRA (TRL's ModelConfig names; docs/config.md)
    use_peft: bool = _f(False, "train LoRA adapters on the frozen policy; the reference is the policy with them off")
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_r")
    lora_dropout: float = _f(0.05, "recorded in the PEFT export; no effect in training (TRL's disable_dropout zeroes it)")
    lora_target_modules: tuple[str, ...] | None = _f(None, "HF module names to adapt (None: PEFT's default per model "
                                                           "type; ['all-linear']: every projection)")
    lora_target_parameters: tuple[str, ...] | None = _f(None, "HF parameters to adapt besides the modules (PEFT's "
                                                              "target_parameters: Qwen3-MoE's and OLMoE's "
                                                              "gate_up_proj, down_proj, gate.weight)")
    # --- data
    dataset_name: str = _f("", "hub dataset id, or a local file/directory (json, jsonl, parquet, csv)")
    dataset_config: str | None = _f(None, "the dataset's config (subset) name")
    dataset_mixer: dict[str, float] | None = _f(None, "open-instruct's mixture in place of dataset_name: {dataset: "
                                                     "fraction (<= 1) or row count (> 1)}, concatenated")
    dataset_eval_mixer: dict[str, float] | None = _f(None, "the same for evaluation (dataset_test_split)")
    dataset_train_split: str = _f("train", "split to train on")
    dataset_test_split: str = _f("test", "split to evaluate on")
    eval_dataset: str | None = _f(None, "evaluation dataset (default: dataset_name's dataset_test_split)")
    max_eval_prompts: int = _f(64, "evaluation prompts used at each evaluation")
    # --- batch and schedule
    per_device_train_batch_size: int = _f(8, "prompts per device per micro-batch (num_generations completions each)")
    per_device_eval_batch_size: int = _f(8, "prompts per device per evaluation batch")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step (gradients averaged)")
    num_train_epochs: float = _f(3.0, "passes over the prompts (ignored when max_steps > 0)")
    max_steps: int = _f(-1, "optimizer steps; > 0 overrides num_train_epochs")
    async_mode: bool = _f(False, "open-instruct's asynchronous generation: a step samples with the policy from "
                                 "before the previous update (one step off-policy; TRL: on-policy)")
    num_generations: int = _f(2, "completions sampled per prompt, k >= 2 (TRL GRPO's name), from one decode sharing "
                                 "the prompt's prefill; one pair per prompt is trained (pairing)")
    pairing: str = _f("auto", "which pair of a prompt's k completions: best_worst (highest vs lowest score; all equal: "
                              "no pair) | random (two of the k) | auto (random for k = 2: TRL's step; best_worst for "
                              "k > 2)")
    sync_steps: int = _f(1, "semi-online DPO (Lanchantin et al. 2025): the sampler holds the policy of the last "
                            "multiple of sync_steps optimizer steps (1: on-policy, as TRL); combines with async_mode")
    num_epochs: int = _f(1, "passes over each rollout batch (open-instruct; TRL: 1), the pairs shuffled at each")
    num_mini_batches: int = _f(1, "optimizer steps per pass over a rollout batch (open-instruct); a rollout holds "
                                  "num_mini_batches x gradient_accumulation_steps micro-batches")
    total_episodes: int | None = _f(None, "the run's length in episodes (prompts, as the episode metric counts them): "
                                          "total_episodes // the global batch steps (open-instruct)")
    learning_rate: float = _f(5e-7, "AdamW peak learning rate")
    lr_scheduler_type: str = _f("linear", "linear | cosine | constant | constant_with_warmup")
    warmup_ratio: float = _f(0.0, "fraction of the steps spent warming up (used when warmup_steps is 0)")
    warmup_steps: int = _f(0, "warm-up steps")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "clip gradients to this global norm (0: off)")
    # --- generation
    max_new_tokens: int = _f(64, "tokens sampled per completion")
    max_length: int = _f(512, "prompt + completion tokens in the loss forward (the prompt is left-truncated)")
    max_prompt_length: int = _f(512, "prompts longer than this are left-truncated")
    temperature: float = _f(0.9, "sampling temperature (0: greedy)")
    top_k: int = _f(0, "top-k filtering (0: off)")
    top_p: float = _f(1.0, "nucleus filtering (1.0: off)")
    min_p: float | None = _f(None, "min-p filtering relative to the top token (None: off)")
    repetition_penalty: float = _f(1.0, "transformers' repetition penalty (1.0: off)")
    stop_token: str | None = _f(None, "open-instruct's stop_token: eos (the default behaviour) | period (completions "
                                      "also end at the first '.', and only it spares them the EOS penalties)")
    temperature_scaled_logprobs: bool = _f(False, "the loss's log-probs from the logits divided by temperature, as "
                                                   "open-instruct computes them (TRL: the raw logits)")
    # --- loss
    beta: float | tuple[float, ...] = _f(0.1, "KL strength; a list is indexed by epoch")
    loss_type: str = _f("sigmoid", "sigmoid | ipo | hinge | robust | exo_pair | nca_pair | sppo_hard | apo_zero | "
                                   "apo_down | discopop | rdpo | simpo (no reference model)")
    label_smoothing: float = _f(0.0, "cDPO / robust / exo_pair label-flip rate")
    ipo_length_normalized: bool = _f(False, "ipo on per-token averaged log-probs (TRL's offline DPO form)")
    discopop_tau: float = _f(0.05, "discopop temperature")
    simpo_gamma: float = _f(0.5, "simpo's target reward margin gamma (TRL CPOConfig)")
    rdpo_alpha: float = _f(0.0, "rdpo's length coefficient alpha (R-DPO, Park et al. 2024; not TRL's rpo_alpha)")
    ld_alpha: float | None = _f(None, "LD-DPO (TRL DPOConfig): weight of the log-probs past the shorter completion's "
                                      "length, in [0, 1] (None: off)")
    # --- TRL's online family (docs/online_family.md)
    method: str = _f("online_dpo", "which of TRL's online trainers a step is: online_dpo | nash_md (TRL 1.12's "
                                   "NashMDTrainer) | xpo (TRL 1.12's XPOTrainer)")
    mixture_coef: float | tuple[float, ...] = _f(OWN_SETTINGS["mixture_coef"][1], "nash_md: the reference's weight "
                                                 "in the geometric mixture sampled beside the policy, in [0, 1]; a "
                                                 "list is indexed by epoch")
    alpha: float | tuple[float, ...] = _f(OWN_SETTINGS["alpha"][1], "xpo: weight of the exploration term (the "
                                          "policy's log-prob of the reference's completion); a list is indexed by "
                                          "epoch")
    router_aux_loss_coef: float = _f(0.0, "a MoE policy's load-balancing loss (transformers' aux_loss) times this is "
                                          "added to the loss and logged as aux_loss (TRL DPOConfig's name); 0: off, "
                                          "as TRL's online trainers")
    moe_routing_replay: bool = _f(False, "routing replay (Megatron's and verl's R3): a MoE policy's training forward "
                                         "takes the experts its sampler chose for each completion token instead of "
                                         "its router's choice (the router's probabilities still weigh them); "
                                         "moe/route_flip_rate is logged either way")
    missing_eos_penalty: float | None = _f(None, "subtracted from the reward of completions without EOS (TRL)")
    non_eos_penalty: bool = _f(False, "replace the reward of completions without EOS by penalty_reward_value")
    penalty_reward_value: float = _f(-1.0, "the reward given by non_eos_penalty (open-instruct)")
    # --- run
    seed: int = _f(42, "seed of the data order, the sampling and any random initialisation")
    output_dir: str = _f("trainer_output", "where metrics.jsonl, tensorboard/, config.json and checkpoints/ go")
    logging_strategy: str = _f("steps", "when training lines are logged: steps (every logging_steps) | epoch (at each "
                                        "epoch's end) | no; the last step too, unless no")
    logging_steps: int = _f(10, "log every this many optimizer steps (logging_strategy steps)")
    logging_first_step: bool = _f(False, "log step 1 too")
    report_to: str | tuple[str, ...] = _f("tensorboard", "trackers besides metrics.jsonl: tensorboard | wandb | a list "
                                                       "of them | all | none (docs/tracking.md)")
    run_name: str | None = _f(None, "the run's name in W&B (None: W&B picks one)")
    save_strategy: str = _f("steps", "when checkpoints are saved: steps (every save_steps) | epoch (at each epoch's "
                                     "end) | no (none: the run cannot resume); the last step too, unless no")
    save_steps: float = _f(500, "checkpoint every this many steps (< 1: a fraction of the run; save_strategy steps)")
    save_total_limit: int | None = _f(None, "checkpoints kept, the newest (None: all); from 2 on, the oldest is "
                                            "deleted just before a save, so the disk never holds more")
    save_only_model: bool = _f(False, "checkpoints hold the parameters only, no optimizer state (a third of the "
                                      "bytes); a resume from one restarts AdamW's moments")
    eval_strategy: str = _f("no", "when the run evaluates: no (TRL's default, even with eval data) | steps (every "
                                  "eval_steps, and the last step) | epoch (at each epoch's end, and the last step)")
    eval_steps: float | None = _f(None, "evaluate every this many steps with eval_strategy steps (< 1: a fraction of "
                                        "the run; None: logging_steps)")
    eval_delay: float = _f(0, "steps (eval_strategy steps) or epochs (epoch) to train before the first evaluation")
    eval_on_start: bool = _f(False, "evaluate the starting policy before the first step (logged at that step)")
    push_to_hub: bool = _f(False, "push the trained policy (a transformers directory; LoRA: the adapter) to the Hub "
                                  "repo hub_model_id at saves (hub_strategy); docs/config.md")
    hub_model_id: str | None = _f(None, "the Hub repo pushed to, 'name' or 'namespace/name' (None: output_dir's name)")
    hub_strategy: str = _f("every_save", "what is pushed when: every_save (the policy, at each save) | checkpoint "
                                         "(also the resumable run, to last-checkpoint/) | all_checkpoints (also each "
                                         "save's run, to checkpoint-STEP/) | end (the policy at the end only)")
    hub_token: str | None = _f(None, "the Hub token pushes use (None: huggingface_hub's own: $HF_TOKEN or hf auth "
                                     "login)")
    hub_private_repo: bool | None = _f(None, "create the repo private (None: the namespace's default); an existing "
                                             "repo is left as it is")
    hub_revision: str | None = _f(None, "the branch pushed to (None: main)")
    max_nonfinite_steps: int = _f(10, "stop the run after this many updates in a row skipped for a NaN/Inf loss or gradient")
    num_sample_generations: int = _f(10, "times a table of sample completions is printed over the run")
    bf16: bool = _f(True, "bfloat16 compute with float32 master weights and float32 log-softmax")
    gradient_checkpointing: bool = _f(True, "rematerialise each layer in the backward pass")
    deterministic: bool = _f(False, "deterministic GPU kernels (XLA's deterministic ops): bitwise resume on a GPU, "
                                    "at some speed; CPUs and TPUs are deterministic anyway")
    compilation_cache_dir: str | None = _f("auto", "persistent XLA compilation cache, so a restarted run skips its "
                                                  "compiles (auto: $JAX_COMPILATION_CACHE_DIR if set, else "
                                                  "$JODPO_CACHE/xla, default ~/.cache/jodpo/xla; None: off)")
    matmul_precision: str = _f("highest", "float32 dots: highest (float32 on every backend, as torch) | high | default "
                                          "(TF32 on GPUs, fewer bf16 passes on TPUs: faster); bf16 compute ignores it")
    attn_implementation: str = _f("auto", "attention of the forwards and the prefill: auto (cudnn where it runs and "
                                          "pays: an NVIDIA GPU, bf16, not deterministic; splash on TPUs in bf16; else "
                                          "xla) | xla (any backend) | cudnn (cuDNN flash attention: an NVIDIA GPU and "
                                          "bf16 compute) | splash (splash attention: TPUs, bf16 compute)")
    decode_attn_implementation: str = _f("auto", "attention of the sampler's decode steps over the KV cache: auto "
                                                 "(pallas on TPUs, else xla) | xla (any backend: the whole cache slab "
                                                 "every step) | pallas (a Pallas kernel reading only the cache blocks "
                                                 "that hold tokens: TPUs)")
    # --- jodpo's own
    remat: str = _f("auto", "auto (from gradient_checkpointing) | none | full | dots; in every mode the backward "
                            "recomputes the norms and the MLP's activation from their inputs rather than keep float32 "
                            "copies")
    prompt_buckets: tuple[int, ...] = _f((), "padded prompt lengths (default: powers of two up to max_prompt_length)")
    decode_chunk: int = _f(8, "decode steps between checks that every completion has ended")
    sampler_slots: int = _f(0, "prompts sampled at once, their caches in memory (0: a step's whole window); fewer: "
                               "the window's prompts are a queue, the rows that ended taking the next prompts between "
                               "decode chunks (refill), the completions unchanged")
    # --- devices (docs/tpu.md)
    mesh_data: int = _f(1, "mesh axis 'data': batch split, parameters replicated (-1: the devices left)")
    mesh_fsdp: int = _f(-1, "mesh axis 'fsdp': batch split, parameters/gradients/optimizer state split (-1: the rest)")
    mesh_expert: int = _f(1, "mesh axis 'expert': a mixture of experts' experts split by expert (their weights, "
                             "gradients, Adam moments), the tokens sent to them; elsewhere as fsdp: batch and other "
                             "parameters split (-1: the rest)")
    mesh_tensor: int = _f(1, "mesh axis 'tensor': attention heads, MLP width and vocabulary split (-1: the rest)")
    sampler_devices: int = _f(0, "devices of their own for sampling (the last ones; the mesh_* fields lay out the rest "
                                 "for training); with async_mode the two overlap. 0: sample on the training mesh")
    param_dtype: str = _f("float32", "the trained policy's parameters and optimizer state: float32 | bfloat16")
    frozen_param_dtype: str = _f("float32", "the dtype the reference policy and reward model are read in: float32 | "
                                            "bfloat16 (with bf16 compute they are kept in bf16, norms as read)")

    def __post_init__(self):
        check(self)


class TrainConfig(_Fields):
    """jodpo's config: TRL's fields (names, meanings and defaults) and jodpo's own, typed and frozen. It also takes
    TRL's other fields (``trl_fields.TABLE``): each is accepted as a no-op, at the values that mean what jodpo does,
    or mapped onto jodpo's fields; the rest are refused, every one said at once. Read back, such a field gives its
    value (or TRL's default), as a TRL config would."""

    def __init__(self, **given):
        fields, trl = trl_fields.answer(given, FIELDS, type(self).__name__)
        super().__init__(**{k: v if k in given else coerce(k, v) for k, v in fields.items()})
        object.__setattr__(self, "_trl", trl)

    def __getattr__(self, name: str):
        if name in trl_fields.TABLE:
            return self.__dict__.get("_trl", {}).get(name, trl_fields.TABLE[name].default)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def trl_given(self) -> dict:
        """TRL's other fields given to this config (name -> value), as accepted."""
        return dict(self.__dict__.get("_trl", {}))

    @property
    def micro_batches(self) -> int:
        """Micro-batches of a step's rollout: gradient_accumulation_steps per optimizer step, num_mini_batches
        optimizer steps per pass."""
        return self.gradient_accumulation_steps * self.num_mini_batches

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per step of the run (per rollout): num_epochs x num_mini_batches (1, as in TRL)."""
        return self.num_epochs * self.num_mini_batches

    def replace(self, **changes) -> "TrainConfig":
        """This config with ``changes`` (jodpo's fields, or TRL's: kept with the ones given before)."""
        fields, trl = trl_fields.answer(changes, FIELDS, type(self).__name__)
        new = dataclasses.replace(self, **{k: v if k in changes else coerce(k, v) for k, v in fields.items()})
        object.__setattr__(new, "_trl", self.trl_given | trl)
        return new

    def to_dict(self) -> dict:
        """The fields as a dict (config.json, W&B's run config); a hub_token is not written, as transformers'."""
        d = dataclasses.asdict(self)
        if d["hub_token"] is not None:
            d["hub_token"] = "<HUB_TOKEN>"
        return d


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


# --------------------------------------------------------------------------------------------------
# Config files and overrides
# --------------------------------------------------------------------------------------------------


def find_config_file(name: str) -> Path:
    """A path, or a bare name found in ``configs/`` (with or without ``.py``)."""
    candidates = [Path(name), CONFIGS_DIR / name, CONFIGS_DIR / f"{name}.py"]
    for p in candidates:
        if p.is_file():
            return p
    known = sorted(p.name for p in CONFIGS_DIR.glob("*.py") if p.name != "__init__.py")
    raise ConfigError(f"config file {name!r} not found (looked at {', '.join(str(p) for p in candidates)}); "
                      f"give a path or one of {known}")


def load_config_file(name: str) -> TrainConfig:
    path = find_config_file(name)
    spec = importlib.util.spec_from_file_location(f"jodpo_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    with _config_file_errors(path):
        spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config(); it must return a jodpo.program.config.TrainConfig "
                          "or a dict")
    with _config_file_errors(path):
        cfg = module.get_config()
    if isinstance(cfg, dict):
        cfg = from_dict(cfg, source=str(path))
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not a TrainConfig or a dict")
    return cfg


@contextlib.contextmanager
def _config_file_errors(path: Path):
    """A config file that does not parse, or raises while it runs (a failed import, a typo): one line naming the
    file and its line. ``ConfigError`` (a bad field value) passes as it is."""
    try:
        yield
    except ConfigError:
        raise
    except SyntaxError as e:
        raise ConfigError(f"config file {path}, line {e.lineno}: {type(e).__name__}: {e.msg}; fix the file") from None
    except Exception as e:  # noqa: BLE001 - whatever the file raised, reported where it raised it
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                 if Path(f.filename).resolve() == path.resolve()]
        where = f", line {lines[-1]}" if lines else ""
        fix = "fix the file"
        if isinstance(e, ModuleNotFoundError) and e.name in MOVED:
            fix = f"{e.name} is now {MOVED[e.name]} (a config file imports TrainConfig as `from jodpo import TrainConfig`)"
        raise ConfigError(f"config file {path}{where}: {type(e).__name__}: {e}; {fix}") from None


def from_dict(d: dict, source: str = "config") -> TrainConfig:
    """A config of the fields ``d`` names (a config file's dict, a YAML recipe, a run's config.json): jodpo's fields
    checked against their types, TRL's others answered (``trl_fields``); every unknown name is said at once."""
    trl_fields.answer(d, FIELDS, source)  # unknown names and refused values first, said with the source
    return TrainConfig(**{k: coerce(k, v) if k in FIELDS else v for k, v in d.items()})


def field_types(annotation) -> tuple:
    hint = typing.get_type_hints(TrainConfig)[annotation]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args
    return (hint,)


def coerce(name: str, value):
    """``value`` checked against the field's type; lists become tuples, ints are accepted for floats."""
    if name not in FIELDS:
        raise ConfigError(f"{trl_fields.unknown_line([name], FIELDS)} Run `python -m jodpo.train --help`.")
    for t in field_types(name):
        if t is type(None) and value is None:
            return None
        if t is bool and isinstance(value, bool):
            return value
        if t in (int, float, str) and isinstance(value, t) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typing.get_origin(t) is dict and isinstance(value, dict):
            bad = [k for k, v in value.items() if not isinstance(k, str) or isinstance(v, bool)
                   or not isinstance(v, (int, float)) or v < 0]
            if bad:
                raise ConfigError(f"field {name!r} maps names to non-negative numbers; {bad[0]!r} does not")
            return {k: float(v) for k, v in value.items()}
        if typing.get_origin(t) is tuple and isinstance(value, (list, tuple)):
            (elem, _) = typing.get_args(t)
            try:
                return tuple(coerce_elem(elem, v) for v in value)
            except TypeError:
                continue
    want = " or ".join(getattr(t, "__name__", str(t)) for t in field_types(name))
    listed = any(typing.get_origin(t) is tuple for t in field_types(name))
    how = f"; a list is written --{name} A B (TRL's style) or --config.{name}=\"['A', 'B']\"" if listed else ""
    raise ConfigError(f"field {name!r} wants {want}, got {value!r} ({type(value).__name__}){how}")


def coerce_elem(t, v):
    if t is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, t) and not isinstance(v, bool):
        return v
    raise TypeError


def parse_override(arg: str) -> tuple[str, object]:
    """``--config.FIELD=VALUE`` -> (FIELD, value). VALUE is a Python literal, or a bare string. TRL's other fields
    (``trl_fields``) come back as parsed, for the config to answer."""
    body = arg[len("--config."):]
    if "=" not in body:
        raise ConfigError(f"{arg}: write overrides as --config.FIELD=VALUE")
    name, text = body.split("=", 1)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    if name in trl_fields.TABLE and name not in FIELDS:
        return name, value
    kinds = field_types(name) if name in FIELDS else ()
    listed = isinstance(value, (list, tuple)) and any(typing.get_origin(t) is tuple for t in kinds)
    if str in kinds and value is not None and not isinstance(value, str) and not listed:
        value = text  # a string field given something that parses as a number: keep the text
    if isinstance(value, str) and str not in kinds and any(typing.get_origin(t) is tuple for t in kinds):
        value = (value,)  # one item of a list field: --config.reward_funcs=my_rewards:concise
    return name, coerce(name, value)


def markdown_table() -> str:
    """The field reference of docs/config.md (``python -m jodpo.program.config`` prints it)."""
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{n}` | `{f.default!r}` | {f.metadata['help'].replace('|', '/')} |" for n, f in FIELDS.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
