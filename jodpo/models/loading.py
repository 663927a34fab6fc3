"""Loading Hugging Face checkpoints (a local directory or a hub id) into ``(Model, params)``.

Tensors are streamed: each HF tensor is read from a memory-mapped safetensors file (or a torch ``.bin``),
converted, and written into its slot of a preallocated, layer-stacked host array, so loading needs
about the model's size once on the host plus one tensor, then the copy to the device.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jodpo.errors import CheckpointError, UnsupportedModelError
from jodpo.models import families, gguf, gguf_tokenizer
from jodpo.models.decoder import Model, Params
from jodpo.models.params import _is_spec, param_specs

WEIGHT_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json"]
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model",
                      "chat_template.*", "added_tokens.json"]



# --------------------------------------------------------------------------------------------------
# Finding the files
# --------------------------------------------------------------------------------------------------


# What a path that is not there should have been, by the task it was given for (a reward model has no GGUF form)
EXPECTED = {"causal_lm": "a directory holding config.json and weights, a .gguf file, or a hub id like 'org/name'",
            "reward": "a directory holding a *ForSequenceClassification checkpoint (config.json with num_labels=1, "
                      "and weights), or a hub id like 'org/name'"}


def resolve_path(path_or_hub_id: str, revision: str | None = None, with_bin: bool = False,
                 task: str = "causal_lm") -> Path:
    """A local directory as is; otherwise a hub snapshot through huggingface_hub (cache, HF_HUB_OFFLINE
    and ``revision`` honoured), fetching only config, weights and tokenizer files. ``task``: what the path was
    given for, which the message of a missing one says it should be."""
    path = Path(os.path.expanduser(str(path_or_hub_id)))
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists() or str(path_or_hub_id).startswith((".", "/", "~")) or str(path_or_hub_id).count("/") > 1:
        raise CheckpointError(f"{path_or_hub_id}: not a model directory (no such directory). Pass "
                              f"{EXPECTED[task]}.")
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    patterns = WEIGHT_PATTERNS + TOKENIZER_PATTERNS + (["pytorch_model*.bin", "*.bin.index.json"] if with_bin else [])
    try:
        return Path(huggingface_hub.snapshot_download(str(path_or_hub_id), revision=revision, allow_patterns=patterns))
    except hf_errors.LocalEntryNotFoundError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached (offline?)"
        fetch = f"hf download {path_or_hub_id}" + (f" --revision {revision}" if revision else "")
        raise CheckpointError(f"{path_or_hub_id}: not in the local Hugging Face cache and {why}. Download it on a "
                              f"machine with network ({fetch}) or pass a local directory.") from e
    except (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError, hf_errors.HfHubHTTPError) as e:
        raise CheckpointError(f"{path_or_hub_id}: cannot be fetched from the Hugging Face hub ({e.__class__.__name__}). "
                              "Check the id, the revision and your token, or pass a local directory.") from e


def read_config_json(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json; this is not a transformers model directory.")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}).") from e


# --------------------------------------------------------------------------------------------------
# Reading tensors
# --------------------------------------------------------------------------------------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _safetensors_entries(file: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of one safetensors file, read one tensor at a time."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(fh.read(n))
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1):
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                dtype = np.dtype(_ST_DTYPES[info["dtype"]])
                if 8 + n + end > size or (end - start) != dtype.itemsize * int(np.prod(info["shape"], dtype=np.int64)):
                    raise ValueError(f"tensor {name} lies outside the file")
                fh.seek(8 + n + start)
                buf = np.empty(info["shape"], dtype)
                fh.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
                yield name, buf
    except (ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({e}). Re-download or re-export it.") from e


def _bin_entries(file: Path) -> Iterator[tuple[str, np.ndarray]]:
    try:
        import torch
    except ImportError as e:
        raise CheckpointError(f"{file}: a PyTorch .bin checkpoint needs torch to read (pip install torch), "
                              "or convert it to safetensors.") from e
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    for name, t in state.items():
        if t.dtype == torch.bfloat16:
            yield name, t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            yield name, t.numpy()


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: safetensors (single or sharded via the index) before .bin."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (path / index).is_file():
            shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise CheckpointError(f"{path}: {index} names shards that are missing: {missing[:3]}")
            return [path / s for s in shards]
        if (path / single).is_file():
            return [path / single]
    raise CheckpointError(f"{path}: no weights found (model.safetensors, a sharded index, or pytorch_model.bin).")


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    for f in weight_files(path):
        yield from (_safetensors_entries(f) if f.suffix == ".safetensors" else _bin_entries(f))


# --------------------------------------------------------------------------------------------------
# Public loading functions
# --------------------------------------------------------------------------------------------------


def _strip_prefix(name: str, model: Model) -> str:
    family = families.family_of(model)
    for old, new in family.renames:  # a multimodal checkpoint's language model
        if name.startswith(old):
            return new + name[len(old):]
    # Some checkpoints (e.g. a base model saved without the head class) lack the "model."/"gpt_neox." prefix.
    base = family.prefix
    if not name.startswith((base, "lm_head.", "embed_out.", "score.")):
        return base + name
    return name


def model_from_dir(path: Path, task: str, dtype) -> Model:
    """The static ``Model`` of a checkpoint directory, checking the architecture against ``task``."""
    raw = read_config_json(path)
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type not in families.MODEL_TYPES:
        raise CheckpointError(f"{path}: architecture {archs or model_type!r} is not supported; jodpo supports "
                              f"{families.SUPPORTED}.")
    if task not in ("causal_lm", "reward"):
        raise ValueError(f"task must be 'causal_lm' or 'reward', not {task!r}")
    known = [families.ARCHITECTURES[a][1] for a in archs if a in families.ARCHITECTURES]
    if task == "reward" and known and "reward" not in known:
        raise CheckpointError(f"{path}: is a {archs[0]}, not a sequence classifier; a reward model must be a "
                              "*ForSequenceClassification checkpoint with num_labels=1.")
    if task == "causal_lm" and known and "causal_lm" not in known:
        raise CheckpointError(f"{path}: is a {archs[0]} (a reward/classifier head); the policy needs a "
                              "*ForCausalLM checkpoint.")
    if task == "reward":
        n_labels = raw.get("num_labels") or len(raw.get("id2label") or {0: 0, 1: 1})
        if n_labels != 1:
            raise CheckpointError(f"{path}: sequence classifier with {n_labels} labels; a reward model needs "
                                  "num_labels=1.")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    if task == "reward":
        cfg.num_labels = 1
    eos = []
    gen = path / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text()).get("eos_token_id")
        eos = g if isinstance(g, list) else [g]
    try:
        return families.model_from_hf_config(cfg, task, dtype=jnp.dtype(dtype).name, eos_token_ids=eos)
    except UnsupportedModelError as e:
        raise CheckpointError(f"{path}: {e}") from e


def is_model_object(x) -> bool:
    """A transformers (torch) model object rather than a path: it has a config and a state_dict."""
    return hasattr(x, "config") and hasattr(x, "state_dict") and not isinstance(x, (str, Path))


def _object_name(obj) -> str:
    return f"the {type(obj).__name__} object ({getattr(obj, 'name_or_path', '') or 'built in code'})"


def model_from_object(obj, task: str, dtype) -> Model:
    """The static ``Model`` of a transformers model object (its config and generation config), as
    ``model_from_dir`` reads a directory's."""
    name, cfg = _object_name(obj), obj.config
    if hasattr(obj, "peft_config") and hasattr(obj, "get_base_model"):  # its tensors are named for its LoRA layers
        raise CheckpointError(f"{name}: is a peft model (LoRA layers injected); give model.merge_and_unload() for its "
                              "weights with the adapters merged (OnlineDPOTrainer trains a peft model's adapters)")
    arch = type(obj).__name__
    kind = families.ARCHITECTURES.get(arch, (None, None))[1]
    if kind is not None and kind != task:
        want = "a *ForSequenceClassification model with num_labels=1" if task == "reward" else "a *ForCausalLM model"
        raise CheckpointError(f"{name}: is a {arch}; this place takes {want}.")
    if task == "reward" and getattr(cfg, "num_labels", 1) != 1:
        raise CheckpointError(f"{name}: sequence classifier with {cfg.num_labels} labels; a reward model needs "
                              "num_labels=1.")
    gen = getattr(obj, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    try:
        return families.model_from_hf_config(cfg, task, dtype=jnp.dtype(dtype).name, eos_token_ids=eos)
    except UnsupportedModelError as e:
        raise CheckpointError(f"{name}: {e}") from e


def _object_tensors(obj) -> Iterator[tuple[str, np.ndarray]]:
    """A model object's tensors as float32 numpy arrays (numpy has no bfloat16; float32 holds bf16 and fp16
    exactly), one at a time: torch is used through the tensors' own methods, never imported."""
    for name, t in obj.state_dict().items():
        yield name, t.detach().to("cpu").float().numpy()


def _per_expert(tensors: Iterator[tuple[str, np.ndarray]], fused) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors with fused experts (transformers 5's in-memory layout, and some hub checkpoints':
    ``experts.gate_up_proj`` [E, 2F, D], ``experts.down_proj`` [E, D, F]) as the per-expert tensors that
    ``hf_mapping.expert_rules`` names (``experts.{e}.gate_proj.weight`` [F, D], ...), but where ``fused(name)``: a
    family that reads them fused (Gemma 4, whose hub layout they are)."""
    for name, tensor in tensors:
        stem, _, last = name.rpartition(".")
        if (stem.endswith("experts") and last in ("gate_up_proj", "down_proj") and tensor.ndim == 3
                and not fused(name)):
            for e, w in enumerate(tensor):
                if last == "down_proj":
                    yield f"{stem}.{e}.down_proj.weight", w
                else:
                    gate, up = np.split(w, 2, 0)
                    yield f"{stem}.{e}.gate_proj.weight", gate
                    yield f"{stem}.{e}.up_proj.weight", up
            continue
        yield name, tensor


def load_params(model: Model, path: Path, dtype=jnp.float32, place=None, tensors=None) -> Params:
    """Stream the checkpoint's tensors into layer-stacked host arrays; each leaf goes to the device (and
    its host copy is freed) as soon as all its layers are in, so the peak stays near twice the model.
    ``place(leaf_path, host_array)`` puts a leaf on the devices (default: ``jax.device_put`` to the default device,
    which compiles nothing: ``jnp.asarray`` compiles a program for each new shape); ``tensors`` yields
    ``(transformers name, array)`` pairs (default: the directory's safetensors or .bin files)."""
    np_dtype = np.dtype(jnp.dtype(dtype))
    leaves: dict[tuple[str, ...], np.ndarray] = {}  # host buffers still being filled
    need: dict[tuple[str, ...], int] = {}  # tensors still missing per leaf
    specs = jax.tree.leaves_with_path(param_specs(model), is_leaf=_is_spec)
    shapes = {tuple(k.key for k in p): s[0] for p, s in specs}
    slots: dict[str, tuple[families.Rule, int | None, int]] = {}
    for rule in families.weight_rules(model):
        for at, i in rule.indices(model):
            for j, name in enumerate(rule.hf):
                slots[name.format(i=i)] = (rule, at, j)
        for leaf in rule.jodpo:
            need[leaf] = len(rule.indices(model))
    if unruled := sorted("/".join(leaf) for leaf in shapes if leaf not in need):  # a family's rules fell behind
        raise NotImplementedError(f"jodpo's {model.family} rules fill no tensor into {unruled}: a bug in "
                                  "jodpo.models.families; please report it with the checkpoint's config.json.")
    done: dict[tuple[str, ...], jax.Array] = {}
    pending: dict[tuple[int, int | None], dict[int, np.ndarray]] = {}
    seen: set[str] = set()
    skipped: dict[str, int] = {}
    left_out = families.family_of(model).skipped
    fused = lambda name: _strip_prefix(name, model) in slots  # noqa: E731 - a rule reads it as it is
    for name, tensor in _per_expert(iter_tensors(path) if tensors is None else tensors, fused):
        part = next((what for prefix, what in left_out.items() if name.startswith(prefix)), None)
        if part is not None:
            skipped[part] = skipped.get(part, 0) + 1
            continue
        name = _strip_prefix(name, model)
        if name not in slots:
            if name.endswith(families.IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.task == "causal_lm"):
                continue  # buffers, or a tied head that the checkpoint stores anyway
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for a {model.family} {model.task} model "
                                  "(config.json and the weights disagree).")
        rule, i, j = slots[name]
        seen.add(name)
        parts = pending.setdefault((id(rule), i), {})
        parts[j] = tensor if tensor.dtype == np_dtype else tensor.astype(np.float32)
        if len(parts) < len(rule.hf):
            continue
        del pending[(id(rule), i)]
        for leaf, value in zip(rule.jodpo, rule.to_jodpo(*(parts[k] for k in range(len(rule.hf))))):
            if leaf not in leaves:
                leaves[leaf] = np.empty(shapes[leaf], np_dtype)
            target = leaves[leaf][i] if rule.per_layer else leaves[leaf]
            if value.shape != target.shape:
                raise CheckpointError(f"{path}: tensor {name!r} has shape {tensor.shape}, which does not fit "
                                      f"{'/'.join(leaf)} {target.shape} of config.json.")
            target[...] = value
            need[leaf] -= 1
            if need[leaf] == 0:
                done[leaf] = place(leaf, leaves.pop(leaf)) if place else jax.device_put(leaves.pop(leaf))
    if skipped:
        import warnings

        parts = " and ".join(f"its {what} ({n} tensors)" for what, n in skipped.items())
        warnings.warn(f"{path}: its language model loads as a text {model.family} model; {parts} "
                      f"{'are' if len(skipped) > 1 else 'is'} left out")
    missing = sorted(set(slots) - seen)
    if missing:
        hint = (" A reward model needs score.weight (a *ForSequenceClassification checkpoint)."
                if any(m.startswith("score") for m in missing) else "")
        raise CheckpointError(f"{path}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}.{hint}")
    params: dict = {}
    for leaf, value in done.items():
        node = params
        for k in leaf[:-1]:
            node = node.setdefault(k, {})
        node[leaf[-1]] = value
    return params


def load_model(path_or_hub_id: str, task: str = "causal_lm", dtype=jnp.float32, *,
               revision: str | None = None, place=None, precision: str = "highest") -> tuple[Model, Params]:
    """Load a transformers checkpoint as ``(model, params)``.

    Args:
      path_or_hub_id: a local directory, a ``.gguf`` file (llama.cpp's format: Llama, Qwen2, Qwen3, Qwen3.5, Gemma 2-4,
        Qwen3-MoE, OLMoE, Qwen3.5-MoE, dequantized to ``dtype``; also a directory holding one and no config.json), or a hub id (fetched through
        huggingface_hub; HF_HUB_OFFLINE and the local cache are honoured).
      task: ``"causal_lm"`` for a policy (``*ForCausalLM``) or ``"reward"`` for a
        ``*ForSequenceClassification`` reward model with ``num_labels=1``.
      dtype: parameter and compute dtype (float32 or bfloat16).
      revision: a hub branch, tag or commit.
      place: where the parameters go, a function ``(model, dtype) -> put(leaf_path, host_array) -> jax.Array``:
        ``jodpo.parallel.sharding.placer(mesh)`` sends each parameter straight from the host to its shards on a
        mesh (every process reads the files and transfers only the pieces its own devices hold); None: the default
        device.
      precision: how float32 dots are computed (``Model.precision``, jax's names): ``"highest"`` is float32 on
        every backend, as torch computes; ``"high"`` or ``"default"`` let a GPU use TF32 (faster, ~1e-3
        relative) and a TPU fewer bf16 passes. ``model.replace(precision=...)`` changes it later.
    """
    if is_model_object(path_or_hub_id):  # a transformers model a script already built: read once, from memory
        model = model_from_object(path_or_hub_id, task, dtype).replace(precision=precision)
        put = None if place is None else place(model, jnp.dtype(dtype))
        return model, load_params(model, _object_name(path_or_hub_id), dtype, put, _object_tensors(path_or_hub_id))
    path = resolve_path(path_or_hub_id, revision, task=task)
    gguf_file, tensors = gguf.find(path), None
    if gguf_file is not None:
        model, tensors = _gguf_model(gguf_file, task, dtype)
    else:
        if not any(path.glob("*.safetensors")):  # a hub repo with only .bin weights: fetch those too
            path = resolve_path(path_or_hub_id, revision, with_bin=True, task=task)
        model = model_from_dir(path, task, dtype)
    model = model.replace(precision=precision)
    put = None if place is None else place(model, jnp.dtype(dtype))
    return model, load_params(model, gguf_file or path, dtype, put, tensors)


def _gguf_model(file: Path, task: str, dtype):
    """The ``Model`` of a GGUF file and the iterator of its dequantized tensors (read only when iterated)."""
    if task != "causal_lm":
        raise CheckpointError(f"{file}: a GGUF file holds a causal LM; a reward model must be a "
                              "*ForSequenceClassification transformers checkpoint with num_labels=1.")
    g = gguf.open_file(file)
    cfg = g.hf_config()
    try:
        model = families.model_from_hf_config(cfg, task, dtype=jnp.dtype(dtype).name, eos_token_ids=g.eos_token_ids())
    except UnsupportedModelError as e:
        raise CheckpointError(f"{file}: {e}") from e
    return model, g.tensors(model.num_heads, model.num_kv_heads)  # (Gemma 4's config has per-layer-type kv heads)


def custom_code(path_or_hub_id, revision: str | None = None) -> str | None:
    """The Python code a checkpoint's config.json names for transformers' Auto classes (its ``auto_map``, which
    transformers runs only with ``trust_remote_code=True``), as ``"AutoModelForCausalLM: modeling_x.XForCausalLM"``;
    None for a checkpoint without any (and for a model object, a GGUF file)."""
    if is_model_object(path_or_hub_id):
        return None
    path = resolve_path(path_or_hub_id, revision)
    if gguf.find(path) is not None:
        return None
    auto_map = read_config_json(path).get("auto_map") or {}
    if not auto_map:
        return None
    key = "AutoModelForCausalLM" if "AutoModelForCausalLM" in auto_map else next(iter(auto_map))
    return f"{key}: {auto_map[key]}"


def describe_model(path_or_hub_id: str, task: str = "causal_lm", dtype=jnp.float32, *,
                   revision: str | None = None) -> Model:
    """The static ``Model`` that ``load_model`` would return, without reading the weights (a transformers
    directory's config.json, or a GGUF file's metadata, or a transformers model object's config)."""
    if is_model_object(path_or_hub_id):
        return model_from_object(path_or_hub_id, task, dtype)
    path = resolve_path(path_or_hub_id, revision, task=task)
    gguf_file = gguf.find(path)
    return _gguf_model(gguf_file, task, dtype)[0] if gguf_file else model_from_dir(path, task, dtype)


def load_tokenizer(path_or_hub_id: str, revision: str | None = None):
    """The checkpoint's tokenizer (``transformers.AutoTokenizer``), left-padding, with a pad token.

    A tokenizer without a pad token gets EOS as its pad token, with a warning, as TRL does.
    """
    from transformers import AutoTokenizer

    path = resolve_path(path_or_hub_id, revision)
    gguf_file = gguf.find(path)
    if gguf_file:  # its own messages (a damaged file is not a missing tokenizer)
        return ready_tokenizer(gguf_tokenizer.tokenizer(gguf_file), str(gguf_file))
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no usable tokenizer ({e}). Save one with tokenizer.save_pretrained(...).") from e
    return ready_tokenizer(tok, str(path))


def ready_tokenizer(tok, name: str):
    """A tokenizer as jodpo uses it: left-padding, with a pad token (EOS, with a warning, as TRL does)."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise CheckpointError(f"{name}: the tokenizer has neither a pad token nor an EOS token; add one.")
        import warnings

        warnings.warn(f"{name}: tokenizer has no pad token; using its EOS token {tok.eos_token!r} as pad (as TRL does).")
        tok.pad_token = tok.eos_token
    return tok
