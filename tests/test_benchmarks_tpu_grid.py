"""benchmarks/tpu_grid.py (bench.py tpu-grid) without libtpu: the tables it prints from the cells in its folder
(XLA:TPU's verdicts written as bench.py memory writes them), the floors' arithmetic, what a compiled cell implies
for the others, and the cell it would compile next; a compile run for at most its time, with its host numbers."""
import json
import subprocess
import sys

import pytest

from tests import helpers


def _cell(out, name, step):
    (out / f"{name}.json").write_text(json.dumps({"compiled": {"online_step": step}}))


def test_the_grid_settles_cells_from_compiled_ones_and_floors(tmp_path):
    out = tmp_path / "grid"
    out.mkdir()
    _cell(out, "qwen3-4b_v5p-1x1x1_full", {"argument_mib": 61000.0, "peak_mib": 80000.0})
    _cell(out, "gemma-3-4b_v5p-1x1x1_full", {"argument_mib": 59209.2, "peak_mib": 105909.4})  # compiled, too big
    _cell(out, "gemma-3-1b_v6e-1x1_full", {"timeout_s": 900.0})  # stopped while it compiled (run_cell)
    _cell(out, "qwen3-1.7b_v6e-1x1_full", {"error": "RESOURCE_EXHAUSTED: ... HLO temporaries (40.73G) exceeds "
                                                    "available HBM (31.25G).", "needed_gib": 40.73,
                                           "available_gib": 31.25})
    proc = subprocess.run([sys.executable, str(helpers.ROOT / "scripts" / "bench.py"), "tpu-grid", "--table-only",
                           "--out", str(out)], cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): [c.strip(" |") for c in line.split(" | ")[1:]]
            for line in (out / "grid.md").read_text().split("LoRA rank 16")[0].splitlines() if line.startswith("| ")}
    assert rows["model"] == ["v5e:1x1", "v6e:1x1", "v5p:1x1x1", "v5e:2x4", "v6e:2x4", "v5p:2x2x2"]
    # compiled: the peak per chip in GiB, or the refusal's numbers
    assert rows["qwen3-4b"][2] == "**yes** 78.1" and rows["qwen3-1.7b"][1] == "**no** (temporaries 40.7 > 31.25)"
    # a larger model of the family fits, so the smaller ones do; one chip fits, so eight do
    assert rows["qwen3-1.7b"][2] == rows["qwen3-0.6b"][2] == "yes (as qwen3-4b)"
    assert rows["qwen3-4b"][5] == rows["qwen3-1.7b"][5] == "yes (as 1 chip)"
    # what is passed alone is more than the chip's HBM: 12 B per trained and 2 B per frozen parameter (Qwen3-4B:
    # 4.022 B, and its reward model's), exact arithmetic
    assert rows["qwen3-4b"][1] == "no (floor 59.9)" and rows["qwen3-8b"][2] == "no (floor 120.9)"
    # a refusal settles the larger models of the family on those chips, not the smaller
    assert rows["qwen3-8b"][1] == "no (floor 120.9)" and rows["qwen3-0.6b"][1] == "? (floor 8.9)"
    assert rows["gemma-3-1b"][0] == "? (floor 14.9)" and rows["gemma-3-12b"][3] == "no (floor 21.9)"
    # compiled is not enough: XLA:TPU checks only the temporaries against the HBM (v5p: 95 GiB a program may use)
    assert rows["gemma-3-4b"][2] == "**no** (peak 103.4 > 95)" and rows["gemma-3-1b"][2] == "? (floor 14.9)"
    # a compile stopped at its time settles nothing, and is not the next one again
    assert rows["gemma-3-1b"][1] == "not compiled in 900 s" and rows["gemma-3-4b"][1] == "no (floor 57.8)"
    # the next compile: one chip before eight, the largest open model of a family first
    assert "next to compile (model, topology, LoRA rank): gemma-3-1b v5e:1x1 0" in proc.stdout
    # --retry-timeouts opens such a cell of this call again (compiling none here: --max-cells 0)
    proc = subprocess.run([sys.executable, str(helpers.ROOT / "scripts" / "bench.py"), "tpu-grid", "--models",
                           "gemma-3-1b", "--tpus", "v6e:1x1", "--lora-ranks", "0", "--retry-timeouts", "--max-cells",
                           "0", "--out", str(out)], cwd=helpers.ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| gemma-3-1b | ? (floor 14.9) |" in proc.stdout and (out / "qwen3-4b_v5p-1x1x1_full.json").exists()


def test_a_cell_compiles_for_at_most_its_time_and_keeps_its_host_numbers(tmp_path, monkeypatch):
    tpu_grid = helpers.benchmark("tpu_grid")
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    done, slow = tmp_path / "done.json", tmp_path / "slow.json"
    # a compile that finishes writes its cell (as bench.py memory does); the grid adds its wall and CPU seconds and
    # its peak host memory: this child's own, 64 MiB held (not the grid's, which spawned it)
    cell = json.dumps({"compiled": {"online_step": {"peak_mib": 1.0}}})
    write = "\n".join(["import time", "held = b'x' * (64 << 20)", "t = time.process_time()",
                       "while time.process_time() - t < 0.3: pass", "time.sleep(1)",
                       f"open({str(done)!r}, 'w').write({cell!r})"])
    host = tpu_grid.run_cell([sys.executable, "-c", write], done, timeout_s=60)
    kept = json.loads(done.read_text())
    assert kept["host"] == host and kept["compiled"]["online_step"] == {"peak_mib": 1.0}
    assert "libtpu_init_args" not in host
    assert host["cpu_s"] >= 0.3 and host["wall_s"] >= host["cpu_s"] - 0.1 and 0.0625 <= host["peak_rss_gib"] < 0.5
    # one still running at its time is stopped, and its cell kept as not compiled in that time, with the libtpu
    # flags it was compiled with
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=8192")
    host = tpu_grid.run_cell([sys.executable, "-c", "import time; time.sleep(60)"], slow, timeout_s=1)
    assert 1 <= host["wall_s"] < 30 and host["peak_rss_gib"] < 0.0625
    assert host["libtpu_init_args"] == "--xla_tpu_scoped_vmem_limit_kib=8192"
    assert json.loads(slow.read_text()) == {"compiled": {"online_step": {"timeout_s": 1}}, "host": host}
    assert tpu_grid.verdict(slow, 16.0) == (None, "not compiled in 1 s")
    # any other failure stops the grid, naming the command
    with pytest.raises(SystemExit, match="exit status 3"):
        tpu_grid.run_cell([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "failed.json", timeout_s=60)
