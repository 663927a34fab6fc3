"""Write a jodpo model as a transformers checkpoint directory (config.json, safetensors, tokenizer).

The tensor names and layouts come from the same per-family rules that loading uses (``Rule.to_hf``), so
``load_model(save_hf(...))`` is the identity in float32. Files above ``max_shard_size`` are split as
transformers splits them (``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``).
The directory is written next to ``out_dir`` and moved into place at the end, so a failure never leaves
a half-written export, nor destroys an existing one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import jax
import ml_dtypes
import numpy as np

from jodpo.errors import ExportMismatch
from jodpo.models import families
from jodpo.models.decoder import Model, Params
from jodpo.models.heads import logits, reward_scores
from jodpo.models.loading import load_model

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` (10^9, as transformers counts), ``500MiB`` (2^20) or a plain integer."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"max shard size {size!r} is not a size; write it like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def hf_tensors(model: Model, params: Params, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
    """(HF tensor name, array in ``dtype``) for every tensor of ``params``, one at a time."""
    target = DTYPES[dtype]
    host = jax.device_get(params)

    def leaf(path):
        node = host
        for k in path:
            node = node[k]
        return np.asarray(node, np.float32)

    for rule in families.weight_rules(model):
        values = [leaf(p) for p in rule.jodpo]
        for at, i in rule.indices(model):
            parts = rule.to_hf(*(v if at is None else v[at] for v in values))
            for name, t in zip(rule.hf, parts):
                yield name.format(i=i), np.ascontiguousarray(t, dtype=target)


def hf_config(model: Model, dtype: str = "float32") -> dict:
    """The config.json of the export: the source model's config with the architecture and dtype it is saved in."""
    config = json.loads(model.hf_config)
    config.update(architectures=[families.hf_architecture(model)], dtype=dtype,
                  tie_word_embeddings=model.tie_embeddings if model.task == "causal_lm"
                  else config.get("tie_word_embeddings", False))
    config.pop("torch_dtype", None)
    if model.task == "reward":
        config["num_labels"] = 1
    return config


def write_metadata(model: Model, out: Path, tokenizer=None, dtype: str = "float32") -> None:
    """config.json, generation_config.json and the tokenizer files (everything but the weights)."""
    (out / "config.json").write_text(json.dumps(hf_config(model, dtype), indent=2) + "\n")
    generation = {"eos_token_id": list(model.eos_token_ids)}
    if model.pad_token_id is not None:
        generation["pad_token_id"] = model.pad_token_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _write_shards(tensors: Iterator[tuple[str, np.ndarray]], out: Path, max_bytes: int) -> None:
    """Greedy shards of at most ``max_bytes`` (a larger tensor gets a file of its own), named as transformers
    names them; an index only when there is more than one file."""
    from safetensors.numpy import save_file

    files: list[Path] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        files.append(out / f"shard-{len(files):05d}.tmp")
        save_file(shard, str(files[-1]), metadata={"format": "pt"})

    for name, t in tensors:
        if shard and size + t.nbytes > max_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
        weight_map[name] = len(files)
    flush()
    if len(files) == 1:
        files[0].rename(out / "model.safetensors")
        return
    names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    for path, name in zip(files, names):
        path.rename(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; give a directory for the export")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; choose an empty directory, or pass overwrite=True "
                              "(--overwrite) to replace what is there")


def save_hf(model: Model, params: Params, out_dir: str | Path, tokenizer=None, overwrite: bool = False, *,
            dtype: str = "float32", max_shard_size: int | str = "5GB", model_card: str | None = None) -> Path:
    """Write ``params`` as a transformers checkpoint that ``from_pretrained`` loads; returns the directory.

    Args:
      dtype: ``"float32"`` (bitwise round trip) or ``"bfloat16"`` (half the size).
      max_shard_size: split the weights into files of at most this size (``"5GB"``, ``"500MB"``, bytes).
      model_card: text of a README.md to write alongside.
      overwrite: replace a non-empty ``out_dir``; otherwise that is refused. The old contents are only
        removed once the new export is completely written.
    """
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(DTYPES)}")
    max_bytes = parse_size(max_shard_size)

    def write(tmp: Path) -> None:
        write_metadata(model, tmp, tokenizer, dtype)
        _write_shards(hf_tensors(model, params, dtype), tmp, max_bytes)
        if model_card is not None:
            (tmp / "README.md").write_text(model_card)

    return write_atomically(out_dir, overwrite, write)


def write_atomically(out_dir: str | Path, overwrite: bool, write) -> Path:
    """``write(tmp)`` fills a hidden sibling directory, which then takes ``out_dir``'s place: a failure never leaves
    half an export, and with ``overwrite`` the old contents go only once the new ones are complete. A non-empty
    ``out_dir`` without ``overwrite`` is refused before anything is written."""
    out = Path(out_dir).absolute()
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write(tmp)
        _umask_modes(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _umask_modes(root: Path) -> None:
    """The modes a plain ``open``/``mkdir`` gives under the process's umask (0644 / 0755 with the usual 022), for
    ``root`` and everything in it: mkdtemp makes 0700 and safetensors writes 0600, which others of the group could
    not read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)



def verify_export(model: Model, params: Params, out: str | Path, dtype: str = "float32", rtol: float = 1e-4) -> list[str]:
    """Re-read an export and check it against ``params`` (rounded to the exported ``dtype``).

    jodpo's loader must give back the same model and bitwise the same parameters; transformers (when torch is
    installed) must give the same logits (or reward scores) on a few fixed tokens within ``rtol`` of the
    largest logit. Returns one line per check; raises ``ExportMismatch`` on a difference."""
    import jax.numpy as jnp


    out = Path(out)
    rounded = jax.tree.map(lambda x: np.asarray(x, np.float32).astype(DTYPES[dtype]).astype(np.float32), params)
    model2, params2 = load_model(str(out), model.task, jnp.float32)
    # Like with like: transformers computes in float32 on the CPU, so jodpo's side does too, whatever the default
    # backend (a GPU would otherwise use TF32) and whatever precision the run trained with.
    f32 = model.replace(dtype="float32", remat="none", precision="highest")
    if model2 != f32:
        raise ExportMismatch(f"{out}: config.json describes a different model than the one exported")
    bad = [jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree.leaves_with_path(rounded), jax.tree.leaves(params2))
           if not np.array_equal(a, np.asarray(b))]
    if bad:
        raise ExportMismatch(f"{out}: re-read parameters differ from the exported ones: {bad[:4]}")
    done = [f"re-read with jodpo: {len(jax.tree.leaves(params2))} parameter arrays equal, bitwise"]
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    except ImportError:
        return done + ["transformers logits not compared: torch is not installed"]
    ids = np.random.default_rng(0).integers(0, model.vocab_size, size=(2, 8)).astype(np.int32)
    mask = np.ones_like(ids)
    cls = AutoModelForCausalLM if model.task == "causal_lm" else AutoModelForSequenceClassification
    try:
        hf = cls.from_pretrained(out, dtype=torch.float32).eval()
    except ValueError as e:  # a class transformers does not have (Gemma 4's sequence classifier)
        if "Unrecognized configuration class" not in str(e):
            raise
        return done + [f"transformers logits not compared: transformers has no {families.hf_architecture(model)}"]
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    with jax.default_device(jax.devices("cpu")[0]):
        if model.task == "causal_lm":
            ours = np.asarray(logits(f32, rounded, ids, mask))
        else:
            ours, theirs = np.asarray(reward_scores(f32, rounded, ids, mask)), theirs[:, 0]
    err = float(np.max(np.abs(ours - theirs)) / max(1.0, float(np.max(np.abs(ours)))))
    if not err <= rtol:
        raise ExportMismatch(f"{out}: transformers' {cls.__name__} gives logits {err:.2e} (relative) away from "
                             f"jodpo's on the exported parameters (tolerance {rtol:.0e})")
    return done + [f"transformers {cls.__name__} logits equal jodpo's within {err:.1e} (relative; tolerance {rtol:.0e})"]
