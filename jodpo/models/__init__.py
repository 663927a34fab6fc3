"""Flax decoders (GPT-NeoX, Llama/Mistral/SmolLM, Qwen2, Qwen3, Qwen3.5, Gemma 2-4, OLMo 2-3, SmolLM3; the mixtures of
experts Qwen3-MoE, OLMoE, Qwen3.5-MoE, Qwen3-Next, Gemma 4 26B-A4B) as pure functions, and their HF loading."""
from jodpo.errors import CheckpointError
from jodpo.models.decoder import Cache, Model, Params, hidden_states, init_cache, prefixed_hidden_states
from jodpo.models.params import init_params, param_axes, param_shapes, param_specs
from jodpo.models.heads import last_token_index, lm_head, logits, prefixed_reward_scores, reward_scores
from jodpo.models.families import ARCHITECTURES, SUPPORTED, hf_architecture, weight_rules
from jodpo.models.loading import load_model, load_tokenizer

__all__ = [
    "ARCHITECTURES", "Cache", "CheckpointError", "Model", "Params", "SUPPORTED", "hf_architecture", "hidden_states",
    "init_cache", "init_params", "last_token_index", "lm_head", "load_model", "load_tokenizer", "logits",
    "param_axes", "param_shapes", "param_specs", "prefixed_hidden_states", "prefixed_reward_scores", "reward_scores",
    "weight_rules",
]
