"""benchmarks/instructions.py end to end on stand-ins (the tiny Llama, the fixture's instruction prompts): jodpo's
k2 and TRL's OnlineDPOTrainer each train one step from the same weights, both are scored as the start model is, and
the table's numbers are those of the files (the held-out scores being IFEval's verdicts of the completions)."""
import importlib.util
import json

import numpy as np
import pytest

from jodpo.tasks import instructions as I
from tests import hf_fixtures, subproc


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_instructions", subproc.ROOT / "benchmarks" / "instructions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jodpo_and_trl_side_by_side_on_stand_ins(bench, checkpoints, tmp_path, capsys):
    data = hf_fixtures.prompt_dataset(tmp_path / "data", instructions=True)
    words = "the nation and its revenue grew while the public debt fell and peace held across the union".split()
    items = [(f"held-{i}", " ".join(words[i:] + words[:i])) for i in range(4)]
    for split, file in (("eval", "eval.jsonl"), ("eval_held_out", "eval_held_out.jsonl")):
        (data / file).write_text("".join(json.dumps(r) + "\n" for r in I.build_rows(items, split)))
    P = 320  # the instructions' text in the tiny character-level tokenizer
    sets = [f"model_name_or_path='{checkpoints['llama']['causal_lm']}'", f"dataset_name='{data / 'train.jsonl'}'",
            "eval_dataset=None", "per_device_train_batch_size=2", "per_device_eval_batch_size=2", "max_new_tokens=4",
            f"max_prompt_length={P}", f"max_length={P + 8}", f"prompt_buckets=({P},)", "logging_steps=1"]
    out = tmp_path / "evidence"
    assert bench.main(["--variants", "k2", "trl", "--seeds", "0", "--steps", "1", "--eval-prompts", "4",
                       "--eval-dir", str(data), "--out", str(out), "--set", *sets]) == 0
    table = (out / "table.md").read_text()
    assert capsys.readouterr().out.rstrip().endswith(table.rstrip())  # printed last, and kept in table.md
    results = json.loads((out / "results.json").read_text())
    runs = {r["variant"]: r for r in results["runs"]}
    assert set(runs) == {"k2", "trl"} and (out / "trl-seed0" / "model" / "config.json").exists()
    logged = [json.loads(x) for x in (out / "k2-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged if "loss" in m] == [1]
    assert "loss" in json.loads((out / "trl-seed0" / "metrics.jsonl").read_text().splitlines()[0])
    for name, where in (("start", out / "start"), ("k2", out / "k2-seed0"), ("trl", out / "trl-seed0")):
        r = results["start"] if name == "start" else runs[name]
        for key, file in bench.SETS.items():
            rows = [json.loads(x) for x in (where / "eval" / key / "scored.jsonl").read_text().splitlines()]
            prompts = [json.loads(x) for x in (data / file).read_text().splitlines()]
            again = I.instruction_reward([p["prompt"] for p in prompts], [x["completion"] for x in rows],
                                         [p["instruction_id_list"] for p in prompts],
                                         [p["instruction_kwargs"] for p in prompts])
            assert [x["score"] for x in rows] == again and r[key]["n"] == 4
            assert r[key]["mean"] == pytest.approx(np.mean(again))
            assert f"{r[key]['mean']:.3f}" in table
    assert runs["k2"]["train_s"] > 0 and runs["trl"]["episodes_per_s"] > 0
    assert "jodpo k2" in table and "no test: fewer than 2 seeds a side" in table
    # --table-only: the finished runs among the variants x seeds asked for, nothing trained (seed 1 never ran)
    assert bench.main(["--variants", "k2", "trl", "--seeds", "0", "1", "--steps", "1", "--eval-prompts", "4",
                       "--eval-dir", str(data), "--out", str(out), "--set", *sets, "--table-only"]) == 0
    assert (out / "table.md").read_text() == table and not (out / "k2-seed1").exists()
