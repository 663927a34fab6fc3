"""Export a jodpo training checkpoint as a transformers model directory.

  python scripts/export_hf.py --checkpoint OUTPUT_DIR_OR_STEP_DIR --out HF_DIR \\
      [--dtype float32|bfloat16] [--max-shard-size 5GB] [--overwrite] [--debug]

``--checkpoint`` is a training ``output_dir`` (its newest readable checkpoint is taken; an unreadable one is
skipped for the previous with a warning) or one ``output_dir/checkpoints/<step>`` directory. Only the policy
parameters are read, onto the CPU, so a checkpoint written on any mesh (8 devices, a pod) exports on a laptop.
The model's config and tokenizer come from ``output_dir/source_model`` (written when training starts), or
else from the run's ``model_name_or_path``.

``HF_DIR`` gets config.json, generation_config.json, safetensors (sharded with an index above
``--max-shard-size``), the tokenizer and a README.md model card with the training config. After writing,
the export is read back (jodpo: bitwise parameters; transformers, when torch is installed: logits) and a
mismatch is an error.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from jodpo.checkpoint import find_step_dir, restore_params  # noqa: E402
from jodpo.models import CheckpointError, param_shapes  # noqa: E402
from jodpo.models.export import DTYPES, ExportMismatch, check_output_dir, save_hf, verify_export  # noqa: E402
from jodpo.models.loading import load_tokenizer, model_from_dir, resolve_path  # noqa: E402

log = logging.getLogger("jodpo")


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


def model_card(run_dir: Path, step_dir: Path, out_dir: Path, dtype: str) -> str:
    cfg_file, metrics_file = run_dir / "config.json", run_dir / "metrics.jsonl"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    step = int(step_dir.name)
    last = {}
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            row = json.loads(line)
            if row.get("step", 0) <= step and "loss" in row:
                last = row
    kind = "online DPO" if "objective/scores" in last or not last else "DPO"
    base = cfg.get("model_name_or_path", "unknown")
    hub_id = base.count("/") == 1 and not base.startswith((".", "/", "~"))  # a local path means nothing elsewhere
    lines = ["---", "library_name: transformers", *([f"base_model: {base}"] if hub_id else []), "tags:", "- jodpo",
             f"- {kind.lower().replace(' ', '-')}", "---", "",
             f"# {kind} policy, step {step}", "",
             f"Trained from `{base}` with jodpo's {kind} "
             f"(TRL `OnlineDPOTrainer` semantics) for {step} optimizer steps; exported from `{step_dir}` in {dtype}.",
             "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             f'model = AutoModelForCausalLM.from_pretrained("{out_dir}")',
             f'tokenizer = AutoTokenizer.from_pretrained("{out_dir}")',
             "```"]
    if last:
        shown = {k: last[k] for k in ("step", "loss", "objective/scores", "objective/rlhf_reward", "objective/kl",
                                      "rewards/accuracies", "eval/objective/scores", "eval/win_rate") if k in last}
        lines += ["", "## Metrics at the exported step", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4g} |" for k, v in shown.items()]
    if cfg:
        lines += ["", "## Training config", "", "```json", json.dumps(cfg, indent=2), "```"]
    return "\n".join(lines) + "\n"


def export(checkpoint: str, out: str, dtype: str = "float32", max_shard_size: str = "5GB",
           overwrite: bool = False) -> tuple[Path, list[str]]:
    """Write the export; returns its directory and the lines of the read-back checks."""
    out_dir = Path(out).absolute()
    check_output_dir(out_dir, overwrite)  # before any work, so a refusal is immediate
    candidates = find_step_dir(checkpoint)
    for k, step_dir in enumerate(candidates):
        try:
            params = restore_params(step_dir)
            break
        except CheckpointError as e:
            if k == len(candidates) - 1:
                raise
            log.warning("%s; trying the previous checkpoint", e)
    run_dir = step_dir.parent.parent
    source = source_model_dir(run_dir)
    model = model_from_dir(source, "causal_lm", "float32")
    got, need = _shapes(params), _shapes(param_shapes(model))
    if got != need:
        diff = sorted(k for k in set(got) | set(need) if got.get(k) != need.get(k))
        raise CheckpointError(f"{step_dir}: the checkpoint's parameters do not fit {source}/config.json "
                              f"(first differences: {diff[:3]})")
    tokenizer = load_tokenizer(str(source))
    written = save_hf(model, params, out_dir, tokenizer, overwrite, dtype=dtype, max_shard_size=max_shard_size,
                      model_card=model_card(run_dir, step_dir, out_dir, dtype))
    return written, verify_export(model, params, written, dtype)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree.leaves_with_path(tree)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/export_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a training output_dir, or one checkpoints/<step> dir")
    parser.add_argument("--out", required=True, help="directory to write (must be empty unless --overwrite)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the saved weights")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (5GB, 500MB, 2GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        out, checks = export(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.overwrite)
    except ExportMismatch as e:
        if args.debug:
            raise
        print(f"export_hf: error: the export does not match the checkpoint: {e}", file=sys.stderr)
        return 1
    except (CheckpointError, FileNotFoundError, FileExistsError, ValueError, OSError) as e:
        if args.debug:
            raise
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    for line in checks:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
