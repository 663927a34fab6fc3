"""Held-out instruction following before -> after, over seeds: jodpo's online-DPO variants and TRL's
OnlineDPOTrainer trained on the same task (jodpo/configs/smollm2_ifeval.py), evaluated the same way.

  python benchmarks/instructions.py [--variants k2 best_of_4 semi_online simpo nash_md xpo trl] [--seeds 0 1 2] [--steps 30]
                                    [--eval-prompts 96] [--out runs/evidence] [--set FIELD=VALUE ...] [--table-only]

Every variant samples the same number of completions per step (the recipe's prompts x 2):
- ``k2``: the recipe as it is: TRL's two samples per prompt (``num_generations=2``), on-policy, sigmoid loss;
- ``best_of_4``: four samples of half as many prompts, the best against the worst (``pairing="best_worst"``);
- ``semi_online``: k2 with the sampler refreshed every 5 steps (``sync_steps=5``);
- ``simpo``: k2 with the reference-free SimPO loss (``loss_type="simpo"``, beta 2, gamma 1: SimPO's scale, untuned);
- ``nash_md``, ``xpo``: TRL 1.12's Nash-MD (a completion from the policy beside one from the geometric mixture with
  the reference, mixture_coef 0.5) and XPO (beside one from the reference, alpha 1e-5) with k2's settings;
- ``trl``: TRL 1.16's ``OnlineDPOTrainer`` with k2's model (the recipe's weights written once as a transformers
  directory), prompts, reward function and hyperparameters.

Each trained model and the starting model are scored by ``jodpo.evaluate --pointwise`` on the first
``--eval-prompts`` prompts of the two held-out sets (addresses never trained on; training instruction types, and
types never trained on), each prompt one instruction, so a score is 0 or 1 and a rate has Wilson's interval; the
paired difference after - before (the same prompts) has a bootstrap interval. Runs already finished are kept (a
rerun continues), so the table can be built over several sessions; each run's wall time is in its ``timing.json``.
The table (markdown) goes to stdout and ``OUT/table.md``; the per-run numbers to ``OUT/results.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

VARIANTS = {
    "k2": {},
    "best_of_4": {"num_generations": 4, "pairing": "best_worst", "batch_divisor": 2},
    "semi_online": {"sync_steps": 5},
    "simpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0},
    "nash_md": {"method": "nash_md"},
    "xpo": {"method": "xpo"},
    "trl": {},
}
KL_METRIC = {"nash_md": "loss/kl"}  # Nash-MD logs its KL under TRL 1.12's name; the others as objective/kl
SETS = {"train_types": "eval.jsonl", "held_out_types": "eval_held_out.jsonl"}


def variant_config(base, name: str, seed: int, steps: int, out: Path):
    overrides = dict(VARIANTS[name])
    if overrides.pop("batch_divisor", None):
        overrides["per_device_train_batch_size"] = base.per_device_train_batch_size // 2
    return base.replace(seed=seed, max_steps=steps, save_steps=steps, output_dir=str(out), report_to="none",
                        **overrides)


def hf_model(base, out: Path) -> Path:
    """The recipe's weights as one transformers directory (TRL's side loads it), written once."""
    import jodpo

    path = out / "start_model"
    if not (path / "config.json").exists():
        model, params = jodpo.load_model(base.model_name_or_path, dtype="float32")
        jodpo.save_hf(model, params, path, tokenizer=jodpo.load_tokenizer(base.model_name_or_path))
    return path


def train_trl(cfg, model_dir: Path, out: Path) -> None:
    """TRL 1.16's OnlineDPOTrainer with the jodpo config's settings, field by field; the model saved to out/model."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from jodpo.program.user_code import import_reward_function

    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = load_dataset("json", data_files=cfg.dataset_name, split="train")
    args = OnlineDPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, beta=cfg.beta,
        loss_type=cfg.loss_type,
        warmup_steps=cfg.warmup_steps or math.ceil(cfg.max_steps * cfg.warmup_ratio),  # as jodpo.program.run counts them
        max_new_tokens=cfg.max_new_tokens, max_length=cfg.max_length, temperature=cfg.temperature,
        missing_eos_penalty=cfg.missing_eos_penalty, seed=cfg.seed, bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    rewards = [import_reward_function(f) for f in cfg.reward_funcs]
    trainer = OnlineDPOTrainer(model=policy, reward_funcs=rewards, args=args, processing_class=tok, train_dataset=data)
    trainer.train()
    trainer.save_model(str(out / "model"))
    tok.save_pretrained(out / "model")
    with open(out / "metrics.jsonl", "w") as f:  # TRL's log history, one object per logged step
        f.writelines(json.dumps(m) + "\n" for m in trainer.state.log_history if "loss" in m)


def evaluate(model: str, cfg, eval_dir: Path, n: int, out: Path) -> dict:
    """``jodpo.evaluate --pointwise`` of ``model`` on each held-out set, with the recipe's sampling settings."""
    from jodpo import evaluate as E

    summaries = {}
    for name, file in SETS.items():
        args = [model, "--pointwise", "--out", str(out / name), "--dataset_name", str(eval_dir / file),
                "--dataset_test_split", "train", "--max_prompts", str(n),
                "--reward_funcs", repr(list(cfg.reward_funcs)),
                "--max_new_tokens", str(cfg.max_new_tokens), "--temperature", str(cfg.temperature),
                "--max_prompt_length", str(cfg.max_prompt_length), "--bf16", "False", "--seed", "0",
                "--per_device_eval_batch_size", str(cfg.per_device_eval_batch_size)]
        if E.main(args) != 0:
            raise SystemExit(f"evaluating {model} on {file} failed (the message is above)")
        summaries[name] = json.loads((out / name / "summary.json").read_text())
    return summaries


def scores(out: Path, name: str) -> list[float]:
    return [json.loads(x)["score"] for x in (out / name / "scored.jsonl").read_text().splitlines()]


def last_mean(metrics: Path, key: str, k: int = 5) -> float:
    """The mean of ``key`` over the last ``k`` logged steps (nan when it is not logged: SimPO has no KL)."""
    vals = [m[key] for m in map(json.loads, metrics.read_text().splitlines()) if key in m]
    return float(np.mean(vals[-k:])) if vals else math.nan


def run_one(base, name: str, seed: int, a, out: Path, eval_dir: Path) -> dict:
    from jodpo.program import backend
    from jodpo.program.loop import train

    run = out / f"{name}-seed{seed}"
    done = run / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = variant_config(base, name, seed, a.steps, run)
    # a run finished before this call (by hand, or a session before): its training time is not this call's
    before = (run / "checkpoints" / str(a.steps)).is_dir() or (run / "model" / "config.json").exists()
    t0 = time.perf_counter()
    if name == "trl":
        if not (run / "model" / "config.json").exists():
            train_trl(cfg, hf_model(base, out), run)
        model = str(run / "model")
    else:
        backend.configure(cfg)
        train(cfg)
        model = str(run)
    t1 = time.perf_counter()
    summaries = evaluate(model, cfg, eval_dir, a.eval_prompts, run / "eval")
    t2 = time.perf_counter()
    result = {"variant": name, "seed": seed, "steps": a.steps, "train_s": None if before else t1 - t0,
              "eval_s": t2 - t1,
              "episodes_per_s": None if before else cfg.per_device_train_batch_size * a.steps / (t1 - t0),
              "kl": last_mean(run / "metrics.jsonl", KL_METRIC.get(name, "objective/kl")),
              **{f"{k}_tokens": s["mean_tokens"]["model"] for k, s in summaries.items()},
              **{k: {"mean": s["mean"], "ci95": s["ci95"], "n": s["n"]} for k, s in summaries.items()}}
    done.write_text(json.dumps(result, indent=2) + "\n")
    return result


def by_type(where: Path, eval_dir: Path, rate: bool = False) -> dict:
    """Per instruction type of both held-out sets: the prompts (or, ``rate``, the share followed) of a scored run."""
    out = {}
    for key, file in SETS.items():
        prompts = [json.loads(x) for x in (eval_dir / file).read_text().splitlines()]
        for p, s in zip(prompts, scores(where / "eval", key)):
            out.setdefault(p["instruction_id_list"][0], []).append(s)
    return {t: (statistics.mean(v) if rate else len(v)) for t, v in sorted(out.items())}


def table(results: list[dict], before: dict, out: Path, eval_dir: Path) -> str:
    """The markdown table: per variant, the rate on each held-out set (mean over seeds, each seed's rate and
    interval), the paired difference to the start, KL and completion length; then TRL against jodpo's k2."""
    from jodpo.evaluate import mean_summary

    def cell(s):
        return f"{s['mean']:.3f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]"

    lines = ["| variant | seeds | " + " | ".join(f"{k}: rate (each seed [95% Wilson])" for k in SETS)
             + " | " + " | ".join(f"{k}: after - before [95% bootstrap]" for k in SETS)
             + " | KL (last 5 steps) | tokens (held-out) | train min (each) |", "|" + " --- |" * (5 + 2 * len(SETS))]
    lines.append("| start (SmolLM2-135M-Instruct) | - | " + " | ".join(cell(before[k]) for k in SETS)
                 + f" | - | - | 0 | {before['train_types_tokens']:.1f} | - |")
    by_variant = {}
    for r in results:
        by_variant.setdefault(r["variant"], []).append(r)
    for name, runs in by_variant.items():
        rates = [" / ".join(cell(r[k]) for r in runs) for k in SETS]
        diffs = []
        for k in SETS:
            per = [mean_summary([x - y for x, y in zip(scores(out / f"{name}-seed{r['seed']}" / "eval", k),
                                                         scores(out / "start" / "eval", k))], paired=True)
                   for r in runs]
            diffs.append(" / ".join(f"{d['mean']:+.3f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]" for d in per))
        mean_rates = [statistics.mean(r[k]["mean"] for r in runs) for k in SETS]
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(f"**{m:.3f}**: {c}" for m, c in zip(mean_rates, rates))
                     + " | " + " | ".join(diffs) + f" | {statistics.mean(r['kl'] for r in runs):.2f} | "
                     f"{statistics.mean(r['train_types_tokens'] for r in runs):.1f} | "
                     + ", ".join("-" if r["train_s"] is None else f"{r['train_s'] / 60:.1f}" for r in runs) + " |")
    lines += ["", "Rate by instruction type (mean over seeds; n prompts per seed):", "",
              "| variant | " + " | ".join(f"{t} (n={n})" for t, n in by_type(out / "start", eval_dir).items()) + " |",
              "|" + " --- |" * (1 + len(by_type(out / "start", eval_dir)))]
    for name, where in [("start", [out / "start"])] + [(v, [out / f"{v}-seed{r['seed']}" for r in rs])
                                                        for v, rs in by_variant.items()]:
        rates = [by_type(w, eval_dir, rate=True) for w in where]
        means = [statistics.mean(r[t] for r in rates) for t in rates[0]]
        lines.append(f"| {name} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    if "trl" in by_variant and "k2" in by_variant:
        lines += ["", two_sample(by_variant["k2"], by_variant["trl"])]
    return "\n".join(lines)


def two_sample(jodpo_runs: list[dict], trl_runs: list[dict]) -> str:
    """jodpo k2 against TRL: Welch's t-test on the seeds' held-out rates (two or more seeds a side), and the
    speed of each (episodes/s, training only)."""
    from scipy import stats

    out = []
    for k in SETS:
        a, b = [r[k]["mean"] for r in jodpo_runs], [r[k]["mean"] for r in trl_runs]
        test = (f"Welch t = {stats.ttest_ind(a, b, equal_var=False).statistic:.2f}, p = "
                f"{stats.ttest_ind(a, b, equal_var=False).pvalue:.2f}") if min(len(a), len(b)) >= 2 else \
            "no test: fewer than 2 seeds a side"
        out.append(f"{k}: jodpo k2 {statistics.mean(a):.3f} (seeds {a}) vs TRL {statistics.mean(b):.3f} (seeds {b}); "
                   f"{test}")
    speed = [[r["episodes_per_s"] for r in rs if r["episodes_per_s"] is not None] for rs in (jodpo_runs, trl_runs)]
    out.append("episodes/s of each run (training, compilation included; a run sharing the machine reads slower): " +
               "; ".join(f"{side} " + (", ".join(f"{x:.3f}" for x in v) if v else "not timed here")
                         for side, v in zip(("jodpo", "TRL"), speed)))
    return "\n\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="smollm2_ifeval.py")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-prompts", type=int, default=96)
    p.add_argument("--eval-dir", type=Path, help="holds eval.jsonl and eval_held_out.jsonl (default: beside the "
                                                 "config's eval_dataset)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="config overrides (as --config.F=V)")
    p.add_argument("--out", type=Path, default=Path("runs/evidence"))
    p.add_argument("--table-only", action="store_true", help="train nothing: the table of the finished runs among "
                                                              "--variants x --seeds")
    a = p.parse_args(argv)
    from jodpo.program.config import load_config_file, parse_override

    base = load_config_file(a.config)
    base = base.replace(**dict(parse_override(f"--config.{s}") for s in a.set))
    eval_dir = a.eval_dir or Path(base.eval_dataset).parent
    a.out.mkdir(parents=True, exist_ok=True)
    start = a.out / "start" / "result.json"
    if start.exists():
        before = json.loads(start.read_text())
    else:
        t = time.perf_counter()
        summ = evaluate(base.model_name_or_path, base, eval_dir, a.eval_prompts, a.out / "start" / "eval")
        before = {**{k: {"mean": s["mean"], "ci95": s["ci95"], "n": s["n"]} for k, s in summ.items()},
                  **{f"{k}_tokens": s["mean_tokens"]["model"] for k, s in summ.items()},
                  "eval_s": time.perf_counter() - t}
        start.write_text(json.dumps(before, indent=2) + "\n")
    results = [run_one(base, name, seed, a, a.out, eval_dir) for name in a.variants for seed in a.seeds
               if not a.table_only or (a.out / f"{name}-seed{seed}" / "result.json").exists()]
    (a.out / "results.json").write_text(json.dumps({"start": before, "runs": results}, indent=2) + "\n")
    text = table(results, before, a.out, eval_dir)
    (a.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
