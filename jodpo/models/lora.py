"""LoRA adapters (PEFT's ``LoraConfig``) on the decoder's projection matrices, in every family.

A target is a HF module name, as PEFT's ``target_modules`` names it (``q_proj``, ``query_key_value``, ...). Its
adapter is one ``a`` ``[N, in..., r]`` (PEFT's ``lora_A``, shared by the weights of a fused module) and one ``b``
``[N, r, out...]`` per jodpo weight it feeds (PEFT's ``lora_B``, zeros at the start), stacked over the N layers like
the weights. The adapters live apart from the base parameters (``attach`` puts them in ``params["layers"]["lora"]``
for a forward); the forward folds them into each layer's weights (``decoder.merge_adapters``), and the reference policy
is the base parameters alone: the adapters off, no second copy of the model.
"""
from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from jodpo.models import families
from jodpo.models.decoder import SUBTREES, Model, Params, merge_adapters
from jodpo.models.layout import group_subtree, subtree_layers
from jodpo.models.params import param_specs
from jodpo.models.export import write_atomically
from jodpo.models.families import family_of

# Each family's modules (HF name -> the jodpo weights it holds; GPT-NeoX fuses q, k and v in one module), PEFT's
# default targets and where each module sits in a HF state dict: ``Family.lora_modules``, ``lora_defaults``,
# ``prefix`` and ``lora_paths`` (jodpo.models.families).
# How many leading axes of each weight (after the layer axis) are its inputs.
_N_IN = {"q": 1, "k": 1, "v": 1, "o": 2, "o_gate": 1, "up": 1, "gate": 1, "down": 1, "in_q": 1, "in_k": 1, "in_v": 1,
         "in_z": 1, "in_b": 1, "in_a": 1, "out": 2, "ple_gate": 1, "ple_proj": 1, "shared_gate": 1}


def group_key(module: str, subtree: str, weight: str) -> str:
    """The key of a module's adapters in one subtree of ``params["layers"]``: the module's name where its weights are at
    home (``decoder.SUBTREES``), ``"module@subtree"`` elsewhere (Gemma 4's ``q_proj`` in its global, KV-sharing and
    wide-MLP layers, whose weights have other shapes or layers)."""
    return module if SUBTREES[weight] == subtree else f"{module}@{subtree}"


def module_of(key: str) -> str:
    return key.partition("@")[0]


def resolve_targets(model: Model, targets) -> tuple[str, ...]:
    """``lora_target_modules`` for this model: None gives PEFT's default, ``"all-linear"`` every projection; an
    unknown name is refused with the list of this family's names."""
    known = family_of(model).lora_modules
    # an ungated MLP (GPT-NeoX) has no gate to adapt; a shared expert (Qwen3.5-MoE) is gated
    gated = (model.mlp is not None and model.mlp.gated) or (model.moe is not None and model.moe.shared_dim > 0)
    if targets is None or len(targets) == 0:
        if not family_of(model).lora_defaults:
            raise ValueError(f"PEFT has no default target modules for {model.family} models: set lora_target_modules "
                             f"(PEFT's target_modules) to some of {sorted(known)}, or 'all-linear'")
        return family_of(model).lora_defaults
    if tuple(targets) == ("all-linear",) or targets == "all-linear":
        return tuple(n for n, ws in known.items() if all(w != "gate" or gated for w in ws))
    bad = [t for t in targets if t not in known or ("gate" in known[t] and not gated)]
    if bad:
        raise ValueError(f"lora_target_modules {bad} are not modules of this {model.family} model; choose from "
                         f"{sorted(known)} or 'all-linear'")
    return tuple(dict.fromkeys(targets))


def adapter_specs(model: Model, targets: tuple[str, ...]) -> dict:
    """``{group: {"a": (shape, axes), "b": {weight: (shape, axes)}}}``: shapes and logical axis names (the rank
    axis is never split), like ``param_specs``."""
    r = model.lora_rank
    layers = param_specs(model)["layers"]
    # every subtree, and the subtrees nested in one (the MoE block's shared expert: "moe.shared"); a weight stacked
    # over the experts (the routed experts' gate, up, down) is no HF module's: PEFT's target_modules never reach them
    subtrees = {**layers, **{f"{k}.{n}": v for k, sub in layers.items() if isinstance(sub, dict)
                             for n, v in sub.items() if isinstance(v, dict)}}
    out = {}
    for group in targets:
        names = family_of(model).lora_modules[group]
        for sub, weights in subtrees.items():  # every subtree that holds the module's weights: an adapter each
            if not isinstance(weights, dict) or not all(n in weights and isinstance(weights[n], tuple)
                                                        and "expert" not in weights[n][1] for n in names):
                continue
            shape, axes = weights[names[0]]
            k = 1 + _N_IN[names[0]]
            b = {}
            for n in names:
                s, ax = weights[n]
                b[n] = ((s[0], r) + s[k:], (ax[0], None) + ax[k:])
            out[group_key(group, sub, names[0])] = {"a": (shape[:k] + (r,), axes[:k] + (None,)), "b": b}
    return out


def init_adapters(model: Model, targets: tuple[str, ...], rng: jax.Array, dtype=jnp.float32) -> Params:
    """PEFT's initialisation: ``a`` uniform in +-1/sqrt(fan_in) (``kaiming_uniform_(a=sqrt(5))``), ``b`` zeros, so
    the adapted model starts exactly as the base model."""
    specs = adapter_specs(model, targets)
    keys = jax.random.split(rng, len(specs))
    out = {}
    for key, (group, spec) in zip(keys, specs.items()):
        a_shape = spec["a"][0]
        bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
        out[group] = {"a": jax.random.uniform(key, a_shape, jnp.float32, -bound, bound).astype(dtype),
                      "b": {n: jnp.zeros(s, dtype) for n, (s, _) in spec["b"].items()}}
    return out


def attach(base: Params, adapters: Params) -> Params:
    """The policy's parameters for a forward: the (frozen) base with the adapters beside its layer weights."""
    return {**base, "layers": {**base["layers"], "lora": adapters}}


def merged(model: Model, base: Params, adapters: Params) -> Params:
    """Plain parameters with the adapters folded in (float32 weights where adapted): what export writes."""
    return {**base, "layers": merge_adapters(model, attach(base, adapters)["layers"])}


# --------------------------------------------------------------------------------------------------
# PEFT's format
# --------------------------------------------------------------------------------------------------


def peft_tensors(model: Model, adapters: Params) -> dict[str, np.ndarray]:
    """The adapters as PEFT's ``adapter_model.safetensors`` names and lays them out: ``lora_A.weight`` ``[r, in]``
    and ``lora_B.weight`` ``[out, r]`` per layer, in the HF module's row order: a fused module's rows (GPT-NeoX's
    ``query_key_value``, a gated ``q_proj``, Qwen3.5's ``in_proj_qkv``) laid out by the family's own rule for the
    module's weight (``hf_mapping.Rule.to_hf``, which reads ``b`` ``[r, out...]`` as a weight of ``r`` inputs)."""
    out = {}
    family = family_of(model)
    rules = {r.jodpo: r for r in families.weight_rules(model)}
    for key, ad in adapters.items():
        a = np.asarray(ad["a"], np.float32)
        bs = {n: np.asarray(b, np.float32) for n, b in ad["b"].items()}
        r, group = a.shape[-1], module_of(key)
        fused = next((rule for leaves, rule in rules.items() if len(bs) > 1 and
                      {leaf[-1] for leaf in leaves} == set(bs) and rule.hf[0].endswith(f"{group}.weight")), None)
        for at, i in enumerate(subtree_layers(model, group_subtree(key, next(iter(bs))))):
            where = ".".join(x for x in (f"layers.{i}", family.lora_paths[group], group) if x)  # "": in the layer
            name = f"base_model.model.{family.prefix}{where}"
            out[name + ".lora_A.weight"] = np.ascontiguousarray(a[at].reshape(-1, r).T)
            if fused is not None:
                (rows,) = fused.to_hf(*(bs[leaf[-1]][at] for leaf in fused.jodpo))
            else:
                (b,) = bs.values()
                rows = b[at].reshape(r, -1).T
            out[name + ".lora_B.weight"] = np.ascontiguousarray(rows)
    return out


def peft_config(model: Model, targets: tuple[str, ...], dropout: float, base_model: str) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": model.lora_rank, "lora_alpha": model.lora_alpha, "lora_dropout": dropout,
            "target_modules": list(dict.fromkeys(module_of(t) for t in targets)), "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}


def save_peft(model: Model, adapters: Params, out_dir, targets: tuple[str, ...], dropout: float, base_model: str,
              tokenizer=None, overwrite: bool = False):
    """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer if given) that
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads onto the base model; written as ``save_hf`` writes
    (a non-empty ``out_dir`` needs ``overwrite``, and nothing is replaced until the new directory is complete).
    Returns the directory."""
    from safetensors.numpy import save_file

    def write(tmp):
        save_file(peft_tensors(model, adapters), str(tmp / "adapter_model.safetensors"))
        config = peft_config(model, targets, dropout, base_model)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return write_atomically(out_dir, overwrite, write)
