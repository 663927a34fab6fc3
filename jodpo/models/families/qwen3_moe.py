"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; ``qwen3_moe``): Qwen3's attention (an RMSNorm over each head's queries
and keys) with a mixture-of-experts block in its sparse layers (``jodpo.models.moe``): ``num_experts`` SwiGLU experts
of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them a token, renormalised where ``norm_topk_prob``
(true in the released models). Dense layers among the sparse ones (``mlp_only_layers``, and the layers
``decoder_sparse_step`` skips: in no released model) are Qwen3's MLP of ``intermediate_size`` (``Model.ffn_kinds``).
``Qwen3MoeForSequenceClassification`` is the reward head.

LoRA adapts what PEFT 0.21 adapts on transformers 5: the attention's projections (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``: modules), and the routed experts and the router, which transformers 5 holds as parameters of no
``nn.Linear`` (PEFT's ``target_parameters``: ``experts.gate_up_proj`` [E, 2F, D], ``experts.down_proj`` [E, D, F], the
router's ``gate.weight`` [E, D]), each expert with its own adapter (PEFT's ``ParamWrapper``). PEFT turns the module
names ``gate_proj`` and ``up_proj`` (both or neither: they are one parameter), ``down_proj`` and ``gate``, and so
``all-linear``, into those parameters, ``gate_up_proj`` at twice the rank and alpha (its rows are both projections').
PEFT has no default target modules for Qwen3-MoE: LoRA needs ``lora_target_modules`` (or
``lora_target_parameters``), as PEFT does."""
from __future__ import annotations

from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family, Rule, moe_fields, with_experts, without_mlp
from jodpo.models.model import AttentionOptions, Model


def model_fields(cfg) -> dict:
    return llama.model_fields(cfg) | dict(attn_options=AttentionOptions(qk_norm="head")) | moe_fields(cfg)


def rules(model: Model) -> list[Rule]:
    """Llama's rules (with the q/k norms), the MoE block's on the sparse layers and the dense MLP's on the others."""
    return with_experts(llama.rules(model), model)


LORA_MODULES, LORA_PATHS = without_mlp(llama.LORA_MODULES, llama.LORA_PATHS)
# PEFT's target_parameters on transformers 5's MoE block (in Qwen3MoeExperts' declaration order: PEFT wraps a module's
# parameters in that order, the last one outermost) and its rewrite of the v4 module names into them (PEFT's
# _MOE_TARGET_MODULE_MAPPING["qwen2_moe"], which Qwen3-MoE and OLMoE use)
LORA_PARAMETERS = {"gate_up_proj": ("mlp.experts", ("gate", "up")), "down_proj": ("mlp.experts", ("down",)),
                   "gate.weight": ("mlp", ("router",))}
LORA_MODULE_PARAMETERS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
                          "gate": "gate.weight"}

FAMILY = Family(
    name="qwen3_moe", module="qwen3_moe", classes={"qwen3_moe": "Qwen3Moe"}, model_fields=model_fields, rules=rules,
    lora_modules=LORA_MODULES, lora_defaults=(), prefix="model.", lora_paths=LORA_PATHS,
    lora_parameters=LORA_PARAMETERS, lora_module_parameters=LORA_MODULE_PARAMETERS,
)
