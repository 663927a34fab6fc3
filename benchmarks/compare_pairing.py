"""k = 2 (TRL's pair) against best-of-k pairs at the same sampling budget.

  python benchmarks/compare_pairing.py [--config tiny.py] [--k 4] [--seeds 0 1 2] [--steps 200] [--eval-steps 25]
                                    [--no-random] [--out DIR]

Runs the config as it is (its prompts per step x 2 completions) and with ``num_generations=k``, ``best_worst`` and
k/2 times fewer prompts per step (the same completions and tokens sampled per step; for configs/tiny.py that is
configs/tiny_best_of_4.py), and ``k``, ``random`` (the budget spent on k without choosing) as a control, for the same
steps and seeds, in one process, one after the other; then prints a markdown table of the held-out score
(``eval/objective/scores``, one sample per evaluation prompt) at each evaluation: mean and range over the seeds.
The runs' metrics.jsonl stay under ``--out`` for ``python -m jodpo.plot``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny.py")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--no-random", action="store_true", help="leave out the k, random control")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=25)
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    from jodpo.program import backend
    from jodpo.program.config import load_config_file
    from jodpo.program.loop import train

    out = Path(args.out or tempfile.mkdtemp(prefix="compare-pairing-"))
    base = load_config_file(args.config)
    n, k = base.per_device_train_batch_size, args.k
    if base.num_generations != 2 or (2 * n) % k:
        raise SystemExit(f"{args.config}: num_generations must be 2 and 2 x per_device_train_batch_size ({2 * n}) a "
                         f"multiple of k={k}")
    fewer = dict(num_generations=k, per_device_train_batch_size=2 * n // k)
    variants = {f"k=2 (TRL), {n} prompts/step": {},
                f"k={k} best_worst, {2 * n // k} prompts/step": dict(fewer, pairing="best_worst")}
    if not args.no_random:
        variants[f"k={k} random, {2 * n // k} prompts/step"] = dict(fewer, pairing="random")
    scores: dict[str, dict[int, list[float]]] = {}
    for name, overrides in variants.items():
        for seed in args.seeds:
            run = out / f"k{overrides.get('num_generations', 2)}-{overrides.get('pairing', 'trl')}-seed{seed}"
            cfg = base.replace(seed=seed, max_steps=args.steps, eval_steps=args.eval_steps, save_steps=args.steps,
                               output_dir=str(run), report_to="none", num_sample_generations=0, **overrides)
            backend.configure(cfg)
            train(cfg)
            for line in (run / "metrics.jsonl").read_text().splitlines():
                m = json.loads(line)
                if "eval/objective/scores" in m:
                    scores.setdefault(name, {}).setdefault(m["step"], []).append(m["eval/objective/scores"])
    steps = sorted(next(iter(scores.values())))
    print(f"held-out eval/objective/scores, mean [min, max] over seeds {args.seeds}; runs in {out}\n")
    print("| variant | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("| --- |" + " --- |" * len(steps))
    for name, by_step in scores.items():
        cells = [f"{sum(v) / len(v):.3f} [{min(v):.2f}, {max(v):.2f}]" for v in (by_step[s] for s in steps)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
