"""What a training step is configured by and what it carries: ``StepConfig`` (static, hashable: the first argument
of every jitted step), ``TrainState`` (the pytree the steps update) and ``PreferenceBatch`` (offline DPO's data).
``jodpo.train_step`` holds the steps themselves and re-exports these names."""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import optax

from jodpo.losses import LossConfig, LossOptions, check_loss_options, needs_reference
from jodpo.methods import OWN_SETTINGS, Method, check_method, get_method, per_epoch
from jodpo.models.decoder import Model, Params
from jodpo.optim import OptimizerConfig
from jodpo.pairing import resolve_pairing
from jodpo.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static about a step (hashable: the first, static argument of the jitted steps)."""

    model: Model
    sampling: SamplingConfig
    optimizer: OptimizerConfig
    beta: tuple[float, ...] = (0.1,)  # beta[min(int(epoch), len - 1)]
    updates_per_epoch: int = 1  # optimizer steps per epoch, to index ``beta``
    loss_type: str = "sigmoid"
    loss_options: LossOptions = LossOptions()
    missing_eos_penalty: float | None = None
    penalty_reward_value: float | None = None
    max_length: int | None = None  # prompt + completion, left-truncating the prompt in the loss forward
    reward_model: Model | None = None  # scored on device by ``online_step`` (shared tokenizer)
    judged: bool = False  # ``update``'s rewards are a judge's verdicts (``jodpo.judges.pair_scores``)
    logprob_temperature: float | None = None  # the loss's logits divided by it (open-instruct); None: raw (TRL)
    # open-instruct's stop_token='period': ids that end a completion (the sampler stops at them too: they are among
    # sampling.eos_token_ids) and alone decide the EOS penalties and val/contain_eos_token; () : the EOS ids do
    stop_token_ids: tuple[int, ...] = ()
    # open-instruct's async_mode: a step samples with the parameters from before the previous update (one step
    # off-policy; the state keeps them as ``sampler_params``), so sampling and training can overlap
    async_mode: bool = False
    num_generations: int = 2  # completions sampled per prompt, k (TRL GRPO's name); one pair per prompt is trained
    pairing: str = "auto"  # which pair of the k (``jodpo.pairing``): auto | best_worst | random
    # semi-online (Lanchantin et al. 2025): the sampler's parameters are the policy's at the last multiple of
    # sync_steps optimizer steps (1: on-policy); with async_mode, at the last multiple before the previous rollout
    sync_steps: int = 1
    # which of TRL's online trainers a step is (``jodpo.methods.METHODS``): online_dpo | nash_md | xpo
    method: str = "online_dpo"
    alpha: tuple[float, ...] = (OWN_SETTINGS["alpha"][1],)  # XPO's exploration weight, alpha[min(int(epoch), len - 1)]
    mixture_coef: tuple[float, ...] = (OWN_SETTINGS["mixture_coef"][1],)  # Nash-MD's weight of the reference in the
    # mixture, indexed as beta
    router_aux_loss_coef: float = 0.0  # a MoE policy's load-balancing loss, times this, added (0: off, as TRL's)
    moe_routing_replay: bool = False  # a MoE policy's training forward takes the sampler's experts (routing replay)

    @property
    def online_method(self) -> Method:
        return get_method(self.method)

    @property
    def reward_eos_ids(self) -> tuple[int, ...]:
        """The EOS ids a reward model sharing the tokenizer does not read (``score_completions``): the special EOS
        ids (TRL 1.16 scores the text decoded without them), or for TRL 1.12's trainers, which score the token ids
        with every pad-token id masked, only an EOS that is the pad token."""
        if self.online_method.reward_reads_eos:
            return tuple(i for i in self.special_eos_ids if i == self.sampling.pad_token_id)
        return self.special_eos_ids

    @property
    def reference_free(self) -> bool:
        """The loss needs no reference (``simpo``): the steps take ``ref_params=None`` (with LoRA, the base the
        adapters ride on) and never run a reference forward."""
        return not needs_reference(self.loss_type)

    @property
    def loss(self) -> LossConfig:
        """The loss's settings as ``jodpo.losses`` reads them (its EOS ids: ``penalty_ids``)."""
        return LossConfig(self.loss_type, self.loss_options, self.max_length, self.logprob_temperature,
                          self.missing_eos_penalty, self.penalty_reward_value, self.penalty_ids, self.judged,
                          self.router_aux_loss_coef, self.moe_routing_replay)

    @property
    def lagging(self) -> bool:
        """The sampler is not the trained policy (``async_mode``, ``sync_steps`` > 1): the state keeps its
        parameters as ``sampler_params``."""
        return self.async_mode or self.sync_steps > 1

    @property
    def pairs_as_sampled(self) -> bool:
        """Each prompt's two completions are its pair as sampled (k = 2, ``random``): TRL's step, nothing chosen."""
        return self.num_generations == 2 and resolve_pairing(self.pairing, 2) == "random"

    @property
    def penalty_ids(self) -> tuple[int, ...]:
        """The ids whose presence spares a completion the EOS penalties."""
        return self.stop_token_ids or self.sampling.eos_token_ids

    @property
    def special_eos_ids(self) -> tuple[int, ...]:
        """The EOS ids proper (special tokens, absent from the text a reward model reads), without stop tokens."""
        return tuple(i for i in self.sampling.eos_token_ids if i not in self.stop_token_ids)

    def __post_init__(self):
        beta = (self.beta,) if isinstance(self.beta, (int, float)) else tuple(self.beta)
        if not beta or any(not b > 0 for b in beta):
            raise ValueError(f"beta must be a positive number or a non-empty list of them, got {self.beta}")
        object.__setattr__(self, "beta", tuple(float(b) for b in beta))
        check_loss_options(self.loss_type, self.loss_options)
        if self.updates_per_epoch < 1:
            raise ValueError("updates_per_epoch must be >= 1")
        if self.num_generations < 2 or self.sync_steps < 1:
            raise ValueError(f"num_generations must be >= 2 and sync_steps >= 1, got {self.num_generations} and "
                             f"{self.sync_steps}")
        resolve_pairing(self.pairing, self.num_generations)
        for name in ("alpha", "mixture_coef"):
            object.__setattr__(self, name, per_epoch(name, getattr(self, name)))
        check_method(self.method, mixture_coef=self.mixture_coef, alpha=self.alpha, loss_type=self.loss_type,
                     loss_options=self.loss_options, num_generations=self.num_generations, pairing=self.pairing,
                     async_mode=self.async_mode, sync_steps=self.sync_steps)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # i32[]: optimizer steps applied
    params: Params
    opt_state: optax.OptState
    rng: jax.Array  # the run's key; never advanced (steps fold in their index)
    sampler_params: Params | None = None  # async_mode / sync_steps > 1 (``StepConfig.lagging``): the policy that
    # samples, as the sampler reads it (``sampler_weights``: in the compute dtype, or LoRA adapters as they are)


@flax.struct.dataclass
class PreferenceBatch:
    """Offline DPO data for one window: prompts left-padded, responses right-padded (EOS included)."""

    prompt_ids: jax.Array  # i32[A, B, P]
    prompt_mask: jax.Array
    chosen_ids: jax.Array  # i32[A, B, C]
    chosen_mask: jax.Array
    rejected_ids: jax.Array  # i32[A, B, C]
    rejected_mask: jax.Array
