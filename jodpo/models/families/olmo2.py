"""OLMo 2 and OLMo 3 (``olmo2``, ``olmo3``): Llama's tensor names with OLMo's norms. No norm before the attention or
the MLP: their outputs are normed instead (``post_attention_layernorm``, ``post_feedforward_layernorm``) before the
residuals; RMSNorms that scale in float32 before the cast back; the q and k norms over the whole projections (every
head at once, a weight per channel), before RoPE. OLMo 3 adds sliding-window layers (three in four by default:
``layer_types``) with RoPE of their own: the config's ``rope_scaling`` (YaRN in the released 7B and 32B, with its
attention factor on cos and sin) is the global layers' only, the sliding layers rotate at the plain base.
PEFT has no default target modules for either: LoRA needs ``lora_target_modules``, as PEFT does."""
from __future__ import annotations

import dataclasses

from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family, rope_of
from jodpo.models.model import AttentionOptions


def model_fields(cfg) -> dict:
    fields = llama.model_fields(cfg)
    fields |= dict(attn_options=AttentionOptions(qk_norm="whole"),
                   norms=dataclasses.replace(fields["norms"], scale_f32=True, sites="post"))
    rope = cfg.rope_parameters
    if "full_attention" in rope:  # OLMo 3: RoPE per layer type
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        local = dict(rope["sliding_attention"]) if "sliding_attention" in cfg.layer_types else None
        fields["rope"] = rope_of(dict(rope["full_attention"]), head_dim, cfg.max_position_embeddings, local=local)
    return fields


FAMILY = Family(
    name="olmo2", module="olmo2", classes={"olmo2": "Olmo2", "olmo3": "Olmo3"}, model_fields=model_fields,
    rules=llama.rules, lora_modules=llama.LORA_MODULES, lora_defaults=(), prefix="model.",
    lora_paths=llama.LORA_PATHS,
)
