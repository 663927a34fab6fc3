"""Export a jodpo training checkpoint as a transformers model directory.

  python scripts/export_hf.py --checkpoint OUTPUT_DIR_OR_STEP_DIR --out HF_DIR \\
      [--dtype float32|bfloat16] [--max-shard-size 5GB] [--overwrite] [--peft] [--debug]

``--checkpoint`` is a training ``output_dir`` (its newest readable checkpoint is taken; an unreadable one is
skipped for the previous with a warning) or one ``output_dir/checkpoints/<step>`` directory. Only the policy
parameters are read, onto the CPU, so a checkpoint written on any mesh (8 devices, a pod) exports on a laptop.
The model's config and tokenizer come from ``output_dir/source_model`` (written when training starts), or
else from the run's ``model_name_or_path``.

``HF_DIR`` gets config.json, generation_config.json, safetensors (sharded with an index above
``--max-shard-size``), the tokenizer and a README.md model card with the training config. After writing,
the export is read back (jodpo: bitwise parameters; transformers, when torch is installed: logits) and a
mismatch is an error.

A LoRA run (``use_peft``) checkpoints only its adapters; the export reads the base weights again from the run's
``model_name_or_path`` and writes the merged model, or with ``--peft`` a PEFT adapter directory
(``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer) that ``peft.PeftModel.from_pretrained``
loads onto the base model; it is checked the same way, through peft, when torch and peft are installed.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import jax

from jodpo.errors import CheckpointError, ExportMismatch
from jodpo.models.export import DTYPES, check_output_dir, save_hf, verify_export
from jodpo.models import lora
from jodpo.program import backend
from jodpo.models.loading import load_tokenizer, model_from_dir, resolve_path
from jodpo.program.trained_policy import (check_fits, lora_parts, restore_newest, run_config, source_model_dir,
                                          step_dir_of)

log = logging.getLogger("jodpo")


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
           overwrite: bool = False, peft: bool = False) -> tuple[Path, list[str]]:
    """Write the export; returns its directory and the lines of the read-back checks. An export whose read-back
    does not match the checkpoint (``ExportMismatch``) is removed: nothing is left at ``out``."""
    out_dir = Path(out).absolute()
    check_output_dir(out_dir, overwrite)  # before any work, so a refusal is immediate
    try:
        return _export(checkpoint, out_dir, dtype, max_shard_size, overwrite, peft)
    except ExportMismatch:
        shutil.rmtree(out_dir, ignore_errors=True)  # written whole (atomically), then found wrong: not an export
        raise


def _export(checkpoint: str, out_dir: Path, dtype: str, max_shard_size: str, overwrite: bool,
            peft: bool) -> tuple[Path, list[str]]:
    step_dir, params = restore_newest(step_dir_of(checkpoint))
    run_dir = step_dir.parent.parent
    source = source_model_dir(run_dir)
    model = model_from_dir(source, "causal_lm", "float32")
    run_cfg = run_config(run_dir)
    if run_cfg.get("use_peft"):
        return _export_lora(run_cfg, model, params, step_dir, source, out_dir, dtype, max_shard_size, overwrite, peft)
    if peft:
        raise ValueError(f"--peft exports LoRA adapters, and {run_dir} is not a LoRA run (use_peft is off); "
                         "export it without --peft")
    check_fits(model, params, step_dir, source)
    tokenizer = load_tokenizer(str(source))
    written = save_hf(model, params, out_dir, tokenizer, overwrite, dtype=dtype, max_shard_size=max_shard_size,
                      model_card=model_card(run_dir, step_dir, out_dir, dtype))
    return written, verify_export(model, params, written, dtype)


def _export_lora(run_cfg: dict, model, adapters, step_dir: Path, source: Path, out_dir: Path, dtype: str,
                 max_shard_size: str, overwrite: bool, peft: bool) -> tuple[Path, list[str]]:
    """The merged model (base weights from ``model_name_or_path`` plus the adapters), or the PEFT adapters."""
    lora_model, targets, base = lora_parts(run_cfg, model, adapters, step_dir, source)
    base_path = run_cfg["model_name_or_path"]
    tokenizer = load_tokenizer(str(source))
    if peft:
        written = lora.save_peft(lora_model, adapters, out_dir, targets, run_cfg.get("lora_dropout", 0.0), base_path,
                                 tokenizer, overwrite)
        return written, verify_peft(lora_model, base, adapters, base_path, written)
    params = lora.merged(lora_model, base, adapters)
    written = save_hf(model, params, out_dir, tokenizer, overwrite, dtype=dtype, max_shard_size=max_shard_size,
                      model_card=model_card(run_dir=step_dir.parent.parent, step_dir=step_dir, out_dir=out_dir,
                                            dtype=dtype))
    return written, verify_export(model, params, written, dtype)


def verify_peft(lora_model, base, adapters, base_path: str, out_dir: Path, rtol: float = 1e-4) -> list[str]:
    """peft's model (the base from ``base_path`` with the written adapters) must give jodpo's logits within ``rtol``
    of the largest logit, on a few fixed tokens."""
    import numpy as np

    from jodpo.models import logits

    try:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError:
        return ["adapters written; not compared through peft: torch or peft is not installed"]
    ids = np.random.default_rng(0).integers(0, lora_model.vocab_size, size=(2, 8)).astype(np.int32)
    mask = np.ones_like(ids)
    f32 = lora_model.replace(dtype="float32", remat="none", precision="highest")
    with jax.default_device(jax.devices("cpu")[0]):
        ours = np.asarray(logits(f32, lora.attach(base, adapters), ids, mask))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_path(base_path)), dtype=torch.float32)
    theirs = PeftModel.from_pretrained(hf, str(out_dir)).eval()
    with torch.no_grad():
        got = theirs(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    err = float(np.abs(got - ours).max() / max(1e-6, float(np.abs(ours).max())))
    if not err <= rtol:
        raise ExportMismatch(f"{out_dir}: peft's logits differ from jodpo's by {err:.2e} of the largest (limit {rtol})")
    return [f"loaded with peft onto {base_path}: logits equal jodpo's within {err:.1e} of the largest"]


def main(argv: list[str] | None = None) -> int:
    backend.start_command()  # no "PyTorch was not found" from transformers where torch is not installed
    parser = argparse.ArgumentParser(prog="python scripts/export_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a training output_dir (its newest checkpoint), or one checkpoints/<step> dir")
    parser.add_argument("--out", required=True, help="directory to write (must be empty unless --overwrite)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="dtype of the saved weights (default: %(default)s, bitwise the trained ones)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file: 5GB, 500MB, 2GiB (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: refuse)")
    parser.add_argument("--peft", action="store_true", help="a LoRA run: write its adapters in PEFT's format "
                                                            "(default: the merged model)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        out, checks = export(args.checkpoint, args.out, args.dtype, args.max_shard_size, args.overwrite, args.peft)
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
