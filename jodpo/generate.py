"""Completions of a model for a prompt dataset, to JSONL: ``python -m jodpo.generate MODEL --out FILE.jsonl``.

MODEL is a training ``output_dir`` (its newest checkpoint, or ``--step N``; a LoRA run's base with its adapters
merged, as export writes it), an exported transformers directory, a ``.gguf`` file or a hub id (anything
``jodpo.load_model`` takes). The settings keep the training config's names (``--temperature 0`` is greedy) and, for
a run, default to the run's own config; the prompts default to the run's evaluation set. Sampling is the in-run
evaluation's: the jitted sampler (``jodpo.sample``), prompts left-padded to the training buckets, batches of
``per_device_eval_batch_size`` x the data-parallel devices split over the mesh, every batch drawn with the key of the
run's evaluation (``seed``, step -1), so a run's checkpoint generates what its evaluation sampled.

One row per prompt: ``index``, ``prompt`` (as in the dataset), ``prompt_text`` (as rendered: chat messages through
the chat template), ``completion``, ``completion_tokens`` (EOS included), ``eos`` (it ended with an EOS). Rows are
appended a whole batch at a time; a rerun of the same command continues where an interrupted one stopped (a
half-written batch is dropped and drawn again) and writes exactly what an uninterrupted run writes. The settings
are kept beside the file (``NAME.settings.json`` for ``NAME.jsonl``); a rerun with other settings is refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

from jodpo import collective_order
from jodpo.errors import CheckpointError, ConfigError, GenerateError
from jodpo.program import backend
from jodpo.program import data as D
from jodpo.parallel import sharding as S
from jodpo.program import flags as F
from jodpo.program.config import FIELDS, TrainConfig, from_dict
from jodpo.models import Model, load_model, load_tokenizer
from jodpo.program.trained_policy import is_run_dir, load_run_policy
from jodpo.sampling import SamplingConfig, sample
from jodpo.program.run import stop_token_ids
from jodpo.program.sources import describe_split, load_split, training_prompts

# The training config's fields that shape generation (``--FIELD VALUE`` on the command line).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "stop_token",
                   "max_prompt_length", "prompt_buckets", "seed", "per_device_eval_batch_size", "decode_chunk",
                   "sampler_slots", "bf16", "matmul_precision", "attn_implementation", "decode_attn_implementation",
                   "param_dtype", "mesh_data", "mesh_fsdp", "mesh_expert", "mesh_tensor")
DATA_FIELDS = ("dataset_name", "dataset_config", "dataset_test_split", "chat_template_path")

_jit_sample = collective_order.jit(sample, static_argnums=(0, 5, 6))



@dataclasses.dataclass
class Policy:
    """A model ready to sample: its settings (a TrainConfig), compute settings applied, parameters on the mesh."""
    name: str  # as given
    step: int | None  # a run's checkpoint step
    cfg: TrainConfig
    model: Model
    params: dict
    tokenizer: object
    mesh: jax.sharding.Mesh
    sampling: SamplingConfig
    trained_on: dict | None = None  # a run's training data (its config's dataset fields), which the prompts avoid

    @property
    def batch_size(self) -> int:
        return self.cfg.per_device_eval_batch_size * S.data_parallel_size(self.mesh)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.cfg.prompt_buckets or D.default_buckets(self.cfg.max_prompt_length)


def _run_cfg(saved: dict, where: Path) -> TrainConfig:
    fields = {k: v for k, v in saved.items() if k in FIELDS}
    fields["report_to"] = "none"  # where the run reported is nothing to sample with
    try:
        return from_dict(fields, source=str(where / "config.json"))
    except ConfigError as e:
        raise ConfigError(f"{where}/config.json: {e}") from None


def load_policy(name: str, step: int | None = None, overrides: dict | None = None) -> Policy:
    """``name`` (a run dir, an HF dir, a .gguf file or a hub id) with its settings: a run's config, else the
    training config's defaults, with ``overrides`` (TrainConfig fields) on top."""
    overrides = dict(overrides or {})
    if is_run_dir(name):
        run = load_run_policy(name, step)
        cfg = _run_cfg(run.config, run.step_dir.parent.parent).replace(**overrides)
        model, params, tokenizer, step = run.model, run.params, run.tokenizer, run.step
        trained_on = {k: run.config.get(k) for k in ("dataset_name", "dataset_mixer", "dataset_train_split")}
    else:
        if step is not None:
            raise GenerateError(f"--step {step}: {name} is not a training output_dir (no checkpoints/), so it has "
                                "no steps; leave --step out")
        cfg = TrainConfig(model_name_or_path=name).replace(**overrides)
        model, params, tokenizer, trained_on = None, None, load_tokenizer(name), None
    D.set_chat_template(tokenizer, cfg.chat_template_path)
    mesh = S.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor, expert=cfg.mesh_expert)
    if params is None:
        model, params = load_model(name, "causal_lm", cfg.param_dtype, place=S.placer(mesh))
    else:
        params = jax.device_put(jax.tree.map(lambda x: x.astype(cfg.param_dtype), params),
                                S.param_shardings(model, mesh))
    model = model.replace(dtype="bfloat16" if cfg.bf16 else "float32", remat="none", precision=cfg.matmul_precision,
                          attention=backend.attention_kernel(cfg, model),
                          decode_attention=backend.decode_attention_kernel(cfg))

    eos = [*model.eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []),
           *stop_token_ids(cfg, tokenizer)]
    sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                              top_p=cfg.top_p, min_p=cfg.min_p or 0.0, repetition_penalty=cfg.repetition_penalty,
                              eos_token_ids=tuple(dict.fromkeys(eos)), pad_token_id=tokenizer.pad_token_id,
                              chunk=cfg.decode_chunk, slots=cfg.sampler_slots)
    return Policy(name, step, cfg, model, params, tokenizer, mesh, sampling, trained_on)


def load_prompts(policy: Policy, max_prompts: int | None = None, allow_training_prompts: bool = False,
                 say=None) -> D.PromptData:
    """The prompts: ``dataset_name`` if given, else a run's evaluation set (its eval_dataset, or its dataset's
    ``dataset_test_split``; mixers as the run mixes them), the first ``max_prompts`` rows. ``say`` (a function of one
    line) is told which split is read. The training prompts of a run (its dataset's training split, or a single file
    it trained on, which has no other split) are refused unless ``allow_training_prompts``: a score on them is no
    held-out measure, and nothing else would tell."""
    cfg = policy.cfg
    if not (cfg.dataset_name or cfg.eval_dataset or cfg.dataset_eval_mixer or cfg.dataset_mixer):
        raise GenerateError("no prompts: give --dataset_name (a hub id, or a local json/jsonl/parquet/csv file or "
                            "directory with a 'prompt' column)")
    mixer, name = cfg.dataset_eval_mixer or (None if cfg.eval_dataset else cfg.dataset_mixer), \
        cfg.eval_dataset or cfg.dataset_name
    where = describe_split(mixer, name, cfg.dataset_test_split)
    same = None if policy.trained_on is None else training_prompts(mixer, name, cfg.dataset_test_split,
                                                                   policy.trained_on)
    if same and not allow_training_prompts:
        raise GenerateError(f"the prompts would be {where}, which {policy.name} trained on ({same}); give held-out "
                            "prompts (--dataset_name, or --dataset_test_split of a dataset with such a split), or "
                            "--allow_training_prompts to use its training prompts anyway")
    rows = load_split(mixer, name, cfg, cfg.dataset_test_split)
    if max_prompts is not None:
        rows = rows.select(range(min(len(rows), max_prompts)))
    if say is not None:
        say(f"prompts: {where}" + (f", the first {len(rows)}" if max_prompts is not None else f", {len(rows)} rows") +
            (" (the run's training prompts: --allow_training_prompts)" if same else ""))
    return D.prepare_prompts(rows, policy.tokenizer, cfg.max_prompt_length)


def sample_batch(policy: Policy, seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Host ``(tokens, mask)`` [B, T] of one completion per prompt, with the in-run evaluation's key."""
    ids, mask = D.prompt_batch(seqs, 1, policy.buckets, policy.sampling.pad_token_id)
    put = lambda x: S.put(x[0], S.batch_sharding(policy.mesh, 2, axis=0))  # noqa: E731
    key = jax.random.fold_in(jax.random.PRNGKey(policy.cfg.seed), np.int32(-1))
    out = _jit_sample(policy.model, policy.params, put(ids), put(mask), key, policy.sampling, 1)
    return S.to_host(out.tokens), S.to_host(out.mask)


def completion_rows(policy: Policy, data: D.PromptData, start: int, stop: int) -> list[dict]:
    """The rows of prompts ``start .. stop - 1`` (one batch; a short last batch is filled with copies of its last
    prompt, so every batch has the compiled shape, and the copies' completions are dropped)."""
    idx = list(range(start, stop))
    seqs = [data.ids[i] for i in idx]
    seqs += [seqs[-1]] * (policy.batch_size - len(seqs))
    tokens, mask = sample_batch(policy, seqs)
    texts = policy.tokenizer.batch_decode(tokens, skip_special_tokens=True)
    eos = np.asarray(policy.sampling.eos_token_ids or (-1,))
    rows, kwargs = [], data.columns.get("chat_template_kwargs")
    for k, i in enumerate(idx):
        real = tokens[k][mask[k] > 0]
        text = D.render_prompt(policy.tokenizer, data.prompts[i], kwargs[i] if kwargs else None)
        rows.append({"index": i, "prompt": data.prompts[i], "prompt_text": text,
                     "completion": texts[k], "completion_tokens": int(len(real)),
                     "eos": bool(np.isin(real, eos).any())})
    return rows


# --------------------------------------------------------------------------------------------------
# Resumable JSONL files
# --------------------------------------------------------------------------------------------------


def settings_path(out: Path) -> Path:
    return out.with_name(out.stem + ".settings.json")


def read_rows(out: Path, batch: int, prompts: list) -> list[dict]:
    """The whole batches already in ``out``, checked against ``prompts``; a torn last line or a half-written last
    batch is cut off the file (nothing is cut from a file that fails the checks)."""
    if not out.exists():
        return []
    raw = out.read_bytes()
    lines = raw[:raw.rfind(b"\n") + 1].splitlines(keepends=True)
    try:
        rows = [json.loads(line) for line in lines]
    except json.JSONDecodeError as e:
        raise GenerateError(f"{out} is not a JSONL file this command wrote ({e}); give a new --out, or --overwrite")
    for k, row in enumerate(rows):
        if not isinstance(row, dict) or row.get("index") != k or k >= len(prompts) or row.get("prompt") != prompts[k]:
            raise GenerateError(f"{out}: row {k} is not prompt {k} of the dataset; the file belongs to other prompts. "
                                "Give a new --out, or --overwrite")
    keep = len(rows) if len(rows) == len(prompts) else len(rows) // batch * batch
    size = sum(map(len, lines[:keep]))
    if size != len(raw) and jax.process_index() == 0:
        with open(out, "r+b") as f:
            f.truncate(size)
    return rows[:keep]


def check_settings(out: Path, settings: dict, overwrite: bool) -> None:
    """Write ``settings`` beside ``out``, or check them against those of the rows already there."""
    path = settings_path(out)
    if overwrite and jax.process_index() == 0:
        out.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
    if out.exists() and out.stat().st_size and path.exists():
        old = json.loads(path.read_text())
        changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if changed:
            detail = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in changed[:4])
            raise GenerateError(f"{out} holds completions made with other settings ({detail}); rerun with the same "
                                "settings to continue it, give a new --out, or --overwrite to start it again")
    elif out.exists() and out.stat().st_size:
        raise GenerateError(f"{out} exists and was not written by this command (no {path.name} beside it); give a "
                            "new --out, or --overwrite to replace it")
    if jax.process_index() == 0:  # (every process reads and checks; process 0 writes)
        out.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=2) + "\n")


def append_rows(out: Path, rows: list[dict]) -> None:
    """One write per batch, flushed to disk before the next batch starts."""
    with open(out, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def settings_of(policy: Policy, max_prompts: int | None) -> dict:
    fields = {k: getattr(policy.cfg, k) for k in (*SAMPLING_FIELDS, *DATA_FIELDS, "eval_dataset")}
    name = str(Path(policy.name).absolute()) if Path(policy.name).exists() else policy.name
    return {"model": name, "step": policy.step, "max_prompts": max_prompts,
            **json.loads(json.dumps(fields))}


def generate(policy: Policy, data: D.PromptData, out: Path, settings: dict, overwrite: bool = False,
             desc: str = "generate") -> list[dict]:
    """Every prompt's row in ``out`` (continuing the rows already there); returns all the rows."""
    from tqdm.auto import tqdm

    from jodpo.program.metrics_log import bar_options

    check_settings(out, settings, overwrite)
    B, N = policy.batch_size, len(data)
    rows = read_rows(out, B, data.prompts)
    write = jax.process_index() == 0
    with tqdm(total=N, initial=len(rows), desc=desc, unit="prompt", dynamic_ncols=True, disable=not write,
              **bar_options()) as bar:
        for start in range(len(rows), N, B):
            batch = completion_rows(policy, data, start, min(start + B, N))
            if write:
                append_rows(out, batch)
            rows += batch
            bar.update(len(batch))
    return rows


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def field_overrides(args: argparse.Namespace, names) -> dict:
    """The training fields given as ``--FIELD VALUE`` (TRL's style) or ``--config.FIELD=VALUE``."""
    return F.given_fields(args, names) | {k: v for k, v in args.dotted.items() if k in names}


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = F.Parser(prog=prog, description=description,
                 epilog="Each field is also --config.FIELD=VALUE (a Python literal), as the training command takes it.")
    p.add_argument("model", help="a training output_dir, an exported transformers directory, a .gguf file or a hub id")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: its newest)")
    p.add_argument("--max_prompts", type=int, default=None, help="only the dataset's first N prompts")
    p.add_argument("--overwrite", action="store_true", help="start the output again instead of continuing it")
    p.add_argument("--allow_training_prompts", action="store_true",
                   help="read the prompts even where they are the run's training prompts (refused otherwise)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    F.add_field_flags(p, DATA_FIELDS, "prompts (a run's evaluation set by default)")
    F.add_field_flags(p, SAMPLING_FIELDS, "sampling (the training config's fields; a run's own by default)")
    return p


ERRORS = (GenerateError, ConfigError, D.DataError, CheckpointError, ValueError, FileNotFoundError, OSError)


def data_overrides(overrides: dict) -> dict:
    """A dataset given on the command line replaces a run's evaluation set and mixers."""
    if "dataset_name" in overrides:
        return {"eval_dataset": None, "dataset_mixer": None, "dataset_eval_mixer": None, **overrides}
    return overrides


def parse(p: argparse.ArgumentParser, argv: list[str] | None, names) -> argparse.Namespace:
    """The command's arguments, its ``--config.FIELD=VALUE`` ones (fields among ``names``) in ``dotted``."""
    args, rest = p.parse_known_args(argv)
    args.dotted = F.dotted_overrides(rest, names)
    return args


def say_for(prog: str):
    """A command's lines on the screen (process 0's, on stdout: stderr holds the progress bars and the error)."""
    def say(line: str) -> None:
        if jax.process_index() == 0:
            print(f"{prog}: {line}", flush=True)
    return say


def argv_debug(argv: list[str] | None) -> bool:
    return "--debug" in (sys.argv[1:] if argv is None else argv)


def main(argv: list[str] | None = None) -> int:
    backend.start_command()
    backend.one_line_warnings("jodpo.generate")
    p = parser("python -m jodpo.generate", __doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSONL file to write (continued if it exists)")
    try:
        args = parse(p, argv, (*DATA_FIELDS, *SAMPLING_FIELDS))
        if args.max_prompts is not None and args.max_prompts < 1:
            raise GenerateError(f"--max_prompts must be >= 1, got {args.max_prompts}")
        overrides = data_overrides(field_overrides(args, (*DATA_FIELDS, *SAMPLING_FIELDS)))
        policy = load_policy(args.model, args.step, overrides)
        data = load_prompts(policy, args.max_prompts, args.allow_training_prompts, say_for("jodpo.generate"))
        out = Path(args.out)
        rows = generate(policy, data, out, settings_of(policy, args.max_prompts), args.overwrite)
    except ERRORS as e:
        if argv_debug(argv):
            raise
        print(f"jodpo.generate: error: {e}", file=sys.stderr)
        return 2
    n = len(rows)
    mean = sum(r["completion_tokens"] for r in rows) / max(n, 1)
    ended = sum(r["eos"] for r in rows)
    print(f"{n} completions in {out} (mean {mean:.1f} tokens, {ended} of {n} ended with EOS)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
