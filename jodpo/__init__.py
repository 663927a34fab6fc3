"""jodpo: Online DPO for language models in JAX/Flax.

The public functional API (outside code imports exactly these names from ``jodpo``)."""
from jodpo import hostmem
from jodpo.models import (CheckpointError, Model, init_cache, init_params, load_model, load_tokenizer, logits,
                          param_axes, reward_scores)
from jodpo.losses import LOSSES, LossOptions, completion_logprobs, dpo_loss, online_dpo_loss
from jodpo.models.export import save_hf
from jodpo.sampling import Samples, SamplingConfig, sample

hostmem.install()  # the compiler's freed scratch memory goes back to the OS after each compilation

__version__ = "0.1.0"
__all__ = ["LOSSES", "LossOptions", "completion_logprobs", "dpo_loss", "online_dpo_loss", "CheckpointError", "Model", "init_cache", "init_params", "load_model", "load_tokenizer", "logits",
           "param_axes", "reward_scores", "sample", "save_hf", "Samples", "SamplingConfig"]
