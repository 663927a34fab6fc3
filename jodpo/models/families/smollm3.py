"""SmolLM3: Llama's layout and arithmetic with no RoPE on some layers (``no_rope_layers``: 0 marks a NoPE layer;
by default every 4th, ``no_rope_layer_interval``), their queries and keys used as projected. A sliding window, when
``use_sliding_window`` asks, is on the layers its ``layer_types`` marks (transformers' default: the NoPE ones). Tied
embeddings (3B). PEFT has no default target modules for it: LoRA needs ``lora_target_modules``, as PEFT does."""
from __future__ import annotations

from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family, rope_of


def model_fields(cfg) -> dict:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    nope = tuple(i for i, rope in enumerate(cfg.no_rope_layers[:cfg.num_hidden_layers]) if not rope)
    return llama.model_fields(cfg) | dict(
        rope=rope_of(dict(cfg.rope_parameters), head_dim, cfg.max_position_embeddings, nope_layers=nope))


FAMILY = Family(
    name="smollm3", module="smollm3", classes={"smollm3": "SmolLM3"}, model_fields=model_fields, rules=llama.rules,
    lora_modules=llama.LORA_MODULES, lora_defaults=(), prefix="model.", lora_paths=llama.LORA_PATHS,
)
