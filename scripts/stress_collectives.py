"""The two multi-device CPU jobs whose collectives once aborted, each run N times under load; prints how many finished.

    JODPO_EXTRAS=test bash scripts/env.sh python scripts/stress_collectives.py [--runs 10] [--load pin|hog] [--out DIR]

- ``two processes``: tldr.py as a job of 2 processes x 4 fake CPU devices (jax.distributed on 127.0.0.1, gloo), 3
  steps (issue 63: gloo's "Received data size doesn't match expected size" in 4 runs of 4 on a busy machine);
- ``8-device warm restart``: the same recipe on 8 fake CPU devices in one process, started on a compilation cache a
  first run filled (issue 53: XLA's "Termination timeout" in 6 restarts of 6).

Both with the setting they failed in (tests/test_collective_order.py's ``tldr`` fixture: a Pythia-shaped pair, prompts of
TL;DR's length, programs compiled as a run compiles them). The load: ``pin`` (the default) puts a run's processes
on one core, where XLA:CPU's threads take turns as on a busy host; ``hog`` starts a busy loop on every core beside
them instead. A run finished when it exited 0 and logged its 3 steps; otherwise its last log line says why. Each run
takes a minute or two on 2 cores. The fixtures (torch writes them) and the runs' directories stay in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import hf_fixtures, subproc  # noqa: E402  (the suite's fixtures and subprocess environments)


def fixtures(out: Path) -> dict:
    """The ``tldr`` fixture of tests/test_collective_order.py, written once into ``out``: ``--config.`` fields."""
    done = out / "fields.json"
    if not done.exists():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        hf_fixtures.build_tokenizer(out / "tokenizer")
        pair = hf_fixtures.build_neox_pair(out, out / "tokenizer")
        data = hf_fixtures.prompt_dataset(out / "data", words=(10, 25))
        fields = dict(model_name_or_path=str(pair["causal_lm"]), reward_model_path=str(pair["reward"]),
                      dataset_name=str(data), max_steps=3, per_device_train_batch_size=1,
                      gradient_accumulation_steps=1, max_new_tokens=8, logging_steps=1, learning_rate=1e-4,
                      warmup_ratio=0.0, bf16=False, num_sample_generations=0)
        done.write_text(json.dumps(fields))
    return json.loads(done.read_text())


def argv(fields: dict, out: Path, **more) -> list[str]:
    return [sys.executable, "-m", "jodpo.train", "--config", "tldr.py",
            *(f"--config.{k}={v}" for k, v in (fields | more).items()), f"--config.output_dir={out}"]


def start(cmd: list[str], environ: dict, log: Path, load: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=environ, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    return subproc.on_one_core(proc) if load == "pin" else proc


def finished(procs: list[subprocess.Popen], out: Path, logs: list[Path]) -> tuple[bool, str]:
    """Waits for ``procs``; (whether the run finished, a word on how it ended)."""
    try:
        codes = [p.wait(timeout=900) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return False, "hung: killed after 15 minutes"
    metrics = out / "metrics.jsonl"
    steps = sum('"loss"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0
    if codes == [0] * len(procs) and steps == 3:
        return True, "finished"
    last = [line for log in logs for line in log.read_text(errors="replace").splitlines() if "jodpo.train:" in line]
    return False, f"exit {codes}, {steps} of 3 steps; {last[-1] if last else 'no jodpo line'}"


def two_processes(fields: dict, out: Path, load: str) -> tuple[bool, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = subproc.compiled_as_a_run(subproc.cpu_env(4, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo"))
    logs = [out.parent / f"{out.name}.p{i}.log" for i in range(2)]
    procs = [start([*argv(fields, out), "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
                    "--process_id", str(i)], environ, logs[i], load) for i in range(2)]
    return finished(procs, out, logs)


def warm_restart(fields: dict, out: Path, load: str, cache: Path) -> tuple[bool, str]:
    environ = subproc.compiled_as_a_run(subproc.cpu_env(8))
    del environ["NPROC"]  # jodpo.train's to set
    log = out.parent / f"{out.name}.log"
    return finished([start(argv(fields, out, compilation_cache_dir=cache), environ, log, load)], out, [log])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each job (default 10)")
    parser.add_argument("--load", choices=("pin", "hog"), default="pin", help="the load beside the runs")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "jodpo-stress-collectives")
    parser.add_argument("--only", choices=("two_processes", "warm_restart"), help="one of the two jobs")
    args = parser.parse_args()
    fields = fixtures(args.out / "fixtures")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)] if args.load == "hog" else []
    totals = {}
    try:
        if args.only in (None, "two_processes"):
            ok = 0
            for i in range(1, args.runs + 1):
                done, how = two_processes(fields, args.out / f"two_processes_{i}", args.load)
                ok += done
                print(f"2 processes x 4 devices, run {i}: {how}", flush=True)
            totals["2 processes x 4 devices"] = ok
        if args.only in (None, "warm_restart"):
            cache = args.out / "xla"
            shutil.rmtree(cache, ignore_errors=True)
            done, how = warm_restart(fields, args.out / "warm_first", args.load, cache)  # fills the cache
            print(f"8 devices, the first run (fills the compilation cache): {how}", flush=True)
            ok = 0
            for i in range(1, args.runs + 1):
                done, how = warm_restart(fields, args.out / f"warm_restart_{i}", args.load, cache)
                ok += done
                print(f"8 devices on a warm cache, run {i}: {how}", flush=True)
            totals["8-device warm restart"] = ok
    finally:
        for h in hogs:
            h.kill()
    for name, ok in totals.items():
        print(f"{name}: finished {ok} of {args.runs} (load: {args.load})")
    return 0 if all(ok == args.runs for ok in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
