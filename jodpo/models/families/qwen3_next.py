"""Qwen3-Next (Qwen3-Next-80B-A3B; ``qwen3_next``): Qwen3.5's hybrid of Gated DeltaNet and gated attention layers
(``jodpo.models.families.qwen3_5``, which transformers builds on this one: the same arithmetic) with a mixture of
experts in its sparse layers (``jodpo.models.moe``): ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``,
``num_experts_per_tok`` a token, renormalised where ``norm_topk_prob``, beside a shared expert of width
``shared_expert_intermediate_size`` whose output is times sigmoid(``shared_expert_gate``). Its DeltaNet layers keep
their input projections fused as transformers does, per key head: ``in_proj_qkvz`` rows ``[q | k | v | z]`` of each
key head's group (its ``num_v_heads / num_k_heads`` value heads' v and z), ``in_proj_ba`` rows ``[b | a]`` likewise;
they are split into Qwen3.5's ``in_q``, ``in_k``, ``in_v``, ``in_z``, ``in_b``, ``in_a`` when loading and fused again
by an export. Dense layers among the sparse ones (``mlp_only_layers``, and the layers ``decoder_sparse_step``
skips: in no released model) are its MLP of ``intermediate_size`` (no shared expert).
``Qwen3NextForSequenceClassification`` is the reward head. LoRA adapts the attention's projections and DeltaNet's
output projection (PEFT has no default target modules for Qwen3-Next)."""
from __future__ import annotations

import numpy as np

from jodpo.models.families import qwen3_5
from jodpo.models.hf_mapping import Family, Rule, moe_fields, with_experts
from jodpo.models.model import Model

_FUSED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5's separate projections, fused here


def model_fields(cfg) -> dict:
    return qwen3_5.model_fields(cfg) | moe_fields(cfg, shared_dim=cfg.shared_expert_intermediate_size)


def _grouped(path, name: str, names: tuple[str, ...], widths: tuple[int, ...], groups: int, heads: tuple) -> Rule:
    """One fused projection whose rows are ``groups`` groups (a key head's) of blocks of ``widths`` rows, each block's
    rows the group's share of a jodpo leaf ``[D, *heads[i]]`` (``names[i]``), and back."""
    def to_jodpo(w):
        blocks = np.split(w.T.reshape(w.shape[1], groups, sum(widths)), np.cumsum(widths)[:-1], -1)
        return tuple(b.reshape(w.shape[1], *h) for b, h in zip(blocks, heads))

    def to_hf(*leaves):
        D = leaves[0].shape[0]
        return (np.concatenate([x.reshape(D, groups, -1) for x in leaves], -1).reshape(D, -1).T,)

    return Rule((name,), tuple(path + (n,) for n in names), to_jodpo, to_hf)


def rules(model: Model) -> list[Rule]:
    """Qwen3.5's rules with DeltaNet's fused input projections in place of its separate ones, and the MoE block's in
    place of the dense MLP's on the sparse layers."""
    d, dn, A = model.deltanet, ("layers", "deltanet"), "model.layers.{i}.linear_attn."
    out = [r for r in qwen3_5.rules(model) if not any(f".{m}." in r.hf[0] for m in _FUSED)]
    if d is not None:
        r = d.num_v_heads // d.num_k_heads  # value heads a key head's group has
        Hk, Hv, dk, dv = d.num_k_heads, d.num_v_heads, d.k_head_dim, d.v_head_dim
        mine = [_grouped(dn, A + "in_proj_qkvz.weight", ("in_q", "in_k", "in_v", "in_z"), (dk, dk, r * dv, r * dv), Hk,
                         ((Hk, dk), (Hk, dk), (Hv, dv), (Hv, dv))),
                _grouped(dn, A + "in_proj_ba.weight", ("in_b", "in_a"), (r, r), Hk, ((Hv,), (Hv,)))]
        out += [x.of_layers(model.layers_of("deltanet")) for x in mine]
    return with_experts(out, model)


LORA_MODULES = {k: v for k, v in qwen3_5.LORA_MODULES.items()
                if k in ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")}
LORA_PATHS = {k: v for k, v in qwen3_5.LORA_PATHS.items() if k in LORA_MODULES}

FAMILY = Family(
    name="qwen3_next", module="qwen3_next", classes={"qwen3_next": "Qwen3Next"}, model_fields=model_fields,
    rules=rules, lora_modules=LORA_MODULES, lora_defaults=(), prefix="model.", lora_paths=LORA_PATHS,
)
