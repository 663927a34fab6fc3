"""scripts/device_check.sh (bench.py device), the GPU check of a short lease, in its CPU dry run: the weighty tests'
selection (every group selects tests, the logits every family), the step phase at a tiny shape with numbers that agree
with each other, the JSON and the table; and its time limits, on a phase that runs out of time."""
import json
import os
import subprocess
import sys

import pytest

from tests import helpers, hf_fixtures

ROOT = helpers.ROOT


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(out), "--dry-run"], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, json.loads((out / "device_check.json").read_text()), proc.stdout


def test_the_selection_covers_every_weighty_group_and_every_family(dry_run):
    _, r, _ = dry_run
    tests = r["phases"]["tests"]
    assert tests["status"] == "passed" and r["dry_run"] is True
    groups = tests["groups"]
    assert set(groups) == {"precision", "logits", "sampler", "step_vs_trl", "resume", "gpu", "moe"}
    for name, g in groups.items():
        assert g["collected"], f"the device check's group {name} selects no test"
        assert all(x.startswith("tests/test_") and "::" in x for x in g["collected"])
    for family in hf_fixtures.FAMILIES:  # parametrized by family: a new family's tests are in it by name
        for test in ("test_logits_match_transformers", "test_reward_scores_match_transformers"):
            assert any(f"{test}[{family}-" in x for x in groups["logits"]["collected"]), (test, family)
    assert any("test_gpu.py::" in x for x in groups["gpu"]["collected"])
    assert any("test_one_step_equals_trl" in x for x in groups["step_vs_trl"]["collected"])


def test_the_step_phase_numbers_agree(dry_run):
    device = helpers.benchmark("device")
    out, r, stdout = dry_run
    s, shape = r["phases"]["step"], r["shape"]
    assert s["status"] == "passed" and s["exit_code"] == 0 and 0 < s["seconds"] <= s["timeout_s"]
    assert s["device"] == "cpu:0" and s["device_peak_mib"] is None and s["nominal_peak_tflops"] is None
    B, T = shape["batch"], shape["new_tokens"]
    D, V, L = shape["hidden"], shape["vocab"], shape["layers"]
    assert s["parameters"] == 2 * V * D + L * (12 * D * D + 13 * D) + 2 * D  # GPT-NeoX, untied, as test_bench's
    x = s["sampler"]
    assert len(x["times_s"]) == 3 and min(x["times_s"]) <= x["median_s"] <= max(x["times_s"])
    assert 0 < x["completion_tokens"] <= 2 * B * T and x["rows"] == 2 * B
    assert x["tokens_per_s"] * x["median_s"] == pytest.approx(x["completion_tokens"])
    assert x["bandwidth_fraction"] == pytest.approx(x["bound_s"] / x["median_s"]) and s["memory_bandwidth_gbps"] > 0
    st = s["step"]
    assert st["episodes_per_s"] == pytest.approx(B / st["median_s"]) and st["compile_plus_first_s"] > st["median_s"]
    assert st["useful_tflops_per_s"] == pytest.approx(st["useful_tflop"] / st["median_s"])
    assert st["mfu_measured_peak"] == pytest.approx(st["useful_tflops_per_s"] / s["matmul_peak_tflops"])
    assert st["mfu_nominal"] is None and helpers.positive(st["loss"])
    v = s["variants"]  # one of each kind, each against its default (the table's ratios)
    assert set(v) == set(device.DRY_IN_PROCESS) and not any("error" in x for x in v.values()), v
    qwen = v["sampler and step, Qwen3.5-2B shape"]  # the hybrid family's step, shrunk to a tiny model here
    assert qwen["episodes_per_s"] == pytest.approx(B / qwen["median_s"]) and qwen["config"] == "qwen3.5-2b"
    assert 0 < qwen["parameters"] < 10 ** 6 and qwen["rows"] == 2 * B
    gemma = v["sampler and step, Gemma 4 E2B shape"]  # two attention shapes, per-layer embeddings, KV sharing
    assert gemma["config"] == "gemma-4-e2b" and 0 < gemma["parameters"] < 10 ** 6 and gemma["tokens_per_s"] > 0
    # unrolled, the same rows (in bf16 two steps in one body may fuse and so round otherwise, which a near tie of a
    # tiny random model's draw shows; float32 unrolling samples the same: test_sampling's scan against the loop)
    assert v["sampler, scan unroll 2"]["rows"] == x["rows"] and v["sampler, scan unroll 2"]["completion_tokens"] > 0
    (moe_name, m), = r["phases"]["moe"].items()  # the dry run: one MoE process, XLA:CPU's flags
    assert m["status"] == "passed" and [row["phase"] for row in m["rows"]] == ["train", "decode"]
    assert all({"tiles", "ragged_dot", "dense"} <= set(row["median_s"]) for row in m["rows"])
    assert r["complete"] is True and r["command"].startswith("python benchmarks/bench.py device")
    table = (out / "device_check.md").read_text()
    assert table.strip() in stdout  # the table printed is the one written
    assert "| tests: logits | " in table and "| fused step, " in table and "| step phase | passed" in table
    assert "| sampler and step, Qwen3.5-2B shape | sampler " in table and "x the speed |" in table
    assert f"| {moe_name} | tiny train, 24 | " in table
    ro = r["phases"]["rollout"]  # refill against fixed batches, the completions checked the same in the benchmark
    assert ro["status"] == "passed" and ro["result"]["slots"] == 4 and ro["result"]["speedup"] > 0
    assert "| rollout, 8 prompts x 2, 4 in flight, budget 16 " in table
    import tarfile

    assert {p.name for p in out.iterdir()} == {"device_check.json", "device_check.md", "tests.log", "raw.tar.gz"}
    with tarfile.open(out / "raw.tar.gz") as tar:  # the rest packed: few files come back from a lent machine
        names = tar.getnames()
    assert {"step.log", "step.json"} <= set(names) and any(n.endswith("after_optimizations.txt") for n in names)


def test_a_phase_out_of_time_is_stopped_and_keeps_what_it_printed(tmp_path):
    device = helpers.benchmark("device")
    code = "import time; print('tests/test_x.py::test_a PASSED', flush=True); time.sleep(60)"
    r = device.run_phase([sys.executable, "-c", code], 1.0, tmp_path / "phase.log")
    assert r["status"] == "timed out" and r["exit_code"] is None and r["seconds"] < 30
    groups = device.parse_pytest((tmp_path / "phase.log").read_text())
    assert groups["precision"]["passed"] == 0 and not any(g["passed"] for g in groups.values())  # test_x: no group
    log = ("tests/test_precision.py::test_a[x] PASSED [ 10%]\n"
           "tests/test_models.py::test_logits_match_transformers[neox-left] FAILED [ 20%]\ntests/test_gpu.py::test_b SKIPPED (needs a GPU) [ 30%]\nFAILED tests/test_models.py::x - msg\n")
    groups = device.parse_pytest(log)
    assert groups["precision"]["passed"] == 1 and groups["gpu"]["skipped"] == 1
    assert groups["logits"]["failed"] == ["tests/test_models.py::test_logits_match_transformers[neox-left]"]
    partial = {"dry_run": False, "shape": device.SHAPES["1.7b"], "phases": {
        "tests": {"status": "timed out", "seconds": 240.0, "timeout_s": 240, "groups": groups},
        "step": {"status": "timed out", "seconds": 200.0, "timeout_s": 200}}}
    table = device.table(partial)
    assert "| test phase | timed out, 240.0 s of 240 |" in table and "| step phase | timed out" in table
    assert "fused step" not in table  # nothing the phase did not finish
