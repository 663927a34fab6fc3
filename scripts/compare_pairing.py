"""k = 2 (TRL's pair) against best-of-k pairs at the same sampling budget, on the embedded tiny world.

  python scripts/compare_pairing.py [--seeds 0 1 2] [--steps 200] [--eval-steps 25] [--out DIR]

Runs configs/tiny.py (16 prompts x 2 completions per step) and configs/tiny_best_of_4.py (8 prompts x 4, the best
against the worst: the same completions and tokens sampled per step) for the same steps and seeds, in one process
(one after the other, so they share the machine's state), and prints a markdown table of the held-out score
(``eval/objective/scores``, one greedy-free sample per evaluation prompt) at each evaluation: mean and range over
the seeds. Also ``k = 4, random`` (the budget spent on k without choosing) as a control. The runs' metrics.jsonl
stay under ``--out`` for ``python -m jodpo.plot``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name: (config file, overrides)
    "k=2 (TRL), 16 prompts/step": ("tiny.py", {}),
    "k=4 best_worst, 8 prompts/step": ("tiny_best_of_4.py", {}),
    "k=4 random, 8 prompts/step": ("tiny_best_of_4.py", {"pairing": "random"}),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=25)
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    from jodpo import backend
    from jodpo.config import load_config_file
    from jodpo.train import train

    out = Path(args.out or tempfile.mkdtemp(prefix="compare-pairing-"))
    scores: dict[str, dict[int, list[float]]] = {}
    for name, (config, overrides) in VARIANTS.items():
        for seed in args.seeds:
            run = out / f"{config.removesuffix('.py')}-{overrides.get('pairing', 'default')}-seed{seed}"
            cfg = load_config_file(config).replace(seed=seed, max_steps=args.steps, eval_steps=args.eval_steps,
                                                   save_steps=args.steps, output_dir=str(run), report_to="none",
                                                   num_sample_generations=0, **overrides)
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
