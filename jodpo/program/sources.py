"""Where a run's pieces come from: the objects a Python caller hands over (``Given``), or else what the config names
(paths, hub ids, ``module:function`` strings): the policy, the rewards, a judge, the data's splits and evaluation
sets. ``run.build`` puts them together."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jodpo import judges as J
from jodpo.errors import CheckpointError, ConfigError
from jodpo.methods import get_method
from jodpo.models import load_model, load_tokenizer
from jodpo.models.loading import custom_code, describe_model
from jodpo.models.model import Model, attention_note
from jodpo.models.params import frozen_params
from jodpo.parallel import sharding as S
from jodpo.program import data as D
from jodpo.program.config import TrainConfig
from jodpo.program.rewards import RewardSet, check_shared_vocab
from jodpo.program.user_code import import_judge, import_reward_function, is_import_path, judge_object


@dataclasses.dataclass(frozen=True)
class Given:
    """What a Python caller hands the program in place of what the config names (``OnlineDPOTrainer``): objects
    already in memory. Each one left None is read as the config says."""

    model: object | None = None  # a transformers *ForCausalLM object, or jodpo's own (Model, params)
    # (model_name_or_path names where it came from)
    tokenizer: object | None = None  # its tokenizer (processing_class)
    ref_model: object | None = None  # TRL's ref_model: the frozen reference, of the policy's architecture (a path,
    # a transformers object or jodpo's (Model, params)); None: the starting policy, as in TRL
    train_rows: object | None = None  # a datasets.Dataset (dataset_name)
    eval_rows: dict | None = None  # {metric prefix: datasets.Dataset} (eval_dataset): {"eval": rows}, or a dict
    # of sets as {"eval_<name>": rows}, each evaluated and logged under its prefix (transformers' naming)
    reward_functions: tuple = ()  # callables (reward_funcs names them), in order
    reward_model: object | None = None  # a *ForSequenceClassification object (reward_model_path)
    reward_tokenizer: object | None = None
    judge: object | None = None  # a callable or an object with judge() (judge names it)


@contextlib.contextmanager
def named(field: str):
    """A model or tokenizer that cannot be read, said with the config field that gave its path."""
    try:
        yield
    except CheckpointError as e:
        raise CheckpointError(f"{field}: {e}") from e


def _same_tokenizer(a, b) -> bool:
    return type(a).__name__ == type(b).__name__ and a.get_vocab() == b.get_vocab()


def say_attention(model, field: str) -> None:
    """One line when the attention kernel asked for cannot compute this model's (cuDNN and Gemma 2's soft-capping)."""
    note = attention_note(model)
    if note:
        warnings.warn(f"{field}: {note}")


def is_jodpo_model(x) -> bool:
    """jodpo's own ``(Model, params)``, as ``jodpo.load_model`` returns it."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Model) and isinstance(x[1], dict)


def trusts_remote_code(cfg: TrainConfig) -> bool:
    """TRL's ``trust_remote_code`` (or ``model_init_kwargs``' key of that name, which TRL's constructor sets from
    it)."""
    return bool(cfg.trust_remote_code or (cfg.model_init_kwargs or {}).get("trust_remote_code"))


def check_custom_code(source, cfg: TrainConfig) -> None:
    """A checkpoint whose config.json names code of its own (``auto_map``) is refused without ``trust_remote_code``,
    as transformers refuses to load it (TRL's ValueError); with it, said once: jodpo runs its own implementation of
    the checkpoint's model_type, never the checkpoint's code."""
    if is_jodpo_model(source):
        return
    with named("model_name_or_path"):
        code = custom_code(source, cfg.model_revision)
    if code is None:
        return
    if not trusts_remote_code(cfg):
        raise ConfigError(f"model_name_or_path: {source} contains custom code ({code}), which transformers runs only "
                          "with trust_remote_code=True (TRL refuses it without); jodpo never runs a checkpoint's "
                          "code: set trust_remote_code=True to train it as jodpo's own implementation of its "
                          "model_type")
    warnings.warn(f"model_name_or_path: {source} contains custom code ({code}); jodpo trains it as its own "
                  "implementation of the checkpoint's model_type (trust_remote_code=True), not that code")


def read_policy(source, dtype, cfg: TrainConfig, mesh, place=None) -> tuple[Model, dict]:
    """The policy as ``(Model, params)`` in ``dtype``, its parameters laid out on the mesh (or as ``place`` puts
    them: ``on_host`` keeps them on the host): read from a path, a hub id or a transformers object (``load_model``),
    or jodpo's own ``(Model, params)`` taken as they are (cast, placed)."""
    if is_jodpo_model(source):
        model, params = source
        put = S.placer(mesh)(model, np.dtype(jnp.dtype(dtype)))
        return model, jax.tree_util.tree_map_with_path(lambda p, x: put(tuple(k.key for k in p), x), params)
    check_custom_code(source, cfg)
    with named("model_name_or_path"):
        return load_model(source, "causal_lm", dtype, revision=cfg.model_revision,
                          place=S.placer(mesh) if place is None else place)


def on_host(model: Model, dtype):
    """``load_model``'s ``place`` that keeps each parameter a host (numpy) array: nothing touches a device."""
    return lambda path, host: host


def check_lora_reference(ref_model, source, base: dict, cfg: TrainConfig, mesh) -> None:
    """TRL's ``ref_model`` beside ``peft_config``: jodpo's LoRA reference is the base with its adapters off (no second
    copy is held), which is the reference given when it has the base's weights (TRL's own tests give the policy's
    checkpoint again); one of other weights is refused in one line."""
    if ref_model is source or (isinstance(ref_model, str) and ref_model == source):
        return
    _, ref_params = read_policy(ref_model, cfg.frozen_param_dtype, cfg, mesh)
    same = jax.jit(lambda a, b: jnp.all(jnp.stack([jnp.array_equal(x, y) for x, y in
                                                    zip(jax.tree.leaves(a), jax.tree.leaves(b))])))
    if not bool(same(base, ref_params)):
        raise ConfigError("ref_model: with peft_config jodpo's reference is the base model with its adapters off, "
                          "and this ref_model's weights are not the base's; leave ref_model None (the base is then "
                          "the reference, as in TRL) or train without peft_config to train against this reference")


def describe_policy(source, dtype, cfg: TrainConfig) -> Model:
    """The policy's ``Model`` without reading its weights (``describe_model``), or that of a given ``(Model,
    params)``."""
    if is_jodpo_model(source):
        return source[0]
    check_custom_code(source, cfg)
    with named("model_name_or_path"):
        return describe_model(source, "causal_lm", dtype, revision=cfg.model_revision)


def load_rewards(cfg: TrainConfig, policy, tokenizer, mesh, chat: bool, given: Given = Given()) -> RewardSet:
    """The run's rewards: the reward model (frozen, in frozen_param_dtype, computing as the ``policy`` model does,
    sharded over the mesh) and the reward functions, with their weights."""
    rm, rm_params, rm_tok, shared = None, None, None, False
    if cfg.reward_model_path or given.reward_model is not None:
        source = cfg.reward_model_path if given.reward_model is None else given.reward_model
        with named("reward_model_path"):
            rm, rm_params = load_model(source, "reward", cfg.frozen_param_dtype, place=S.placer(mesh))
            rm_tok = given.reward_tokenizer or load_tokenizer(cfg.reward_model_path)
        if chat and rm_tok.chat_template is None:  # it reads chat prompts and completions as a conversation
            raise ConfigError(f"reward_model_path: {source if isinstance(source, str) else 'the reward model'}'s "
                              "tokenizer has no chat template, and the prompts are chat messages, which a reward model "
                              "scores as a conversation in its own template; use a reward model whose tokenizer has "
                              "one, or text prompts")
        rm = rm.replace(dtype=policy.dtype, precision=policy.precision, attention=policy.attention)
        say_attention(rm, "reward_model_path")
        rm_params = frozen_params(rm, rm_params)
        rm_tok.padding_side = "right"
        shared = _same_tokenizer(tokenizer, rm_tok)
        if shared:
            check_shared_vocab(policy, rm)
    fns = list(given.reward_functions) or [import_reward_function(s) for s in cfg.reward_funcs]
    return RewardSet(rm, rm_params, rm_tok, fns, cfg.reward_weights, shared_tokenizer=shared, chat=chat)


def load_judge(cfg: TrainConfig, policy, mesh, given=None) -> J.LLMJudge | J.CallableJudge:
    """A callable judge (``given``, or from its import path), or a causal LM as an LLM judge: frozen, in
    frozen_param_dtype, computing as the policy does, its parameters sharded over the mesh like the reward model's."""
    if given is not None:
        return given if isinstance(given, (J.LLMJudge, J.CallableJudge)) else judge_object(given, cfg.judge)
    if is_import_path(cfg.judge):
        return import_judge(cfg.judge)
    with named("judge"):
        model, params = load_model(cfg.judge, "causal_lm", cfg.frozen_param_dtype, place=S.placer(mesh))
        tokenizer = load_tokenizer(cfg.judge)
    model = model.replace(dtype=policy.dtype, precision=policy.precision, attention=policy.attention)
    say_attention(model, "judge")
    params = frozen_params(model, params)
    try:
        return J.LLMJudge(model, params, tokenizer, J.read_template(cfg.judge_prompt),
                          cfg.judge_answer_tokens, cfg.judge_both_orders)
    except J.JudgeError as e:
        raise ConfigError(f"judge {cfg.judge!r}: {e}") from None


def load_split(mixer: dict | None, name: str, cfg: TrainConfig, split: str):
    """The rows of a split: a dataset_mixer's mixture when there is one, else the named dataset."""
    if mixer:
        return D.load_mixture(mixer, cfg.dataset_config, split)
    return D.load_rows(name, cfg.dataset_config, split)


def _single_files(mixer: dict | None, name: str) -> bool:
    """Whether every dataset named is one local file: a file has no splits (``load_rows`` reads it whole as
    whichever split is asked for)."""
    return all(Path(n).expanduser().is_file() for n in (mixer or {name: 1}))


def _same(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.resolve() == pb.resolve() if pa.exists() and pb.exists() else a == b


def describe_split(mixer: dict | None, name: str, split: str) -> str:
    """What ``load_split(mixer, name, ..., split)`` reads, in words."""
    what = f"the mixture of {', '.join(mixer)}" if mixer else name
    if _single_files(mixer, name):
        return f"{what} (all its rows: a single file has no splits, so the {split!r} split is the whole file)"
    return f"the {split!r} split of {what}"


def training_prompts(mixer: dict | None, name: str, split: str, trained: dict) -> str | None:
    """Why the split ``load_split(mixer, name, ..., split)`` reads is the training data of a run whose config is
    ``trained`` (its ``dataset_name``, ``dataset_mixer``, ``dataset_train_split``), or None when it is not."""
    t_mixer, t_name, t_split = trained.get("dataset_mixer"), trained.get("dataset_name") or "", \
        trained.get("dataset_train_split", "train")
    if bool(mixer) != bool(t_mixer):
        return None
    if mixer and (len(mixer) != len(t_mixer) or not all(map(_same, mixer, t_mixer)) or
                  list(mixer.values()) != list(t_mixer.values())):
        return None
    if not mixer and not (name and _same(name, t_name)):
        return None
    if _single_files(mixer, name):
        return f"{'its files are' if mixer else 'it is'} the training data, read whole"
    return f"{split!r} is also the training split (dataset_train_split)" if split == t_split else None


def prompt_bos(cfg: TrainConfig, tokenizer) -> int | None:
    """The token put first in each prompt: the tokenizer's BOS for the methods whose TRL trainers tokenize with
    ``tokenize_row`` (TRL 1.12's Nash-MD and XPO), else None."""
    return tokenizer.bos_token_id if get_method(cfg.method).prompt_bos else None


def eval_sets(cfg: TrainConfig, given: Given, tokenizer, dp: int, offline: bool) -> tuple:
    """The run's evaluation sets as ``((metric prefix, PromptData), ...)``, when it evaluates (``eval_strategy`` not
    "no", or ``eval_on_start``): the caller's (one, or each of a dict), else ``eval_dataset`` / ``dataset_eval_mixer``
    / the training data's test split (a caller's own training rows have no test split: they need an evaluation set,
    as transformers requires; offline DPO is not evaluated); at most ``max_eval_prompts`` prompts each. A set smaller
    than the data-parallel size is left out, said once."""
    given_set = given.eval_rows is not None or cfg.eval_dataset or cfg.dataset_eval_mixer
    if cfg.eval_strategy == "no" and not cfg.eval_on_start:
        if given_set:
            warnings.warn("an evaluation set is given and eval_strategy='no' (TRL's default): the run does not "
                          "evaluate; set eval_strategy='steps' (or 'epoch') to evaluate on it", stacklevel=3)
        return ()
    if offline:
        warnings.warn("a preference dataset trains offline DPO, which is not evaluated (evaluation samples and scores "
                      "completions); eval_strategy is ignored", stacklevel=3)
        return ()
    if given.eval_rows is not None:
        named_rows = given.eval_rows
    elif given.train_rows is not None and not (cfg.eval_dataset or cfg.dataset_eval_mixer):
        raise ConfigError(f"eval_strategy={cfg.eval_strategy!r} needs an eval_dataset (as transformers' Trainer "
                          "requires one): give the trainer eval_dataset, or set eval_strategy='no'")
    else:
        mixer = cfg.dataset_eval_mixer or (None if cfg.eval_dataset else cfg.dataset_mixer)
        name = cfg.eval_dataset or cfg.dataset_name
        same = training_prompts(mixer, name, cfg.dataset_test_split, cfg.to_dict())
        if same:  # as TRL's script would, but said: scores on prompts it trains on are no held-out measure
            warnings.warn(f"evaluation reads {describe_split(mixer, name, cfg.dataset_test_split)}: {same}, so its "
                          "scores are on prompts the run trains on; give eval_dataset for held-out prompts",
                          stacklevel=3)
        named_rows = {"eval": load_split(mixer, name, cfg, cfg.dataset_test_split)}
    out = []
    for prefix, rows in named_rows.items():
        data = D.prepare_prompts(rows.select(range(min(len(rows), cfg.max_eval_prompts))), tokenizer,
                                 cfg.max_prompt_length, prompt_bos(cfg, tokenizer))
        if len(data) < dp:  # an eval batch needs a prompt per data-parallel device
            warnings.warn(f"the evaluation set{'' if prefix == 'eval' else ' ' + prefix[5:]} has {len(data)} "
                          f"prompts, fewer than the {dp} data-parallel devices (mesh_data x mesh_fsdp x "
                          "mesh_expert); it is not evaluated. Raise max_eval_prompts or give more evaluation rows.",
                          stacklevel=3)
            continue
        out.append((prefix, data))
    return tuple(out)
