"""Qwen2 and Qwen2.5: Llama's layout with biases on the q, k and v projections (never on the output projection),
and a sliding window on the layers its config's ``layer_types`` marks."""
from __future__ import annotations

from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family


def model_fields(cfg) -> dict:
    return llama.model_fields(cfg) | dict(qkv_bias=True, out_bias=False)


FAMILY = Family(
    name="qwen2", module="qwen2", classes={"qwen2": "Qwen2"}, model_fields=model_fields, rules=llama.rules,
    lora_modules=llama.LORA_MODULES, lora_defaults=("q_proj", "v_proj"), prefix="model.",
    lora_paths=llama.LORA_PATHS,
)
