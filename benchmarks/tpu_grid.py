"""Which real models train on which TPU chips: ``bench.py memory --tpu`` over a grid of models x chips x (full
fine-tuning | LoRA), one compile per cell in a process of its own, kept in a folder so the grid fills over several
sessions (a cell already there is not compiled again), then the tables of docs/tpu.md.

  python benchmarks/bench.py tpu-grid [--models qwen3-0.6b ...] [--tpus v5e:1x1 v5e:2x4 ...] [--lora-ranks 0 16]
                                      [--mesh-expert 8] [--out runs/tpu-grid] [--table-only]

The mixtures of experts (``MOE_MODELS``: Qwen3-30B-A3B, Qwen3.5-35B-A3B) take ``--mesh-expert N``: their experts
split by expert over N chips (``mesh_expert``), the rest FSDP over all; such cells are kept apart (``_eN``).

Each cell is TRL's recipe batch of the Qwen3, Gemma 3 and Gemma 4 recipes (8 prompts a chip, 2 micro-batches, prompts
at the largest bucket, 512, 64 new tokens, bf16 compute, float32 weights and Adam, the frozen models in bf16, full
remat) with a reward model of the policy's shape. A cell is **yes** when XLA:TPU compiles the fused step (its peak per chip in GiB
is shown), **no** when it refuses it for the chip's HBM (the temporaries it named) or when the peak it compiled
is more than the chip's HBM (XLA:TPU checks the temporaries alone when it compiles). LoRA cells adapt PEFT's default
modules, every projection (all-linear) where PEFT has none (Qwen3.5). A cell not compiled may still be
settled by another one of the same family, chips and training, on the assumption that a step's memory grows with the
model (every dimension of the larger of two Qwen3, Qwen3.5 or Gemma 3 models is at least the smaller's; Gemma 4's
sizes grow in memory though not in every dimension: benchmarks/configs/README.md): a larger model that fits
says yes (``yes<``), a smaller one refused says no (``no>``); everything else is left open (``?``).

Each compile runs for at most ``--timeout`` seconds (900); its wall and CPU seconds and its peak host memory (the
process's own high-water resident set) go into the cell's JSON (``host``). A compile still running then is stopped and
its cell kept as not compiled in that time (``not compiled in 900 s``), with those numbers: it settles nothing, and
the grid is not held up by it (``--retry-timeouts`` compiles such cells again, e.g. with a longer ``--timeout``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness import BENCH
from memory import TPU_CHIPS, hf_models, lora_targets, topology_chips

MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b",
          "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-4-e2b", "gemma-4-e4b", "gemma-4-31b")
MOE_MODELS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b")
TPUS = ("v5e:1x1", "v6e:1x1", "v5p:1x1x1", "v5e:2x4", "v6e:2x4", "v5p:2x2x2")
RECIPE = ["--batch", "8", "--accumulation", "2", "--prompt-len", "512", "--new-tokens", "64", "--max-length", "512",
          "--frozen-param-dtype", "bfloat16", "--pieces", "online_step"]


def add_parser(sub) -> None:
    p = sub.add_parser("tpu-grid", help="bench.py memory --tpu over models x TPU chips x full/LoRA: docs/tpu.md")
    p.add_argument("--models", nargs="+", default=list(MODELS), help="names in benchmarks/configs/, smallest first "
                   "within a family")
    p.add_argument("--tpus", nargs="+", default=list(TPUS), help="TPU topologies (libtpu's names)")
    p.add_argument("--lora-ranks", nargs="+", type=int, default=[0, 16], help="0: full fine-tuning")
    p.add_argument("--mesh-expert", type=int, default=1, help="the expert axis of every cell (mesh_expert): "
                   "bench.py memory --mesh-expert")
    p.add_argument("--out", type=Path, default=Path("runs/tpu-grid"), help="one JSON per cell, kept between calls")
    p.add_argument("--max-cells", type=int, default=10 ** 6, help="compile at most this many cells in this call")
    p.add_argument("--table-only", action="store_true", help="compile nothing: the tables of the cells there")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a cell's compile may run; one still "
                   "running then is stopped and kept as not compiled in that time")
    p.add_argument("--retry-timeouts", action="store_true", help="compile again the cells kept as not compiled "
                   "in time")


def cell_path(out: Path, model: str, tpu: str, rank: int, expert: int = 1) -> Path:
    axis = f"_e{expert}" if expert > 1 else ""
    return out / f"{model}_{tpu.replace(':', '-')}_{'full' if rank == 0 else f'lora{rank}'}{axis}.json"


def verdict(path: Path, hbm: float) -> tuple[bool | None, str] | None:
    """(fits, what XLA:TPU said) of a compiled cell, or None when it was not compiled. XLA:TPU refuses a program
    whose temporaries alone exceed the chip's HBM; one that compiles fits only if its peak (arguments + outputs -
    aliased + temporaries) does too."""
    if not path.exists():
        return None
    step = json.loads(path.read_text())["compiled"]["online_step"]
    if "timeout_s" in step:  # stopped while it compiled: no verdict
        return None, f"not compiled in {step['timeout_s']:g} s"
    if "error" in step:  # a refusal names the sizes; any other failure settles nothing
        return ((False, f"temporaries {step['needed_gib']:.1f} > {step['available_gib']:.2f}") if "needed_gib" in step
                else (None, step["error"][:80]))
    peak = step["peak_mib"] / 1024
    return (True, f"{peak:.1f}") if peak <= hbm else (False, f"peak {peak:.1f} > {hbm:g}")


def floor_gib(model: str, rank: int) -> float:
    """What the step is passed on one chip, exact arithmetic, no compile: 12 B per trained parameter (float32 weights
    and two Adam moments), 2 B per parameter of the frozen reference (with LoRA, the base) and of the reward model;
    FSDP splits it evenly over the chips. Above a chip's HBM it settles the cell (no), below only the compiler can."""
    import tempfile

    import jax

    from jodpo.models import lora
    from jodpo.models.params import param_shapes

    with tempfile.TemporaryDirectory() as t:
        policy, rm = hf_models(model, None, Path(t))
    size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    n, n_rm, trained = size(param_shapes(policy)), size(param_shapes(rm)), None
    if rank:
        m = policy.replace(lora_rank=rank, lora_alpha=2.0 * rank)
        trained = size(jax.eval_shape(lambda: lora.init_adapters(m, lora_targets(m), jax.random.key(0))))
    return (12 * (trained or n) + 2 * n + 2 * n_rm) / 2 ** 30


# HBM a program may use per chip, GiB: XLA:TPU's own figure where its refusals name it (v5e, v6e), else Google's
# user-allocatable figure (v5p: 96 GiB physical, 95 allocatable; docs.cloud.google.com/tpu/docs/v5p)
HBM_USABLE = {"v5e": 15.75, "v6e": 31.25, "v5p": 95.0}


def hbm_of(tpu: str) -> float:
    kind = tpu.partition(":")[0]
    return HBM_USABLE.get(kind, TPU_CHIPS[kind][2])


def family(model: str) -> str:
    """The name less its size: qwen3, qwen3.5, gemma-3, gemma-4."""
    return model.rsplit("-", 1)[0]


def settle(models: list[str], tpus: list[str], ranks: list[int], compiled: dict, floors: dict) -> dict:
    """Each cell's entry: what XLA:TPU said; else the floor above the chip's HBM; else what a compiled cell implies,
    on the assumption that a step's memory per chip grows with the model within a family (a larger model that
    fits, or a smaller one refused, on the same chips with the same training) and shrinks as FSDP splits it over
    more chips of the same kind (fits on one chip -> fits on eight; refused on eight -> refused on one)."""
    fits = {k: v[0] for k, v in compiled.items() if v is not None and v[0] is not None}
    fits |= {k: False for k, f in floors.items() if k not in fits and f > hbm_of(k[1])}
    why = {}
    changed = True
    while changed:  # implications chain (0.6b fits because 1.7b does, which fits because 4b does...)
        changed = False
        for m in models:
            same = [x for x in models if family(x) == family(m)]
            for tpu in tpus:
                kind, one = tpu.partition(":")[0], topology_chips(tpu) == 1
                other = [t for t in tpus if t.partition(":")[0] == kind and (topology_chips(t) == 1) != one]
                for rank in ranks:
                    if (m, tpu, rank) in fits:
                        continue
                    # (the cell that would settle this one, its label): yes from a larger model or from one chip,
                    # no from a smaller model or from eight chips
                    yes = [((x, tpu, rank), f"as {x}") for x in same[same.index(m) + 1:]] + \
                          ([] if one else [((m, t, rank), "as 1 chip") for t in other])
                    no = [((x, tpu, rank), f"as {x}") for x in same[:same.index(m)]] + \
                         ([((m, t, rank), "as 8 chips") for t in other] if one else [])
                    hit = next(((v, label) for v, cands in ((True, yes), (False, no)) for key, label in cands
                                if fits.get(key) is v), None)
                    if hit:
                        fits[m, tpu, rank], why[m, tpu, rank] = hit
                        changed = True
    out = {}
    for m in models:
        for tpu in tpus:
            for rank in ranks:
                k = (m, tpu, rank)
                if compiled.get(k) is not None and compiled[k][0] is None:  # not a verdict: its JSON says why
                    timed_out = compiled[k][1].startswith("not compiled in")
                    out[k] = compiled[k][1] if timed_out else f"error: {compiled[k][1]}"
                elif compiled.get(k) is not None:
                    out[k] = f"**yes** {compiled[k][1]}" if compiled[k][0] else f"**no** ({compiled[k][1]})"
                elif k in why:
                    out[k] = f"{'yes' if fits[k] else 'no'} ({why[k]})"
                elif k in fits:
                    out[k] = f"no (floor {floors[k]:.1f})"
                else:
                    out[k] = f"? (floor {floors[k]:.1f})"
    return out


def next_cell(a, cells: dict):
    """The open cell to compile next: one chip before eight (a yes on one settles eight), and within a family the
    largest open model first (XLA:TPU refuses in seconds what does not fit; the first that fits, minutes, settles every
    smaller one)."""
    open_ = [k for k, v in cells.items() if v.startswith("?")]
    return min(open_, key=lambda k: (k[2], topology_chips(k[1]) > 1, a.tpus.index(k[1]), family(k[0]),
                                     -a.models.index(k[0])), default=None)


def _high_water_kib(pid: int) -> int:
    """The process's peak resident set so far (``VmHWM``, KiB; 0 once it has exited). Its own program's: the
    counter starts again at exec, where ``ru_maxrss`` would count the parent that spawned it."""
    try:
        return int(next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if x.startswith("VmHWM:")).split()[1])
    except (OSError, StopIteration):
        return 0


def run_cell(cmd: list[str], path: Path, timeout_s: float) -> dict:
    """One cell's compile (``cmd``, a process of its own that writes ``path``) for at most ``timeout_s`` seconds.
    Returns its wall and CPU seconds (``os.wait4``) and its peak host memory (its high-water resident set, read every
    0.2 s), and the libtpu flags it ran with (``LIBTPU_INIT_ARGS``, where set), also kept in the cell's JSON
    (``host``). A compile still running at ``timeout_s`` is stopped and its
    cell written as not compiled in that time; a process that fails otherwise stops the grid."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd)
    timed_out, peak_kib = False, 0
    while True:
        peak_kib = max(peak_kib, _high_water_kib(proc.pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - t > timeout_s:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            timed_out = True
            break
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    host = {"wall_s": round(time.perf_counter() - t, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_gib": round(peak_kib / 2 ** 20, 2)}
    if os.environ.get("LIBTPU_INIT_ARGS"):  # XLA:TPU's flags change its compile time (docs/tpu.md: scoped VMEM)
        host["libtpu_init_args"] = os.environ["LIBTPU_INIT_ARGS"]
    if timed_out:
        path.write_text(json.dumps({"compiled": {"online_step": {"timeout_s": timeout_s}}, "host": host}, indent=2))
    elif proc.returncode != 0:
        raise SystemExit(f"tpu-grid: {' '.join(cmd[1:])} failed (exit status {proc.returncode})")
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), "host": host}, indent=2))
    return host


def bench_tpu_grid(a) -> dict:
    a.out.mkdir(parents=True, exist_ok=True)
    per_model = {(m, r): floor_gib(m, r) for m in a.models for r in a.lora_ranks}
    floors = {(m, tpu, r): per_model[m, r] / topology_chips(tpu)
              for m in a.models for tpu in a.tpus for r in a.lora_ranks}

    def cells() -> dict:
        compiled = {(m, tpu, rank): verdict(cell_path(a.out, m, tpu, rank, a.mesh_expert), hbm_of(tpu))
                    for rank in a.lora_ranks for tpu in a.tpus for m in a.models}
        return settle(a.models, a.tpus, a.lora_ranks, compiled, floors)

    if a.retry_timeouts and not a.table_only:  # this call's cells kept as not compiled in time: open again
        for path in (cell_path(a.out, m, tpu, r, a.mesh_expert) for m in a.models for tpu in a.tpus
                     for r in a.lora_ranks):
            if path.exists() and "timeout_s" in json.loads(path.read_text())["compiled"]["online_step"]:
                path.unlink()
    timings = {}
    while not a.table_only and len(timings) < a.max_cells and (k := next_cell(a, cells())) is not None:
        m, tpu, rank = k
        path = cell_path(a.out, m, tpu, rank, a.mesh_expert)
        cmd = [sys.executable, str(BENCH), "memory", "--hf-config", m, "--tpu", tpu, *RECIPE,
               "--lora-rank", str(rank), "--mesh-expert", str(a.mesh_expert), "--out", str(path)]
        print(" ".join(cmd[1:]), flush=True)
        timings[path.name] = run_cell(cmd, path, a.timeout)
    final = cells()
    k = next_cell(a, final)
    return {"benchmark": "tpu-grid", "tpus": a.tpus, "models": a.models, "lora_ranks": a.lora_ranks,
            "cells": {f"{m} {tpu} {rank}": c for (m, tpu, rank), c in final.items()},
            "next": None if k is None else f"{k[0]} {k[1]} {k[2]}", "compiled_now": timings, "out": str(a.out)}


def table(r: dict) -> str:
    """One markdown table per training (full, LoRA r): models down, TPU topologies across."""
    lines = []
    for rank in r["lora_ranks"]:
        title = "full fine-tuning, with a reference" if rank == 0 else f"LoRA rank {rank}"
        lines += ["", f"{title} (peak GiB per chip):", "", "| model | " + " | ".join(r["tpus"]) + " |",
                  "|" + " --- |" * (1 + len(r["tpus"]))]
        for m in r["models"]:
            lines.append(f"| {m} | " + " | ".join(r["cells"][f"{m} {tpu} {rank}"] for tpu in r["tpus"]) + " |")
    return "\n".join(lines[1:]) + "\n"


def print_tpu_grid(r: dict) -> None:
    print(table(r))
    late = sum(c.startswith("not compiled in") for c in r["cells"].values())
    none = "none: every cell is settled" if not late else \
        f"none open; {late} not compiled in their time (--retry-timeouts, with a longer --timeout)"
    print(f"next to compile (model, topology, LoRA rank): {r['next'] or none}")
