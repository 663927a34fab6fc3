"""Qwen3.5-MoE (Qwen3.5-35B-A3B, Qwen3.5-122B-A10B; Qwen3.6's MoE shares it; ``qwen3_5_moe_text``, ``qwen3_5_moe``):
Qwen3.5's hybrid of Gated DeltaNet and gated attention layers (``jodpo.models.families.qwen3_5``) with a mixture of
experts in every layer (``jodpo.models.moe``): ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``,
``num_experts_per_tok`` a token, always renormalised (its router has no ``norm_topk_prob``), beside a shared expert of
width ``shared_expert_intermediate_size`` whose output is times sigmoid(``shared_expert_gate``). The language model of
a ``Qwen3_5MoeForConditionalGeneration`` (the released checkpoints) loads as a text model, its vision tower and
multi-token-prediction layers (``mtp.*``) left out in one line; experts fused on the hub (``experts.gate_up_proj``)
are split when loading, and an export writes transformers 5.24's per-expert layout as a ``Qwen3_5MoeForCausalLM``.
transformers has no Qwen3.5-MoE sequence classifier: a reward head is read and written as its generic one would be.
LoRA adapts the attention's and DeltaNet's projections and the shared expert's (``gate_proj``, ``up_proj``,
``down_proj``, its gate ``shared_expert_gate``: the nn.Linear modules PEFT adapts); PEFT has no default target modules
for Qwen3.5-MoE: LoRA needs ``lora_target_modules``, as PEFT does."""
from __future__ import annotations

from jodpo.models.families import qwen3_5
from jodpo.models.hf_mapping import Family, Rule, moe_fields, with_experts
from jodpo.models.model import Model


def model_fields(cfg) -> dict:
    return qwen3_5.model_fields(cfg) | moe_fields(cfg, norm_topk_prob=True,
                                                  shared_dim=cfg.shared_expert_intermediate_size)


def rules(model: Model) -> list[Rule]:
    """Qwen3.5's rules, the dense MLP's replaced by the MoE block's."""
    return with_experts(qwen3_5.rules(model), model)


# PEFT's names reach the shared expert's nn.Linear modules (gate_proj, up_proj, down_proj, its gate
# shared_expert_gate: every one of them in PEFT's all-linear) and never the routed experts, which transformers 5 holds
# as stacked parameters (PEFT converts no Qwen3.5-MoE target names to target_parameters)
LORA_MODULES = qwen3_5.LORA_MODULES | {"shared_expert_gate": ("shared_gate",)}
LORA_PATHS = qwen3_5.LORA_PATHS | {m: "mlp.shared_expert" for m in ("gate_proj", "up_proj", "down_proj")} | {
    "shared_expert_gate": "mlp"}

FAMILY = Family(
    name="qwen3_5_moe", module="qwen3_5_moe", classes={"qwen3_5_moe_text": "Qwen3_5Moe", "qwen3_5_moe": "Qwen3_5Moe"},
    model_fields=model_fields, rules=rules, lora_modules=LORA_MODULES, lora_defaults=(), prefix="model.",
    lora_paths=LORA_PATHS, more_classes={"Qwen3_5MoeForConditionalGeneration": "causal_lm"},
    renames=(("model.language_model.", "model."),),
    skipped={"model.visual.": "vision tower", "mtp.": "multi-token-prediction layers"},
)
