"""jodpo: Online DPO for language models in JAX/Flax.

The public functional API: outside code imports exactly these names from ``jodpo``. Importing jodpo does no work
and changes no setting of jax (the commands set up XLA themselves: ``jodpo.program.backend``)."""
import jodpo.parallel.sharding  # noqa: F401 (jodpo.parallel.sharding: meshes, shardings, placement)
import jodpo.parallel.split_sampler  # noqa: F401
from jodpo import train_step  # the pure training step (init_state, online_step, jit_steps, ...)
from jodpo.collective_order import order_collectives
from jodpo.errors import CheckpointError
from jodpo.losses import (LOSSES, LossOptions, completion_logprobs, dpo_loss, nash_md_loss, online_dpo_loss,
                          xpo_loss)
from jodpo.models import Model, init_cache, init_params, load_model, load_tokenizer, logits, param_axes, reward_scores
from jodpo.models.export import save_hf
from jodpo.program.config import TrainConfig
from jodpo.sampling import Samples, SamplingConfig, sample

__version__ = "0.1.0"


def __getattr__(name: str):
    """TRL's trainer API (``OnlineDPOConfig``, ``OnlineDPOTrainer``; TRL 1.12's ``NashMDConfig``, ``NashMDTrainer``,
    ``XPOConfig``, ``XPOTrainer``, ``GeometricMixtureWrapper``), imported when first used: the training program's
    modules (Orbax, the trackers) load only for code that trains."""
    if name in ("OnlineDPOConfig", "OnlineDPOTrainer"):
        from jodpo.program import trainer

        return getattr(trainer, name)
    if name in ("NashMDConfig", "NashMDTrainer", "XPOConfig", "XPOTrainer", "GeometricMixtureWrapper"):
        from jodpo.program import family_trainers

        return getattr(family_trainers, name)
    raise AttributeError(f"module 'jodpo' has no attribute {name!r}")


__all__ = ["LOSSES", "CheckpointError", "LossOptions", "Model", "Samples", "SamplingConfig", "completion_logprobs",
           "dpo_loss", "nash_md_loss", "xpo_loss", "init_cache", "init_params", "load_model", "load_tokenizer",
           "logits", "online_dpo_loss", "order_collectives", "param_axes", "reward_scores", "sample", "save_hf",
           "TrainConfig", "train_step", "parallel", "OnlineDPOConfig", "OnlineDPOTrainer", "NashMDConfig",
           "NashMDTrainer", "XPOConfig", "XPOTrainer", "GeometricMixtureWrapper"]
