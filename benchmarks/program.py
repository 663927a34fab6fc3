"""``bench.py program``: the real training program (``python -m jodpo.train --config tldr.py``) vs its own fused
step, with TRL 1.16's real ``OnlineDPOTrainer(...).train()`` loop side by side (issue 17).

Three runs, one after the other on the same fixture (``harness.build_fixture`` plus ``train.jsonl`` and a
``test.jsonl`` with reference completions, written here), with tldr.py's settings: 8 prompts per device x
gradient_accumulation_steps 2, gradient checkpointing on, bf16 compute (float32 weights) unless ``--dtype
float32``, 53 new tokens, warmup_ratio 0.1; ``--steps`` optimizer steps with a checkpoint every ``--save-steps``
and an evaluation every ``--eval-steps`` (on ``--eval-prompts`` prompts of the test split):

1. **step**: ``train_step.jit_online_step`` in the train mode's jodpo worker, built from the same command line
   by ``jodpo.program.run.build`` (same config, buckets, dtypes, remat, data order) and started by
   ``loop.initial_state`` (the program's first state, laid out as the step's outputs); two untimed calls (the
   first compiles), then the median of ``--step-repeats`` timed calls.
   Then, on that state, what the loop's stalls are measured against: checkpoint saves as the program makes them,
   one more than the recipe keeps, so that the last deletes the oldest first (``Checkpointer.save`` timed to its
   return, which is what a save blocks the loop for: the non-finite check and the device-to-host copy; then to
   ``wait()``: the whole save), and an evaluation (``evaluation.evaluate``, and its
   sampling alone, ``evaluation.eval_samples``), warm.
2. **program**: ``python -m jodpo.train`` in a subprocess, run through ``bench.py _program`` (``runpy`` runs the
   module as ``-m`` does, then the wrapper writes the process's ``ru_maxrss`` and, on an accelerator, jax's
   ``peak_bytes_in_use``). ``logging_steps=1``, so ``metrics.jsonl`` has one line per step; its ``eps`` is
   ``global_batch / (wall seconds since the previous logged step)`` (the first: since the loop began), so
   ``global_batch / eps`` is the exact wall time of each step, log to log: batching, the step, reading the
   metrics back (a sync), logging, and whatever the loop did after the previous step's log (its evaluation
   and its checkpoint save). The parent polls ``metrics.jsonl`` (every 20 ms) to timestamp the first step.
   ``num_sample_generations=0``: the completion table only at the end (10 over a real run is one per
   thousands of steps; 10 over 12 steps would be one per step). The compilation cache is a fresh directory
   (a first run's cold compiles) unless ``--cache-dir`` gives one.
3. **trl**: ``OnlineDPOTrainer(...).train()`` (``workers.worker_trl_program``), with its step ends and
   saves timed by a ``TrainerCallback``; step k's time is from the end of step k-1 (the first: train begin)
   to the end of step k, the same log-to-log span as jodpo's.

Per run: episodes/s over the whole process (launch to exit), after the first step (its log to exit), and
steady (``global_batch`` / the median step time of the steps that are neither the first nor right after a
save or an evaluation); time to the first step (launch to its end, loading and compilation included);
seconds lost per save and per evaluation (the time of the step after it minus the steady median; a save is
asynchronous in jodpo, so what it costs the loop is what the next step pays); peak RSS. The evaluations are
read from the evaluation log lines; the saves are the program's schedule (the recipe keeps the newest two,
which must be the checkpoint directories left), TRL's from its ``on_save`` callbacks.

4. **restart**: the same command in a new output directory, with the compilation cache the program run just
   filled, killed once its first step is logged: the time to the first step with a warm cache, against the cold
   one (and both minus one steady step: loading and compiling).
5. **resume**: the program's run again, as if stopped after its previous checkpoint (the newest checkpoint and
   the log lines after the previous one removed): the same command resumes it, restoring the state, with the
   cache warm; killed once its first step is logged. This is the restart issue 17's >= 5x target is about.
"""
from __future__ import annotations

import json
import os
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import (BENCH, FIXED, ROOT, Phases, Worker, build_fixture, disturbance_warning, make_prompts, maxrss_mib,
                     pseudo_words)


def add_parser(sub, defaults: dict):
    p = sub.add_parser("program", help="python -m jodpo.train vs its fused step, TRL's train() side by side")
    p.add_argument("--batch", type=int, default=8, help="prompts per device per micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--new-tokens", type=int, default=53)
    p.add_argument("--prompt-len", type=int, default=70, help="longest prompt, tokens (prompts are 6 shorter at most)")
    p.add_argument("--prompts", type=int, default=64, help="prompts in the train split")
    p.add_argument("--eval-prompts", type=int, default=16, help="prompts in the test split (max_eval_prompts)")
    for k in ("vocab", "hidden", "layers", "heads"):
        p.add_argument(f"--{k}", type=int, default=defaults[k])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of each run")
    p.add_argument("--save-steps", type=int, default=3,
                   help="checkpoint every this many steps (and the last); the recipe keeps 2, so the third deletes one")
    p.add_argument("--eval-steps", type=int, default=4, help="evaluate every this many steps (and the last)")
    p.add_argument("--step-repeats", type=int, default=5, help="timed calls of the fused step")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="compute dtype (bf16: float32 weights, bf16 compute, both sides)")
    p.add_argument("--no-trl", action="store_true", help="jodpo only")
    p.add_argument("--attention", choices=("xla", "cudnn", "splash"), default="xla", help="jodpo's attn_implementation")
    p.add_argument("--deterministic", action="store_true",
                   help="jodpo with deterministic=True (XLA's deterministic GPU ops): run with and without to cost it")
    p.add_argument("--cache-dir", type=Path, help="XLA compilation cache of the program (default: a fresh one)")
    p.add_argument("--fixture", type=Path, help="build (or reuse) the fixture here instead of a temporary dir")
    p.add_argument("--out", type=Path)


def write_datasets(fx: Path, a) -> tuple[Path, Path]:
    """train.jsonl (the fixture's prompts) and test.jsonl (other prompts with a reference ``completion``, as
    TL;DR's test split, so the evaluation also scores references for ``eval/win_rate``)."""
    import numpy as np

    words = pseudo_words(a.vocab - len(FIXED) - 3)  # the tokenizer's pseudo-words (build_tokenizer's order)
    rng = np.random.default_rng(1)
    train, test = fx / "train.jsonl", fx / "test.jsonl"
    train.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in json.loads((fx / "prompts.json").read_text())))
    test.write_text("".join(json.dumps({"prompt": p, "completion": " ".join(words[i] for i in rng.integers(0, len(words), 24))})
                            + "\n" for p in make_prompts(words, a.eval_prompts, a.prompt_len, seed=1)))
    return train, test


def train_argv(fx: Path, a, out_dir: Path, cache_dir: Path) -> list[str]:
    """The program's command line (after ``python -m jodpo.train``): tldr.py on the fixture."""
    from jodpo.program.config import FIELDS

    o = dict(model_name_or_path=fx / "policy", reward_model_path=fx / "reward", dataset_name=fx / "train.jsonl",
             eval_dataset=fx / "test.jsonl", output_dir=out_dir, max_steps=a.steps, save_steps=a.save_steps,
             eval_steps=a.eval_steps, max_eval_prompts=a.eval_prompts, per_device_train_batch_size=a.batch,
             gradient_accumulation_steps=a.accumulation, max_new_tokens=a.new_tokens, bf16=a.dtype == "bfloat16",
             gradient_checkpointing=True, logging_steps=1, num_sample_generations=0)
    if "compilation_cache_dir" in FIELDS:
        o["compilation_cache_dir"] = cache_dir
    if a.attention != "xla":
        o["attn_implementation"] = a.attention
    if a.deterministic:
        o["deterministic"] = True
    return ["--config", "tldr.py", *(f"--config.{k}={v}" for k, v in o.items())]


def child(stats_path: str, argv: list[str]) -> None:
    """``python -m jodpo.train ARGV`` in this process (``runpy``, as ``-m``), then its peak memory to ``stats_path``."""
    import resource

    sys.argv, code = ["python -m jodpo.train", *argv], 0
    try:
        runpy.run_module("jodpo.train", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code or 0
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    Path(stats_path).write_text(json.dumps({
        "exit_code": code, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device": str(jax.devices()[0]),
        "device_peak_mib": stats["peak_bytes_in_use"] / 2 ** 20 if stats and "peak_bytes_in_use" in stats else None}))
    sys.exit(code)


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()), OMP_WAIT_POLICY="PASSIVE")


def run_program(argv: list[str], tmp: Path, out_dir: Path, steps: int = 0, save_steps: int = 1,
                first_only=False) -> dict:
    """One ``python -m jodpo.train`` run, timed from launch to exit, its steps from ``metrics.jsonl``. The saves
    are the program's schedule (every ``save_steps`` and the last step); the recipe keeps only the newest
    (``save_total_limit``), so the kept checkpoint directories must be the newest of them. ``first_only``: killed
    (SIGKILL) as soon as the first step is logged; only the time to it, and its number, are returned."""
    stats, log = tmp / "program_stats.json", tmp / "program.log"
    metrics, lines = out_dir / "metrics.jsonl", []
    seen = len(metrics.read_text()) if metrics.exists() else 0  # a resumed run's log: only its new lines count
    t_launch = time.time()
    proc = subprocess.Popen([sys.executable, str(BENCH), "_program", str(stats), *argv],
                            cwd=ROOT, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    while True:
        done = proc.poll() is not None
        if metrics.exists():
            text = metrics.read_text()
            new = text[seen:text.rfind("\n") + 1]
            seen += len(new)
            now = time.time()
            lines += [(now, json.loads(x)) for x in new.splitlines() if x.strip()]
        if first_only and lines:
            proc.kill()
            proc.wait()
            first = lines[0][1]
            return {"time_to_first_step_s": lines[0][0] - t_launch, "first_step_s": first["episode"] / first["step"] /
                    first["eps"], "first_logged_step": first["step"]}
        if done:
            break
        time.sleep(0.02)
    t_exit = time.time()
    if proc.returncode != 0 or not stats.exists():
        raise RuntimeError(f"python -m jodpo.train failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
    train = [(t, m) for t, m in lines if "eps" in m]
    ckpts, saves = out_dir / "checkpoints", [k for k in range(1, steps + 1) if k % save_steps == 0 or k == steps]
    return {"t_launch": t_launch, "t_exit": t_exit, "t_first": train[0][0], "child": json.loads(stats.read_text()),
            "step_s": {m["step"]: m["episode"] / m["step"] / m["eps"] for _, m in train},
            "evals": sorted(m["step"] for _, m in lines if any(k.startswith("eval/") for k in m)),
            "kept": sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else [],
            "final_metrics": train[-1][1], "saves": saves}


def resume_program(argv: list[str], tmp: Path, out_dir: Path, kept: list[int]) -> dict | None:
    """The finished run resumed as if it had stopped after its previous checkpoint: the newest checkpoint and the
    log lines after the previous one removed (as the program itself truncates them), then the same command in
    the same directory, killed at its first step (``run_program``'s ``first_only``). None with fewer than two
    checkpoints kept."""
    from jodpo.program.metrics_log import truncate_metrics

    if len(kept) < 2:
        return None
    shutil.rmtree(out_dir / "checkpoints" / str(kept[-1]))
    truncate_metrics(out_dir / "metrics.jsonl", kept[-2])
    return run_program(argv, tmp, out_dir, first_only=True) | {"resumed_from_step": kept[-2]}


def run_trl(fx: Path, a, tmp: Path) -> dict:
    spec = dict(fixture=str(fx), output_dir=str(tmp / "trl_out"), events=str(tmp / "trl_events.json"),
                train_file=str(fx / "train.jsonl"), eval_file=str(fx / "test.jsonl"), batch=a.batch,
                accumulation=a.accumulation, new_tokens=a.new_tokens, dtype=a.dtype, steps=a.steps,
                save_steps=a.save_steps)
    log = tmp / "trl.log"
    t_launch = time.time()
    rc = subprocess.run([sys.executable, str(BENCH), "_worker", "trl_program", json.dumps(spec)],
                        cwd=ROOT, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT).returncode
    t_exit = time.time()
    if rc != 0 or not Path(spec["events"]).exists():
        raise RuntimeError(f"the TRL program worker failed (exit {rc}):\n{log.read_text()[-4000:]}")
    ev = json.loads(Path(spec["events"]).read_text())
    ends = dict((s, t) for t, s in ev["step_end"])
    prev = {s: ends.get(s - 1, ev["train_begin"]) for s in ends}
    return {"t_launch": t_launch, "t_exit": t_exit, "t_first": ends[1], "events": ev, "saves": ev["checkpoints"],
            "step_s": {s: ends[s] - prev[s] for s in ends}, "evals": [],
            "save_s_direct": [t - ends[s] for t, s in ev["save"]]}


def loop_stats(r: dict, episodes_per_step: int) -> dict:
    """The per-run numbers from a timeline: launch/first/exit times, step k's seconds, saves and evals done."""
    steps, n, gb = r["step_s"], max(r["step_s"]), episodes_per_step
    saves, evals = set(r["saves"]), set(r["evals"])
    kind = {k: "first" if k == 1 else "+".join(x for x, s in (("save", saves), ("eval", evals)) if k - 1 in s) or "steady"
            for k in steps}
    steady = [steps[k] for k in sorted(steps) if kind[k] == "steady"]
    med = statistics.median(steady)
    extra = lambda what: [{"after_step": k - 1, "s": steps[k] - med} for k in sorted(steps) if kind[k] == what]
    mean = lambda xs: statistics.mean(x["s"] for x in xs) if xs else None
    save, ev = extra("save"), extra("eval")
    out = {"steps": n, "episodes_per_step": gb, "wall_s": r["t_exit"] - r["t_launch"],
           "episodes_per_s_whole": n * gb / (r["t_exit"] - r["t_launch"]),
           "episodes_per_s_after_first_step": (n - 1) * gb / (r["t_exit"] - r["t_first"]),
           "episodes_per_s_steady": gb / med, "steady_median_step_s": med, "steady_steps": len(steady),
           "time_to_first_step_s": r["t_first"] - r["t_launch"], "first_step_s": steps[1],
           "before_first_step_s": r["t_first"] - r["t_launch"] - steps[1],  # start, imports, loading
           "after_last_step_s": r["t_exit"] - r["t_first"] - sum(steps[k] for k in steps if k > 1),
           "step_s": [steps[k] for k in sorted(steps)], "step_kind": [kind[k] for k in sorted(steps)],
           "saves_after_steps": sorted(saves), "evals_after_steps": sorted(evals),
           "save_s": save, "save_s_mean": mean(save), "eval_s": ev, "eval_s_mean": mean(ev)}
    return out


def bench_program(args) -> dict:
    gb = args.batch * args.accumulation
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        fx = args.fixture or tmp / "fixture"
        fx.mkdir(parents=True, exist_ok=True)
        clock = Phases()

        prompts = args.prompts
        dims = build_fixture(fx, args)
        write_datasets(fx, args)
        clock.end("fixture")
        argv = train_argv(fx, args, tmp / "run", args.cache_dir or tmp / "xla")
        w = Worker("jodpo", {"train_argv": argv, "save_dir": str(tmp / "save_probe")}, tmp / "step.log")
        try:  # build() writes nothing to output_dir
            ready = w.ask()
            runs = [w.ask("step") for _ in range(2 + args.step_repeats)]
            rss = w.ask("rss")
            alone = {"save": w.ask("save"), "eval": w.ask("eval")}
        finally:
            w.close()
        clock.end("step")
        prog = run_program(argv, tmp, tmp / "run", args.steps, args.save_steps)
        clock.end("program")
        # The same command again in a new output directory: a restart, its compiles read from the cache just filled
        warm = run_program(train_argv(fx, args, tmp / "run_warm", args.cache_dir or tmp / "xla"), tmp, tmp / "run_warm",
                           args.steps, args.save_steps, first_only=True)
        clock.end("restart")
        resumed = resume_program(argv, tmp, tmp / "run", prog["kept"])
        clock.end("resume")
        trl = None if args.no_trl else run_trl(fx, args, tmp)
        clock.end("trl")
        loadavg = os.getloadavg()
    step_times = [r["s"] for r in runs[2:]]  # the second call compiles again (see the docstring)
    step = {"median_s": statistics.median(step_times), "episodes_per_s": gb / statistics.median(step_times),
            "times_s": step_times, "compile_plus_first_s": runs[0]["s"], "second_s": runs[1]["s"],
            "load_s": ready["load_s"],
            "prompt_width": ready["prompt_width"], "completion_tokens": [r["completion_tokens"] for r in runs],
            "recompiles_timed": sum(r["compiled"] for r in runs[2:]), "peak_rss_mib": rss["peak_rss_mib"],
            "device_peak_mib": rss["device_peak_mib"], "save": alone["save"], "eval": alone["eval"]}
    p = loop_stats(prog, gb) | {"peak_rss_mib": prog["child"]["peak_rss_mib"],
                                "device_peak_mib": prog["child"]["device_peak_mib"], "device": prog["child"]["device"],
                                "final_loss": prog["final_metrics"].get("loss"), "kept_checkpoints": prog["kept"]}
    # time to the first step of a restart with the cache warm, and what it spends beyond a steady step (loading,
    # compiles), cold and warm: on an accelerator, where a step is short, the second ratio is the compile saving
    overhead = lambda r: r["time_to_first_step_s"] - p["steady_median_step_s"]  # noqa: E731
    restart = {"time_to_first_step_s": warm["time_to_first_step_s"], "first_step_s": warm["first_step_s"],
               "ratio_cold_over_warm": p["time_to_first_step_s"] / warm["time_to_first_step_s"],
               "overhead_cold_s": overhead(p), "overhead_warm_s": overhead(warm),
               "overhead_ratio_cold_over_warm": overhead(p) / max(overhead(warm), 1e-9)}
    # the same for the run resumed from its previous checkpoint (the cache warm, the state read from disk)
    resume = resumed and {"resumed_from_step": resumed["resumed_from_step"], "first_step": resumed["first_logged_step"],
                          "time_to_first_step_s": resumed["time_to_first_step_s"],
                          "first_step_s": resumed["first_step_s"],
                          "ratio_cold_over_resumed": p["time_to_first_step_s"] / resumed["time_to_first_step_s"],
                          "overhead_resumed_s": overhead(resumed),
                          "overhead_ratio_cold_over_resumed": overhead(p) / max(overhead(resumed), 1e-9)}
    # the targets of issue 17: a save costs the loop < 2 s beyond what it blocks for (the non-finite check and the
    # device-to-host copy, timed alone on the step's state); an evaluation no more than its sampling (timed alone)
    # (the program's first save is set against the first one timed alone: both compile the non-finite check)
    probe = [x["blocking_s"] for x in alone["save"]["saves"]]
    blocking = [probe[min(i, len(probe) - 1)] for i in range(len(p["save_s"]))]
    sampling, evaluation = alone["eval"]["sampling_s"][0], alone["eval"]["evaluate_s"][0]
    stalls = {"save_blocking_s": blocking, "save_beyond_blocking_s": [x["s"] - b for x, b in zip(p["save_s"], blocking)],
              "eval_sampling_s": sampling, "evaluate_alone_s": evaluation,
              "eval_over_sampling": [x["s"] / sampling for x in p["eval_s"]],
              "eval_over_evaluate_alone": [x["s"] / evaluation for x in p["eval_s"]]}
    t = None
    if trl:
        ev = trl["events"]
        t = loop_stats(trl, gb) | {"peak_rss_mib": ev["peak_rss_mib"], "device_peak_mib": ev["device_peak_mib"],
                                   "device": ev["device"], "save_s_direct": trl["save_s_direct"],
                                   "gradient_checkpointing": ev["gradient_checkpointing"],
                                   "eval_error": ev.get("eval_error"), "eval_s_direct": ev.get("eval_s")}
    ratio = lambda x, y: x / y if x is not None and y else None
    return {
        "benchmark": "program",
        "model": f"GPT-NeoX (random), hidden {dims['hidden']}, {dims['layers']} layers, {dims['heads']} heads, "
                 f"vocab {dims['vocab']}, {args.dtype} compute, float32 weights, gradient checkpointing",
        "settings": dict(batch=args.batch, accumulation=args.accumulation, episodes_per_step=gb,
                         new_tokens=args.new_tokens, prompts=prompts, prompt_len=args.prompt_len,
                         eval_prompts=args.eval_prompts, steps=args.steps, save_steps=args.save_steps,
                         eval_steps=args.eval_steps, step_repeats=args.step_repeats, dtype=args.dtype,
                         compilation_cache="given" if args.cache_dir else "fresh (cold compiles)"),
        "train_command": "python -m jodpo.train " + " ".join(argv),
        "step": step, "program": p, "stalls": stalls, "restart_warm_cache": restart, "resume": resume, "trl": t,
        "ratio_program_over_step_steady": p["episodes_per_s_steady"] / step["episodes_per_s"],
        "ratio_program_over_step_whole": p["episodes_per_s_whole"] / step["episodes_per_s"],
        "ratio_program_over_step_after_first": p["episodes_per_s_after_first_step"] / step["episodes_per_s"],
        "ratio_jodpo_over_trl_eps": {k: ratio(p[k], t and t[k]) for k in (
            "episodes_per_s_whole", "episodes_per_s_after_first_step", "episodes_per_s_steady")},
        "phases_s": clock.seconds, "cores_taken_by_others_share": clock.foreign, "loadavg_at_end": loadavg,
        "parent_peak_rss_mib": maxrss_mib(),
    }


def print_program(r: dict):
    p, t, s = r["program"], r["trl"], r["step"]
    f = lambda x, fmt="{:.3f}": "-" if x is None else fmt.format(x)
    g = lambda d, k, fmt="{:.3f}": f(d and d[k], fmt)
    st = r["settings"]
    print(f"\n{r['model']}; {st['batch']} prompts x {st['accumulation']} micro-batches = {st['episodes_per_step']} "
          f"episodes/step, {st['new_tokens']} new tokens; {st['steps']} steps, save every {st['save_steps']}, "
          f"eval every {st['eval_steps']} ({st['eval_prompts']} prompts)")
    print(f"{'':34s}{'jodpo':>10s}{'TRL 1.16':>10s}{'jodpo/TRL':>11s}")
    rows = [("episodes/s whole run", "episodes_per_s_whole"), ("episodes/s after first step", "episodes_per_s_after_first_step"),
            ("episodes/s steady", "episodes_per_s_steady")]
    for name, k in rows:
        print(f"{name:34s}{p[k]:10.3f}{g(t, k):>10s}{f(r['ratio_jodpo_over_trl_eps'][k]):>11s}")
    for name, k in (("s to first step (load+compile)", "time_to_first_step_s"), ("s steady step (median)", "steady_median_step_s"),
                    ("s lost per save (mean)", "save_s_mean"), ("s lost per eval (mean)", "eval_s_mean"),
                    ("s after the last step", "after_last_step_s")):
        print(f"{name:34s}{f(p[k]):>10s}{g(t, k):>10s}")
    print(f"{'peak RSS MiB':34s}{p['peak_rss_mib']:10.0f}{g(t, 'peak_rss_mib', '{:.0f}'):>10s}")
    print(f"device {p['device']}, device peak MiB: jodpo {f(p['device_peak_mib'], '{:.0f}')}, "
          f"TRL {g(t, 'device_peak_mib', '{:.0f}')}")
    print(f"\njodpo fused step (jit_online_step, same settings): {s['median_s']:.3f} s, {s['episodes_per_s']:.3f} "
          f"episodes/s (compile + first {s['compile_plus_first_s']:.1f} s, prompts padded to {s['prompt_width']})")
    print(f"program / step: steady {r['ratio_program_over_step_steady']:.3f}, whole run "
          f"{r['ratio_program_over_step_whole']:.3f}, after the first step {r['ratio_program_over_step_after_first']:.3f}")
    w = r["restart_warm_cache"]
    print(f"restart with the compilation cache warm: first step after {w['time_to_first_step_s']:.1f} s (cold "
          f"{p['time_to_first_step_s']:.1f} s, {w['ratio_cold_over_warm']:.2f}x); beyond one steady step "
          f"{w['overhead_warm_s']:.1f} s (cold {w['overhead_cold_s']:.1f} s, {w['overhead_ratio_cold_over_warm']:.2f}x)")
    if r["resume"]:
        u = r["resume"]
        print(f"resumed from the checkpoint of step {u['resumed_from_step']}: its first step after "
              f"{u['time_to_first_step_s']:.1f} s ({u['ratio_cold_over_resumed']:.2f}x faster than cold); beyond one "
              f"steady step {u['overhead_resumed_s']:.1f} s ({u['overhead_ratio_cold_over_resumed']:.2f}x)")
    print(f"jodpo saves after {p['saves_after_steps']}, evals after {p['evals_after_steps']}; per save "
          + ", ".join(f"{x['s']:.2f}" for x in p["save_s"]) + " s; per eval " + ", ".join(f"{x['s']:.2f}" for x in p["eval_s"]) + " s")
    z = r["stalls"]
    saves = s["save"]["saves"]
    print(f"alone, on the step's state ({s['save']['state_mib']:.0f} MiB): a save blocks "
          + ", ".join(f"{x['blocking_s']:.2f}" for x in saves) + " s (whole saves "
          + ", ".join(f"{x['whole_s']:.2f}" for x in saves) + " s, "
          + ", ".join(f"{x['cpu_user_s'] + x['cpu_kernel_s']:.2f}" for x in saves) + " CPU-s of which kernel "
          + ", ".join(f"{x['cpu_kernel_s']:.2f}" for x in saves) + "); per save the loop lost "
          + ", ".join(f"{x:.2f}" for x in z["save_beyond_blocking_s"]) + " s beyond that (target < 2)")
    print(f"alone: evaluate() {z['evaluate_alone_s']:.2f} s, its sampling {z['eval_sampling_s']:.2f} s; per eval the "
          "loop lost " + ", ".join(f"{x:.2f}x" for x in z["eval_over_sampling"]) + " the sampling, "
          + ", ".join(f"{x:.2f}x" for x in z["eval_over_evaluate_alone"])
          + " evaluate() (the first also scores the references, once per run)")
    if t:
        evaluation = t["eval_error"] or f"{t['eval_s_direct']:.2f} s"
        print(f"TRL saves after {t['saves_after_steps']} ({', '.join(f'{x:.2f}' for x in t['save_s_direct'])} s each, "
              f"timed directly); TRL evaluation: {evaluation}")
    if warning := disturbance_warning(r["cores_taken_by_others_share"]):
        print(warning)
