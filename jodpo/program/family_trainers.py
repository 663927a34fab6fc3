"""TRL 1.12's Nash-MD and XPO trainers over jodpo's training program: ``NashMDConfig`` / ``NashMDTrainer``
(``trl.experimental.nash_md``) and ``XPOConfig`` / ``XPOTrainer`` (``trl.experimental.xpo``), with TRL 1.12's
constructors, so that a TRL script runs on jodpo with its import changed. Each is jodpo's ``OnlineDPOConfig`` /
``OnlineDPOTrainer`` with ``method`` set (``jodpo.methods``): the same program, checkpoints, resume, evaluation and
callbacks; docs/online_family.md. And Nash-MD's ``GeometricMixtureWrapper``, TRL's public class."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jodpo.errors import ConfigError
from jodpo.models import load_model, logits
from jodpo.models.params import param_shapes
from jodpo.program.config import TrainConfig
from jodpo.program.sources import is_jodpo_model
from jodpo.program.trainer import OnlineDPOConfig, OnlineDPOTrainer
from jodpo.sampling import SamplingConfig, geometric_mixture, sample_pair


class _FamilyConfig(OnlineDPOConfig):
    method_name = ""  # jodpo's method
    schedule = ""  # the method's own per-epoch setting

    def __init__(self, output_dir: str | None = None, **fields):
        if fields.setdefault("method", self.method_name) != self.method_name:
            raise ConfigError(f"{type(self).__name__}: method={fields['method']!r}; this config is "
                              f"method={self.method_name!r} (use jodpo.OnlineDPOConfig for another method)")
        value = fields.get(self.schedule)
        if isinstance(value, (list, tuple)) and len(value) == 1:  # as TRL's __post_init__: one value, a float
            fields[self.schedule] = value[0]
        super().__init__(output_dir, **fields)


class NashMDConfig(_FamilyConfig):
    """TRL 1.12's ``NashMDConfig``: ``OnlineDPOConfig``'s fields (TRL's names and defaults, jodpo's own) with
    ``method="nash_md"`` and ``mixture_coef`` (the reference's weight in the geometric mixture: a float, or a list
    indexed by epoch, the last kept; default 0.5)."""

    method_name, schedule = "nash_md", "mixture_coef"


class XPOConfig(_FamilyConfig):
    """TRL 1.12's ``XPOConfig``: ``OnlineDPOConfig``'s fields with ``method="xpo"`` and ``alpha`` (the weight of
    the exploration term: a float, or a list indexed by epoch, the last kept; default 1e-5); ``loss_type`` sigmoid
    (default) or ipo as TRL's, or any of jodpo's losses that has a reference."""

    method_name, schedule = "xpo", "alpha"


def _args(trainer: str, config: type[_FamilyConfig], args):
    """The trainer's config: ``args``, or the config class's defaults; one of another method is refused."""
    if args is None:
        return config()
    if not isinstance(args, TrainConfig):
        raise ConfigError(f"{trainer}: args is a {type(args).__name__}; give a jodpo.{config.__name__}")
    if args.method != config.method_name:
        raise ConfigError(f"{trainer}: args has method={args.method!r} ({type(args).__name__}); give a "
                          f"jodpo.{config.__name__} (method={config.method_name!r})")
    return args


class NashMDTrainer(OnlineDPOTrainer):
    """TRL 1.12's ``NashMDTrainer(model, ref_model, reward_funcs, args, data_collator, train_dataset, eval_dataset,
    processing_class, peft_config, compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics)``: each
    step samples a completion from the policy and one from the geometric mixture of policy and reference, scores
    both, and trains on Nash-MD's REINFORCE loss. The arguments are ``OnlineDPOTrainer``'s (the reward models' and
    functions' tokenizer is ``processing_class``, as TRL's); ``judge`` (jodpo's, keyword-only) in place of rewards
    gives the probability that the policy's completion is the better one."""

    def __init__(self, model=None, ref_model=None, reward_funcs=None, args: TrainConfig | None = None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None, peft_config=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None), preprocess_logits_for_metrics=None,
                 *, judge=None):
        super().__init__(model, ref_model, reward_funcs, _args("NashMDTrainer", NashMDConfig, args), data_collator,
                         train_dataset, eval_dataset, processing_class, processing_class, peft_config,
                         compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics, judge=judge)


class XPOTrainer(OnlineDPOTrainer):
    """TRL 1.12's ``XPOTrainer(model, ref_model, reward_funcs, args, data_collator, train_dataset, eval_dataset,
    processing_class, reward_processing_classes, peft_config, compute_metrics, callbacks, optimizers,
    preprocess_logits_for_metrics)``: each step samples a completion from the policy and one from the reference,
    scores both, and trains on the DPO loss of that pair plus ``alpha`` times the policy's log-probability of the
    reference's completion. The arguments are ``OnlineDPOTrainer``'s; ``judge`` (jodpo's, keyword-only) in place of
    rewards picks the chosen completion."""

    def __init__(self, model=None, ref_model=None, reward_funcs=None, args: TrainConfig | None = None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, peft_config=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, *, judge=None):
        super().__init__(model, ref_model, reward_funcs, _args("XPOTrainer", XPOConfig, args), data_collator,
                         train_dataset, eval_dataset, processing_class, reward_processing_classes, peft_config,
                         compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics, judge=judge)


class MixtureOutput(NamedTuple):
    """What ``GeometricMixtureWrapper``'s forward returns: transformers' output's ``logits`` field."""
    logits: object


class GeometricMixtureWrapper:
    """TRL 1.12's ``GeometricMixtureWrapper(model, ref_model, generation_config, mixture_coef=0.5, device=None)``
    (``trl.experimental.nash_md``): the geometric mixture of a policy and its reference that Nash-MD samples from.
    ``model`` and ``ref_model``: transformers ``*ForCausalLM`` objects (read once into jodpo's own), jodpo's ``(model,
    params)``, or paths; both of one architecture and size. Calling it (``forward``) gives TRL's output: ``logits``,
    the mixture's log-probabilities ``log_softmax(c * ref + (1 - c) * policy)`` of the raw logits (c =
    ``mixture_coef``), f32[B, L, V], a torch tensor for torch inputs; ``generate`` decodes from the mixture (jodpo's
    sampler, ``sampling.sample_pair``'s mixture block, as NashMDTrainer's steps sample it) as transformers'
    ``generate`` does: the prompts followed by the completions."""

    main_input_name = "input_ids"

    def __init__(self, model, ref_model, generation_config=None, mixture_coef=0.5, device=None):
        self.model, self.ref_model, self.generation_config = model, ref_model, generation_config
        self.mixture_coef, self.device = mixture_coef, device
        (self._model, self._params), (reference, self._ref_params) = map(_jodpo_pair, (model, ref_model))
        if self._model.family != reference.family or param_shapes(self._model) != param_shapes(reference):
            raise ConfigError(f"GeometricMixtureWrapper: ref_model is a {reference.family} model of other shapes than "
                              f"the model ({self._model.family}); give a reference of the model's architecture and "
                              "size")
        self.config = getattr(model, "config", self._model)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids, attention_mask=None, **kwargs) -> MixtureOutput:
        """The mixture's log-probabilities at every position of ``input_ids`` [B, L] (``attention_mask``: ones)."""
        ids, mask = _arrays(input_ids, attention_mask)
        mixed = geometric_mixture(logits(self._model, self._params, ids, mask),
                                  logits(self._model, self._ref_params, ids, mask), self.mixture_coef)
        return MixtureOutput(_like(input_ids, mixed))

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs) -> dict:
        """As TRL's: the inputs of a forward, with the cache off (jodpo's ``generate`` keeps its own)."""
        return {**kwargs, "input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}

    def generate(self, input_ids, attention_mask=None, generation_config=None, seed: int = 0, **kwargs):
        """``input_ids`` [B, L] (left-padded) followed by up to ``max_new_tokens`` tokens from the mixture, as
        transformers' ``generate`` returns them (pad after an EOS); ``generation_config`` (default: the wrapper's)
        and keyword arguments of it set max_new_tokens, do_sample (False: greedy), temperature, top_k, top_p,
        eos_token_id and pad_token_id; ``seed`` the draw."""
        ids, mask = _arrays(input_ids, attention_mask)
        given = generation_config if generation_config is not None else self.generation_config
        gen = {**(given.to_dict() if given is not None else {}), **kwargs}
        eos = gen.get("eos_token_id")
        eos = list(self._model.eos_token_ids) if eos is None else [eos] if isinstance(eos, int) else list(eos)
        pad = gen.get("pad_token_id")
        pad = (self._model.pad_token_id if self._model.pad_token_id is not None else eos[0]) if pad is None else pad
        cfg = SamplingConfig(max_new_tokens=gen.get("max_new_tokens") or 20,
                             temperature=(gen.get("temperature") or 1.0) if gen.get("do_sample") else 0.0,
                             top_k=gen.get("top_k") or 0, top_p=gen.get("top_p") or 1.0, eos_token_ids=tuple(eos),
                             pad_token_id=pad)
        out = jax.jit(sample_pair, static_argnums=(0, 6))(self._model, self._params, self._ref_params, ids, mask,
                                                          jax.random.key(seed), cfg, self.mixture_coef)
        return _like(input_ids, np.concatenate([ids, np.asarray(out.tokens)[len(ids):]], axis=1))


def _jodpo_pair(x):
    return x if is_jodpo_model(x) else load_model(str(x) if isinstance(x, Path) else x)


def _arrays(input_ids, attention_mask):
    """numpy int32 [B, L] of token ids given as a torch tensor, an array or lists; the mask ones when None."""
    to_np = lambda t: np.asarray(t.detach().cpu().numpy() if hasattr(t, "detach") else t, np.int32)  # noqa: E731
    ids = to_np(input_ids)
    return ids, np.ones_like(ids) if attention_mask is None else to_np(attention_mask)


def _like(given, array):
    """``array`` as a torch tensor when ``given`` is one (torch is imported only then), else a numpy array."""
    array = np.asarray(array)
    if hasattr(given, "detach"):
        import torch

        return torch.from_numpy(array.copy()).to(given.device)
    return array
