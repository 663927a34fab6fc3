"""Gemma 4 (text; dense: E2B, E4B, 31B; mixture of experts: 26B-A4B): exactly transformers' ``models/gemma4``, as
``Gemma4ForCausalLM`` and the language model of ``Gemma4ForConditionalGeneration`` (its vision and audio towers left
out, one line says so).
- RMSNorms as ``x * w`` (not Gemma 3's ``1 + w``), scaled in float32; four a layer; q and k norms per head and a
  scale-free value norm; attention scores unscaled (scale 1); GeGLU; embeddings times sqrt(hidden); logits soft-capped;
- sliding layers (the mixer kind ``sliding_attention``: the ``Model``'s shape, ``head_dim`` and RoPE, a cache of the
  window's slots) and global layers (``full_attention``: the mixer kind ``global_attention``, with ``global_head_dim``,
  ``num_global_key_value_heads`` and, with ``attention_k_eq_v``, values that are the keys before their norm and RoPE;
  "proportional" partial RoPE);
  the last layer global whatever ``layer_types`` says (transformers forces it);
- per-layer embeddings (E2B, E4B: ``hidden_size_per_layer_input``): a packed ``[vocab, layers x Dp]`` table and a
  projection of the embeddings, combined into each layer's input, and after each MLP a gated projection of it, normed,
  added (``Model.per_layer_embeddings``);
- KV sharing: the last ``num_kv_shared_layers`` layers (kinds ``shared_sliding_attention``, ``shared_global_attention``)
  reuse the keys and values of the last earlier layer of their type, and with ``use_double_wide_mlp`` have MLPs twice
  as wide;
- each layer's output times its learned ``layer_scalar``;
- the MoE checkpoints (26B-A4B: ``enable_moe_block``): in every layer experts beside the dense MLP
  (``jodpo.models.moe.beside_mlp``), routed from the residual stream by Gemma 4's router (a scale-free RMSNorm, a
  learned scale and hidden_size^-1/2; top ``top_k_experts`` of ``num_experts``, renormalised, times a learned scale of
  each expert), the fused ``experts.gate_up_proj`` read and written as transformers holds it; transformers computes
  no load-balancing loss for them (``router_aux_loss_coef`` is refused).
transformers has no ``Gemma4ForSequenceClassification``: a reward head is read and written as its generic sequence
classifiers are (``score.weight`` over the text model), which transformers' own classes of other families are. PEFT's
default LoRA targets (a regex over the language model's ``q_proj`` and ``v_proj``) are ``q_proj, v_proj``."""
from __future__ import annotations

import dataclasses

import numpy as np

from jodpo.errors import UnsupportedModelError
from jodpo.models.families import llama
from jodpo.models.hf_mapping import (Family, Rule, head_bias, in_heads, linear, norm_rules, out_heads, rope_of,
                                     same)
from jodpo.models.layout import KEYS
from jodpo.models.model import MLP, READS, Attention, AttentionOptions, Model, MoE, Norms, PerLayerEmbeddings

LAYER_KINDS = {"sliding_attention": "sliding_attention", "full_attention": "global_attention"}
SHARED = {"sliding_attention": "shared_sliding_attention", "global_attention": "shared_global_attention"}


def _moe(cfg) -> MoE:
    """The experts of a Gemma 4 MoE checkpoint (26B-A4B: ``enable_moe_block``), beside its dense MLP in every layer:
    ``num_experts`` of width ``moe_intermediate_size``, ``top_k_experts`` a token, always renormalised, Gemma 4's
    router (``MoE.router_norm``)."""
    k, E = cfg.top_k_experts, cfg.num_experts
    if not (E and cfg.moe_intermediate_size):
        raise UnsupportedModelError(f"enable_moe_block=True needs num_experts and moe_intermediate_size, got "
                                    f"num_experts={E}, moe_intermediate_size={cfg.moe_intermediate_size}")
    if not (k and 0 < k <= E):
        raise UnsupportedModelError(f"top_k_experts={k} must be between 1 and num_experts={E}")
    return MoE(num_experts=E, top_k=k, expert_dim=cfg.moe_intermediate_size, norm_topk_prob=True,
               activation=cfg.hidden_activation, router_norm=True, aux_loss=False)


def model_fields(cfg) -> dict:
    if getattr(cfg, "use_bidirectional_attention", None) == "all":
        raise UnsupportedModelError("gemma4 with use_bidirectional_attention='all' (an embedding model) is not a "
                                    "causal LM; jodpo trains causal Gemma models")
    types = list(cfg.layer_types)
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown:
        raise UnsupportedModelError(f"layer_types {unknown} are not supported (supported: {sorted(LAYER_KINDS)})")
    first_shared = cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)
    kinds = tuple(LAYER_KINDS[t] if i < first_shared else SHARED[LAYER_KINDS[t]] for i, t in enumerate(types))
    per_type = {t: cfg.per_layer_config[t] for t in set(types)}  # transformers' per-layer-type shapes
    sliding = per_type.get("sliding_attention", cfg)
    head_dim = sliding.head_dim
    options = AttentionOptions(qk_norm="head", v_norm=True)
    # transformers' heterogeneous config refuses cfg.head_dim and cfg.num_key_value_heads (they differ by layer type)
    fields = dict(
        norms=Norms("rmsnorm", cfg.rms_norm_eps, scale_f32=True, sites="sandwich"), parallel_residual=False,
        num_kv_heads=sliding.num_key_value_heads, head_dim=head_dim, attn_options=options, query_scale=1.0,
        embed_scale=float(cfg.hidden_size ** 0.5),
        final_softcap=float(cfg.final_logit_softcapping or 0.0), layer_kinds=kinds, layer_scalar=True,
        rope=rope_of(dict(cfg.rope_parameters.get("sliding_attention") or {"rope_theta": 1e4}), head_dim,
                     cfg.max_position_embeddings),
        # the KV-sharing layers' MLPs twice as wide where use_double_wide_mlp
        mlp=MLP(cfg.intermediate_size, cfg.hidden_activation, wide_kinds=tuple(
            k for k in dict.fromkeys(kinds) if k in READS and cfg.use_double_wide_mlp)),
        qkv_bias=bool(cfg.attention_bias), out_bias=bool(cfg.attention_bias))
    if "full_attention" in per_type:
        full = per_type["full_attention"]
        fields["global_attention"] = Attention(
            num_heads=cfg.num_attention_heads, num_kv_heads=full.num_key_value_heads, head_dim=full.head_dim,
            rope=rope_of(dict(cfg.rope_parameters["full_attention"]), full.head_dim, cfg.max_position_embeddings),
            options=dataclasses.replace(options, k_eq_v=bool(cfg.attention_k_eq_v)))
    if cfg.hidden_size_per_layer_input:
        fields["per_layer_embeddings"] = PerLayerEmbeddings(dim=cfg.hidden_size_per_layer_input,
                                                            vocab_size=cfg.vocab_size_per_layer_input,
                                                            activation=cfg.hidden_activation)
    if getattr(cfg, "enable_moe_block", False):
        fields["moe"] = _moe(cfg)
    return fields


def _attention_rules(model: Model, kind: str) -> list[Rule]:
    """A mixer kind's q/k/v/o projections and norms, over that kind's layers (a KV-sharing kind's: q and o only)."""
    a = model.attention_of(kind)
    H, K, Dh, L, attn = a.num_heads, a.num_kv_heads, a.head_dim, "model.layers.{i}.self_attn.", ("layers", KEYS[kind])
    own = kind not in READS
    out = [in_heads(attn + ("q",), L + "q_proj.weight", H, Dh), out_heads(attn + ("o",), L + "o_proj.weight", H, Dh),
           same(attn + ("q_norm", "scale"), L + "q_norm.weight")]
    if model.qkv_bias:
        out.append(head_bias(attn + ("q_bias",), L + "q_proj.bias", H, Dh))
    if model.out_bias:
        out.append(same(attn + ("o_bias",), L + "o_proj.bias"))
    for name in (("k",) + (() if a.options.k_eq_v else ("v",))) if own else ():
        out.append(in_heads(attn + (name,), L + f"{name}_proj.weight", K, Dh))
        if model.qkv_bias:
            out.append(head_bias(attn + (f"{name}_bias",), L + f"{name}_proj.bias", K, Dh))
    if own:
        out.append(same(attn + ("k_norm", "scale"), L + "k_norm.weight"))
    return [r.of_layers(model.layers_of(kind)) for r in out]


def rules(model: Model) -> list[Rule]:
    L, layers = "model.layers.{i}.", ("layers",)
    out = [same(("embed",), "model.embed_tokens.weight", per_layer=False)]
    out += norm_rules(model, ("final_norm",), "model.norm", per_layer=False)
    if model.task == "causal_lm" and not model.tie_embeddings:
        out.append(same(("lm_head",), "lm_head.weight", per_layer=False))
    for ours, theirs in (("ln1", "input_layernorm"), ("post_attn", "post_attention_layernorm"),
                         ("ln2", "pre_feedforward_layernorm"), ("post_mlp", "post_feedforward_layernorm")):
        out += norm_rules(model, layers + (ours,), L + theirs)
    out.append(same(layers + ("scalar",), L + "layer_scalar"))
    wide = model.layers_of(*model.wide_kinds)
    narrow = tuple(i for i in range(model.num_layers) if i not in wide)
    for key, which in (("mlp", narrow), ("mlp_wide", wide)):
        out += [linear(layers + (key, ours), L + f"mlp.{theirs}.weight").of_layers(which) for ours, theirs in
                (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")) if which]
    for kind in dict.fromkeys(model.kinds):
        out += _attention_rules(model, kind)
    if model.moe is not None:
        out += _expert_rules(model)
    pe = model.per_layer_embeddings
    if pe is not None:
        N, D, Dp = model.num_layers, model.hidden_size, pe.dim
        out += [Rule(("model.embed_tokens_per_layer.weight",), (("embed_per_layer",),), lambda w: (w.T,),
                     lambda w: (w.T,), False),
                Rule(("model.per_layer_model_projection.weight",), (("per_layer_proj",),),
                     lambda w: (w.T.reshape(D, N, Dp),), lambda w: (w.reshape(D, -1).T,), False),
                same(("per_layer_norm", "scale"), "model.per_layer_projection_norm.weight", per_layer=False),
                linear(layers + ("ple", "ple_gate"), L + "per_layer_input_gate.weight"),
                linear(layers + ("ple", "ple_proj"), L + "per_layer_projection.weight"),
                same(layers + ("ple_norm", "scale"), L + "post_per_layer_input_norm.weight")]
    return out


def _expert_rules(model: Model) -> list[Rule]:
    """The experts beside the dense MLP (26B-A4B), in the layout transformers holds and saves them: ``router.proj``
    [E, D], ``router.scale`` [D], ``router.per_expert_scale`` [E], the fused ``experts.gate_up_proj`` [E, 2F, D] and
    ``experts.down_proj`` [E, D, F], and the branches' norms."""
    L, moe = "model.layers.{i}.", ("layers", "moe")
    out = [linear(moe + ("router",), L + "router.proj.weight"), same(moe + ("router_scale",), L + "router.scale"),
           same(moe + ("expert_scale",), L + "router.per_expert_scale"),
           Rule((L + "experts.gate_up_proj",), (moe + ("gate",), moe + ("up",)),
                lambda w: tuple(np.split(w.transpose(0, 2, 1), 2, -1)),
                lambda g, u: (np.concatenate([g, u], -1).transpose(0, 2, 1),)),
           Rule((L + "experts.down_proj",), (moe + ("down",),), lambda w: (w.transpose(0, 2, 1),),
                lambda w: (w.transpose(0, 2, 1),))]
    for ours, theirs in (("pre_norm", "pre_feedforward_layernorm_2"), ("post_norm", "post_feedforward_layernorm_2"),
                         ("mlp_post_norm", "post_feedforward_layernorm_1")):
        out += norm_rules(model, moe + (ours,), L + theirs)
    return out


LORA_MODULES = llama.LORA_MODULES | {"per_layer_input_gate": ("ple_gate",), "per_layer_projection": ("ple_proj",)}
LORA_PATHS = llama.LORA_PATHS | {"per_layer_input_gate": "", "per_layer_projection": ""}

FAMILY = Family(
    name="gemma4", module="gemma4", classes={"gemma4_text": "Gemma4", "gemma4": "Gemma4"}, model_fields=model_fields,
    rules=rules, lora_modules=LORA_MODULES, lora_defaults=("q_proj", "v_proj"), prefix="model.",
    lora_paths=LORA_PATHS, more_classes={"Gemma4ForConditionalGeneration": "causal_lm"},
    renames=(("model.language_model.", "model."),),
    skipped={prefix: what for what, prefixes in (("vision tower", ("model.vision_tower.", "model.embed_vision.")),
                                                 ("audio tower", ("model.audio_tower.", "model.embed_audio.")))
             for prefix in prefixes},
)
