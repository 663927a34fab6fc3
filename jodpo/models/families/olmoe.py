"""OLMoE (OLMoE-1B-7B; ``olmoe``): Llama's layout and norms (before the attention and the feed-forward) with OLMo's q
and k norms over the whole projections (every head at once, a weight per channel), and a mixture-of-experts block in
every layer (``jodpo.models.moe``): ``num_experts`` SwiGLU experts of width ``intermediate_size``,
``num_experts_per_tok`` of them a token, not renormalised unless ``norm_topk_prob``. ``clip_qkv`` (clamping q, k and v:
in no released OLMoE) is refused in one line. transformers has no OLMoE sequence classifier: a reward model exports
as ``OlmoeForSequenceClassification`` (transformers' generic classifier, the score on the last non-pad token). LoRA
adapts what it adapts in Qwen3-MoE (``jodpo.models.families.qwen3_moe``): the attention, and through PEFT's
``target_parameters`` the routed experts and the router."""
from __future__ import annotations

from jodpo.errors import UnsupportedModelError
from jodpo.models.families import llama, qwen3_moe
from jodpo.models.hf_mapping import Family, moe_fields
from jodpo.models.model import AttentionOptions


def model_fields(cfg) -> dict:
    if getattr(cfg, "clip_qkv", None) is not None:
        raise UnsupportedModelError(f"clip_qkv={cfg.clip_qkv}: clamping q, k and v is not supported (clip_qkv=null)")
    return llama.model_fields(cfg) | dict(attn_options=AttentionOptions(qk_norm="whole")) | moe_fields(cfg)


FAMILY = Family(
    name="olmoe", module="olmoe", classes={"olmoe": "Olmoe"}, model_fields=model_fields, rules=qwen3_moe.rules,
    lora_modules=qwen3_moe.LORA_MODULES, lora_defaults=(), prefix="model.", lora_paths=qwen3_moe.LORA_PATHS,
    lora_parameters=qwen3_moe.LORA_PARAMETERS, lora_module_parameters=qwen3_moe.LORA_MODULE_PARAMETERS,
)
