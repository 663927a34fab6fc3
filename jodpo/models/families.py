"""Per-family knowledge: a transformers config -> ``Model``, and HF tensor names <-> jodpo parameters.

Each family is a list of ``Rule``s. A rule ties one or more HF tensors to one or more jodpo leaves and
carries both directions (``to_jodpo`` for loading, ``to_hf`` for export), so the mapping is written once.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

import numpy as np

from jodpo.models.core import ACTIVATIONS, Model

# architecture name in config.json -> (family, task)
ARCHITECTURES = {
    "GPTNeoXForCausalLM": ("gpt_neox", "causal_lm"),
    "GPTNeoXForSequenceClassification": ("gpt_neox", "reward"),
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "MistralForCausalLM": ("llama", "causal_lm"),
    "MistralForSequenceClassification": ("llama", "reward"),
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "Qwen2ForSequenceClassification": ("qwen2", "reward"),
}
MODEL_TYPES = {"gpt_neox": "gpt_neox", "llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
SUPPORTED = "GPT-NeoX/Pythia (gpt_neox), Llama 2/3, Mistral, SmolLM, TinyLlama (llama, mistral), Qwen2 (qwen2)"


class UnsupportedModelError(ValueError):
    pass


def hf_architecture(model: Model) -> str:
    """The transformers class name that a jodpo model exports as."""
    model_type = json.loads(model.hf_config).get("model_type", model.family)
    prefix = {"gpt_neox": "GPTNeoX", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[model_type]
    return prefix + ("ForCausalLM" if model.task == "causal_lm" else "ForSequenceClassification")


def rope_inv_freq(rope: dict, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, int]:
    """Inverse frequencies (float32, computed as transformers computes them) and the rotary width."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = float(rope["rope_theta"])
    inv_freq = (1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
    if rope_type == "default":
        return inv_freq, dim
    if rope_type == "linear":
        return (inv_freq / np.float32(rope["factor"])).astype(np.float32), dim
    if rope_type == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope.get("original_max_position_embeddings", max_position_embeddings)
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), dim
    raise UnsupportedModelError(
        f"RoPE scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


def model_from_hf_config(cfg, task: str, dtype: str = "float32", eos_token_ids=()) -> Model:
    """Build the static ``Model`` from a ``transformers.PretrainedConfig`` of a supported family."""
    family = MODEL_TYPES.get(cfg.model_type)
    if family is None:
        raise UnsupportedModelError(f"model_type {cfg.model_type!r} is not supported; jodpo supports {SUPPORTED}")
    if cfg.hidden_act not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported (supported: {ACTIVATIONS})")
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    inv_freq, rotary_dim = rope_inv_freq(dict(cfg.rope_parameters), head_dim, cfg.max_position_embeddings)
    windows: tuple[int, ...] = ()
    if getattr(cfg, "sliding_window", None):
        layer_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
        windows = tuple(int(cfg.sliding_window) if t == "sliding_attention" else 0 for t in layer_types)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, (list, tuple)) else [cfg.eos_token_id]
    eos_ids = tuple(dict.fromkeys(int(e) for e in [*eos, *eos_token_ids] if e is not None))
    common = dict(
        task=task, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        num_heads=num_heads, head_dim=head_dim, mlp_dim=cfg.intermediate_size, activation=cfg.hidden_act,
        rotary_dim=rotary_dim, inv_freq=tuple(float(f) for f in inv_freq),
        tie_embeddings=bool(cfg.tie_word_embeddings) and task == "causal_lm", sliding_windows=windows,
        pad_token_id=cfg.pad_token_id, eos_token_ids=eos_ids, dtype=dtype, hf_config=cfg.to_json_string(),
    )
    if family == "gpt_neox":
        return Model(family=family, num_kv_heads=num_heads, norm="layernorm", norm_eps=cfg.layer_norm_eps,
                     gated_mlp=False, mlp_bias=True, qkv_bias=cfg.attention_bias, out_bias=cfg.attention_bias,
                     parallel_residual=cfg.use_parallel_residual, **common)
    qkv_bias = True if family == "qwen2" else bool(getattr(cfg, "attention_bias", False))
    out_bias = False if family == "qwen2" else bool(getattr(cfg, "attention_bias", False))
    return Model(family=family, num_kv_heads=cfg.num_key_value_heads or num_heads, norm="rmsnorm",
                 norm_eps=cfg.rms_norm_eps, gated_mlp=True, mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
                 qkv_bias=qkv_bias, out_bias=out_bias, parallel_residual=False, **common)


# --------------------------------------------------------------------------------------------------
# Tensor-name rules
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # HF tensor names; "{i}" is the layer index
    jodpo: tuple[tuple[str, ...], ...]  # jodpo leaf paths (per-layer leaves are stacked on axis 0)
    to_jodpo: Callable[..., tuple[np.ndarray, ...]]  # hf arrays -> jodpo arrays (one layer)
    to_hf: Callable[..., tuple[np.ndarray, ...]]  # jodpo arrays -> hf arrays (one layer)
    per_layer: bool = True


def _linear(path, name):
    """HF ``nn.Linear`` weight [out, in] <-> jodpo [in, *out_shape] (reshape done by the caller's shape)."""
    return Rule((name,), (path,), lambda w: (w.T,), lambda w: (w.reshape(w.shape[0], -1).T,))


def _in_heads(path, name, heads, head_dim):
    """A projection into heads: HF [heads*head_dim, D] <-> jodpo [D, heads, head_dim]."""
    return Rule((name,), (path,), lambda w: (w.T.reshape(-1, heads, head_dim),),
                lambda w: (w.reshape(w.shape[0], -1).T,))


def _out_heads(path, name, heads, head_dim):
    """The output projection: HF [D, heads*head_dim] <-> jodpo [heads, head_dim, D]."""
    return Rule((name,), (path,), lambda w: (w.T.reshape(heads, head_dim, -1),),
                lambda w: (w.reshape(heads * head_dim, -1).T,))


def _head_bias(path, name, heads, head_dim):
    return Rule((name,), (path,), lambda b: (b.reshape(heads, head_dim),), lambda b: (b.reshape(-1),))


def _same(path, name, per_layer=True):
    return Rule((name,), (path,), lambda x: (x,), lambda x: (x,), per_layer)


def _norm_rules(model: Model, path, name, per_layer=True) -> list[Rule]:
    rules = [_same(path + ("scale",), name + ".weight", per_layer)]
    if model.norm == "layernorm":
        rules.append(_same(path + ("bias",), name + ".bias", per_layer))
    return rules


def _neox_rules(model: Model) -> list[Rule]:
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
    rules = [Rule((L + "attention.query_key_value.weight",), (attn + ("q",), attn + ("k",), attn + ("v",)),
                  split_w, fuse_w),
             _out_heads(attn + ("o",), L + "attention.dense.weight", H, Dh)]
    if model.qkv_bias:
        rules.append(Rule((L + "attention.query_key_value.bias",),
                          (attn + ("q_bias",), attn + ("k_bias",), attn + ("v_bias",)), split_b, fuse_b))
    if model.out_bias:
        rules.append(_same(attn + ("o_bias",), L + "attention.dense.bias"))
    mlp = ("layers", "mlp")
    rules += [_linear(mlp + ("up",), L + "mlp.dense_h_to_4h.weight"), _same(mlp + ("up_bias",), L + "mlp.dense_h_to_4h.bias"),
              _linear(mlp + ("down",), L + "mlp.dense_4h_to_h.weight"), _same(mlp + ("down_bias",), L + "mlp.dense_4h_to_h.bias")]
    rules += _norm_rules(model, ("layers", "ln1"), L + "input_layernorm")
    rules += _norm_rules(model, ("layers", "ln2"), L + "post_attention_layernorm")
    rules += _norm_rules(model, ("final_norm",), "gpt_neox.final_layer_norm", per_layer=False)
    rules.append(_same(("embed",), "gpt_neox.embed_in.weight", per_layer=False))
    if model.task == "causal_lm":
        rules.append(_same(("lm_head",), "embed_out.weight", per_layer=False))
    return rules


def _llama_rules(model: Model) -> list[Rule]:
    H, K, Dh = model.num_heads, model.num_kv_heads, model.head_dim
    L = "model.layers.{i}."
    attn, mlp = ("layers", "attn"), ("layers", "mlp")
    rules = [_in_heads(attn + ("q",), L + "self_attn.q_proj.weight", H, Dh),
             _in_heads(attn + ("k",), L + "self_attn.k_proj.weight", K, Dh),
             _in_heads(attn + ("v",), L + "self_attn.v_proj.weight", K, Dh),
             _out_heads(attn + ("o",), L + "self_attn.o_proj.weight", H, Dh)]
    if model.qkv_bias:
        rules += [_head_bias(attn + ("q_bias",), L + "self_attn.q_proj.bias", H, Dh),
                  _head_bias(attn + ("k_bias",), L + "self_attn.k_proj.bias", K, Dh),
                  _head_bias(attn + ("v_bias",), L + "self_attn.v_proj.bias", K, Dh)]
    if model.out_bias:
        rules.append(_same(attn + ("o_bias",), L + "self_attn.o_proj.bias"))
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        rules.append(_linear(mlp + (ours,), L + f"mlp.{theirs}.weight"))
        if model.mlp_bias:
            rules.append(_same(mlp + (ours + "_bias",), L + f"mlp.{theirs}.bias"))
    rules += _norm_rules(model, ("layers", "ln1"), L + "input_layernorm")
    rules += _norm_rules(model, ("layers", "ln2"), L + "post_attention_layernorm")
    rules += _norm_rules(model, ("final_norm",), "model.norm", per_layer=False)
    rules.append(_same(("embed",), "model.embed_tokens.weight", per_layer=False))
    if model.task == "causal_lm" and not model.tie_embeddings:
        rules.append(_same(("lm_head",), "lm_head.weight", per_layer=False))
    return rules


def weight_rules(model: Model) -> list[Rule]:
    """Every HF tensor of ``model``'s checkpoint and the jodpo leaves it becomes."""
    rules = _neox_rules(model) if model.family == "gpt_neox" else _llama_rules(model)
    if model.task == "reward":
        rules.append(Rule(("score.weight",), (("score",),), lambda w: (w.T,), lambda w: (w.T,), False))
    return rules


# HF tensors that carry no parameters (buffers some checkpoints include).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")
