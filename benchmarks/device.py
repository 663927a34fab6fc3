"""``bench.py device``: the GPU check that fits a short lease (``scripts/device_check.sh`` runs it on a lent machine).

Two phases, each in a process of its own under its own time limit, one after the other:

1. **tests**: the suite's tests that carry weight (``WEIGHTY``: precision, every family's logits and reward scores,
   KV-cache decoding, the sampler against transformers and a Python loop, the step against TRL's recorded step,
   resume, and the tests marked ``gpu``), selected by name (``pytest -k``), so a new family's parametrized tests
   are in it the day they land. jax's default backend is whatever the machine has: the GPU on a lent one.
2. **step**: the fused online step (``train_step.jit_online_step``: sample, score with the reward model, update)
   and the sampler alone (``jit_sample_completions``) at a ~1.7B GPT-NeoX shape in bf16 (hidden 2304, 24 layers, 18
   heads: 1.76B parameters), models built from a ``config.json`` with random weights (nothing read from disk):
   episodes/s, completion tokens/s, and MFU (useful FLOPs, ``harness.step_flops``, against the chip's nominal
   dense bf16 peak and against the matmul peak measured in the run).

Each phase's results go to ``DIR/device_check.json`` as soon as the phase ends (a phase that runs out of time is
recorded as ``timed out``, with what it finished: the tests that reported, the step's pieces that were timed), and
``DIR/device_check.md`` is the table for docs/gpu.md. ``--dry-run`` is the suite's check of this code on a CPU:
the test phase only collects (each group must select tests, the logits every family), the step phase runs at a
tiny shape.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import BENCH, ROOT, config_models, jax_matmul_peak, step_flops, timed

# group: fragments of test names (pytest -k matches a fragment anywhere in a test's name or its file's)
WEIGHTY = {
    "precision": ("test_precision",),
    "logits": ("logits_match_transformers", "reward_scores_match_transformers", "kv_cache_decoding_equals"),
    "sampler": ("greedy_equals_transformers_generate", "scan_sampler_equals_python_loop"),
    "step_vs_trl": ("one_step_equals_trl",),
    "resume": ("resumes_exactly", "resume_exactly", "kill_and_resume", "resume_without_determinism"),
    "gpu": ("test_gpu",),
}
# the ~1.7B shape of the step phase, and the tiny one of --dry-run
SHAPES = {"1.7b": dict(vocab=50304, hidden=2304, layers=24, heads=18, batch=16, prompt_len=128, new_tokens=128,
                       peak_size=None),
          "tiny": dict(vocab=512, hidden=64, layers=2, heads=4, batch=2, prompt_len=16, new_tokens=8, peak_size=256)}
# nominal dense bf16 TFLOP/s by device kind (the first fragment found in jax's device_kind wins)
NOMINAL_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0), ("L4", 121.0))


def add_parser(sub) -> None:
    p = sub.add_parser("device", help="the GPU check of a short lease: the weighty tests, then the step at ~1.7B")
    p.add_argument("--out", type=Path, default=Path("device-check"), help="folder of device_check.json/.md and logs")
    p.add_argument("--dry-run", action="store_true", help="collect the tests only, and the step at a tiny shape")
    p.add_argument("--tests-timeout", type=float, default=330, help="seconds for the test phase")
    p.add_argument("--step-timeout", type=float, default=130, help="seconds for the step phase")
    p.add_argument("--steps", type=int, default=3, help="timed calls of the step and of the sampler")
    p.add_argument("--nominal-peak-tflops", type=float, help="the chip's dense bf16 peak (default: by device kind)")


def selection() -> str:
    """The ``pytest -k`` expression of every weighty group."""
    return " or ".join(f for fragments in WEIGHTY.values() for f in fragments)


def groups_of(nodeid: str) -> list[str]:
    return [g for g, fragments in WEIGHTY.items() if any(f in nodeid for f in fragments)]


def parse_pytest(log: str) -> dict:
    """Per group, the tests' outcomes from pytest's output (``-v`` lines ``ID PASSED``, or ``--collect-only -q``'s
    bare ids): what a phase that ran out of time had finished is there too."""
    out = {g: {"passed": 0, "failed": [], "skipped": 0, "collected": []} for g in WEIGHTY}
    for line in log.splitlines():
        parts = line.split()
        if not parts or "::" not in parts[0] or not parts[0].startswith("tests/"):
            continue
        nodeid, outcome = parts[0], (parts[1] if len(parts) > 1 else "COLLECTED")
        for g in groups_of(nodeid):
            if outcome == "PASSED":
                out[g]["passed"] += 1
            elif outcome in ("FAILED", "ERROR"):
                out[g]["failed"].append(nodeid)
            elif outcome == "SKIPPED":
                out[g]["skipped"] += 1
            elif outcome == "COLLECTED":
                out[g]["collected"].append(nodeid)
    return out


def run_phase(cmd: list[str], timeout: float, log: Path) -> dict:
    """``cmd`` in a session of its own, its output to ``log``; at ``timeout`` the session is stopped (SIGTERM, then
    SIGKILL after 10 s) and the phase recorded as timed out."""
    t = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code, status = p.wait(timeout=timeout), None
        except subprocess.TimeoutExpired:
            code, status = None, "timed out"
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                os.killpg(p.pid, sig)
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
    status = status or ("passed" if code == 0 else "failed")
    return {"status": status, "exit_code": code, "seconds": round(time.perf_counter() - t, 1), "timeout_s": timeout,
            "log": log.name}


def bench_device(a) -> dict:
    a.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES["tiny" if a.dry_run else "1.7b"]
    result = {"benchmark": "device", "dry_run": a.dry_run, "selection": selection(), "shape": shape, "phases": {}}

    def save():
        (a.out / "device_check.json").write_text(json.dumps(result, indent=2))

    pytest = [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", "--continue-on-collection-errors",
              "-k", selection()]
    pytest += ["--collect-only", "-q"] if a.dry_run else ["-v", "--durations=25"]
    tests = run_phase(pytest, a.tests_timeout, a.out / "tests.log")
    if a.dry_run and tests["status"] == "failed" and tests["exit_code"] == 5:
        tests["status"] = "failed: no test selected"
    tests["groups"] = parse_pytest((a.out / "tests.log").read_text())
    result["phases"]["tests"] = tests
    save()
    spec = dict(shape, out=str(a.out / "step.json"), steps=a.steps, nominal_peak_tflops=a.nominal_peak_tflops)
    step = run_phase([sys.executable, str(BENCH), "_device_step", json.dumps(spec)], a.step_timeout,
                     a.out / "step.log")
    if (a.out / "step.json").exists():
        step.update(json.loads((a.out / "step.json").read_text()))
    result["phases"]["step"] = step
    result["complete"] = all(p["status"] == "passed" for p in result["phases"].values())
    save()
    return result


def write(result: dict, folder: Path) -> None:
    """The finished check, with the machine and the command: ``device_check.json`` and its table, ``.md``."""
    (folder / "device_check.json").write_text(json.dumps(result, indent=2))
    (folder / "device_check.md").write_text(table(result))


def step_phase(spec: dict) -> None:
    """The step phase (``bench.py _device_step SPEC``): writes ``spec["out"]`` after each measurement."""
    import types

    import jax
    import jax.numpy as jnp

    import jodpo
    from jodpo import train_step as ts
    from jodpo.models.params import frozen_params

    out, r = Path(spec["out"]), {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind}

    def save(**kv):
        r.update(kv)
        out.write_text(json.dumps(r, indent=2))

    a = types.SimpleNamespace(**spec)
    kind = r["device_kind"]
    nominal = a.nominal_peak_tflops or next((v for k, v in NOMINAL_BF16_TFLOPS if k in kind), None)
    save(nominal_peak_tflops=nominal, matmul_peak_tflops=jax_matmul_peak("bfloat16", 3, a.peak_size) / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = config_models(a, Path(tmp))
    model, rm = policy.replace(dtype="bfloat16", remat="full"), rm.replace(dtype="bfloat16")
    cfg = ts.StepConfig(model=model, reward_model=rm, beta=0.1, missing_eos_penalty=1.0, max_length=a.prompt_len +
                        a.new_tokens, optimizer=ts.OptimizerConfig(learning_rate=5e-7, total_steps=1000),
                        sampling=jodpo.SamplingConfig(max_new_tokens=a.new_tokens, temperature=0.9,
                                                      eos_token_ids=(0,), pad_token_id=1))
    t = time.perf_counter()
    params = jodpo.init_params(model, jax.random.key(0), jnp.float32)
    ref = frozen_params(model, params)  # the reference as the program holds it: bf16, as its forwards read it
    rm_params = frozen_params(rm, jodpo.init_params(rm, jax.random.key(1), jnp.float32))
    state = ts.init_state(cfg, params, jax.random.key(2))
    del params
    ids = jax.random.randint(jax.random.key(3), (1, a.batch, a.prompt_len), 2, a.vocab, jnp.int32)
    mask = jnp.ones_like(ids)
    jax.block_until_ready((state, ref, rm_params))
    save(parameters=sum(x.size for x in jax.tree.leaves(state.params)), init_s=time.perf_counter() - t)
    peak = 1e12 * nominal if nominal else None

    # the sampler alone: two completions of every prompt, [1, 2B, T]
    first = timed(lambda: jax.block_until_ready(ts.jit_sample_completions(cfg, state, ids, mask)))
    times, tokens = [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        samples = jax.block_until_ready(ts.jit_sample_completions(cfg, state, ids, mask))
        times.append(time.perf_counter() - t)
        tokens.append(int(samples.mask.sum()))
    med = statistics.median(times)
    lens_p, lens_c = np.full(a.batch, a.prompt_len), np.asarray(samples.mask).sum(-1).ravel()
    flops = step_flops(vars(a), lens_p, lens_c, a.prompt_len, a.new_tokens)
    sampling_flops = 1e9 * flops["sampling"]["useful"]
    save(sampler={"compile_plus_first_s": first, "times_s": times, "median_s": med, "completion_tokens": tokens,
                  "tokens_per_s": statistics.median(tokens) / med, "useful_tflops_per_s": sampling_flops / med / 1e12,
                  "mfu_nominal": sampling_flops / med / peak if peak else None})

    # the fused step: sample, score on device, update (the state donated)
    t = time.perf_counter()
    state, metrics, samples, _ = jax.block_until_ready(ts.jit_online_step(cfg, state, ref, rm_params, ids, mask))
    first, times = time.perf_counter() - t, []
    for _ in range(a.steps):
        t = time.perf_counter()
        state, metrics, samples, _ = jax.block_until_ready(ts.jit_online_step(cfg, state, ref, rm_params, ids, mask))
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    lens_c = np.asarray(samples.mask).sum(-1).ravel()
    flops = step_flops(vars(a), lens_p, lens_c, a.prompt_len, a.new_tokens)
    useful = 1e9 * flops["step"]["useful"]
    measured = 1e12 * r["matmul_peak_tflops"]
    save(step={"compile_plus_first_s": first, "times_s": times, "median_s": med, "episodes_per_s": a.batch / med,
               "loss": float(metrics["loss"]), "useful_tflop": useful / 1e12,
               "useful_tflops_per_s": useful / med / 1e12,
               "mfu_nominal": useful / med / peak if peak else None, "mfu_measured_peak": useful / med / measured},
         device_peak_mib=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2 ** 20
         if jax.default_backend() != "cpu" else None)


def table(r: dict) -> str:
    """The markdown table of a device check, for docs/gpu.md."""
    m, ph = r.get("machine", {}), r["phases"]
    kind, dry = ph.get("step", {}).get("device_kind", "?"), " (dry run)" if r["dry_run"] else ""
    rows = [f"Device check (`{r.get('command', 'python benchmarks/bench.py device')}`): {kind}, jax {m.get('jax', '?')}"
            f"{dry}",
            "", "| check | result |", "| --- | --- |"]
    tests = ph["tests"]
    for g, x in tests["groups"].items():
        ran = x["passed"] + len(x["failed"]) + x["skipped"]
        res = (f"{len(x['collected'])} collected" if r["dry_run"] else
               "not reached (the phase stopped first)" if not ran and tests["status"] != "passed" else
               f"{x['passed']} passed, {len(x['failed'])} failed, {x['skipped']} skipped")
        rows.append(f"| tests: {g} | {res}" + (f" ({', '.join(x['failed'])})" if x["failed"] else "") + " |")
    rows.append(f"| test phase | {tests['status']}, {tests['seconds']} s of {tests['timeout_s']:.0f} |")
    s, sh = ph["step"], r["shape"]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    if "sampler" in s:
        x = s["sampler"]
        rows.append(f"| sampler, {sh['batch']} prompts x 2 x {sh['new_tokens']} tokens | {x['tokens_per_s']:.0f} "
                    f"tokens/s ({x['median_s']:.3f} s; compile + first {x['compile_plus_first_s']:.1f} s), MFU "
                    f"{pct(x['mfu_nominal'])} |")
    if "step" in s:
        x = s["step"]
        nominal = f" of {s['nominal_peak_tflops']} TFLOP/s" if s["nominal_peak_tflops"] else ""
        rows.append(f"| fused step, {s['parameters'] / 1e6:,.0f}M parameters, bf16 | {x['episodes_per_s']:.2f} "
                    f"episodes/s "
                    f"({x['median_s']:.3f} s; compile + first {x['compile_plus_first_s']:.1f} s), MFU "
                    f"{pct(x['mfu_nominal'])}{nominal}, {pct(x['mfu_measured_peak'])} of the "
                    f"{s['matmul_peak_tflops']:.3g} TFLOP/s measured |")
    rows.append(f"| step phase | {s['status']}, {s['seconds']} s of {s['timeout_s']:.0f} |")
    return "\n".join(rows) + "\n"


def print_device(r: dict) -> None:
    print(table(r))
