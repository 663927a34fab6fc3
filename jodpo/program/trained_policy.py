"""A training run's policy as a model: the parameters of one Orbax checkpoint (only ``state/params``, read onto
the CPU, whatever mesh wrote them), the architecture and tokenizer from ``output_dir/source_model`` (written when
training starts; else the run's ``model_name_or_path``), and for a LoRA run (``use_peft``) the base weights read
again from ``model_name_or_path`` with the adapters. ``scripts/export_hf.py`` and ``python -m jodpo.generate``
read runs through it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax

from jodpo.errors import CheckpointError
from jodpo.program.checkpoint import find_step_dir, restore_params
from jodpo.models import Model, param_shapes
from jodpo.models import lora
from jodpo.models.loading import load_model, load_tokenizer, model_from_dir, resolve_path

log = logging.getLogger("jodpo")


def is_run_dir(path: str | Path) -> bool:
    """``path`` is a training output_dir (or its ``checkpoints/``, or one ``checkpoints/<step>``)."""
    p = Path(path)
    return p.is_dir() and ((p / "checkpoints").is_dir() or (p / "state").is_dir() or
                           (p.name == "checkpoints" and (p.parent / "config.json").is_file()))


def source_model_dir(run_dir: Path) -> Path:
    """Where the policy's config and tokenizer are: ``output_dir/source_model``, else ``model_name_or_path``."""
    if (run_dir / "source_model" / "config.json").is_file():
        return run_dir / "source_model"
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{run_dir} has neither source_model/ nor config.json: it is not a jodpo output_dir, "
                                "so the model's architecture is unknown")
    cfg = json.loads(cfg_file.read_text())
    return resolve_path(cfg["model_name_or_path"], cfg.get("model_revision"))


def run_config(run_dir: Path) -> dict:
    """The run's saved ``config.json`` (empty when there is none)."""
    f = run_dir / "config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def step_dir_of(checkpoint: str | Path, step: int | None = None) -> list[Path]:
    """Step directories to try, newest first: ``find_step_dir`` of ``checkpoint``, or only step ``step`` of it."""
    candidates = find_step_dir(checkpoint)
    if step is None:
        return candidates
    chosen = [p for p in candidates if p.name == str(step)]
    if not chosen:
        raise FileNotFoundError(f"{checkpoint} has no checkpoint of step {step}; it has steps "
                                f"{sorted(int(p.name) for p in candidates)}")
    return chosen


def restore_newest(candidates: list[Path]) -> tuple[Path, dict]:
    """The first readable step of ``candidates`` (newest first) and its policy parameters; an unreadable one is
    skipped for the previous with a warning."""
    for k, step_dir in enumerate(candidates):
        try:
            return step_dir, restore_params(step_dir)
        except CheckpointError as e:
            if k == len(candidates) - 1:
                raise
            log.warning("%s; trying the previous checkpoint", e)
    raise FileNotFoundError("no checkpoint to restore")


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree.leaves_with_path(tree)}


def check_fits(model: Model, params: dict, step_dir: Path, source: Path) -> None:
    """The checkpoint's parameters have exactly the shapes ``source/config.json`` gives."""
    got, need = _shapes(params), _shapes(param_shapes(model))
    if got != need:
        diff = sorted(k for k in set(got) | set(need) if got.get(k) != need.get(k))
        raise CheckpointError(f"{step_dir}: the checkpoint's parameters do not fit {source}/config.json "
                              f"(first differences: {diff[:3]})")


def lora_parts(run_cfg: dict, model: Model, adapters: dict, step_dir: Path, source: Path, read_base: bool = True):
    """A LoRA run's ``(lora_model, targets, base params)``: the adapters checked against ``lora_r`` and the targets,
    the base weights read again (float32) from the run's ``model_name_or_path`` (None without ``read_base``: a PEFT
    adapter directory holds the adapters alone, and a base given in memory has no path to read)."""
    lora_model = model.replace(lora_rank=run_cfg["lora_r"], lora_alpha=float(run_cfg["lora_alpha"]))
    targets = lora.resolve_targets(lora_model, run_cfg.get("lora_target_modules"),
                                   run_cfg.get("lora_target_parameters"))
    specs = lora.adapter_specs(lora_model, targets)
    need = _shapes(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], "float32"), specs,
                                is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple)))
    if _shapes(adapters) != need:
        raise CheckpointError(f"{step_dir}: the checkpoint's adapters do not fit lora_r={run_cfg['lora_r']} and the "
                              f"targets {list(targets)} of {source}/config.json")
    if not read_base:
        return lora_model, targets, None
    _, base = load_model(run_cfg["model_name_or_path"], "causal_lm", "float32", revision=run_cfg.get("model_revision"))
    return lora_model, targets, base


@dataclasses.dataclass
class RunPolicy:
    step_dir: Path  # the checkpoint read (output_dir/checkpoints/<step>)
    source: Path  # where the architecture and tokenizer came from
    config: dict  # the run's config.json
    model: Model
    params: dict  # float32, on the CPU; a LoRA run's base with its adapters merged in
    tokenizer: object

    @property
    def step(self) -> int:
        return int(self.step_dir.name)


def load_run_policy(checkpoint: str | Path, step: int | None = None) -> RunPolicy:
    """The policy of a run's newest readable checkpoint (or of ``step``), as export writes it: a LoRA run's base
    with its adapters merged."""
    step_dir, params = restore_newest(step_dir_of(checkpoint, step))
    run_dir = step_dir.parent.parent
    source = source_model_dir(run_dir)
    model = model_from_dir(source, "causal_lm", "float32")
    cfg = run_config(run_dir)
    if cfg.get("use_peft"):
        lora_model, _, base = lora_parts(cfg, model, params, step_dir, source)
        params = lora.merged(lora_model, base, params)
    else:
        check_fits(model, params, step_dir, source)
    return RunPolicy(step_dir, source, cfg, model, params, load_tokenizer(str(source)))


def export_run(run_dir: str | Path, out: str | Path, step_dir: Path | None = None, params: dict | None = None) -> Path:
    """A run's policy as a transformers directory in ``out`` (a LoRA run's as a PEFT adapter directory), with the
    tokenizer: ``params`` (host arrays of the trained policy, a LoRA run's adapters) when given, else checkpoint
    ``step_dir``'s, else the run's newest readable one. ``OnlineDPOTrainer.save_model`` and the Hub pushes write
    through it. Returns ``out``."""
    from jodpo.models.export import save_hf

    run_dir = Path(run_dir)
    if params is None:
        step_dir, params = restore_newest([step_dir] if step_dir is not None else step_dir_of(run_dir))
    source = source_model_dir(run_dir)
    model, cfg = model_from_dir(source, "causal_lm", "float32"), run_config(run_dir)
    tokenizer = load_tokenizer(str(source))
    if cfg.get("use_peft"):
        lora_model, targets, _ = lora_parts(cfg, model, params, step_dir or run_dir, source, read_base=False)
        return lora.save_peft(lora_model, params, out, targets, cfg.get("lora_dropout", 0.0),
                              cfg["model_name_or_path"], tokenizer, overwrite=True)
    return save_hf(model, params, out, tokenizer, overwrite=True)
