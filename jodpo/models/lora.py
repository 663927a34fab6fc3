"""LoRA adapters (PEFT's ``LoraConfig``) on the decoder's projection matrices, in every family.

A target is a HF module name, as PEFT's ``target_modules`` names it (``q_proj``, ``query_key_value``, ...), or a
parameter no ``nn.Linear`` holds, as its ``target_parameters`` names it (transformers 5's stacked experts and router of
Qwen3-MoE and OLMoE: ``gate_up_proj``, ``down_proj``, ``gate.weight``; ``Family.lora_parameters``). Its adapter is one
``a`` ``[N, in..., r]`` (PEFT's ``lora_A``, shared by the weights of a fused module) and one ``b`` ``[N, r, out...]``
per jodpo weight it feeds (PEFT's ``lora_B``, zeros at the start), stacked over the N layers like the weights, and
over the experts after them (``[N, E, ...]``: an adapter per expert, PEFT's ``ParamWrapper``). The adapters live apart
from the base parameters (``attach`` puts them in ``params["layers"]["lora"]`` for a forward); the forward folds them
into each layer's weights (``decoder.merge_adapters``), and the reference policy is the base parameters alone: the
adapters off, no second copy of the model.
"""
from __future__ import annotations

import json
import math
import re

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
         "in_z": 1, "in_b": 1, "in_a": 1, "out": 2, "ple_gate": 1, "ple_proj": 1, "shared_gate": 1, "router": 1}


def group_key(module: str, subtree: str, weight: str) -> str:
    """The key of a module's adapters in one subtree of ``params["layers"]``: the module's name where its weights are at
    home (``decoder.SUBTREES``), ``"module@subtree"`` elsewhere (Gemma 4's ``q_proj`` in its global, KV-sharing and
    wide-MLP layers, whose weights have other shapes or layers)."""
    return module if SUBTREES.get(weight) == subtree else f"{module}@{subtree}"


def module_of(key: str) -> str:
    return key.partition("@")[0]


def resolve_targets(model: Model, targets, parameters=None) -> tuple[str, ...]:
    """``lora_target_modules`` and ``lora_target_parameters`` for this model, as PEFT reads its ``target_modules`` and
    ``target_parameters``: None gives PEFT's default modules (none where parameters are named), ``"all-linear"`` every
    projection (and, where PEFT rewrites module names into parameters, ``Family.lora_module_parameters``, those names
    too: Qwen3-MoE's experts and router). Returns the names, modules first; an unknown name is refused with the list of
    this family's."""
    family = family_of(model)
    known, renamed = family.lora_modules, family.lora_module_parameters
    params = _resolve_parameters(model, parameters or ())
    # an ungated MLP (GPT-NeoX) has no gate to adapt; a shared expert (Qwen3.5-MoE) is gated
    gated = (model.mlp is not None and model.mlp.gated) or (model.moe is not None and model.moe.shared_dim > 0)
    if targets is None or len(targets) == 0:
        if params:  # PEFT's default target modules apply only where no parameter is named
            return params
        if not family.lora_defaults:
            raise ValueError(f"PEFT has no default target modules for {model.family} models: set lora_target_modules "
                             f"(PEFT's target_modules) to some of {sorted(known | renamed)}, or 'all-linear'")
        return family.lora_defaults
    if tuple(targets) == ("all-linear",) or targets == "all-linear":
        modules = tuple(n for n, ws in known.items() if all(w != "gate" or gated for w in ws))
        modules += tuple(renamed)  # PEFT adds the rewritten names to all-linear's modules
    else:
        bad = [t for t in targets
               if t not in renamed and (t not in known or ("gate" in known[t] and not gated))]
        if bad:
            raise ValueError(f"lora_target_modules {bad} are not modules of this {model.family} model; choose from "
                             f"{sorted(known | renamed)} or 'all-linear'")
        modules = tuple(dict.fromkeys(targets))
        for param in dict.fromkeys(renamed.values()):  # PEFT's refusal: a fused parameter's modules go together
            fused = [m for m, p in renamed.items() if p == param]
            named = [m for m in fused if m in modules]
            if named and len(named) < len(fused):
                raise ValueError(f"lora_target_modules {named} without {[m for m in fused if m not in named]}: in "
                                 f"this {model.family} model they are one parameter ({param}, as PEFT adapts it); "
                                 "name all of them or none")
    return modules + tuple(p for p in params if p not in modules)


def _resolve_parameters(model: Model, parameters) -> tuple[str, ...]:
    """``lora_target_parameters`` as the family's names (``Family.lora_parameters``): a name, or its path in a layer
    (``mlp.experts.gate_up_proj``), as PEFT matches a parameter by a suffix of its name."""
    family = family_of(model)
    if isinstance(parameters, str):
        parameters = (parameters,)
    paths = {f"{where}.{name}": name for name, (where, _) in family.lora_parameters.items()}
    found, bad = [], []
    for t in parameters:
        hit = [name for path, name in paths.items() if name in t and (path == t or path.endswith("." + t))]
        (found if hit else bad).append(hit[0] if hit else t)
    if bad and not family.lora_parameters:
        raise ValueError(f"lora_target_parameters {bad}: this {model.family} model has no parameters that LoRA adapts "
                         "apart from its modules (PEFT's target_parameters reach the stacked experts and the router of "
                         "qwen3_moe and olmoe); name them in lora_target_modules instead")
    if bad:
        raise ValueError(f"lora_target_parameters {bad} are not parameters LoRA adapts in this {model.family} model; "
                         f"choose from {list(family.lora_parameters)} (or their paths in a layer, {sorted(paths)})")
    return tuple(dict.fromkeys(found))


def groups(model: Model, targets: tuple[str, ...]) -> dict[str, tuple[tuple[str, ...], int]]:
    """``{PEFT target: (the jodpo weights it adapts, k)}``, an adapter of rank ``k x lora_rank`` and alpha ``k x
    lora_alpha`` each: the modules among ``targets`` (k = 1), then the parameters they name directly or through the
    module names PEFT rewrites into them, in the family's order; a parameter that ``k > 1`` module names fuse into
    gets k (PEFT's rank_pattern and alpha_pattern: Qwen3-MoE's ``gate_up_proj``, from ``gate_proj`` and
    ``up_proj``)."""
    family = family_of(model)
    out = {t: (family.lora_modules[t], 1) for t in targets if t in family.lora_modules}
    for param, (_, weights) in family.lora_parameters.items():
        via = [t for t in targets if family.lora_module_parameters.get(t) == param]
        if via or param in targets:
            out[param] = (weights, max(len(via), 1))
    return out


def adapter_specs(model: Model, targets: tuple[str, ...]) -> dict:
    """``{group: {"a": (shape, axes), "b": {weight: (shape, axes)}}}``: shapes and logical axis names (the rank
    axis is never split), like ``param_specs``. An adapter of weights stacked over the experts has one per expert
    (PEFT's ``ParamWrapper``), ``a`` ``[N, E, in..., r]`` and ``b`` ``[N, E, r, out...]``, split over the ``expert``
    axis like them."""
    layers = param_specs(model)["layers"]
    modules = family_of(model).lora_modules
    # every subtree, and the subtrees nested in one (the MoE block's shared expert: "moe.shared"); a weight stacked
    # over the experts (the routed experts' gate, up, down) is no HF module's: only PEFT's target_parameters reach them
    subtrees = {**layers, **{f"{k}.{n}": v for k, sub in layers.items() if isinstance(sub, dict)
                             for n, v in sub.items() if isinstance(v, dict)}}
    out = {}
    for group, (names, k) in groups(model, targets).items():
        r = k * model.lora_rank
        for sub, weights in subtrees.items():  # every subtree that holds the module's weights: an adapter each
            if group not in modules and sub != "moe":  # PEFT's target_parameters: the MoE block's alone, never the
                continue  # dense MLP of a layer without experts (Qwen3-MoE's mlp_only_layers)
            if not isinstance(weights, dict) or not all(n in weights and isinstance(weights[n], tuple)
                                                        and (group not in modules or "expert" not in weights[n][1])
                                                        for n in names):
                continue
            shape, axes = weights[names[0]]
            lead = 1 + ("expert" in axes)  # the layers, and the experts: an adapter per expert
            k_in = lead + _N_IN[names[0]]
            b = {}
            for n in names:
                s, ax = weights[n]
                b[n] = (s[:lead] + (r,) + s[k_in:], ax[:lead] + (None,) + ax[k_in:])
            out[group_key(group, sub, names[0])] = {"a": (shape[:k_in] + (r,), axes[:k_in] + (None,)), "b": b}
    return out


def init_adapters(model: Model, targets: tuple[str, ...], rng: jax.Array, dtype=jnp.float32) -> Params:
    """PEFT's initialisation: ``a`` uniform in +-1/sqrt(fan_in) (``kaiming_uniform_(a=sqrt(5))`` of each layer's or
    expert's ``lora_A``), ``b`` zeros, so the adapted model starts exactly as the base model."""
    specs = adapter_specs(model, targets)
    keys = jax.random.split(rng, len(specs))
    out = {}
    for key, (group, spec) in zip(keys, specs.items()):
        a_shape, a_axes = spec["a"]
        fan_in = math.prod(n for n, ax in zip(a_shape[:-1], a_axes) if ax not in ("layers", "expert"))
        bound = 1.0 / math.sqrt(fan_in)
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
    module's weight (``hf_mapping.Rule.to_hf``, which reads ``b`` ``[r, out...]`` as a weight of ``r`` inputs).
    A parameter's adapter is PEFT's ``ParamWrapper``'s (``_parameter_tensors``)."""
    out = {}
    family = family_of(model)
    rules = {r.jodpo: r for r in families.weight_rules(model)}
    params = [module_of(key) for key in adapters if module_of(key) not in family.lora_modules]
    for key, ad in adapters.items():
        a = np.asarray(ad["a"], np.float32)
        bs = {n: np.asarray(b, np.float32) for n, b in ad["b"].items()}
        r, group = a.shape[-1], module_of(key)
        if group not in family.lora_modules:
            layers = subtree_layers(model, group_subtree(key, next(iter(bs))))
            out |= _parameter_tensors(model, group, params, layers, a, bs)
            continue
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


def _parameter_tensors(model: Model, param: str, params: list[str], layers: tuple[int, ...], a_N: np.ndarray,
                       bs: dict) -> dict:
    """A PEFT target parameter's adapter in PEFT 0.21's ``ParamWrapper`` layout. Its module's path: where the
    parameter's name continues the family's path (``mlp.gate`` for ``gate.weight``), with one ``.base_layer`` per
    parameter of the same module targeted after it (PEFT wraps a module's parameters in their order, each wrapper
    around the last: ``mlp.experts.base_layer`` holds ``gate_up_proj``'s where ``down_proj`` is adapted too).
    Stacked over E experts: ``lora_A`` ``[r x E, in]`` (expert e's rows ``e r .. (e + 1) r``), ``lora_B``
    ``[out, r x E]`` (expert e's columns ``e, e + E, ...``), its rows those of each jodpo weight in turn
    (``gate_up_proj``: the gate's, then up's)."""
    family = family_of(model)
    where, weights = family.lora_parameters[param]
    module = f"{where}.{param}".rpartition(".")[0]
    order = [p for p in family.lora_parameters if p in params]
    after = [p for p in order[order.index(param) + 1:] if f"{family.lora_parameters[p][0]}.{p}".rpartition(".")[0]
             == module]
    out = {}
    for at, i in enumerate(layers):
        name = f"base_model.model.{family.prefix}layers.{i}.{module}" + ".base_layer" * len(after)
        a = a_N[at]
        b = np.concatenate([bs[w][at] for w in weights], axis=-1)  # [E, r, out] or [r, out]
        if a.ndim == 3:  # [E, in, r]: one adapter per expert
            E, n_in, r = a.shape
            lora_a = a.transpose(0, 2, 1).reshape(E * r, n_in)
            lora_b = b.transpose(2, 1, 0).reshape(b.shape[-1], r * E)
        else:
            lora_a, lora_b = a.T, b.T
        out[name + ".lora_A.weight"] = np.ascontiguousarray(lora_a)
        out[name + ".lora_B.weight"] = np.ascontiguousarray(lora_b)
    return out


def peft_config(model: Model, targets: tuple[str, ...], dropout: float, base_model: str) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters, as PEFT 0.21 saves it: the modules in ``target_modules``,
    the parameters in ``target_parameters`` with the rank and alpha of a fused one in ``rank_pattern`` and
    ``alpha_pattern``. ``lora_dropout`` is 0 where parameters are adapted (PEFT's ``ParamWrapper`` refuses dropout;
    jodpo trains without it anyway)."""
    family = family_of(model)
    adapted = groups(model, targets)
    params = {p: k for p, (_, k) in adapted.items() if p not in family.lora_modules}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": model.lora_rank, "lora_alpha": model.lora_alpha, "lora_dropout": 0.0 if params else dropout,
              "target_modules": [g for g in adapted if g in family.lora_modules], "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    if params:
        config["target_parameters"] = list(params)
        config["rank_pattern"] = {rf".*\.{re.escape(p)}": k * model.lora_rank for p, k in params.items() if k > 1}
        config["alpha_pattern"] = {rf".*\.{re.escape(p)}": k * model.lora_alpha for p, k in params.items() if k > 1}
    return config


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
