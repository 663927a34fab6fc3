"""Qwen3.5 (dense; Qwen3.6 shares it): a hybrid of Gated DeltaNet layers (``linear_attention``, the mixer kind of
``jodpo.models.deltanet``) and gated softmax attention (``full_attention``), three to one by default, as the config's
``layer_types`` says. Exactly transformers' ``models/qwen3_5`` (built on ``qwen3_next``):
- zero-centred RMSNorms, ``x * (1 + w)`` in float32 (the layers', the final one, the attention's q/k norms);
- attention: ``q_proj`` yields each head's query and a gate (``[query | gate]`` per head); q/k norms; partial RoPE
  over the first ``partial_rotary_factor`` of each head (text positions: Qwen-VL's multimodal RoPE reduces to the
  plain one); the output times sigmoid(gate) before ``o_proj``;
- DeltaNet: the fused ``in_proj_qkv`` and the depthwise ``conv1d`` over [q | k | v] split into q, k, v (so their heads
  can be sharded), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``dt_bias``, ``A_log``, the gated norm, ``out_proj``;
- a SwiGLU MLP in every layer.
``Qwen3_5ForCausalLM`` and ``Qwen3_5TextForSequenceClassification`` load as they are; the language model of a
``Qwen3_5ForConditionalGeneration`` (the released checkpoints) or ``Qwen3_5ForSequenceClassification`` loads as a text
model, its vision tower and multi-token-prediction layer (``mtp.*``) left out in one line; exports are text classes.
PEFT has no default target modules for Qwen3.5: LoRA needs ``lora_target_modules`` (or ``all-linear``), as PEFT does.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jodpo.errors import UnsupportedModelError
from jodpo.models.families import llama
from jodpo.models.hf_mapping import Family, Rule, in_heads, linear, out_heads, same
from jodpo.models.model import AttentionOptions, DeltaNet, Model

LAYER_TYPES = {"linear_attention": "deltanet", "full_attention": "attention"}


def model_fields(cfg) -> dict:
    unknown = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"layer_types {unknown} are not supported (supported: {sorted(LAYER_TYPES)})")
    deltanet = DeltaNet(num_k_heads=cfg.linear_num_key_heads, num_v_heads=cfg.linear_num_value_heads,
                        k_head_dim=cfg.linear_key_head_dim, v_head_dim=cfg.linear_value_head_dim,
                        conv_kernel=cfg.linear_conv_kernel_dim)
    fields = llama.model_fields(cfg)
    return fields | dict(attn_options=AttentionOptions(qk_norm="head", output_gate=True), deltanet=deltanet,
                         norms=dataclasses.replace(fields["norms"], offset=1.0),
                         layer_kinds=tuple(LAYER_TYPES[t] for t in cfg.layer_types))


def _gated_q(path, name, heads, head_dim, suffix="weight"):
    """``q_proj``: per head ``[query | gate]`` rows <-> jodpo's ``q`` and ``o_gate`` ([D, H, Dh] each; the biases
    [H, Dh])."""
    q, g = path + ("q" if suffix == "weight" else "q_bias",), path + ("o_gate" if suffix == "weight" else "o_gate_bias",)
    if suffix == "weight":
        def to_jodpo(w):
            w = w.T.reshape(w.shape[1], heads, 2, head_dim)
            return w[:, :, 0], w[:, :, 1]

        def to_hf(wq, wg):
            return (np.stack([wq, wg], 2).reshape(wq.shape[0], -1).T,)
    else:
        def to_jodpo(b):
            b = b.reshape(heads, 2, head_dim)
            return b[:, 0], b[:, 1]

        def to_hf(bq, bg):
            return (np.stack([bq, bg], 1).reshape(-1),)
    return Rule((f"{name}.{suffix}",), (q, g), to_jodpo, to_hf)


def _split(path, names, name, sizes, heads, transform):
    """One HF tensor over concatenated channels [q | k | v] <-> three jodpo leaves, each channel block reshaped to
    its heads; ``transform`` (jodpo leaf <- HF block [C, ...]) and its inverse as a pair."""
    to_leaf, to_block = transform

    def to_jodpo(w):
        blocks = np.split(w, np.cumsum(sizes)[:-1], 0)
        return tuple(to_leaf(b, h) for b, h in zip(blocks, heads))

    def to_hf(*leaves):
        return (np.concatenate([to_block(x) for x in leaves], 0),)

    return Rule((name,), tuple(path + (n,) for n in names), to_jodpo, to_hf)


def rules(model: Model) -> list[Rule]:
    out = []
    attn_layers, dn_layers = model.layers_of("attention"), model.layers_of("deltanet")
    L = "model.layers.{i}."
    H, K, Dh = model.num_heads, model.num_kv_heads, model.head_dim
    attn = ("layers", "attn")
    for rule in llama.rules(model):  # norms, MLP, embeddings, head as Llama's; its attention rules replaced below
        if rule.jodpo[0][:2] != attn:
            out.append(rule)
    mine = [_gated_q(attn, L + "self_attn.q_proj", H, Dh), in_heads(attn + ("k",), L + "self_attn.k_proj.weight", K, Dh),
            in_heads(attn + ("v",), L + "self_attn.v_proj.weight", K, Dh),
            out_heads(attn + ("o",), L + "self_attn.o_proj.weight", H, Dh),
            same(attn + ("q_norm", "scale"), L + "self_attn.q_norm.weight"),
            same(attn + ("k_norm", "scale"), L + "self_attn.k_norm.weight")]
    if model.qkv_bias:
        mine += [_gated_q(attn, L + "self_attn.q_proj", H, Dh, "bias"),
                 Rule((L + "self_attn.k_proj.bias",), (attn + ("k_bias",),), lambda b: (b.reshape(K, Dh),),
                      lambda b: (b.reshape(-1),)),
                 Rule((L + "self_attn.v_proj.bias",), (attn + ("v_bias",),), lambda b: (b.reshape(K, Dh),),
                      lambda b: (b.reshape(-1),))]
    if model.out_bias:
        mine.append(same(attn + ("o_bias",), L + "self_attn.o_proj.bias"))
    out += [r.of_layers(attn_layers) for r in mine]

    d, dn, A = model.deltanet, ("layers", "deltanet"), L + "linear_attn."
    if d is not None:
        kdim, vdim = d.num_k_heads * d.k_head_dim, d.num_v_heads * d.v_head_dim
        heads = ((d.num_k_heads, d.k_head_dim),) * 2 + ((d.num_v_heads, d.v_head_dim),)
        weight = (lambda b, h: b.T.reshape(-1, *h), lambda x: x.reshape(x.shape[0], -1).T)  # [C, D] <-> [D, H, Dh]
        conv = (lambda b, h: b[:, 0].T.reshape(-1, *h), lambda x: x.reshape(x.shape[0], -1).T[:, None])  # [C,1,W]
        mine = [_split(dn, ("in_q", "in_k", "in_v"), A + "in_proj_qkv.weight", (kdim, kdim, vdim), heads, weight),
                _split(dn, ("conv_q", "conv_k", "conv_v"), A + "conv1d.weight", (kdim, kdim, vdim), heads, conv),
                in_heads(dn + ("in_z",), A + "in_proj_z.weight", d.num_v_heads, d.v_head_dim),
                linear(dn + ("in_b",), A + "in_proj_b.weight"), linear(dn + ("in_a",), A + "in_proj_a.weight"),
                same(dn + ("dt_bias",), A + "dt_bias"), same(dn + ("a_log",), A + "A_log"),
                same(dn + ("gnorm",), A + "norm.weight"),
                out_heads(dn + ("out",), A + "out_proj.weight", d.num_v_heads, d.v_head_dim)]
        out += [r.of_layers(dn_layers) for r in mine]
    return out


LORA_MODULES = {"q_proj": ("q", "o_gate"), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
                "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",),
                "in_proj_qkv": ("in_q", "in_k", "in_v"), "in_proj_z": ("in_z",), "in_proj_b": ("in_b",),
                "in_proj_a": ("in_a",), "out_proj": ("out",)}
LORA_PATHS = llama.LORA_PATHS | {m: "linear_attn" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                            "out_proj")}

FAMILY = Family(
    name="qwen3_5", module="qwen3_5", classes={"qwen3_5_text": "Qwen3_5", "qwen3_5": "Qwen3_5"},
    model_fields=model_fields, rules=rules, lora_modules=LORA_MODULES, lora_defaults=(), prefix="model.",
    lora_paths=LORA_PATHS,
    more_classes={"Qwen3_5ForConditionalGeneration": "causal_lm", "Qwen3_5TextForSequenceClassification": "reward"},
    export_classes={("qwen3_5_text", "reward"): "Qwen3_5TextForSequenceClassification"},
    renames=(("model.language_model.", "model."),),
    skipped={"model.visual.": "vision tower", "mtp.": "multi-token-prediction layer"},
)
