"""TRL 1.12's Nash-MD and XPO trainers over jodpo's training program: ``NashMDConfig`` / ``NashMDTrainer``
(``trl.experimental.nash_md``) and ``XPOConfig`` / ``XPOTrainer`` (``trl.experimental.xpo``), with TRL 1.12's
constructors, so that a TRL script runs on jodpo with its import changed. Each is jodpo's ``OnlineDPOConfig`` /
``OnlineDPOTrainer`` with ``method`` set (``jodpo.methods``): the same program, checkpoints, resume, evaluation and
callbacks; docs/online_family.md."""
from __future__ import annotations

from jodpo.errors import ConfigError
from jodpo.program.config import TrainConfig
from jodpo.program.trainer import OnlineDPOConfig, OnlineDPOTrainer


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
