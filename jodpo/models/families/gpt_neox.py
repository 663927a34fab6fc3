"""GPT-NeoX (Pythia): LayerNorm, a parallel residual (attention and MLP both read the layer's input), partial
rotary embeddings, q, k and v fused in one ``query_key_value`` module whose rows interleave them per head, and
biases everywhere."""
from __future__ import annotations

import numpy as np

from jodpo.models.hf_mapping import Family, Rule, linear, norm_rules, out_heads, same
from jodpo.models.model import MLP, Model, Norms


def model_fields(cfg) -> dict:
    return dict(num_kv_heads=cfg.num_attention_heads, norms=Norms("layernorm", cfg.layer_norm_eps),
                mlp=MLP(cfg.intermediate_size, cfg.hidden_act, gated=False, bias=True), qkv_bias=cfg.attention_bias,
                out_bias=cfg.attention_bias,
                parallel_residual=cfg.use_parallel_residual)


def rules(model: Model) -> list[Rule]:
    H, Dh = model.num_heads, model.head_dim
    L = "gpt_neox.layers.{i}."

    # Fused QKV: HF rows are [head, (q|k|v), head_dim] (view(..., heads, 3*head_dim) then chunk(3)).
    def split_w(w):
        w = w.reshape(H, 3, Dh, -1)
        return tuple(w[:, j].transpose(2, 0, 1) for j in range(3))  # [D, H, Dh] each

    def fuse_w(q, k, v):
        return (np.stack([q, k, v], 0).transpose(2, 0, 3, 1).reshape(3 * H * Dh, -1),)

    def split_b(b):
        b = b.reshape(H, 3, Dh)
        return tuple(b[:, j] for j in range(3))

    def fuse_b(q, k, v):
        return (np.stack([q, k, v], 1).reshape(-1),)

    attn = ("layers", "attn")
    out = [Rule((L + "attention.query_key_value.weight",), (attn + ("q",), attn + ("k",), attn + ("v",)),
                split_w, fuse_w),
           out_heads(attn + ("o",), L + "attention.dense.weight", H, Dh)]
    if model.qkv_bias:
        out.append(Rule((L + "attention.query_key_value.bias",),
                        (attn + ("q_bias",), attn + ("k_bias",), attn + ("v_bias",)), split_b, fuse_b))
    if model.out_bias:
        out.append(same(attn + ("o_bias",), L + "attention.dense.bias"))
    mlp = ("layers", "mlp")
    out += [linear(mlp + ("up",), L + "mlp.dense_h_to_4h.weight"), same(mlp + ("up_bias",), L + "mlp.dense_h_to_4h.bias"),
            linear(mlp + ("down",), L + "mlp.dense_4h_to_h.weight"),
            same(mlp + ("down_bias",), L + "mlp.dense_4h_to_h.bias")]
    out += norm_rules(model, ("layers", "ln1"), L + "input_layernorm")
    out += norm_rules(model, ("layers", "ln2"), L + "post_attention_layernorm")
    out += norm_rules(model, ("final_norm",), "gpt_neox.final_layer_norm", per_layer=False)
    out.append(same(("embed",), "gpt_neox.embed_in.weight", per_layer=False))
    if model.task == "causal_lm":
        out.append(same(("lm_head",), "embed_out.weight", per_layer=False))
    return out


FAMILY = Family(
    name="gpt_neox", module="gpt_neox", classes={"gpt_neox": "GPTNeoX"}, model_fields=model_fields, rules=rules,
    lora_modules={"query_key_value": ("q", "k", "v"), "dense": ("o",), "dense_h_to_4h": ("up",),
                  "dense_4h_to_h": ("down",)},
    lora_defaults=("query_key_value",), prefix="gpt_neox.",
    lora_paths={"query_key_value": "attention", "dense": "attention", "dense_h_to_4h": "mlp", "dense_4h_to_h": "mlp"},
)
