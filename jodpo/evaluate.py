"""Win rate of a model: ``python -m jodpo.evaluate MODEL --out DIR [--baseline MODEL2] [--judge J | --reward_model_path
RM | --reward_funcs F]``.

The model generates one completion per prompt (``python -m jodpo.generate``'s loading, sampling and files), and
each is compared with the dataset's reference completion (its ``completion`` column, as TRL's ``judge_tldr.py``)
or with a second model's completion of the same prompt (``--baseline``, sampled with the same settings). The
comparison is made by a pairwise judge (training's ``judge``: an LLM on the device, asked in both orders, or a
``module:function`` callable) through the in-run evaluation's code, or by rewards (a reward model, reward
functions; training's ``reward_model_path`` / ``reward_funcs``): the higher score wins. A run compares by its own
judge or rewards unless one is given.

DIR gets ``completions.jsonl`` (and ``baseline.jsonl``), ``judged.jsonl`` (one row per prompt: both completions, the
verdict, the probability that the model's completion is the better one) and ``summary.json``; the win rate (ties
count half), its 95% Wilson score interval and both sides' mean lengths are printed. Every file is written a batch
at a time and continued by a rerun of the same command.

``--pointwise``: no comparison with references; the model's mean reward on the prompts with its 95% interval (Wilson
for 0/1 rewards, an accuracy; else a percentile bootstrap), and with ``--baseline`` the baseline's too and the mean
of the paired differences (model - baseline, prompt by prompt) with its bootstrap interval (``scored.jsonl``).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

from jodpo.program import backend
from jodpo.program import data as D
from jodpo import generate as G
from jodpo.program import flags as F
from jodpo import judges as J
from jodpo.program.training_eval import judge_against
from jodpo.models.loading import resolve_path
from jodpo.program.user_code import import_judge, import_reward_function, is_import_path
from jodpo.program.sources import load_judge, load_rewards

COMPARISON_FIELDS = ("judge", "judge_prompt", "judge_answer_tokens", "judge_both_orders", "reward_model_path",
                     "reward_funcs", "reward_weights", "frozen_param_dtype")
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``successes / n`` (95% by default); (nan, nan) for n = 0."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def verdict(p_model_better: float) -> str | None:
    if not math.isfinite(p_model_better):
        return None
    return "win" if p_model_better > 0.5 else "tie" if p_model_better == 0.5 else "loss"


def summarize(verdicts: list[str | None]) -> dict:
    """Wins, ties, losses, the win rate (a tie counts half, as ``jodpo.judges.win_rate``) and its interval."""
    wins, ties, losses = (sum(v == k for v in verdicts) for k in ("win", "tie", "loss"))
    n = wins + ties + losses
    rate = (wins + ties / 2) / n if n else math.nan
    lo, hi = wilson_interval(wins + ties / 2, n)
    return {"judged": n, "wins": wins, "ties": ties, "losses": losses, "no_verdict": len(verdicts) - n,
            "win_rate": rate, "ci95": [lo, hi], "interval": "Wilson score, 95%, ties counted as half a win"}


BOOTSTRAP_RESAMPLES = 10_000


def bootstrap_interval(values, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of ``values`` (the 2.5% and 97.5% quantiles of the means
    of ``resamples`` resamples with replacement, drawn from ``seed``); (nan, nan) for no values."""
    x = np.asarray(values, np.float64)
    if x.size == 0:
        return math.nan, math.nan
    rng, means = np.random.default_rng(seed), []
    for start in range(0, resamples, 1000):  # 1,000 resamples at a time: n x 1,000 indices in memory
        idx = rng.integers(0, x.size, (min(1000, resamples - start), x.size))
        means.append(x[idx].mean(axis=1))
    lo, hi = np.quantile(np.concatenate(means), [0.025, 0.975])
    return float(lo), float(hi)


def mean_summary(values, paired: bool = False) -> dict:
    """``mean``, ``ci95`` and ``n`` of the finite ``values`` (rewards without a value are left out, counted in
    ``no_score``), and which interval: Wilson's score interval when every value is 0 or 1 (the mean is a proportion)
    and they are not paired differences, else the percentile bootstrap of the mean."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    n = int(x.size)
    if not paired and n and np.isin(x, (0.0, 1.0)).all():
        ci, how = wilson_interval(float(x.sum()), n), "Wilson score, 95% (every value 0 or 1: a proportion)"
    else:
        ci, how = bootstrap_interval(x), f"percentile bootstrap of the mean, 95%, {BOOTSTRAP_RESAMPLES} resamples"
    return {"mean": float(x.mean()) if n else math.nan, "ci95": list(ci), "n": n, "no_score": len(values) - n,
            "interval": how}


class Comparison:
    """A judge or rewards, applied to (prompts, baseline completions, model completions) a batch at a time. Checked
    when made (a callable is imported, a model's path resolved), loaded when first used: after the completions are
    generated, so the devices never hold a judge or reward model beside the policy."""

    def __init__(self, cfg, policy: G.Policy, chat: bool):
        self.cfg, self.chat = cfg, chat
        self.model, self.mesh, self.tokenizer = policy.model, policy.mesh, policy.tokenizer  # not its parameters
        self.judge, self.rewards = None, None
        if cfg.judge:
            if is_import_path(cfg.judge):
                self.judge = import_judge(cfg.judge)
            else:
                resolve_path(cfg.judge)
            self.name = f"judge {cfg.judge}"
        elif cfg.reward_model_path or cfg.reward_funcs:
            for spec in cfg.reward_funcs:
                import_reward_function(spec)
            if cfg.reward_model_path:
                resolve_path(cfg.reward_model_path, task="reward")
            parts = [*([cfg.reward_model_path] if cfg.reward_model_path else []), *cfg.reward_funcs]
            self.name = f"rewards {', '.join(parts)} (the higher score wins)"
        else:
            raise G.GenerateError("nothing to compare with: give --judge (an LLM, or module:function), "
                                  "--reward_model_path or --reward_funcs")

    def load(self) -> None:
        if self.judge is None and self.cfg.judge:
            self.judge = load_judge(self.cfg, self.model, self.mesh)
        elif self.rewards is None and not self.cfg.judge:
            self.rewards = load_rewards(self.cfg, self.model, self.tokenizer, self.mesh, self.chat)

    def settings(self) -> dict:
        return json.loads(json.dumps({k: getattr(self.cfg, k) for k in COMPARISON_FIELDS}))

    def scores(self, prompts: list, completions: list[str], columns: dict) -> list[float | None]:
        """The rewards of ``completions`` (pointwise: no judge); None where a reward gives no value."""
        self.load()
        return [float(s) if math.isfinite(s) else None for s in
                self.rewards.score(prompts, completions, None, columns).tolist()]

    def rows(self, prompts: list, baseline: list[str], completions: list[str], columns: dict) -> list[dict]:
        self.load()
        if self.judge is not None:
            p_model = 1.0 - judge_against(self.judge, prompts, baseline, completions)
            return [{"verdict": verdict(float(p)), "probability": None if math.isnan(p) else float(p)}
                    for p in p_model]
        score = self.rewards.score(prompts, completions, None, columns)
        base = self.rewards.score(prompts, baseline, None, columns)
        out = []
        for s, b in zip(score.tolist(), base.tolist()):
            p = 0.5 * (1 + math.tanh((s - b) / 2)) if math.isfinite(s - b) else math.nan  # Bradley-Terry
            v = None if math.isnan(p) else "win" if s > b else "tie" if s == b else "loss"
            out.append({"verdict": v, "probability": None if math.isnan(p) else p, "score": s, "baseline_score": b})
        return out

    def pointwise_rows(self, prompts: list, baseline: list[str] | None, completions: list[str],
                       columns: dict) -> list[dict]:
        """Each completion's reward (and its baseline's, when there is one)."""
        out = [{"score": s} for s in self.scores(prompts, completions, columns)]
        if baseline is not None:
            for row, b in zip(out, self.scores(prompts, baseline, columns)):
                row["baseline_score"] = b
        return out


def judge_rows(comparison: Comparison, data: D.PromptData, completions: list[dict], baseline: list[str] | None,
               out: Path, settings: dict, batch: int, overwrite: bool, pointwise: bool = False) -> list[dict]:
    """Every prompt's verdict (``pointwise``: its scores) in ``out`` (continuing the rows already there), a batch at
    a time."""
    from tqdm.auto import tqdm

    from jodpo.program.metrics_log import bar_options

    G.check_settings(out, settings, overwrite)
    rows = G.read_rows(out, batch, data.prompts)
    N, write = len(data), jax.process_index() == 0  # every process judges, process 0 writes
    with tqdm(total=N, initial=len(rows), desc="judge", unit="prompt", dynamic_ncols=True, disable=not write,
              **bar_options()) as bar:
        for start in range(len(rows), N, batch):
            idx = range(start, min(start + batch, N))
            prompts = [data.prompts[i] for i in idx]
            texts = [completions[i]["completion"] for i in idx]
            columns = {k: [v[i] for i in idx] for k, v in data.columns.items()}
            other = None if baseline is None else [baseline[i] for i in idx]
            judged = (comparison.pointwise_rows if pointwise else comparison.rows)(prompts, other, texts, columns)
            new = [{"index": i, "prompt": data.prompts[i], "completion": completions[i]["completion"],
                    **({} if baseline is None else {"baseline": baseline[i]}), **j} for i, j in zip(idx, judged)]
            if write:
                G.append_rows(out, new)
            rows += new
            bar.update(len(new))
    return rows


def _mean(xs) -> float:
    xs = list(xs)
    return float(np.mean(xs)) if xs else math.nan


def evaluate(args) -> dict:
    """Generate, judge, summarize (``main``'s work); returns the summary."""
    out_dir = Path(args.out)
    overrides = G.data_overrides(G.field_overrides(args, (*G.DATA_FIELDS, *G.SAMPLING_FIELDS)))
    policy = G.load_policy(args.model, args.step, overrides)
    compare = G.field_overrides(args, COMPARISON_FIELDS)
    if compare:  # given on the command line: it replaces a run's own judge or rewards
        compare = {"judge": None, "reward_model_path": None, "reward_funcs": (), "reward_weights": None, **compare}
    cfg = policy.cfg.replace(**compare)
    if args.pointwise and cfg.judge:
        raise G.GenerateError("--pointwise scores each completion by rewards, and a judge only compares two: give "
                              "--reward_model_path or --reward_funcs")
    data = G.load_prompts(policy, args.max_prompts, args.allow_training_prompts, G.say_for("jodpo.evaluate"))
    if args.baseline is None and data.references is None and not args.pointwise:
        raise G.GenerateError("the dataset has no 'completion' column to compare with; give one (reference "
                              "completions), or --baseline MODEL to compare with a second model's completions")
    comparison = Comparison(cfg, policy, chat=isinstance(data.prompts[0], list))
    gen_settings = G.settings_of(policy, args.max_prompts)
    model_rows = G.generate(policy, data, out_dir / "completions.jsonl", gen_settings, args.overwrite, "model")
    policy.params = None  # one model on the devices at a time
    tokens = {"model": _mean(r["completion_tokens"] for r in model_rows)}
    if args.baseline is not None:
        same = {k: getattr(policy.cfg, k) for k in (*G.SAMPLING_FIELDS, *G.DATA_FIELDS, "eval_dataset", "dataset_mixer",
                                                     "dataset_eval_mixer")}
        if args.baseline_seed is not None:
            same["seed"] = args.baseline_seed
        base_policy = G.load_policy(args.baseline, args.baseline_step, same)
        base_data = G.load_prompts(base_policy, args.max_prompts, allow_training_prompts=True)  # the model's
        base_rows = G.generate(base_policy, base_data, out_dir / "baseline.jsonl",
                               G.settings_of(base_policy, args.max_prompts), args.overwrite, "baseline")
        baseline = [r["completion"] for r in base_rows]
        tokens["baseline"] = _mean(r["completion_tokens"] for r in base_rows)
        base_name = f"{args.baseline}" + (f" (step {base_policy.step})" if base_policy.step is not None else "")
        base_policy.params = None
    elif args.pointwise:
        baseline, base_name = None, None
    else:
        baseline = data.references
        tokens["baseline"] = _mean(len(x) for x in policy.tokenizer(baseline, add_special_tokens=False)["input_ids"])
        base_name = "the dataset's reference completions"
    settings = {"completions": gen_settings, "baseline": args.baseline, "baseline_step": args.baseline_step,
                "baseline_seed": args.baseline_seed, **comparison.settings()}
    rows = judge_rows(comparison, data, model_rows, baseline, out_dir / ("scored.jsonl" if args.pointwise else
                      "judged.jsonl"), settings, policy.batch_size, args.overwrite, args.pointwise)
    if args.pointwise:
        summary = pointwise_summary(args, gen_settings["step"], base_name, comparison.name, rows, tokens)
    else:
            summary = {"model": args.model, "step": gen_settings["step"], "baseline": base_name,
                   "comparison": comparison.name,
                   "prompts": len(rows), **summarize([r["verdict"] for r in rows]),
                   "mean_tokens": tokens,
                   "mean_words": {"model": _mean(len(r["completion"].split()) for r in rows),
                                  "baseline": _mean(len(r["baseline"].split()) for r in rows)}}
    if jax.process_index() == 0:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def pointwise_summary(args, step, base_name, rewards: str, rows: list[dict], tokens: dict) -> dict:
    """The model's mean score with its interval; with a baseline, the baseline's and the paired difference's."""
    summary = {"model": args.model, "step": step, "baseline": base_name, "comparison": rewards, "prompts": len(rows),
               **mean_summary([r["score"] for r in rows]), "mean_tokens": tokens,
               "mean_words": {"model": _mean(len(r["completion"].split()) for r in rows)}}
    if base_name is not None:
        summary["baseline_scores"] = mean_summary([r["baseline_score"] for r in rows])
        summary["difference"] = mean_summary([r["score"] - r["baseline_score"] for r in rows
                                              if r["score"] is not None and r["baseline_score"] is not None], True)
        summary["mean_words"]["baseline"] = _mean(len(r["baseline"].split()) for r in rows)
    return summary


def _interval(s: dict) -> str:
    return f"95% interval [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] ({s['interval'].split(',')[0]})"


def report_pointwise(s: dict, out_dir: Path) -> str:
    step = f" (step {s['step']})" if s["step"] is not None else ""
    unscored = f"; {s['no_score']} without a score" if s["no_score"] else ""
    lines = [f"model {s['model']}{step}, {s['prompts']} prompts, by {s['comparison']}",
             f"mean score {s['mean']:.3f} of {s['n']} scored{unscored}, {_interval(s)}"]
    length = f"mean length: model {s['mean_tokens']['model']:.1f} tokens, {s['mean_words']['model']:.1f} words"
    if s["baseline"] is not None:
        b, d = s["baseline_scores"], s["difference"]
        lines += [f"baseline {s['baseline']}: mean score {b['mean']:.3f} of {b['n']}, {_interval(b)}",
                  f"paired difference (model - baseline) {d['mean']:+.3f} over {d['n']} prompts, {_interval(d)}"]
        length += (f"; baseline {s['mean_tokens']['baseline']:.1f} tokens, {s['mean_words']['baseline']:.1f} "
                   "words")
    return "\n".join([*lines, length, f"rows in {out_dir / 'scored.jsonl'}, summary in {out_dir / 'summary.json'}"])


def report(summary: dict, out_dir: Path) -> str:
    s = summary
    if "mean" in s:
        return report_pointwise(s, out_dir)
    step = f" (step {s['step']})" if s["step"] is not None else ""
    lo, hi = s["ci95"]
    t, w = s["mean_tokens"], s["mean_words"]
    unjudged = f"; {s['no_verdict']} without a verdict" if s["no_verdict"] else ""
    return "\n".join([
        f"model {s['model']}{step} vs {s['baseline']}, {s['prompts']} prompts, by {s['comparison']}",
        f"win rate {s['win_rate']:.3f} ({s['wins']} wins, {s['ties']} ties, {s['losses']} losses of {s['judged']} "
        f"judged{unjudged}; a tie counts half)",
        f"95% confidence interval (Wilson score): [{lo:.3f}, {hi:.3f}]",
        f"mean length: model {t['model']:.1f} tokens, {w['model']:.1f} words; baseline {t['baseline']:.1f} tokens, "
        f"{w['baseline']:.1f} words",
        f"rows in {out_dir / 'judged.jsonl'}, summary in {out_dir / 'summary.json'}"])


def main(argv: list[str] | None = None) -> int:
    backend.start_command()
    backend.one_line_warnings("jodpo.evaluate")
    p = G.parser("python -m jodpo.evaluate", __doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--out", required=True, help="the directory to write (continued if it holds an evaluation)")
    group = p.add_argument_group("the other side (default: the dataset's 'completion' column)")
    group.add_argument("--baseline", default=None, help="a second model (as MODEL), sampled with the same settings")
    group.add_argument("--baseline_step", type=int, default=None, help="the baseline run's checkpoint step")
    group.add_argument("--baseline_seed", type=int, default=None, help="the baseline's seed (default: seed)")
    group.add_argument("--pointwise", action="store_true",
                       help="the mean reward with its interval instead of a win rate; with --baseline, the paired "
                            "difference too")
    F.add_field_flags(p, COMPARISON_FIELDS, "the comparison (training's fields; a run's own by default)")
    try:
        args = G.parse(p, argv, (*G.DATA_FIELDS, *G.SAMPLING_FIELDS, *COMPARISON_FIELDS))
        if args.max_prompts is not None and args.max_prompts < 1:
            raise G.GenerateError(f"--max_prompts must be >= 1, got {args.max_prompts}")
        summary = evaluate(args)
    except (*G.ERRORS, J.JudgeError) as e:
        if G.argv_debug(argv):
            raise
        print(f"jodpo.evaluate: error: {e}", file=sys.stderr)
        return 2
    print(report(summary, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
