"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; ``qwen3_moe``): Qwen3's attention (an RMSNorm over each head's queries
and keys) with a mixture-of-experts block in every layer (``jodpo.models.moe``): ``num_experts`` SwiGLU experts of
width ``moe_intermediate_size``, ``num_experts_per_tok`` of them a token, renormalised where ``norm_topk_prob`` (true
in the released models). Dense layers among the sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` above 1: in
no released model) are refused in one line. ``Qwen3MoeForSequenceClassification`` is the reward head. LoRA adapts the
attention's projections; not yet the routed experts or the router, which PEFT 0.21 reaches on transformers 5 by turning
``gate_proj``, ``up_proj``, ``down_proj`` and ``gate`` (and ``all-linear``) into ``target_parameters`` on the stacked
experts and the router (jodpo refuses those names; its ``all-linear`` is the attention's four). PEFT has no default
target modules for Qwen3-MoE: LoRA needs ``lora_target_modules``, as PEFT does."""
from __future__ import annotations

from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family, Rule, moe_of, with_experts, without_mlp
from jodpo.models.model import AttentionOptions, Model


def model_fields(cfg) -> dict:
    return llama.model_fields(cfg) | dict(attn_options=AttentionOptions(qk_norm="head"), mlp=None,
                                          moe=moe_of(cfg))


def rules(model: Model) -> list[Rule]:
    """Llama's rules (with the q/k norms), the dense MLP's replaced by the MoE block's."""
    return with_experts(llama.rules(model), model)


LORA_MODULES, LORA_PATHS = without_mlp(llama.LORA_MODULES, llama.LORA_PATHS)

FAMILY = Family(
    name="qwen3_moe", module="qwen3_moe", classes={"qwen3_moe": "Qwen3Moe"}, model_fields=model_fields, rules=rules,
    lora_modules=LORA_MODULES, lora_defaults=(), prefix="model.", lora_paths=LORA_PATHS,
)
