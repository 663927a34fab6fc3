"""Llama 2/3 (and Mistral, SmolLM, TinyLlama, which load as Llama): RMSNorm, SwiGLU, grouped-query attention with
separate q/k/v projections, optional attention and MLP biases, RoPE with linear or llama3 scaling, a sliding
window where the config sets one. Its rules are the base of the families that share this layout (Qwen2, Qwen3,
Gemma 2 and 3): q/k norms and Gemma's four norms a layer are there too, read from the ``Model``."""
from __future__ import annotations

from jodpo.models.hf_mapping import Family, Rule, head_bias, in_heads, linear, norm_rules, out_heads, same
from jodpo.models.model import MLP, Model, Norms


def model_fields(cfg) -> dict:
    bias = bool(getattr(cfg, "attention_bias", False))
    fields = dict(num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
                  norms=Norms("rmsnorm", cfg.rms_norm_eps), qkv_bias=bias, out_bias=bias, parallel_residual=False)
    if getattr(cfg, "intermediate_size", None):  # (Qwen3.5-MoE's config, the experts' alone, has none)
        fields["mlp"] = MLP(cfg.intermediate_size, cfg.hidden_act, bias=bool(getattr(cfg, "mlp_bias", False)))
    return fields


def rules(model: Model) -> list[Rule]:
    H, K, Dh = model.num_heads, model.num_kv_heads, model.head_dim
    L = "model.layers.{i}."
    attn, mlp = ("layers", "attn"), ("layers", "mlp")
    out = [in_heads(attn + ("q",), L + "self_attn.q_proj.weight", H, Dh),
           in_heads(attn + ("k",), L + "self_attn.k_proj.weight", K, Dh),
           in_heads(attn + ("v",), L + "self_attn.v_proj.weight", K, Dh),
           out_heads(attn + ("o",), L + "self_attn.o_proj.weight", H, Dh)]
    if model.qkv_bias:
        out += [head_bias(attn + ("q_bias",), L + "self_attn.q_proj.bias", H, Dh),
                head_bias(attn + ("k_bias",), L + "self_attn.k_proj.bias", K, Dh),
                head_bias(attn + ("v_bias",), L + "self_attn.v_proj.bias", K, Dh)]
    if model.out_bias:
        out.append(same(attn + ("o_bias",), L + "self_attn.o_proj.bias"))
    if model.attn_options.qk_norm == "whole":  # a weight per channel (OLMo 2): HF [H * Dh] <-> jodpo [H, Dh]
        out += [head_bias(attn + ("q_norm", "scale"), L + "self_attn.q_norm.weight", H, Dh),
                head_bias(attn + ("k_norm", "scale"), L + "self_attn.k_norm.weight", K, Dh)]
    elif model.attn_options.qk_norm == "head":
        out += [same(attn + ("q_norm", "scale"), L + "self_attn.q_norm.weight"),
                same(attn + ("k_norm", "scale"), L + "self_attn.k_norm.weight")]
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")) if model.mlp else ():
        out.append(linear(mlp + (ours,), L + f"mlp.{theirs}.weight"))
        if model.mlp.bias:
            out.append(same(mlp + (ours + "_bias",), L + f"mlp.{theirs}.bias"))
    if model.norms.pre:
        out += norm_rules(model, ("layers", "ln1"), L + "input_layernorm")
    if model.norms.post:  # Gemma, OLMo 2: post_attention_layernorm norms the attention's output; the MLP's input
        out += norm_rules(model, ("layers", "post_attn"), L + "post_attention_layernorm")  # has its own (Gemma's)
        if model.norms.pre:
            out += norm_rules(model, ("layers", "ln2"), L + "pre_feedforward_layernorm")
        out += norm_rules(model, ("layers", "post_mlp"), L + "post_feedforward_layernorm")
    else:
        out += norm_rules(model, ("layers", "ln2"), L + "post_attention_layernorm")
    out += norm_rules(model, ("final_norm",), "model.norm", per_layer=False)
    out.append(same(("embed",), "model.embed_tokens.weight", per_layer=False))
    if model.task == "causal_lm" and not model.tie_embeddings:
        out.append(same(("lm_head",), "lm_head.weight", per_layer=False))
    return out


LORA_MODULES = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("gate",),
                "up_proj": ("up",), "down_proj": ("down",)}
LORA_PATHS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

FAMILY = Family(
    name="llama", module="llama", classes={"llama": "Llama", "mistral": "Mistral"}, model_fields=model_fields,
    rules=rules, lora_modules=LORA_MODULES, lora_defaults=("q_proj", "v_proj"), prefix="model.",
    lora_paths=LORA_PATHS,
)
