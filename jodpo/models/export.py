"""Write a jodpo model as a transformers checkpoint directory (config.json, safetensors, tokenizer).

The tensor names and layouts come from the same per-family rules that loading uses (``Rule.to_hf``), so
``load_model(save_hf(...))`` is the identity.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jodpo.models import families
from jodpo.models.core import Model, Params


def hf_tensors(model: Model, params: Params) -> dict[str, np.ndarray]:
    """{HF tensor name: float32 array} of ``params``."""
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))

    def leaf(path):
        node = host
        for k in path:
            node = node[k]
        return node

    out = {}
    for rule in families.weight_rules(model):
        values = [leaf(p) for p in rule.jodpo]
        for i in range(model.num_layers) if rule.per_layer else [None]:
            parts = rule.to_hf(*(v[i] if rule.per_layer else v for v in values))
            for name, t in zip(rule.hf, parts):
                out[name.format(i=i)] = np.ascontiguousarray(t)
    return out


def save_hf(model: Model, params: Params, out_dir: str | Path, tokenizer=None, overwrite: bool = False) -> Path:
    """Write ``params`` as a transformers checkpoint (float32 safetensors) that ``from_pretrained`` loads.

    Refuses a non-empty ``out_dir`` unless ``overwrite``."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; choose an empty directory or pass overwrite=True")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(model.hf_config)
    config.update(architectures=[families.hf_architecture(model)], dtype="float32",
                  tie_word_embeddings=model.tie_embeddings if model.task == "causal_lm"
                  else config.get("tie_word_embeddings", False))
    config.pop("torch_dtype", None)
    if model.task == "reward":
        config["num_labels"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": list(model.eos_token_ids)}
    if model.pad_token_id is not None:
        generation["pad_token_id"] = model.pad_token_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(hf_tensors(model, params), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
