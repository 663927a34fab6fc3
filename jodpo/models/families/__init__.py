"""Every family jodpo implements, one module each (``gpt_neox``, ``llama``, ``qwen2``, ``qwen3``, ``qwen3_5``,
``gemma2``, ``gemma3``, ``gemma4`` (with its mixture of experts), ``olmo2``, ``smollm3``; the mixtures of experts
``qwen3_moe``, ``olmoe``, ``qwen3_5_moe``, ``qwen3_next``): a
transformers config -> ``Model``, and HF tensor names <-> jodpo parameters (``jodpo.models.hf_mapping``).

A new family is a new module here defining ``FAMILY`` (a ``Family``) and one line in ``FAMILIES``; where its
forward differs from the shared decoder, a field of ``Model`` says so (``jodpo.models.decoder``).
"""
from __future__ import annotations

import json

from jodpo.errors import UnsupportedModelError
from jodpo.models.families import (gemma2, gemma3, gemma4, gpt_neox, llama, olmo2, olmoe, qwen2, qwen3, qwen3_5,
                                   qwen3_5_moe, qwen3_moe, qwen3_next, smollm3)
from jodpo.models.hf_mapping import Family, Rule, rope_of
from jodpo.models.layers import ACTIVATIONS
from jodpo.models.model import MLP, SLIDING, Model

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt_neox.FAMILY, llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                                   qwen3_5.FAMILY, gemma2.FAMILY, gemma3.FAMILY, gemma4.FAMILY,
                                                   olmo2.FAMILY, smollm3.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY,
                                                   qwen3_5_moe.FAMILY, qwen3_next.FAMILY)}
# HF model_type -> the family that implements it
MODEL_TYPES = {model_type: f.name for f in FAMILIES.values() for model_type in f.classes}
# architecture name in config.json -> (family, task)
ARCHITECTURES = {prefix + suffix: (f.name, task) for f in FAMILIES.values() for prefix in f.classes.values()
                 for suffix, task in (("ForCausalLM", "causal_lm"), ("ForSequenceClassification", "reward"))}
ARCHITECTURES |= {name: (f.name, task) for f in FAMILIES.values() for name, task in f.more_classes.items()}
SUPPORTED = ("GPT-NeoX/Pythia (gpt_neox), Llama 2/3, Mistral, SmolLM, TinyLlama (llama, mistral), Qwen2 (qwen2), "
             "Qwen3 (qwen3), Qwen3-MoE (qwen3_moe), Qwen3.5/3.6 dense (qwen3_5_text, and qwen3_5's language model), "
             "Qwen3.5/3.6-MoE (qwen3_5_moe_text, and qwen3_5_moe's language model), Qwen3-Next (qwen3_next), Gemma 2 (gemma2), "
             "Gemma 3 (gemma3_text, and gemma3's language model), Gemma 4 and Gemma 4 MoE (gemma4_text, and gemma4's "
             "language model), OLMo 2 and 3 (olmo2, olmo3), OLMoE (olmoe), SmolLM3 (smollm3)")
# HF tensors that carry no parameters (buffers some checkpoints include).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def family_of(model: Model) -> Family:
    return FAMILIES[model.family]


def hf_architecture(model: Model) -> str:
    """The transformers class name that a jodpo model exports as."""
    family = family_of(model)
    model_type = json.loads(model.hf_config).get("model_type", model.family)
    if (model_type, model.task) in family.export_classes:
        return family.export_classes[(model_type, model.task)]
    prefix = family.classes.get(model_type) or next(iter(family.classes.values()))
    return prefix + ("ForCausalLM" if model.task == "causal_lm" else "ForSequenceClassification")


def model_from_hf_config(cfg, task: str, dtype: str = "float32", eos_token_ids=()) -> Model:
    """Build the static ``Model`` from a ``transformers.PretrainedConfig`` of a supported family (a multimodal
    config: its text model's)."""
    family = MODEL_TYPES.get(cfg.model_type)
    if family is None:
        raise UnsupportedModelError(f"model_type {cfg.model_type!r} is not supported; jodpo supports {SUPPORTED}")
    # A *ForConditionalGeneration ties its LM head by its own (top-level) config's tie_word_embeddings, as
    # transformers resolves it (its class default where config.json has none); text_config's flag is the text
    # class's, which such a checkpoint never uses
    tie = bool(cfg.tie_word_embeddings)
    cfg = cfg.get_text_config()  # the config itself, but for a multimodal model's (Gemma 3 4B-27B)
    fields = FAMILIES[family].model_fields(cfg)  # the family's own, which may set any of the shared ones below
    if "mlp" not in fields:  # a gated MLP of intermediate_size and hidden_act without biases, unless the family says
        fields["mlp"] = MLP(cfg.intermediate_size, cfg.hidden_act)
    for ff in (fields["mlp"], fields.get("moe")):
        if ff is not None and ff.activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {ff.activation!r} is not supported (supported: "
                                        f"{tuple(ACTIVATIONS)})")
    num_heads = cfg.num_attention_heads
    head_dim = fields.pop("head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    if "rope" not in fields:
        fields["rope"] = rope_of(dict(cfg.rope_parameters), head_dim, cfg.max_position_embeddings)
    window = int(getattr(cfg, "sliding_window", None) or 0)
    if window and "layer_kinds" not in fields:  # the layers that slide are their own mixer kind (a family of mixed
        # kinds, Gemma 4, names its sliding layers itself)
        layer_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
        fields["layer_kinds"] = tuple("sliding_attention" if t == "sliding_attention" else "attention"
                                      for t in layer_types)
    fields["sliding_window"] = window if set(fields.get("layer_kinds", ())) & set(SLIDING) else 0
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, (list, tuple)) else [cfg.eos_token_id]
    eos_ids = tuple(dict.fromkeys(int(e) for e in [*eos, *eos_token_ids] if e is not None))
    return Model(
        family=family, task=task, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=num_heads, head_dim=head_dim,
        tie_embeddings=tie and task == "causal_lm",
        pad_token_id=cfg.pad_token_id, eos_token_ids=eos_ids, dtype=dtype,
        hf_config=cfg.to_json_string(), **fields)


def weight_rules(model: Model) -> list[Rule]:
    """Every HF tensor of ``model``'s checkpoint and the jodpo leaves it becomes."""
    rules = family_of(model).rules(model)
    if model.task == "reward":
        rules.append(Rule(("score.weight",), (("score",),), lambda w: (w.T,), lambda w: (w.T,), False))
    return rules


__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "IGNORED_SUFFIXES", "MODEL_TYPES", "Rule", "SUPPORTED",
           "UnsupportedModelError", "family_of", "hf_architecture", "model_from_hf_config", "weight_rules"]
