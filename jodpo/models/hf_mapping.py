"""What a family module (``jodpo.models.families.<name>``) is built from.

``Family`` is everything jodpo knows of one family of transformers checkpoints: its class names, how its config
becomes a ``Model``, its tensor-name rules and its LoRA modules. A ``Rule`` ties one or more HF tensors to one or
more jodpo leaves and carries both directions (``to_jodpo`` for loading, ``to_hf`` for export), so the mapping is
written once. The helpers below are the rules that recur across families, and RoPE's inverse frequencies as
transformers computes them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from jodpo.errors import UnsupportedModelError
from jodpo.models.model import Model, Rope


@dataclasses.dataclass(frozen=True)
class Family:
    """One family of transformers checkpoints (``Model.family`` is its ``name``)."""

    name: str
    module: str  # its module in jodpo.models.families
    classes: dict[str, str]  # HF model_type -> the transformers class prefix ("mistral" -> "Mistral")
    # the family's own fields of ``Model`` from a transformers config (the shared ones are filled by the registry)
    model_fields: Callable[[Any], dict]
    rules: Callable[[Model], list["Rule"]]  # every HF tensor of a checkpoint and the jodpo leaves it becomes
    lora_modules: dict[str, tuple[str, ...]]  # HF module name -> the jodpo weights it holds (PEFT's target_modules)
    lora_defaults: tuple[str, ...]  # PEFT's default target_modules for this model type
    prefix: str  # where the decoder sits in a HF state dict ("model.", "gpt_neox.")
    lora_paths: dict[str, str]  # HF module name -> its submodule in a layer ("q_proj" -> "self_attn")
    # transformers classes besides the prefixes' ForCausalLM / ForSequenceClassification: class name -> task
    # (Gemma3ForConditionalGeneration -> "causal_lm")
    more_classes: dict[str, str] = dataclasses.field(default_factory=dict)
    # the class an export writes for (model_type, task) where it is not the prefix's
    export_classes: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    # checkpoint tensor-name prefixes read as another (a multimodal model's language model: "model.language_model."
    # -> "model."), and prefixes of tensors left out (its vision tower)
    renames: tuple[tuple[str, str], ...] = ()
    # prefixes of tensors left out -> what they are, for the one line that says so (a vision tower, Qwen3.5's
    # multi-token-prediction layer)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    # PEFT's target_parameters jodpo can adapt (parameters no nn.Linear holds: transformers 5's stacked experts, a
    # router module): name -> (the submodule path in a layer its name continues, the jodpo weights it holds), in the
    # order the HF modules declare them ("gate_up_proj" -> ("mlp.experts", ("gate", "up")): layers.{i}.mlp.experts.
    # gate_up_proj); the names never coincide with lora_modules'
    lora_parameters: dict[str, tuple[str, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    # target_modules names that PEFT rewrites into target_parameters on this model type (transformers 4's module names
    # of the experts and the router: "gate_proj" -> "gate_up_proj"); a parameter several of them fuse into gets
    # their number times the rank and alpha (PEFT's rank_pattern and alpha_pattern)
    lora_module_parameters: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # HF tensor names; "{i}" is the layer index
    jodpo: tuple[tuple[str, ...], ...]  # jodpo leaf paths (per-layer leaves are stacked on axis 0)
    to_jodpo: Callable[..., tuple[np.ndarray, ...]]  # hf arrays -> jodpo arrays (one layer)
    to_hf: Callable[..., tuple[np.ndarray, ...]]  # jodpo arrays -> hf arrays (one layer)
    per_layer: bool = True
    # the layers a per-layer leaf is stacked over (a mixer kind's, Model.layers_of); None: every layer
    layers: tuple[int, ...] | None = None

    def indices(self, model: Model) -> list:
        """``(place in the leaf's stack, layer index for "{i}")`` of every tensor of this rule (None, None: not per
        layer)."""
        if not self.per_layer:
            return [(None, None)]
        return list(enumerate(range(model.num_layers) if self.layers is None else self.layers))

    def of_layers(self, layers: tuple[int, ...]) -> "Rule":
        return dataclasses.replace(self, layers=tuple(layers))


def linear(path, name):
    """HF ``nn.Linear`` weight [out, in] <-> jodpo [in, *out_shape] (reshape done by the caller's shape)."""
    return Rule((name,), (path,), lambda w: (w.T,), lambda w: (w.reshape(w.shape[0], -1).T,))


def in_heads(path, name, heads, head_dim):
    """A projection into heads: HF [heads*head_dim, D] <-> jodpo [D, heads, head_dim]."""
    return Rule((name,), (path,), lambda w: (w.T.reshape(-1, heads, head_dim),),
                lambda w: (w.reshape(w.shape[0], -1).T,))


def out_heads(path, name, heads, head_dim):
    """The output projection: HF [D, heads*head_dim] <-> jodpo [heads, head_dim, D]."""
    return Rule((name,), (path,), lambda w: (w.T.reshape(heads, head_dim, -1),),
                lambda w: (w.reshape(heads * head_dim, -1).T,))


def head_bias(path, name, heads, head_dim):
    return Rule((name,), (path,), lambda b: (b.reshape(heads, head_dim),), lambda b: (b.reshape(-1),))


def same(path, name, per_layer=True):
    return Rule((name,), (path,), lambda x: (x,), lambda x: (x,), per_layer)


def norm_rules(model: Model, path, name, per_layer=True) -> list[Rule]:
    rules = [same(path + ("scale",), name + ".weight", per_layer)]
    if model.norms.kind == "layernorm":
        rules.append(same(path + ("bias",), name + ".bias", per_layer))
    return rules


def rope_inv_freq(rope: dict, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, int]:
    """Inverse frequencies (float32, computed as transformers computes them) and the rotary width."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = float(rope["rope_theta"])
    if rope_type == "proportional":
        # Gemma 4's global layers: the first partial_rotary_factor of each rotate-half half rotates, at exponents over
        # the whole head; the other frequencies are 0 (cos 1, sin 0: those dims pass as they are); all over factor
        angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
        rotated = 1.0 / (base ** (np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / head_dim))
        inv = np.concatenate([rotated.astype(np.float32), np.zeros(head_dim // 2 - angles, np.float32)])
        return (inv / np.float32(rope.get("factor", 1.0))).astype(np.float32), head_dim
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
    if rope_type == "yarn":
        return _yarn(rope, base, dim, max_position_embeddings), dim
    raise UnsupportedModelError(
        f"RoPE scaling type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)")


def _yarn(rope: dict, base: float, dim: int, max_position_embeddings: int) -> np.ndarray:
    """YaRN's inverse frequencies, as transformers' ``_compute_yarn_parameters``: the low frequencies interpolated
    (divided by ``factor``), the high ones kept, a linear ramp between ``beta_slow`` and ``beta_fast`` rotations over
    the original context."""
    old = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / old
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp
    return (1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep).astype(np.float32)


def rope_of(rope: dict, head_dim: int, max_position_embeddings: int, local: dict | None = None,
            nope_layers: tuple[int, ...] = ()) -> Rope:
    """The ``Rope`` of transformers' ``rope_parameters`` (``rope``), with the sliding-window layers' own (``local``)
    where they differ, and the layers that rotate nothing."""
    inv_freq, rotary_dim = rope_inv_freq(rope, head_dim, max_position_embeddings)
    local_inv_freq = ()
    if local is not None and local != rope:
        if rope_attention_factor(local) != 1.0:
            raise UnsupportedModelError("YaRN on the sliding-window layers is not supported (its attention factor "
                                        "is the global layers' only)")
        local_inv_freq = tuple(float(f) for f in rope_inv_freq(local, head_dim, max_position_embeddings)[0])
    return Rope(rotary_dim, tuple(float(f) for f in inv_freq), local_inv_freq, rope_attention_factor(rope),
                tuple(nope_layers))


def rope_attention_factor(rope: dict) -> float:
    """The factor on RoPE's cos and sin: YaRN's ``attention_factor`` (given, or 0.1 ln(factor) + 1, or DeepSeek's
    mscale ratio); 1 for the other types."""
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope["factor"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
    return float(mscale(factor))


def expert_rules(model: Model, prefix: str) -> list[Rule]:
    """A MoE block's tensors (``Model.moe``) under ``prefix`` (``"model.layers.{i}.mlp."``), in the layout transformers
    5.24 saves for Qwen3-MoE, OLMoE and Qwen3.5-MoE: the router ``gate.weight`` [E, D], each expert's
    ``experts.{e}.gate_proj``/``up_proj`` [F, D] and ``down_proj`` [D, F] (the fused ``experts.gate_up_proj`` of other
    checkpoints is split when loading: ``loading``), and a shared expert with its gate where there is one."""
    path, E = ("layers", "moe"), model.moe.num_experts

    def experts(ours, theirs):
        names = tuple(f"{prefix}experts.{e}.{theirs}.weight" for e in range(E))
        return Rule(names, (path + (ours,),), lambda *ws: (np.stack([w.T for w in ws]),),
                    lambda w: tuple(we.T for we in w))

    out = [linear(path + ("router",), prefix + "gate.weight"), experts("gate", "gate_proj"),
           experts("up", "up_proj"), experts("down", "down_proj")]
    if model.moe.shared_dim:
        out += [linear(path + ("shared", w), f"{prefix}shared_expert.{w}_proj.weight") for w in ("gate", "up", "down")]
        out.append(linear(path + ("shared_gate",), prefix + "shared_expert_gate.weight"))
    return out


def with_experts(rules: list[Rule], model: Model, prefix: str = "model.layers.{i}.mlp.") -> list[Rule]:
    """A dense family's rules with the MoE block's (``expert_rules`` under ``prefix``) on the layers with experts, and
    its MLP's on the dense layers among them, if any (``Model.ffns``)."""
    dense = model.layers_with("mlp")
    return ([r if r.jodpo[0][:2] != ("layers", "mlp") else r.of_layers(dense) for r in rules
             if r.jodpo[0][:2] != ("layers", "mlp") or dense]
            + ([r.of_layers(model.layers_with("moe")) for r in expert_rules(model, prefix)] if model.moe else []))


MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def without_mlp(modules: dict[str, tuple[str, ...]], paths: dict[str, str]):
    """A dense family's LoRA modules and their paths (``Family.lora_modules``, ``lora_paths``) without its MLP's
    (``gate_proj``, ``up_proj``, ``down_proj``), which a MoE family holds as stacked experts, not the ``nn.Linear``
    modules PEFT adapts."""
    modules = {k: v for k, v in modules.items() if k not in MLP_MODULES}
    return modules, {k: v for k, v in paths.items() if k in modules}


def moe_fields(cfg, norm_topk_prob: bool | None = None, shared_dim: int = 0) -> dict:
    """The ``Model`` fields of a transformers config's feed-forwards: its ``MoE`` (``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``) and, where some layers are dense
    (Qwen3-MoE's and Qwen3-Next's ``mlp_only_layers``, and the layers ``decoder_sparse_step`` skips: transformers'
    ``layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0`` is sparse), their MLP of
    ``intermediate_size`` and each layer's kind (``Model.ffn_kinds``). A top-k jodpo cannot honour is refused in one
    line."""
    from jodpo.models.model import MLP, MoE

    k, E = cfg.num_experts_per_tok, cfg.num_experts
    if not 0 < k <= E:
        raise UnsupportedModelError(f"num_experts_per_tok={k} must be between 1 and num_experts={E}")
    step, only = getattr(cfg, "decoder_sparse_step", None), set(getattr(cfg, "mlp_only_layers", None) or ())
    step = 1 if step is None else step
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step={step} must be 1 or more (every step-th layer is sparse)")
    ffns = tuple("moe" if i not in only and (i + 1) % step == 0 else "mlp" for i in range(cfg.num_hidden_layers))
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    norm = getattr(cfg, "norm_topk_prob", False) if norm_topk_prob is None else norm_topk_prob
    moe = MoE(num_experts=E, top_k=k, expert_dim=width, norm_topk_prob=bool(norm), activation=cfg.hidden_act,
              shared_dim=shared_dim)
    if "mlp" not in ffns:
        return dict(moe=moe, mlp=None)
    dense = MLP(width=cfg.intermediate_size, activation=cfg.hidden_act)
    return dict(moe=moe if "moe" in ffns else None, mlp=dense, ffn_kinds=ffns if "moe" in ffns else ())
