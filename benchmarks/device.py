"""``bench.py device``: the GPU check that fits a short lease (``scripts/device_check.sh`` runs it on a lent machine).

Five phases, each in processes of its own under its own time limit, one after the other:

1. **tests**: the suite's tests that carry weight (``WEIGHTY``: precision, every family's logits and reward scores,
   KV-cache decoding, the sampler against transformers and a Python loop, the step against TRL's recorded step,
   resume, and the tests marked ``gpu``), selected by name (``pytest -k``), so a new family's parametrized tests
   are in it the day they land; the files of ``FIRST`` run first, so a phase that runs out of time has covered them.
   jax's default backend is whatever the machine has: the GPU on a lent one.
2. **moe**: one OLMoE-shaped mixture-of-experts layer in bf16 (``bench.py moe``: 2,048 tokens' forward and backward,
   a decode step), its grouped matmuls as ``jax.lax.ragged_dot`` as XLA:GPU lowers it against the tiles and the
   one-hot reference, timed in the same process (``--moe-lowerings``: XLA's other lowerings too, a process each).
3. **step**: the fused online step and the sampler alone at a ~1.7B GPT-NeoX shape in bf16 (hidden 2304, 24 layers,
   18 heads: 1.76B parameters, random weights; ``device_measure``): episodes/s, completion tokens/s, MFU against the
   chip's nominal dense bf16 peak and the matmul peak measured in the run, the sampler's share of its bandwidth bound;
   then ``IN_PROCESS`` variants, each one choice changed, timed in the same process.
4. **rollout**: ``bench.py rollout`` at a ~0.1B Llama shape in bf16: fixed batches against refill between chunks
   (``SamplingConfig.slots``) at the same rows in flight, long-tailed completion lengths, the completions checked
   the same.
5. **variants**: ``FLAG_SETS``, the sampler in a process under other XLA flags (command buffers that capture the
   decode loop), and with ``--baseline DIR`` (a copy of an earlier ``jodpo`` package) the same on that version: the
   sampler as it was, measured side by side in the same call.

Each phase's results go to ``DIR/device_check.json`` as soon as the phase ends (a phase that runs out of time is
recorded as ``timed out``, with what it finished: the tests that reported, the measurements made), and
``DIR/device_check.md`` is the table for docs/gpu.md. ``--dry-run`` is the suite's check of this code on a CPU:
the test phase only collects (each group must select tests, the logits every family), the MoE phase runs one process
at the tests' tiny shape, the step and variants phases run at a tiny shape.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import BENCH, ROOT

# group: fragments of test names (pytest -k matches a fragment anywhere in a test's name or its file's)
WEIGHTY = {
    "precision": ("test_precision",),
    "logits": ("logits_match_transformers", "reward_scores_match_transformers", "kv_cache_decoding_equals"),
    "sampler": ("greedy_equals_transformers_generate", "scan_sampler_equals_python_loop"),
    "step_vs_trl": ("one_step_equals_trl",),
    "resume": ("resumes_exactly", "resume_exactly", "kill_and_resume", "resume_without_determinism"),
    "gpu": ("test_gpu",),
    "moe": ("test_moe", "test_routing_replay"),  # ragged_dot's grouped matmuls, routing replay in bf16
}
# test files run first (the mixtures of experts, the sampler, the step against TRL, precision, the GPU's own): the
# rest of the selection follows
FIRST = ("test_moe.py", "test_routing_replay.py", "test_sampling.py", "test_losses_vs_trl.py", "test_precision.py",
         "test_gpu.py")
# one choice changed each, timed in the step phase's process against its default (device_measure.run), by name
IN_PROCESS = {
    "update (xla attention, remat full)": {"what": "update"},
    "update, cudnn attention": {"what": "update", "attention": "cudnn"},
    "update, remat dots": {"what": "update", "remat": "dots"},
    "update, cudnn attention + remat dots": {"what": "update", "attention": "cudnn", "remat": "dots"},
    "step, cudnn attention + remat dots": {"what": "step", "attention": "cudnn", "remat": "dots"},
    "step, remat dots": {"what": "step", "remat": "dots"},
    "sampler and step, Qwen3.5-2B shape": {"what": "family", "config": "qwen3.5-2b"},
    "sampler and step, Gemma 4 E2B shape": {"what": "family", "config": "gemma-4-e2b"},
    # the mixture of experts: OLMoE's layers (64 experts, 8 per token), 4 of its 16 (1.8B parameters: the 7B's
    # float32 Adam state and reward model would not fit beside the rest)
    "sampler and step, OLMoE-1B-7B shape, 4 layers": {"what": "family", "config": "olmoe-1b-7b",
                                                      "override": {"num_hidden_layers": 4}},
    "sampler, 4x rows": {"what": "sampler", "batch_factor": 4},
    "sampler, scan unroll 2": {"what": "sampler", "unroll": 2},
    "sampler, cudnn prefill": {"what": "sampler", "attention": "cudnn"},
}
# what the dry run times of them (one of each kind: its processes are the suite's)
DRY_IN_PROCESS = ("update (xla attention, remat full)", "sampler, scan unroll 2", "sampler and step, Qwen3.5-2B shape",
                  "sampler and step, Gemma 4 E2B shape")
# the dry run's real configs shrunk to tiny models: Qwen3.5 (same kinds, head grouping and partial RoPE), Gemma 4 E2B
# (sliding and global layers of two shapes, per-layer embeddings, the last layer sharing the global layer's keys and
# values with a double-wide MLP: its fewest layers, each one more compiled in every program of the dry run)
DRY_SHRINK = {
    "qwen3.5-2b": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8,
                       layer_types=["linear_attention", "full_attention"]),
    "gemma-4-e2b": dict(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        global_head_dim=32, hidden_size_per_layer_input=8, num_kv_shared_layers=1,
                        layer_types=["sliding_attention", "full_attention", "full_attention"]),
    "olmoe-1b-7b": dict(vocab_size=512, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
}
# the MoE phase: one OLMoE-shaped layer's forward+backward (bench.py moe, bf16) in a process per XLA flag set: jax
# 0.11.2's XLA:GPU lowers ragged_dot to one dense matmul over every expert's weights (E times the FLOPs: seen in the
# sampler's optimised HLO, 2026-11-28); its experimental fusion lowering is a flag (the grouped-GEMM flag,
# --xla_gpu_experimental_use_ragged_dot_grouped_gemm, changed nothing on an H200: 62.7 ms both, 2026-11-28). A
# process takes ~65 s there (compiles of 3-7 s each, and transformers' block on the host's CPU)
MOE_FLAG_SETS = (("ragged_dot as XLA lowers it", ""),
                 ("ragged_dot, fusion", "--xla_gpu_experimental_use_ragged_dot_fusion=true"))
MOE_ARGS = {"1.7b": ["--shapes", "olmoe-1b-7b", "--tokens", "2048", "--ragged-max-tokens", "2048"],
            "tiny": ["--shapes", "tiny", "--tokens", "24", "--decode-tokens", "2", "--ragged-max-tokens", "24"]}
# XLA's command buffers (CUDA graphs) for the decode loop and its branches too, not only runs of kernels
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
# the variants phase: (name, XLA flags added, on the --baseline package)
FLAG_SETS = (("baseline", "", True), ("command buffers", COMMAND_BUFFERS, False),
             ("baseline, command buffers", COMMAND_BUFFERS, True))
# the targets: the sampler's share of its bandwidth bound, the fused step's MFU of the nominal peak
SAMPLER_TARGET, STEP_TARGET = 0.70, 0.35
# the rollout phase's sampler (bench.py rollout), and the tiny one of --dry-run
ROLLOUT_ARGS = {"1.7b": ["--hidden", "1024", "--layers", "4", "--heads", "8", "--vocab", "32768", "--prompts", "64",
                         "--slots", "16", "--dtype", "bfloat16", "--repeats", "2"],
                "tiny": ["--hidden", "64", "--layers", "1", "--heads", "2", "--vocab", "512", "--prompts", "8",
                         "--slots", "4", "--new-tokens", "16", "--repeats", "1"]}
# the ~1.7B shape of the step phase, and the tiny one of --dry-run
SHAPES = {"1.7b": dict(vocab=50304, hidden=2304, layers=24, heads=18, batch=16, prompt_len=128, new_tokens=128,
                       peak_size=None),
          "tiny": dict(vocab=512, hidden=64, layers=2, heads=4, batch=2, prompt_len=16, new_tokens=8, peak_size=256)}


def add_parser(sub) -> None:
    p = sub.add_parser("device", help="the GPU check of a short lease: the weighty tests, then the step at ~1.7B")
    p.add_argument("--out", type=Path, default=Path("device-check"), help="folder of device_check.json/.md and logs")
    p.add_argument("--dry-run", action="store_true", help="collect the tests only, and the step at a tiny shape")
    p.add_argument("--tests-timeout", type=float, default=100, help="seconds for the test phase")
    p.add_argument("--step-timeout", type=float, default=200, help="seconds for the step phase and its variants")
    p.add_argument("--variant-timeout", type=float, default=40, help="seconds for each process of the variants phase")
    p.add_argument("--moe-timeout", type=float, default=90, help="seconds for each process of the MoE phase")
    p.add_argument("--rollout-timeout", type=float, default=40, help="seconds for the rollout phase")
    p.add_argument("--moe-lowerings", nargs="+", choices=[n for n, _ in MOE_FLAG_SETS], default=[MOE_FLAG_SETS[0][0]],
                   help="XLA:GPU lowerings of ragged_dot timed in the MoE phase, a process each (default: XLA's own)")
    p.add_argument("--baseline", type=Path, help="a folder holding an earlier jodpo package, measured side by side")
    p.add_argument("--groups", nargs="+", choices=tuple(WEIGHTY), default=tuple(WEIGHTY), help="weighty test groups")
    p.add_argument("--variants", nargs="+", choices=tuple(IN_PROCESS), help="in-process variants (default: all)")
    p.add_argument("--flag-sets", nargs="+", choices=[n for n, _, _ in FLAG_SETS], help="variant processes (all)")
    p.add_argument("--steps", type=int, default=3, help="timed calls of the step and of the sampler")
    p.add_argument("--nominal-peak-tflops", type=float, help="the chip's dense bf16 peak (default: by device kind)")


def selection(groups=tuple(WEIGHTY)) -> str:
    """The ``pytest -k`` expression of the weighty ``groups``."""
    return " or ".join(f for g in groups for f in WEIGHTY[g])


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


def run_phase(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> dict:
    """``cmd`` in a session of its own, its output to ``log``; at ``timeout`` the session is stopped (SIGTERM, then
    SIGKILL after 10 s) and the phase recorded as timed out."""
    t = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
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


def test_files() -> list[str]:
    """Every test file, ``FIRST``'s first."""
    rest = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if p.name not in FIRST)
    return [f"tests/{name}" for name in (*FIRST, *rest)]


def bench_device(a) -> dict:
    a.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES["tiny" if a.dry_run else "1.7b"]
    result = {"benchmark": "device", "dry_run": a.dry_run, "selection": selection(), "shape": shape, "phases": {}}

    def save():
        (a.out / "device_check.json").write_text(json.dumps(result, indent=2))

    pytest = [sys.executable, "-m", "pytest", *test_files(), "-p", "no:cacheprovider", "--given-order",
              "--continue-on-collection-errors", "-k", selection(a.groups)]
    pytest += ["--collect-only", "-q"] if a.dry_run else ["-v", "--durations=25"]
    tests = run_phase(pytest, a.tests_timeout, a.out / "tests.log")
    if a.dry_run and tests["status"] == "failed" and tests["exit_code"] == 5:
        tests["status"] = "failed: no test selected"
    tests["groups"] = parse_pytest((a.out / "tests.log").read_text())
    result["phases"]["tests"] = tests
    save()

    def measure(name: str, timeout: float, flags: str = "", env: dict | None = None, **spec) -> dict:
        """``device_measure.run`` in a process of its own under ``flags`` (added to XLA_FLAGS), the sampler's
        optimised HLO dumped beside its results (``hlo-NAME/``: what the GPU compiler made of the decode loop)."""
        out, dump = a.out / f"{name}.json", a.out / f"hlo-{name}"
        spec = dict(shape, out=str(out), steps=a.steps, nominal_peak_tflops=a.nominal_peak_tflops, profile=True,
                    **spec)
        flags += f" --xla_dump_to={dump} --xla_dump_hlo_module_re=sample_completions --xla_dump_hlo_as_text"
        env = {**(env or {}), "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        phase = run_phase([sys.executable, str(BENCH), "_device_step", json.dumps(spec)], timeout,
                          a.out / f"{name}.log", env)
        for f in dump.rglob("*"):
            if f.is_file() and not f.name.endswith("after_optimizations.txt"):
                f.unlink()
        if out.exists():
            phase.update(json.loads(out.read_text()))
        return phase

    moe = {}
    for name, flags in MOE_FLAG_SETS[:1] if a.dry_run else [m for m in MOE_FLAG_SETS if m[0] in a.moe_lowerings]:
        tag = "moe-" + name.replace(", ", "-").replace(" ", "_")
        moe[name] = run_phase([sys.executable, str(BENCH), "moe", *MOE_ARGS["tiny" if a.dry_run else "1.7b"],
                               "--dtype", "bfloat16", "--repeats", str(a.steps), "--out", str(a.out / f"{tag}.json")],
                              a.moe_timeout, a.out / f"{tag}.log",
                              {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()})
        if (a.out / f"{tag}.json").exists():
            moe[name]["rows"] = json.loads((a.out / f"{tag}.json").read_text())["rows"]
        result["phases"]["moe"] = moe
        save()

    names = a.variants or (DRY_IN_PROCESS if a.dry_run else tuple(IN_PROCESS))
    result["phases"]["step"] = measure("step", a.step_timeout, variants=[{"name": n, **IN_PROCESS[n]} for n in names],
                                       shrink=DRY_SHRINK if a.dry_run else None)
    save()
    out = a.out / "rollout.json"
    rollout = run_phase([sys.executable, str(BENCH), "rollout", *ROLLOUT_ARGS["tiny" if a.dry_run else "1.7b"],
                         "--out", str(out)], a.rollout_timeout if not a.dry_run else max(a.rollout_timeout, 150),
                        a.out / "rollout.log")  # a CPU's compiles (the dry run) take longer than a GPU's run
    if out.exists():
        rollout["result"] = json.loads(out.read_text())
    result["phases"]["rollout"] = rollout
    save()

    variants = {}
    for name, flags, baseline in FLAG_SETS:
        if ((baseline or a.dry_run) and not a.baseline) or (a.flag_sets and name not in a.flag_sets):
            continue  # (a dry run without a baseline skips these: each process compiles)
        env = {}
        if baseline:
            env["PYTHONPATH"] = f"{a.baseline.resolve()}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        variants[name] = measure(name.replace(", ", "-").replace(" ", "_"), a.variant_timeout, flags, env, step=False)
        result["phases"]["variants"] = variants
        save()
    result["complete"] = all(p["status"] == "passed" for p in [*result["phases"].values(), *variants.values(),
                                                                *moe.values()] if "status" in p)
    save()
    return result


# what stays beside raw.tar.gz: the device tool brings back few files from a lent machine (8 in 2026-11)
KEPT = ("device_check.json", "device_check.md", "tests.log")


def write(result: dict, folder: Path) -> None:
    """The finished check, with the machine and the command: ``device_check.json`` and its table, ``.md``; the
    phases' own files (logs, JSON, the sampler's optimised HLO and profiler traces) packed into ``raw.tar.gz``."""
    import shutil
    import tarfile

    (folder / "device_check.json").write_text(json.dumps(result, indent=2))
    (folder / "device_check.md").write_text(table(result))
    rest = [p for p in sorted(folder.iterdir()) if p.name not in KEPT and p.name != "raw.tar.gz"]
    with tarfile.open(folder / "raw.tar.gz", "w:gz") as tar:
        for p in rest:
            tar.add(p, arcname=p.name)
    for p in rest:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


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
                    f"{pct(x['mfu_nominal'])}, {pct(x['bandwidth_fraction'])} of its bandwidth bound at the "
                    f"{s['memory_bandwidth_gbps']:,.0f} GB/s measured (target {pct(SAMPLER_TARGET)}) |")
    if "step" in s:
        x = s["step"]
        nominal = f" of {s['nominal_peak_tflops']} TFLOP/s" if s["nominal_peak_tflops"] else ""
        rows.append(f"| fused step, {s['parameters'] / 1e6:,.0f}M parameters, bf16 | {x['episodes_per_s']:.2f} "
                    f"episodes/s "
                    f"({x['median_s']:.3f} s; compile + first {x['compile_plus_first_s']:.1f} s), MFU "
                    f"{pct(x['mfu_nominal'])}{nominal} (target {pct(STEP_TARGET)}), {pct(x['mfu_measured_peak'])} "
                    f"of the {s['matmul_peak_tflops']:.3g} TFLOP/s measured |")
    rows.append(f"| step phase | {s['status']}, {s['seconds']} s of {s['timeout_s']:.0f} |")
    return "\n".join(rows + variant_rows(r) + moe_rows(r) + rollout_rows(r)) + "\n"


def rollout_rows(r: dict) -> list[str]:
    """The rollout phase's row: refill against fixed batches (bench.py rollout)."""
    ph = r["phases"].get("rollout")
    if ph is None:
        return []
    x = ph.get("result")
    if x is None:
        return [f"| rollout phase | {ph['status']}, {ph['seconds']} s of {ph['timeout_s']:.0f} |"]
    return [f"| rollout, {x['prompts']} prompts x {x['samples']}, {x['slots']} in flight, budget {x['new_tokens']} "
            f"(mean length {x['mean_length']:.0f}) | refill {x['tokens_per_s']['refill']:.0f} real tokens/s against "
            f"fixed batches' {x['tokens_per_s']['fixed']:.0f}: {x['speedup']:.2f}x; slot utilisation "
            f"{x['slot_utilization']['refill']:.2f} against {x['slot_utilization']['fixed']:.2f} |"]


def moe_rows(r: dict) -> list[str]:
    """The MoE phase: one layer's forward+backward and decode step, per lowering of ``ragged_dot``, against the tiles
    (the CPU's scan over one expert's rows at a time) and the one-hot reference, timed in the same process."""
    rows = ["", "| MoE layer (bench.py moe, bf16) | phase, tokens | tiles | ragged_dot | dense | ragged_dot / tiles |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, x in r["phases"].get("moe", {}).items():
        if "rows" not in x:
            rows.append(f"| {name} | {x['status']} after {x['seconds']} s | | | | |")
        for row in x.get("rows", ()):
            m = row["median_s"]
            ragged = f"{m['ragged_dot']:.4f} s" if "ragged_dot" in m else "-"
            ratio = f"{row['ratio_ragged_dot_over_tiles']:.2f}x" if "ratio_ragged_dot_over_tiles" in row else "-"
            rows.append(f"| {name} | {row['shape']} {row['phase']}, {row['tokens']} | {m['tiles']:.4f} s | {ragged} | "
                        f"{m['dense']:.4f} s | {ratio} |")
    return rows if len(rows) > 3 else []


def variant_rows(r: dict) -> list[str]:
    """The variants, each against its default: a sampler's tokens/s against the step phase's sampler, an update's
    time against the first update's (the defaults)."""
    s = r["phases"]["step"]
    rows = ["", "| variant | measured | against the default |", "| --- | --- | --- |"]
    update = next((x for x in s.get("variants", {}).values() if "mfu_nominal" in x and "rows" not in x
                   and "episodes_per_s" not in x), None)
    done = {**s.get("variants", {}), **{f"sampler, {k} (own process)": v.get("sampler")
                                        for k, v in r["phases"].get("variants", {}).items()}}
    for name, x in done.items():
        if x is None:
            rows.append(f"| {name} | not measured (its process stopped first) | |")
        elif "error" in x:
            rows.append(f"| {name} | failed: {x['error']} | |")
        elif "config" in x:  # another family's shape: its own numbers, no default to compare with
            rows.append(f"| {name} | sampler {x['tokens_per_s']:.0f} tokens/s ({x['sampler_median_s']:.3f} s); fused "
                        f"step {x['episodes_per_s']:.2f} episodes/s ({x['median_s']:.3f} s; compile + first "
                        f"{x['compile_plus_first_s']:.1f} s), {x['parameters'] / 1e6:,.0f}M parameters | |")
        elif "tokens_per_s" in x:
            base = s.get("sampler")
            vs = f"{x['tokens_per_s'] / base['tokens_per_s']:.2f}x the tokens/s" if base else "-"
            rows.append(f"| {name} | {x['tokens_per_s']:.0f} tokens/s, {x['rows']} rows ({x['median_s']:.3f} s), "
                        f"{100 * x['bandwidth_fraction']:.1f}% of its bandwidth bound | {vs} |")
        else:
            base = s.get("step") if "episodes_per_s" in x else update
            vs = f"{base['median_s'] / x['median_s']:.2f}x the speed" if base else "-"
            rows.append(f"| {name} | {x['median_s']:.3f} s, MFU {100 * (x['mfu_nominal'] or 0):.1f}% | {vs} |")
    for name, x in r["phases"].get("variants", {}).items():
        rows.append(f"| {name} process | {x['status']}, {x['seconds']} s of {x['timeout_s']:.0f} | |")
    return rows if len(rows) > 3 else []


def print_device(r: dict) -> None:
    print(table(r))
