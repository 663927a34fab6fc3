"""bench.py program on a tiny model (through scripts/bench.py): the real program, its fused step, a warm-cache restart and TRL's
train() side by side (its own file, so pytest-xdist can run it beside tests/test_bench.py's train benchmark)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers

ROOT = helpers.ROOT
B, T = 2, 4  # the prompts of a micro-batch and the tokens of a completion (as tests/test_bench.py)

# --------------------------------------------------------------------------------------------------
# bench.py program: python -m jodpo.train vs its fused step, TRL's train() side by side
# --------------------------------------------------------------------------------------------------

STEPS, SAVE, EVAL = 6, 3, 2  # saves after 3 and 6, evaluations after 2, 4 and 6; steady steps 2 and 6


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("bench_program") / "program.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "program", "--hidden", "64", "--layers", "1",
           "--heads", "4", "--vocab", "512", "--prompts", "16", "--prompt-len", "24", "--new-tokens", str(T),
           "--batch", str(B), "--eval-prompts", "4", "--steps", str(STEPS), "--save-steps", str(SAVE),
           "--eval-steps", str(EVAL), "--step-repeats", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "program / step" in proc.stdout and "episodes/s steady" in proc.stdout  # the table was printed
    return json.loads(out.read_text()) | {"stdout": proc.stdout}


def test_program_runs_saves_and_evaluates(program):
    s, p, t = program["settings"], program["program"], program["trl"]
    assert (s["batch"], s["accumulation"], s["episodes_per_step"], s["steps"]) == (B, 2, 2 * B, STEPS)
    assert "--config tldr.py" in program["train_command"] and "--config.logging_steps=1" in program["train_command"]
    # what really happened: checkpoint directories and evaluation lines of the run, and TRL's checkpoint-* dirs
    assert p["saves_after_steps"] == [3, 6] and p["evals_after_steps"] == [2, 4, 6]
    assert p["step_kind"] == ["first", "steady", "eval", "save", "eval", "steady"]
    assert [x["after_step"] for x in p["save_s"]] == [3] and [x["after_step"] for x in p["eval_s"]] == [2, 4]
    assert t["saves_after_steps"] == [3, 6] and t["evals_after_steps"] == []
    assert t["step_kind"] == ["first", "steady", "steady", "save", "steady", "steady"]
    assert t["gradient_checkpointing"] is True and len(t["save_s_direct"]) == 2
    assert all(helpers.positive(x) for x in t["save_s_direct"])
    assert (t["eval_error"] is None) != (t["eval_s_direct"] is None)  # TRL 1.16's evaluation: its error, or its time
    assert program["step"]["recompiles_timed"] == 0 and program["step"]["prompt_width"] == 32
    assert p["kept_checkpoints"] == [3, 6]  # tldr.py keeps the last two (save_total_limit)


def test_restart_with_a_warm_cache(program):
    w, p = program["restart_warm_cache"], program["program"]
    assert helpers.positive(w["time_to_first_step_s"]) and helpers.positive(w["first_step_s"])
    assert w["ratio_cold_over_warm"] == pytest.approx(p["time_to_first_step_s"] / w["time_to_first_step_s"])
    assert w["overhead_cold_s"] == pytest.approx(p["time_to_first_step_s"] - p["steady_median_step_s"])
    assert w["overhead_warm_s"] == pytest.approx(w["time_to_first_step_s"] - p["steady_median_step_s"])
    assert "restart" in program["phases_s"] and "restart with the compilation cache warm" in program["stdout"]


def test_resumed_run_restores_the_previous_checkpoint(program):
    u, p = program["resume"], program["program"]
    assert u["resumed_from_step"] == SAVE and u["first_step"] == SAVE + 1  # the newest (STEPS) removed
    assert helpers.positive(u["time_to_first_step_s"]) and helpers.positive(u["first_step_s"])
    assert u["ratio_cold_over_resumed"] == pytest.approx(p["time_to_first_step_s"] / u["time_to_first_step_s"])
    assert u["overhead_resumed_s"] == pytest.approx(u["time_to_first_step_s"] - p["steady_median_step_s"])
    assert "resume" in program["phases_s"] and f"resumed from the checkpoint of step {SAVE}" in program["stdout"]


def test_program_numbers_and_ratios(program):
    p, t, st = program["program"], program["trl"], program["step"]
    gb = 2 * B
    for r in (p, t):
        for k in ("episodes_per_s_whole", "episodes_per_s_after_first_step", "episodes_per_s_steady",
                  "steady_median_step_s", "time_to_first_step_s", "first_step_s", "before_first_step_s",
                  "after_last_step_s", "wall_s", "peak_rss_mib"):
            assert helpers.positive(r[k]), k
        assert len(r["step_s"]) == STEPS and all(helpers.positive(x) for x in r["step_s"])
        steady = [x for x, k in zip(r["step_s"], r["step_kind"]) if k == "steady"]
        assert r["steady_median_step_s"] == pytest.approx(float(np.median(steady)))
        assert r["episodes_per_s_steady"] == pytest.approx(gb / r["steady_median_step_s"])
        assert r["episodes_per_s_whole"] == pytest.approx(STEPS * gb / r["wall_s"])
        assert r["episodes_per_s_whole"] < r["episodes_per_s_after_first_step"]  # loading and compiling count
        assert r["time_to_first_step_s"] == pytest.approx(r["before_first_step_s"] + r["first_step_s"])
        assert r["time_to_first_step_s"] + sum(r["step_s"][1:]) + r["after_last_step_s"] == pytest.approx(r["wall_s"])
        for x in r["save_s"] + r["eval_s"]:
            assert x["s"] == pytest.approx(r["step_s"][x["after_step"]] - r["steady_median_step_s"])
        assert 100 < r["peak_rss_mib"] < 20000
    assert p["first_step_s"] > p["steady_median_step_s"]  # the first step compiles
    assert p["device"] == "cpu:0" and p["device_peak_mib"] is None
    assert helpers.positive(st["episodes_per_s"]) and st["episodes_per_s"] == pytest.approx(gb / st["median_s"])
    assert program["ratio_program_over_step_steady"] == pytest.approx(p["episodes_per_s_steady"] / st["episodes_per_s"])
    assert program["ratio_program_over_step_whole"] == pytest.approx(p["episodes_per_s_whole"] / st["episodes_per_s"])
    assert program["ratio_program_over_step_after_first"] == pytest.approx(
        p["episodes_per_s_after_first_step"] / st["episodes_per_s"])
    for k, v in program["ratio_jodpo_over_trl_eps"].items():
        assert v == pytest.approx(p[k] / t[k]), k
    assert program["command"].startswith("python benchmarks/bench.py program")
    assert set(program["cores_taken_by_others_share"]) >= {"step", "program", "restart", "trl"}


def test_stalls_against_the_save_and_the_evaluation_alone(program):
    """Issue 17's stall targets need what a save blocks for and what an evaluation's sampling takes, each timed
    alone on the step's state; the loop's losses are then compared with them."""
    z, p, alone = program["stalls"], program["program"], program["step"]
    saves = alone["save"]["saves"]
    assert len(saves) == 3 and all(0 < x["blocking_s"] <= x["whole_s"] for x in saves)  # tldr.py keeps 2
    # the CPU a save takes (Orbax's threads and the kernel's write path), no more than its cores had meanwhile
    for x in saves:
        assert x["cpu_user_s"] >= 0 and x["cpu_kernel_s"] >= 0
        assert 0 < x["cpu_user_s"] + x["cpu_kernel_s"] <= x["whole_s"] * os.cpu_count() + 0.05
    assert " CPU-s of which kernel " in program["stdout"]
    assert alone["save"]["state_mib"] > 0 and len(p["save_s"]) == 1  # the save after step 3 (6 is the last)
    assert z["save_blocking_s"] == [saves[0]["blocking_s"]]
    assert z["save_beyond_blocking_s"] == pytest.approx([p["save_s"][0]["s"] - saves[0]["blocking_s"]])
    ev = alone["eval"]
    assert len(ev["evaluate_s"]) == len(ev["sampling_s"]) == 3
    assert all(helpers.positive(x) for x in ev["evaluate_s"] + ev["sampling_s"])
    assert z["eval_sampling_s"] == min(ev["sampling_s"]) and z["evaluate_alone_s"] == min(ev["evaluate_s"])
    assert z["eval_over_sampling"] == pytest.approx([x["s"] / z["eval_sampling_s"] for x in p["eval_s"]])
    assert z["eval_over_evaluate_alone"] == pytest.approx([x["s"] / z["evaluate_alone_s"] for x in p["eval_s"]])
    assert "a save blocks" in program["stdout"] and "its sampling" in program["stdout"]


def test_loop_stats_attribution():
    """Which step pays for a save or an evaluation, on a made-up timeline: the step after it."""
    bench_program = helpers.benchmark("program")

    run = {"t_launch": 0.0, "t_first": 10.0, "t_exit": 30.0, "saves": [2, 5], "evals": [3, 5],
           "step_s": {1: 4.0, 2: 1.0, 3: 3.0, 4: 2.5, 5: 1.2, 6: 1.0}}
    r = bench_program.loop_stats(run, 8)
    assert r["step_kind"] == ["first", "steady", "save", "eval", "steady", "save+eval"]
    assert r["steady_median_step_s"] == pytest.approx(1.1) and r["episodes_per_s_steady"] == pytest.approx(8 / 1.1)
    assert r["save_s"] == [{"after_step": 2, "s": pytest.approx(1.9)}]
    assert r["eval_s"] == [{"after_step": 3, "s": pytest.approx(1.4)}]
    assert r["episodes_per_s_whole"] == pytest.approx(48 / 30) and r["episodes_per_s_after_first_step"] == pytest.approx(2)
    assert r["before_first_step_s"] == pytest.approx(6) and r["after_last_step_s"] == pytest.approx(20 - 8.7)
