"""Qwen3 (dense): Llama's layout with an RMSNorm over each head's queries and keys after the projection and before
RoPE, no q/k/v biases (unless the config's ``attention_bias``), an explicit ``head_dim``, tied or untied embeddings,
and a sliding window on the layers its config's ``layer_types`` marks (off in the released models)."""
from __future__ import annotations

from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family
from jodpo.models.model import AttentionOptions


def model_fields(cfg) -> dict:
    return llama.model_fields(cfg) | dict(attn_options=AttentionOptions(qk_norm="head"))


FAMILY = Family(
    name="qwen3", module="qwen3", classes={"qwen3": "Qwen3"}, model_fields=model_fields, rules=llama.rules,
    lora_modules=llama.LORA_MODULES, lora_defaults=("q_proj", "v_proj"), prefix="model.",
    lora_paths=llama.LORA_PATHS,
)
