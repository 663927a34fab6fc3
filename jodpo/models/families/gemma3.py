"""Gemma 3 (text): Gemma 2's arithmetic (``gemma2``) with a (1 + w) RMSNorm over each head's queries and keys instead
of soft-capping, and RoPE of its own on the local (sliding-window) layers: base ``rope_local_base_freq`` (10k), the
global layers' 1M with their RoPE scaling (linear x8 from 4B up). ``Gemma3ForCausalLM`` (270M, 1B) loads as it is;
the language model of a ``Gemma3ForConditionalGeneration`` checkpoint (4B-27B) loads as a text model (its vision
tower left out, one line says so) and exports as ``Gemma3ForCausalLM``."""
from __future__ import annotations

from jodpo.models.families import gemma2, llama
from jodpo.models.hf_mapping import Family, rope_of
from jodpo.models.model import AttentionOptions


def model_fields(cfg) -> dict:
    rope = cfg.rope_parameters
    return gemma2.model_fields(cfg) | dict(
        attn_options=AttentionOptions(qk_norm="head"),
        rope=rope_of(dict(rope["full_attention"]), cfg.head_dim, cfg.max_position_embeddings,
                     local=dict(rope["sliding_attention"])))


FAMILY = Family(
    name="gemma3", module="gemma3", classes={"gemma3_text": "Gemma3", "gemma3": "Gemma3"}, model_fields=model_fields,
    rules=llama.rules, lora_modules=llama.LORA_MODULES, lora_defaults=("q_proj", "v_proj"), prefix="model.",
    lora_paths=llama.LORA_PATHS,
    more_classes={"Gemma3ForConditionalGeneration": "causal_lm", "Gemma3TextForSequenceClassification": "reward"},
    export_classes={("gemma3_text", "reward"): "Gemma3TextForSequenceClassification"},
    # transformers 5 saves the language model under model.language_model., the checkpoints of the hub (4.x) under
    # language_model.model. (and its head as language_model.lm_head.)
    renames=(("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head.")),
    skipped={prefix: "vision tower" for prefix in ("model.vision_tower.", "model.multi_modal_projector.",
                                                    "vision_tower.", "multi_modal_projector.")},
)
